"""A callback delivery heals (issue 25): a worker SIGKILLed mid-POST is noticed by the POST's
heartbeat timeout and another worker sends it again, long before the attempt timeout; a receiver
that was down a while is served within the backoff's bound of its return."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from agent_reach_proto import wire
from agent_reach_sdk.wire import Answer, Inbound
from tests.conftest import new_stack
from tests.helpers import (
    Agent,
    GatewayProcess,
    OutageReceiver,
    Worker,
    invoke,
    path_server,
    wait_until,
)

pytestmark = pytest.mark.integration

ATTEMPT = wire.HTTP_DELIVERY_ATTEMPT.lower()
# The POST's attempt timeout here: before the heartbeat, the only way a POST held by a dead
# worker ended, so a redelivery that came from it would arrive ~a minute after the first POST.
ATTEMPT_TIMEOUT_S = 60
# The heartbeat timeout (5 s) and the first backoff (0.2 s in tests), bounded for a busy box
# and well below what the attempt timeout could give (it has ~50 s left at the SIGKILL).
REDELIVERED_BOUND_S = 25.0


class HoldingReceiver:
    """Holds the first callback POST open (its worker dies holding it); answers the rest 200."""

    def __init__(self) -> None:
        self.arrived: list[tuple[float, dict[str, str], dict[str, Any]]] = []
        self._release = asyncio.Event()
        self.server = path_server(self._handle)

    async def _handle(self, request: Inbound) -> Answer:
        self.arrived.append((time.monotonic(), dict(request.headers), json.loads(request.body)))
        if len(self.arrived) == 1:
            await self._release.wait()
        return Answer(200, {"ok": True})

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.port}/callback"

    async def close(self) -> None:
        self._release.set()
        await self.server.close()


async def test_a_worker_sigkilled_mid_post_is_redelivered_by_another_within_seconds(
    temporal_server: str, tmp_path: Path, http: httpx.AsyncClient, capability: str
) -> None:
    """Only the doomed gateway's worker runs when the first POST is sent, so it is the one
    holding it; a worker started then takes the retry after the heartbeat timeout."""
    extra = {"REACH_CALLBACK__ATTEMPT_TIMEOUT_S": str(ATTEMPT_TIMEOUT_S)}
    stack = new_stack(temporal_server, tmp_path, extra=extra)
    doomed = await GatewayProcess(stack, "doomed").ready()
    await Agent(doomed, f"{capability}-01", capability).ready()
    receiver = HoldingReceiver()
    await receiver.server.start()
    try:
        r = await invoke(http, doomed, capability, callback=receiver.url)
        assert r.status_code == 202, r.text
        request_id = r.json()["request_id"]
        await wait_until(lambda: bool(receiver.arrived), 30, every_s=0.05)
        survivor = await Worker(stack).ready()
        doomed.proc.kill()  # SIGKILL, its POST held open by the receiver
        killed = time.monotonic()
        await wait_until(lambda: len(receiver.arrived) >= 2, 45, every_s=0.05)
        redelivered_s = receiver.arrived[1][0] - killed
        held_s = killed - receiver.arrived[0][0]
        print(f"redelivered {redelivered_s:.2f} s after the SIGKILL ({held_s:.2f} s into the POST)")
        (_, first, _), (_, second, envelope) = receiver.arrived[:2]
        assert (first[ATTEMPT], second[ATTEMPT]) == ("1", "2"), survivor.proc.output()
        assert envelope["request_id"] == request_id
        assert envelope["status"] == "success", envelope
        assert redelivered_s < REDELIVERED_BOUND_S, f"{redelivered_s:.1f} s after the SIGKILL"
    finally:
        await receiver.close()


@pytest.mark.slow  # ~40 s: the receiver's 30 s outage is the fault
async def test_a_receiver_down_30_s_is_served_within_the_max_backoff_of_its_return(
    temporal_server: str, tmp_path: Path, http: httpx.AsyncClient, capability: str
) -> None:
    """The shipped backoff (1 s doubling to callback.max_backoff_s, 5 s): an attempt every 5 s
    by the end of the outage, so the callback comes within about 5 s of the receiver's return
    (a faster test, test_fault_outcomes, checks the bound at 1 s)."""
    stack = new_stack(temporal_server, tmp_path, extra={"REACH_CALLBACK__INITIAL_BACKOFF_S": "1"})
    gateway = await GatewayProcess(stack).ready()
    await Agent(gateway, f"{capability}-01", capability).ready()
    receiver = OutageReceiver()
    try:
        r = await invoke(http, gateway, capability, callback=receiver.url)
        assert r.status_code == 202, r.text
        request_id = r.json()["request_id"]
        await asyncio.sleep(30.0)  # the receiver's outage (nothing to wait for: it is the fault)
        back = await receiver.up()
        await wait_until(lambda: bool(receiver.arrived), 30, every_s=0.05)
        served_after_s = receiver.arrived[0][0] - back
        print(f"served {served_after_s:.2f} s after the receiver came back")
        assert receiver.arrived[0][1]["request_id"] == request_id
        assert served_after_s < 8.0, served_after_s
    finally:
        await receiver.close()
