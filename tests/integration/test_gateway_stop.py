"""A gateway told to stop (SIGTERM) does not wait out a synchronous caller's long deadline."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time
import uuid
from pathlib import Path
from typing import Any

import httpx
import pytest

from agent_reach_sdk import AgentRuntime
from tests.conftest import new_stack
from tests.helpers import GatewayProcess, wait_until

pytestmark = pytest.mark.integration


async def test_a_sync_wait_in_flight_is_answered_running_when_its_gateway_stops(
    temporal_server: str, tmp_path: Path
) -> None:
    """uvicorn lets requests in flight finish before it stops: a sync invoke with a 2-minute
    deadline held a SIGTERMed gateway (and a rollout) for those 2 minutes. It is now let run
    `transport.drain_s`, then answered `running` with its RequestID (the request goes on)."""
    capability = f"stop-{uuid.uuid4().hex[:6]}"
    runtime = AgentRuntime(
        capability, protocol="http", service_address="127.0.0.1:0", heartbeat_interval=0.5
    )
    started = asyncio.Event()

    @runtime.operation("slow", timeout_ms=120_000)
    async def slow(payload: dict[str, Any]) -> dict[str, Any]:
        started.set()
        await asyncio.sleep(60)
        return {}

    stack = new_stack(temporal_server, tmp_path, extra={"REACH_TRANSPORT__DRAIN_S": "1"})
    gateway = GatewayProcess(stack)
    try:
        runtime.reach_url = (await gateway.ready()).url
        # Stopped with no grace after the call: its handler only holds it (`async with runtime`
        # gave the handler 5 s more).
        await runtime.astart()
        stopped = contextlib.AsyncExitStack()
        stopped.push_async_callback(runtime.astop, grace_s=0)
        async with stopped, httpx.AsyncClient(trust_env=False, timeout=90) as http:

            async def joined() -> bool:
                r = await http.get(f"{gateway.url}/reach/capabilities/{capability}")
                return r.status_code == 200 and len(r.json()["instances"]) == 1

            await wait_until(joined, 20)
            call = asyncio.create_task(
                http.post(
                    f"{gateway.url}/reach/invoke",
                    json={"target": capability, "operation": "slow", "timeout_ms": 120_000},
                )
            )
            await asyncio.wait_for(started.wait(), 30)
            stopping = time.monotonic()
            os.killpg(gateway.proc.popen.pid, signal.SIGTERM)
            r = await call
            waited = time.monotonic() - stopping
        assert r.status_code == 504, r.text
        body = r.json()
        assert body["status"] == "running"
        assert body["error"]["type"] == "unavailable"
        assert "stopping" in body["error"]["message"]
        assert body["request_id"] in body["error"]["message"]
        assert waited < 45, waited  # not the call's 60 s, nor its 120 s deadline
    finally:
        gateway.proc.stop()
