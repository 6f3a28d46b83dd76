"""The A2A connector's reading of a task's stream (SubscribeToTask's server-sent events):
events split anywhere across chunks, what ends a subscription, what is refused, and the looks
asked besides while a stream says nothing of the end."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest

from connectors.a2a import HeldStreams, ended, held, sse_data
from reach.errors import AgentError, ReachError, TransportError
from reach.messages import Reply

TASK = "task-1"


def event(result: dict[str, Any]) -> bytes:
    answer = {"jsonrpc": "2.0", "id": 1, "result": result}
    return f"data: {json.dumps(answer)}\r\n\r\n".encode()


def status(state: str, task_id: str = TASK) -> dict[str, Any]:
    return {"statusUpdate": {"taskId": task_id, "contextId": "c", "status": {"state": state}}}


def streamed(body: bytes, size: int) -> httpx.Response:
    chunks = [body[i : i + size] for i in range(0, len(body), size)]

    class Chunks(httpx.AsyncByteStream):
        async def __aiter__(self) -> AsyncIterator[bytes]:
            for chunk in chunks:
                yield chunk

    return httpx.Response(200, stream=Chunks())


@pytest.mark.parametrize("size", [1, 7, 4096])
async def test_events_are_read_whole_however_the_stream_is_cut(size: int) -> None:
    body = (
        b": ping\r\n\r\n"
        + event({"task": {"id": TASK, "status": {"state": "TASK_STATE_WORKING"}}})
        + event(status("TASK_STATE_COMPLETED"))
    )
    got = [answer async for answer in sse_data(streamed(body, size), 1 << 20)]
    assert [ended(answer, TASK, "agent a") for answer in got] == [False, True]


@pytest.mark.parametrize(
    ("result", "stops"),
    [
        (status("TASK_STATE_WORKING"), False),
        (status("TASK_STATE_SUBMITTED"), False),
        ({"artifactUpdate": {"taskId": TASK, "artifact": {"artifactId": "a"}}}, False),
        (status("TASK_STATE_COMPLETED"), True),
        (status("TASK_STATE_FAILED"), True),
        (status("TASK_STATE_INPUT_REQUIRED"), True),
        (status("TASK_STATE_AUTH_REQUIRED"), True),
        ({"message": {"messageId": "m", "role": "ROLE_AGENT", "parts": [{"text": "hi"}]}}, True),
    ],
)
def test_what_ends_a_subscription(result: dict[str, Any], stops: bool) -> None:
    assert ended({"jsonrpc": "2.0", "id": 1, "result": result}, TASK, "agent a") is stops


@pytest.mark.parametrize(
    "answer",
    [
        {"jsonrpc": "2.0", "id": 1, "error": {"code": -32001, "message": "gone"}},
        {"jsonrpc": "2.0", "id": 1, "result": status("TASK_STATE_COMPLETED", "another")},
        {"jsonrpc": "2.0", "id": 1, "result": {"statusUpdate": {"status": {"state": 3.5}}}},
        [1, 2],
    ],
)
def test_an_error_another_task_s_event_or_no_event_is_refused(answer: Any) -> None:
    with pytest.raises(AgentError):
        ended(answer, TASK, "agent a")


async def test_an_event_past_the_limit_is_refused_unheld() -> None:
    body = b"data: " + b"x" * 5000
    with pytest.raises(AgentError, match="more than 1000 bytes"):
        async for _ in sse_data(streamed(body, 100), 1000):
            pass


async def test_an_event_of_many_lines_past_the_limit_is_refused_unheld() -> None:
    # Each data: line under the limit, no event's end: the lines together are the event.
    body = (b"data: " + b"x" * 500 + b"\n") * 50
    with pytest.raises(AgentError, match="more than 1000 bytes"):
        async for _ in sse_data(streamed(body, 4096), 1000):
            pass


async def test_a_line_in_small_chunks_is_read_in_linear_time() -> None:
    # 2 MB sent 32 bytes at a time: 0.3 s here, 20 s when each chunk rescanned the line.
    line = b'data: {"pad": "' + b"x" * (2 << 20) + b'"}\n\n'
    started = time.perf_counter()
    got = [answer async for answer in sse_data(streamed(line, 32), 4 << 20)]
    assert len(got[0]["pad"]) == 2 << 20
    assert time.perf_counter() - started < 10


async def never_ends() -> str:
    await asyncio.Event().wait()
    return ""


def looks_at(*answers: Reply | ReachError) -> tuple[list[int], Any]:
    asked: list[int] = []

    async def look() -> Reply:
        asked.append(1)
        answer = answers[min(len(asked), len(answers)) - 1]
        if isinstance(answer, ReachError):
            raise answer
        return answer

    return asked, look


async def test_a_stream_that_never_tells_the_end_is_asked_about_besides() -> None:
    # An agent whose stream says working (or nothing) after its task completed left the request
    # to wait out its deadline, then time out with CancelTask sent to a completed task.
    asked, look = looks_at(
        Reply(status="accepted", follow={"task_id": TASK}),
        TransportError("the agent did not answer"),  # let go: the stream goes on
        Reply(status="ok", result={"done": True}),
    )
    got = await asyncio.wait_for(held(never_ends(), look, first_s=0.01), 30)
    assert isinstance(got, Reply)
    assert got.status == "ok"
    assert len(asked) == 3


async def test_the_stream_s_own_end_stands_and_a_look_s_agent_error_ends_it() -> None:
    async def says_ended() -> str:
        return ""

    asked, look = looks_at(Reply(status="ok"))
    assert await held(says_ended(), look, first_s=10) == ""
    assert asked == []
    _, refused = looks_at(AgentError("task not found"))
    with pytest.raises(AgentError, match="task not found"):
        await asyncio.wait_for(held(never_ends(), refused, first_s=0.01), 30)


def not_cancelable() -> AgentError:
    err = AgentError("agent a refused CancelTask: task_not_cancelable", retryable=False)
    err.code = -32002  # type: ignore[attr-defined]
    return err


@pytest.mark.parametrize(
    ("states", "asks", "ends"),
    [
        (["canceled"], 1, None),  # refused, yet the task ended canceled: done
        (["accepted", "canceled"], 2, None),  # still going: asked again, then canceled
        (["ok"], 1, AgentError),  # it ended on its own first: the refusal stands
    ],
)
async def test_a_cancel_refused_as_not_cancelable_looks_at_the_task(
    states: list[str], asks: int, ends: type[Exception] | None
) -> None:
    held_streams = HeldStreams()
    asked: list[float] = []
    seen = iter(states)

    async def ask(left_s: float) -> None:
        asked.append(left_s)
        raise not_cancelable()

    async def look(left_s: float) -> Reply:
        return Reply(status=next(seen))  # type: ignore[arg-type]

    if ends is None:
        await held_streams.cancel(TASK, ask, look, 5.0)
    else:
        with pytest.raises(ends):
            await held_streams.cancel(TASK, ask, look, 5.0)
    assert len(asked) == asks


async def test_a_cancel_lets_go_of_the_task_s_stream_held_here() -> None:
    held_streams = HeldStreams()
    forever = asyncio.Event()

    async def reading() -> str:
        await forever.wait()
        return ""

    reader = asyncio.ensure_future(held_streams.read(TASK, reading()))
    await asyncio.sleep(0)

    async def ask(left_s: float) -> None:
        return None

    async def look(left_s: float) -> Reply:
        raise AssertionError("not asked: the cancel was taken")

    await held_streams.cancel(TASK, ask, look, 5.0)
    async with asyncio.timeout(5):
        why = await reader
    assert "let go" in why
