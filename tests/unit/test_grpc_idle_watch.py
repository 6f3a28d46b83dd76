"""The gRPC Heartbeat stream's idle bound (`IdleWatch`): one timer per idle period, re-armed
while reports keep coming, so a stream that reports keeps going past the bound and one that
falls silent is ended (its wait cancelled, marked expired)."""

from __future__ import annotations

import asyncio
import time

from gateway_api.grpc_idle import IdleWatch


def test_a_stream_that_reports_stays_and_one_that_falls_silent_is_ended() -> None:
    idle_s = 1.0

    async def stream(reporting_s: float) -> tuple[bool, float]:
        watch = IdleWatch(lambda: idle_s)
        began = time.monotonic()
        try:
            while time.monotonic() - began < reporting_s:  # a report every tenth of the bound
                watch.waiting()
                await asyncio.sleep(idle_s / 10)
                watch.busy()
            watch.waiting()
            silent = time.monotonic()
            try:
                await asyncio.sleep(30)  # the next report never comes
            except asyncio.CancelledError:
                return watch.expired, time.monotonic() - silent
            return False, 30.0
        finally:
            watch.close()

    expired, after = asyncio.run(stream(2.5 * idle_s))
    assert expired  # it lived 2.5 bounds while reporting, then was ended for its silence
    assert idle_s <= after < 10 * idle_s
