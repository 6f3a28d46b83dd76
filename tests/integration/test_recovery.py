"""Nothing accepted is lost: a process running the invoke worker dies mid-request (SIGKILL)."""

from __future__ import annotations

import asyncio
import uuid
from pathlib import Path

import httpx
import pytest

from tests.conftest import new_stack
from tests.helpers import Agent, CallbackReceiver, Gateway, Worker, wait_until

pytestmark = pytest.mark.integration


async def test_sigkilled_gateway_worker_mid_request_is_finished_elsewhere(
    temporal_server: str, redis_prefix: str, tmp_path: Path, http: httpx.AsyncClient
) -> None:
    stack = new_stack(
        temporal_server,
        tmp_path,
        registry="redis",
        key_prefix=redis_prefix,
        heartbeat_timeout=5.0,
    )
    doomed = Gateway(stack, "doomed")  # API + invoke worker: eager start runs the call here
    survivor_api = Gateway(stack, "api", worker=False)  # where the agent joins and heartbeats
    survivor = Worker(stack)  # python worker.py: picks the request up after the crash
    await asyncio.gather(doomed.ready(), survivor_api.ready(), survivor.ready())
    ledger = tmp_path / "ledger.txt"
    agent = await Agent(
        survivor_api, "slow-01", "slow-cap", "--delay-ms", "2000", "--ledger", str(ledger)
    ).ready()

    async with CallbackReceiver() as receiver:
        rid = f"req-{uuid.uuid4().hex}"
        r = await http.post(
            f"{doomed.url}/reach/invoke",
            json={
                "request_id": rid,
                "target": "slow-cap",
                "operation": "query",
                "payload": {"text": "survive"},
                "timeout_ms": 60_000,
                "callback": receiver.url,
            },
        )
        assert r.status_code == 202, r.text

        async def agent_started() -> bool:
            return ledger.exists() and rid in ledger.read_text()

        await wait_until(agent_started, 10, every_s=0.02)
        doomed.proc.kill()  # SIGKILL, mid-call

        await receiver.wait(1, timeout_s=45)
        assert len(receiver.received) == 1, survivor.proc.output()
        envelope = receiver.received[0][1]
        assert envelope["request_id"] == rid
        assert envelope["status"] == "success"
        assert envelope["result"]["instance_id"] == agent.instance_id
        await asyncio.sleep(1.0)
        assert len(receiver.received) == 1
    # The worker re-ran the call (at-least-once); the SDK answered it without running it again.
    assert [line.split()[0] for line in ledger.read_text().splitlines()] == [rid]
    status = await http.get(f"{survivor_api.url}/reach/requests/{rid}")
    assert status.json()["status"] == "success"
