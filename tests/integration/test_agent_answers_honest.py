"""What a keyless write's caller is told after the agent ran it (issue 25), on a real gateway
and real agents (examples/knowledge_retriever.py, whose ledger counts executions):

- the agent answered 500 or 503 (OperationError): it ran, so the error is not `retryable` (it
  said `true`, though Reach itself would not retry it); a keyed request keeps `true` (its
  repeat runs again under its key, the point of the key), and the agent's 429, a refusal, too;
- its connection broke mid-call (the agent SIGKILLed): `outcome_unknown`, not retryable, and no
  longer told "repeat it with an idempotency_key to be safe" (a new key lets it run twice).
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx
import pytest

from tests.helpers import Agent, GatewayProcess, executions, invoke, rid, wait_until

pytestmark = pytest.mark.integration


async def test_a_keyless_write_the_agent_failed_after_running_is_not_retryable(
    gateway: GatewayProcess, http: httpx.AsyncClient, capability: str, tmp_path: Path
) -> None:
    for status, retryable_keyless in ((500, False), (503, False), (429, True)):
        ledger = tmp_path / f"ledger-{status}.txt"
        agent = await Agent(
            gateway,
            f"{capability}-{status}",
            f"{capability}-{status}",
            "--fail-first",
            "10",  # every call here fails
            "--fail-status",
            str(status),
            "--ledger",
            str(ledger),
        ).ready()
        try:
            request_id = rid()
            r = await invoke(
                http, gateway, f"{capability}-{status}", "create", request_id=request_id
            )
            assert r.status_code == 502, r.text
            error = r.json()["error"]
            assert error["type"] == "agent_error", error
            assert error["agent"]["status"] == status, error
            assert error["retryable"] is retryable_keyless, (status, error)
            if not retryable_keyless:
                assert "the agent answered, so it ran" in error["message"], error
            assert executions(ledger, request_id) == [agent.instance_id]
            # With a key it is retried (on its key) and its repeat is the key's to run again:
            # still retryable.
            r = await invoke(
                http, gateway, f"{capability}-{status}", "create", idempotency_key=rid()
            )
            # (Its retries' failures may open the capability's breaker: its last word.)
            assert r.json()["error"]["type"] in ("agent_error", "circuit_open"), r.text
            assert r.json()["error"]["retryable"] is True, r.text
        finally:
            agent.proc.stop()


async def test_a_keyless_write_whose_agent_died_mid_call_is_not_told_to_add_a_key(
    gateway: GatewayProcess, http: httpx.AsyncClient, capability: str, tmp_path: Path
) -> None:
    ledger = tmp_path / "ledger.txt"
    agent = await Agent(
        gateway, f"{capability}-01", capability, "--delay-ms", "20000", "--ledger", str(ledger)
    ).ready()
    request_id = rid()
    call = asyncio.create_task(
        invoke(http, gateway, capability, "create", request_id=request_id, timeout_ms=30_000)
    )
    await wait_until(lambda: bool(executions(ledger, request_id)), 15, every_s=0.02)
    agent.proc.kill()
    r = await call
    assert r.status_code == 502, r.text
    body = r.json()
    error = body["error"]
    assert error["type"] == "transport_error", error
    assert (error.get("outcome_unknown"), error["retryable"]) == (True, False), error
    assert body["instance_id"] == agent.instance_id, body
    assert "with an idempotency_key to be safe" not in error["message"], error
    assert "sent again, it may run twice" in error["message"], error
    assert "Find out whether it ran first" in error["message"], error
    assert executions(ledger, request_id) == [agent.instance_id]
