"""Hostile review of the callback bounds (008344a, d0043d1): one caller's hung receivers on a
few host names (any name counts as a receiver of its own: 127.0.0.x here, a wildcard DNS name
anywhere) take the worker's whole share of callback POSTs (64), and every other caller's
callback is then refused `callback_busy` until a hung POST's attempt timeout frees a slot, and
then only by lottery against the hostile caller's retries."""

from __future__ import annotations

import time
from pathlib import Path

import httpx
import pytest

from activities.receivers import AT_ONCE, PER_RECEIVER
from tests.helpers import invoke, wait_until
from tests.integration.test_callback_hostile import (
    RawReceiver,
    answer_after,
    never_answer,
    stack_with_agent,
)

pytestmark = pytest.mark.integration

HOSTS = AT_ONCE // PER_RECEIVER + 2  # more hung POSTs than the worker's share, on 6 names


async def test_one_caller_s_hung_receivers_do_not_hold_up_another_caller_s_callback(
    temporal_server: str, tmp_path: Path, http: httpx.AsyncClient, capability: str
) -> None:
    gateway = await stack_with_agent(
        temporal_server, tmp_path, capability, REACH_CALLBACK__ATTEMPT_TIMEOUT_S="30"
    )
    hung = [await RawReceiver(never_answer, f"127.0.0.{i + 10}").start() for i in range(HOSTS)]
    healthy = await RawReceiver(answer_after({}), "127.0.0.2").start()
    open_now = lambda: sum(h.open_now() for h in hung)  # noqa: E731
    try:
        for receiver in hung:
            for _ in range(PER_RECEIVER):
                r = await invoke(http, gateway, capability, caller="mallory", callback=receiver.url)
                assert r.status_code == 202, r.text
        # As many as the worker lets one caller hold (all 64 before a caller's share).
        await wait_until(lambda: open_now() >= AT_ONCE // 2, 30, every_s=0.1)
        sent = time.monotonic()
        r = await invoke(http, gateway, capability, caller="alice", callback=healthy.url)
        assert r.status_code == 202, r.text
        await wait_until(lambda: bool(healthy.posts), 60, every_s=0.05)
        waited_s = healthy.posts[0].opened - sent
        print(f"alice's callback after {waited_s:.2f} s; mallory's hung POSTs open {open_now()}")
        assert waited_s < 5.0, f"{waited_s:.1f} s"
    finally:
        for receiver in hung:
            await receiver.close()
        await healthy.close()
