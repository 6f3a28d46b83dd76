"""The A2A push route's pacing (`PushPacer`): one request's signals at most once a second, and
past a burst of them a growing gap up to its most, so a steady flood of pushes (an agent
pushing every second for hours, or anyone holding the request's token) cannot fill the
workflow's history; a request quiet for a while starts again at a second."""

from __future__ import annotations

import asyncio

from gateway_api.a2a_front import PushPacer


async def _never() -> None:
    raise AssertionError("no trailing signal: every push here comes once its gap has passed")


def test_a_steady_flood_is_paced_ever_more_slowly_up_to_its_most() -> None:
    now = [0.0]
    pacer = PushPacer(clock=lambda: now[0])
    gaps: list[float] = []
    for _ in range(16):  # the agent pushes each time the gap allows
        assert pacer.now("req-1", _never)
        gap = pacer.gap("req-1")
        gaps.append(gap)
        now[0] += gap
    assert gaps[:9] == [1.0] * 9  # a short task's pushes keep their pace
    assert gaps[9:] == [2.0, 4.0, 8.0, 10.0, 10.0, 10.0, 10.0]
    # Another request is paced on its own.
    assert pacer.now("req-2", _never)
    assert pacer.gap("req-2") == 1.0
    # Quiet for a minute: the next push starts a new burst.
    now[0] += 60.0
    assert pacer.now("req-1", _never)
    assert pacer.gap("req-1") == 1.0


async def test_a_push_inside_the_gap_is_folded_into_one_trailing_signal() -> None:
    now = [100.0]
    pacer = PushPacer(clock=lambda: now[0])
    sent: list[float] = []
    came = asyncio.Event()

    async def signal() -> None:
        sent.append(now[0])
        came.set()

    assert pacer.now("req-3", signal)
    now[0] += 0.5
    assert not pacer.now("req-3", signal)  # folded: a trailing signal is pending
    assert not pacer.now("req-3", signal)  # and one only
    async with asyncio.timeout(10):  # due at the gap's end, 0.5 s on
        await came.wait()
    await asyncio.sleep(0.1)
    assert len(sent) == 1
