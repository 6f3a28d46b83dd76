"""A request whose attempt ran in a workflow task that was lost after a wait (issue 25; stop
34's soak found it): the request waited for the store (Redis away), the task that fired the
wait's timer routed the attempt and sent it, then its gateway was SIGKILLed; the task that took
the request over met the deadline before routing the attempt itself. The history holds no trace
of the lost task's call, only the pin resolve claimed in the store before it: the caller must be
told it may have run, and where, not a plain timeout that reads as never sent. And when the
run that takes it over has time left, routes it back to the instance the lost task pinned and
cannot connect (the agent died too), not a plain transport_error."""

from __future__ import annotations

import time
from pathlib import Path

import httpx
import pytest

from tests.conftest import new_stack
from tests.helpers import (
    Agent,
    CallbackReceiver,
    GatewayProcess,
    Worker,
    executions,
    invoke,
    rid,
    wait_until,
)
from tests.integration.test_redis_outages import RedisServer

pytestmark = pytest.mark.integration

TIMEOUT_MS = 15_000  # a worker starts, waits out the store, and calls the agent before it
LONG_MS = 60_000  # the other request's: the run that takes it over routes it itself


async def test_writes_sent_by_a_task_lost_after_a_store_wait_may_have_run_and_say_where(
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
            request_id, long = rid(), rid()
            for rid_, timeout_ms in ((request_id, TIMEOUT_MS), (long, LONG_MS)):
                r = await invoke(
                    http,
                    api,
                    "waits",
                    "create",
                    request_id=rid_,
                    timeout_ms=timeout_ms,
                    callback=receiver.url,
                )
                assert r.status_code == 202, r.text  # accepted; no worker has run it yet
            deadline = time.monotonic() + TIMEOUT_MS / 1000
            redis.stop()
            doomed = Worker(stack)  # its resolve meets no store: the requests wait for it
            await wait_until(lambda: "waiting for the store" in doomed.proc.output(), 20)
            port = redis.port
            redis = RedisServer()
            redis.port, redis.url = port, f"redis://127.0.0.1:{port}/0"
            redis.start()  # empty: the agent joins again at its next heartbeat
            both = (request_id, long)
            await wait_until(lambda: all(executions(ledger, r) for r in both), TIMEOUT_MS / 1000)
            doomed.proc.kill()
            agent.proc.kill()  # its record lives on (heartbeat_timeout): routed back, refused
            # Nobody runs the requests until the first's deadline has passed; then another
            # worker takes them over: the first's run meets its deadline before it routes
            # anything itself, the second's goes back to the agent and cannot connect.
            await wait_until(lambda: time.monotonic() > deadline + 0.5, TIMEOUT_MS / 1000 + 5)
            other = await Worker(stack).ready()
            await receiver.wait(2, timeout_s=60)
            envelopes = {e["request_id"]: e for _, e in receiver.received}
    finally:
        redis.stop()
    log = other.proc.output()[-3000:]  # the runs that took the requests over
    envelope = envelopes[request_id]
    assert envelope["status"] == "timeout", (envelope, log)
    assert envelope["error"].get("outcome_unknown") is True, (envelope, log)
    assert envelope["error"]["retryable"] is False, envelope
    assert envelope["instance_id"] == agent.instance_id, envelope
    assert agent.instance_id in envelope["error"]["message"], envelope
    envelope = envelopes[long]
    assert envelope["status"] == "error", (envelope, log)
    assert envelope["error"].get("outcome_unknown") is True, (envelope, log)
    assert envelope["error"]["retryable"] is False, envelope
    assert envelope["instance_id"] == agent.instance_id, envelope
    for rid_ in (request_id, long):
        assert executions(ledger, rid_) == [agent.instance_id]  # run once, never again
