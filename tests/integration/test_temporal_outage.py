"""A stuck Temporal (a server that accepts connections and never answers) is a prompt 503."""

from __future__ import annotations

import asyncio
import os
import signal
import time
import uuid
from pathlib import Path
from typing import Any

import httpx
import pytest

from gateway_api.devserver import DevServer, free_port
from tests.helpers import GatewayProcess, Stack, start_agents

pytestmark = pytest.mark.integration


async def test_a_stuck_temporal_answers_503_within_the_rpc_timeout(
    tmp_path: Path, http: httpx.AsyncClient
) -> None:
    server = DevServer(str(tmp_path / "t.db"), free_port(), None, log_file=tmp_path / "t.log")
    server.start()
    assert server.process is not None
    try:
        stack = Stack(
            temporal=server.address,
            tmp=tmp_path,
            task_queue=f"tq-{uuid.uuid4().hex[:8]}",
            extra={"REACH_TEMPORAL__RPC_TIMEOUT_S": "1"},
        )
        gateway = await GatewayProcess(stack).ready()
        await start_agents(gateway, "stuck-cap", 1)
        done = await http.post(
            f"{gateway.url}/reach/invoke", json={"target": "stuck-cap", "operation": "query"}
        )
        assert done.status_code == 200, done.text
        rid = done.json()["request_id"]
        os.killpg(server.process.pid, signal.SIGSTOP)
        try:

            async def timed(method: str, path: str, body: Any) -> tuple[httpx.Response, float]:
                start = time.monotonic()
                r = await http.request(method, f"{gateway.url}{path}", json=body)
                return r, time.monotonic() - start

            calls = (
                ("POST", "/reach/invoke", {"target": "stuck-cap", "operation": "query"}),
                ("GET", f"/reach/requests/req-{uuid.uuid4().hex}", None),
                ("GET", f"/reach/requests/{rid}", None),  # a finished one: its result is read
                ("POST", f"/reach/requests/{rid}/result", {"status": "success"}),
                ("GET", "/readyz", None),
            )
            # All at once: each waits for the stuck server on its own.
            answers = await asyncio.gather(*(timed(*call) for call in calls))
            for (_, path, _), (r, took) in zip(calls, answers, strict=True):
                assert r.status_code == 503, (path, r.text)
                assert took < 4.5, (path, took)  # before: 30 s and more, or until SIGCONT
                if path != "/readyz":
                    assert r.json()["error"]["type"] == "unavailable"
                    assert r.headers["Retry-After"] == "1"
        finally:
            os.killpg(server.process.pid, signal.SIGCONT)
    finally:
        server.stop()
