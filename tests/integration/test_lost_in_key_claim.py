"""A keyed write whose first workflow task claimed its idempotency key and sent it (the door's
route, called unpinned in that task) before its gateway was SIGKILLed, taken over by a run that
meets the deadline while it waits for the store to claim the key again (issue 25; today's soak
found one reported a plain timeout, the agent had run it). The takeover's history shows the
lost task (more than a first task's events before its first command) and nothing of what it did:
the caller must be told the write may have run, and where, not a failure that reads as never
sent. And a keyed write whose lost task never sent it (its key's claim stalled, the gateway
killed then) keeps an honest result: the takeover, the store back, sends it once and succeeds.

Real processes: two gateways on one task queue (the doomed one starts the requests eagerly), a
Redis behind a proxy in this process that stalls or drops the commands it is told to, agents
whose ledger counts executions, a callback receiver for what each caller was told.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest

from tests.helpers import (
    Agent,
    CallbackReceiver,
    GatewayProcess,
    executions,
    invoke,
    redis_stack,
    rid,
    wait_until,
)
from tests.integration.test_redis_outages import RedisServer
from tests.redis_proxy import RedisProxy

pytestmark = pytest.mark.integration

IDEM = b"claim:idem:"  # idempotency keys' claims (reach.invocation.idempotency_scope)
PIN = b"claim:pin:"  # an attempt's pin claims (reach.resolve.pin_key)
TIMEOUT_MS = 15_000  # past the workflow task timeout (10 s): the takeover meets it waiting
LONG_MS = 30_000  # the takeover has time to send it


class StoreGate(RedisProxy):
    """A command whose bytes `stall` matches is held (never forwarded, its connection kept
    open); one `drop` matches closes its connection unforwarded."""

    def __init__(self, upstream_port: int) -> None:
        super().__init__(upstream_port)
        self.stall: Callable[[bytes], bool] = lambda chunk: False
        self.drop: Callable[[bytes], bool] = lambda chunk: False
        self.stalled = 0
        self.dropped = 0

    async def admit(self, chunk: bytes) -> bool:
        if self.stall(chunk):
            self.stalled += 1
            await asyncio.Event().wait()  # held until the connection goes
        if self.drop(chunk):
            self.dropped += 1
            return False
        return True


async def keyed_create(
    http: httpx.AsyncClient,
    gateway: GatewayProcess,
    capability: str,
    request_id: str,
    timeout_ms: int,
    callback: str,
) -> None:
    """Starts a keyed write (`create`, its key `k-<request_id>`) whose outcome goes to
    `callback`: accepted, to run in the workflow."""
    r = await invoke(
        http,
        gateway,
        capability,
        "create",
        request_id=request_id,
        idempotency_key=f"k-{request_id}",
        timeout_ms=timeout_ms,
        callback=callback,
    )
    assert r.status_code == 202, r.text


async def test_a_keyed_write_a_lost_task_sent_may_have_run_when_the_takeover_waits_out_the_key(
    temporal_server: str, tmp_path: Path, http: httpx.AsyncClient
) -> None:
    redis = RedisServer()
    redis.start()
    try:
        async with StoreGate(redis.port) as gate:
            stack = redis_stack(temporal_server, tmp_path, gate.url)
            doomed = GatewayProcess(stack, "doomed")  # eager start: the first tasks run here
            other = GatewayProcess(stack, "other")  # its worker takes the requests over
            await asyncio.gather(doomed.ready(), other.ready())
            ledger = tmp_path / "ledger.txt"
            flags = ("--delay-ms", "60000", "--ledger", str(ledger))
            warm, quick = await asyncio.gather(
                Agent(other, "warm-01", "keyed-warm", *flags).ready(),
                Agent(other, "quick-01", "keyed-quick", "--ledger", str(ledger)).ready(),
            )
            # The door routes attempt 1 itself (it has routed the capability before).
            for capability in ("keyed-warm", "keyed-quick"):
                r = await invoke(http, doomed, capability, "get_metadata")
                assert r.status_code == 200, r.text
            async with CallbackReceiver() as receiver:
                sent, unsent = rid(), rid()
                await keyed_create(http, doomed, "keyed-warm", sent, TIMEOUT_MS, receiver.url)
                await wait_until(lambda: bool(executions(ledger, sent)), 15, every_s=0.02)
                mark, target = unsent.encode(), sent.encode()
                gate.stall = lambda chunk: IDEM in chunk and mark in chunk
                await keyed_create(http, doomed, "keyed-quick", unsent, LONG_MS, receiver.url)
                await wait_until(lambda: gate.stalled >= 1, 15, every_s=0.02)  # its key: held
                doomed.proc.kill()
                # Through the sent request's takeover and deadline: its key is not claimed
                # again, nor its pin read (the store is away for it); the other's store is back.
                gate.stall = lambda chunk: False
                gate.drop = lambda chunk: (IDEM in chunk or PIN in chunk) and target in chunk
                await receiver.wait(2, timeout_s=60)
                envelopes = {e["request_id"]: e for _, e in receiver.received}
            log = other.proc.output()[-4000:]
            other.proc.kill()
    finally:
        redis.stop()
    envelope = envelopes[sent]
    error = envelope.get("error") or {}
    assert envelope["status"] == "timeout", (envelope, log)
    assert error.get("outcome_unknown") is True, (envelope, log)
    assert error.get("retryable") is False, envelope
    assert envelope.get("instance_id") == warm.instance_id, envelope
    assert warm.instance_id in error["message"], envelope
    assert executions(ledger, sent) == [warm.instance_id]  # it ran, once
    # The lost task never sent the other: the takeover sent it, once, and it succeeded.
    envelope = envelopes[unsent]
    assert envelope["status"] == "success", (envelope, log)
    assert envelope.get("instance_id") == quick.instance_id, envelope
    assert executions(ledger, unsent) == [quick.instance_id]
