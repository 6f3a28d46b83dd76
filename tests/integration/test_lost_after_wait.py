"""A request whose attempt ran in a workflow task that was lost after a wait (issue 25; stop
34's soak found it): the request waited for the store (Redis away), the task that fired the
wait's timer routed the attempt and sent it, then its gateway was SIGKILLed; the task that took
the request over met the deadline before routing the attempt itself. The history holds no trace
of the lost task's call, only the pin resolve claimed in the store before it: the caller must be
told it may have run, and where, not a plain timeout that reads as never sent."""

from __future__ import annotations

import time
from pathlib import Path

import httpx
import pytest

from tests.conftest import new_stack
from tests.helpers import Agent, CallbackReceiver, GatewayProcess, Worker, invoke, rid, wait_until
from tests.integration.test_redis_outages import RedisServer

pytestmark = pytest.mark.integration

TIMEOUT_MS = 15_000  # a worker starts, waits out the store, and calls the agent before it


def executions(ledger: Path, request_id: str) -> list[str]:
    if not ledger.exists():
        return []
    rows = [line.split() for line in ledger.read_text().splitlines() if line.strip()]
    return [instance for request, instance in rows if request == request_id]


async def test_a_write_sent_by_a_task_lost_after_a_store_wait_may_have_run_and_says_where(
    temporal_server: str, tmp_path: Path, http: httpx.AsyncClient
) -> None:
    redis = RedisServer()
    redis.start()
    try:
        stack = new_stack(
            temporal_server,
            tmp_path,
            registry="redis",
            heartbeat_timeout=60.0,
            extra={"REACH_REGISTRY__REDIS_URL": redis.url},
        )
        api = await GatewayProcess(stack, "api", worker=False).ready()
        ledger = tmp_path / "ledger.txt"
        agent = await Agent(
            api, "slow-01", "waits", "--delay-ms", "60000", "--ledger", str(ledger)
        ).ready()
        async with CallbackReceiver() as receiver:
            request_id = rid()
            r = await invoke(
                http,
                api,
                "waits",
                "create",
                request_id=request_id,
                timeout_ms=TIMEOUT_MS,
                callback=receiver.url,
            )
            assert r.status_code == 202, r.text  # accepted; no worker has run it yet
            deadline = time.monotonic() + TIMEOUT_MS / 1000
            redis.stop()
            doomed = Worker(stack)  # its resolve meets no store: the request waits for it
            await wait_until(lambda: "waiting for the store" in doomed.proc.output(), 20)
            port = redis.port
            redis = RedisServer()
            redis.port, redis.url = port, f"redis://127.0.0.1:{port}/0"
            redis.start()  # empty: the agent joins again at its next heartbeat
            await wait_until(lambda: executions(ledger, request_id), TIMEOUT_MS / 1000)
            doomed.proc.kill()
            # Nobody runs the request until its deadline has passed; then another worker
            # takes it over, and its run meets the deadline before it routes anything itself.
            await wait_until(lambda: time.monotonic() > deadline + 0.5, TIMEOUT_MS / 1000 + 5)
            other = await Worker(stack).ready()
            await receiver.wait(1, timeout_s=60)
            envelope = receiver.received[0][1]
    finally:
        redis.stop()
    log = other.proc.output()[-3000:]  # the run that took the request over
    assert envelope["request_id"] == request_id
    assert envelope["status"] == "timeout", (envelope, log)
    assert envelope["error"].get("outcome_unknown") is True, (envelope, log)
    assert envelope["error"]["retryable"] is False, envelope
    assert envelope["instance_id"] == agent.instance_id, envelope
    assert agent.instance_id in envelope["error"]["message"], envelope
    assert executions(ledger, request_id) == [agent.instance_id]  # run once, never again
