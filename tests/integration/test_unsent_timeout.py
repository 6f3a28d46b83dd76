"""A request whose deadline passed before anything was sent (`timeout_ms: 1`) says so in its
envelope (issue 25): it said only "no answer within timeout_ms=1" (the CLI said "never sent",
the envelope did not), and its `attempts` listed attempt 1 on the door's instance as if it had
gone there, though the call never began. Real gateway, real agent (its ledger stays empty)."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from tests.helpers import Agent, GatewayProcess, executions, invoke, rid

pytestmark = pytest.mark.integration


async def test_a_timeout_never_sent_says_so_and_lists_no_instance(
    gateway: GatewayProcess, http: httpx.AsyncClient, capability: str, tmp_path: Path
) -> None:
    ledger = tmp_path / "ledger.txt"
    agent = await Agent(gateway, f"{capability}-01", capability, "--ledger", str(ledger)).ready()
    try:
        r = await invoke(http, gateway, capability, "query")  # the door routes it once
        assert r.status_code == 200, r.text
        request_id = rid()
        r = await invoke(http, gateway, capability, "create", request_id=request_id, timeout_ms=1)
        assert r.status_code == 504, r.text
        body = r.json()
        error = body["error"]
        assert error["type"] == "timeout", error
        assert "outcome_unknown" not in error, error
        assert "it was never sent: no agent ran it" in error["message"], error
        assert body.get("instance_id") is None, body
        for attempt in body.get("attempts") or []:
            assert attempt.get("instance_id") is None, body
        assert executions(ledger, request_id) == []
    finally:
        agent.proc.stop()
