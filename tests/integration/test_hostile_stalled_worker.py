"""Hostile review of a STALLED worker (SIGSTOP, not SIGKILL) against the pin claims of 88bb2ee,
c52b743 and 054df6d, on real processes: two gateways' workers on one task queue, each talking
to one private Redis through a proxy of its own in this process, so the store can hold or drop
a command of one gateway's and not the other's. The MCP server's ledger (a line per run of
`count`) says what ran; the callback what the caller was told.
"""

from __future__ import annotations

import asyncio
import signal
from dataclasses import replace
from pathlib import Path

import httpx
import pytest

from tests.helpers import Worker, rid, runs, wait_until
from tests.integration.test_hostile_pin_claims import (
    PIN,
    SENT,
    KeyBlocker,
    keyless_writes,
    refused_unsent_twice,
)

pytestmark = pytest.mark.integration

TAKEN_OVER = "was taken over by another worker"  # reach.resolve: a stalled task sends nothing


class KeyHolder(KeyBlocker):
    """A `KeyBlocker` that can also hold (not drop) a command naming one of the `held` key
    prefixes until `release` is set: the command reaches Redis, and its answer its client, only
    then."""

    def __init__(self, upstream_port: int) -> None:
        super().__init__(upstream_port)
        self.held: set[bytes] = set()
        self.holding = 0
        self.release = asyncio.Event()

    async def admit(self, chunk: bytes) -> bool:
        if any(key in chunk for key in self.held):
            self.holding += 1
            await self.release.wait()
        return await super().admit(chunk)


async def test_a_write_a_stalled_worker_sent_after_the_takeover_pinned_it_stays_unknown(
    temporal_server: str, tmp_path: Path, http: httpx.AsyncClient
) -> None:
    """A keyless write to an MCP server is refused unsent while gateway A's send-once claims
    are dropped, and waits for the store. The task that fires that wait's timer resolves it
    again: its pin claim is held in A's proxy, and A is SIGSTOPped. Past the workflow task
    timeout, worker B takes the request over; its pin claim (the same number) passes first,
    its send-once claims are dropped. Then A's held claim goes through and A is SIGCONTed
    (that claim's read had timed out in A, so A resolves again on the same key, 054df6d, and
    finds B's pin). Before the fix A's send-once claim passed, the server ran the write, and
    the caller was told unavailable, retryable: true, 'not sent' (B's claims kept being
    dropped until the deadline; its call was 'routed here'). A claim found held by a later
    task of the same run now tells A it was taken over, and it sends nothing: whatever the
    caller is told, a write that ran must say it may have run (issue 25)."""
    envelope: dict[str, object] = {}
    async with (
        keyless_writes(
            temporal_server, tmp_path, http, "tools-stall", gateway="stalled", proxy=KeyHolder
        ) as scene,
        KeyBlocker(scene.redis.port) as pb,
    ):
        pa, stalled = scene.blocker, scene.gateway
        assert isinstance(pa, KeyHolder)
        stack_b = replace(scene.stack, extra={"REACH_REGISTRY__REDIS_URL": pb.url})
        try:
            pb.blocked = {SENT}
            tag = await refused_unsent_twice(http, scene, rid(), sleep_s=1)
            pa.held = {PIN}  # the next resolve's pin claim waits in the proxy
            await wait_until(lambda: pa.holding >= 1, 30)
            stalled.proc.kill(signal.SIGSTOP)
            scene.other = await Worker(stack_b).ready()
            # B took it over, pinned it first and was refused unsent (nothing sent by it).
            await wait_until(lambda: pb.dropped[SENT] >= 1, 60)
            pa.held, pa.blocked = set(), set()
            pa.release.set()  # A's claim reaches the store now, after B's
            stalled.proc.kill(signal.SIGCONT)
            # A wakes: it sends the write (before the fix) or finds it taken over.
            await wait_until(
                lambda: runs(scene.server, tag) > 0 or TAKEN_OVER in stalled.proc.output(), 30
            )
            await scene.cb.wait(1, timeout_s=90)
            envelope = scene.cb.received[0][1]
        finally:
            stalled.proc.kill(signal.SIGCONT)
            stalled.proc.stop()
    log = scene.log()
    woke = stalled.proc.output()
    error = envelope.get("error") or {}
    assert isinstance(error, dict)
    if runs(scene.server, tag):  # it ran (before the fix: unavailable, retryable, 'not sent')
        assert runs(scene.server, tag) == 1, log
        assert error.get("retryable") is not True, (envelope, log)
        assert error.get("outcome_unknown") is True, (envelope, log)
    else:  # the stalled worker sent nothing: whatever the caller is told is true
        assert TAKEN_OVER in woke, woke[-3000:]
