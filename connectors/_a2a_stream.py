"""Following an A2A task by its stream: `SubscribeToTask` on the JSON-RPC binding, read as
server-sent events (docs/protocols/a2a.md, "Following a long task").

A subscription is only a way to learn *when* to look: what the task ended as is read by one
`GetTask` after the stream says so (the stream's artifacts come in chunks that would have to be
put together, and a `GetTask` reads the whole task as polling does). So the stream's events are
read for their state alone, each checked as an A2A `StreamResponse` about the task followed:

    a task or status update, submitted / working       still going: read on (asking now and
                                                       then besides: `held`)
    a task or status update, final or interrupted      the end: stop, and look (`GetTask`)
    a message                                          the end of the stream: look
    the stream ends, breaks, stays quiet past          stop, and look; still going means the
    STREAM_QUIET_S, or answers with a JSON-RPC error   workflow polls from here

An event about another task, or one the SDK's types cannot read, ends the subscription like a
break (the look that follows says what the followed task is).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine
from typing import Any

import httpx
from a2a.types import StreamResponse, TaskState

from connectors._a2a_wire import A2A_VERSION, PENDING, parse
from reach.errors import AgentError, ReachError
from reach.messages import Reply, dumps

CANCEL_AGAIN_FOR_S = 2.5
"""How long CancelTask is asked again while refused because a stream of the task is held."""
# An SDK agent's SSE stream sends a ping comment every 15 s: a stream quiet for longer is lost.
STREAM_QUIET_S = 60.0
# The longest SSE line read (an event past it is refused, not held).
MAX_LINE_BYTES = 4 * 1024 * 1024
# While a stream is held, the task is asked about (GetTask) after this long, then twice as
# long each time up to SIDE_LOOK_MAX_S: a stream that keeps saying working (or pings, or says
# nothing) after the task ended must not keep its end unseen until the request's deadline.
SIDE_LOOK_FIRST_S = 5.0
SIDE_LOOK_MAX_S = 60.0


async def sse_data(response: httpx.Response, limit: int) -> AsyncIterator[Any]:
    """Each event's data of a server-sent event stream, read as JSON; no line, and no event's
    data (its `data:` lines together), past `limit`. Each byte is looked at once for a line's
    end, however small the chunks come (an agent sending a line a few bytes at a time made
    every chunk rescan and copy the whole line: a 2 MB line in 32-byte chunks held the
    worker's loop 20 s, a 4 MB one in 64-byte chunks six minutes)."""
    buffer = bytearray()
    scanned = 0  # buffer[:scanned] has no line's end
    data: list[bytes] = []
    held = 0  # the bytes of `data`
    async for chunk in response.aiter_bytes():
        buffer += chunk
        start = 0
        while True:
            end = buffer.find(b"\n", max(start, scanned))
            if end < 0:
                del buffer[:start]
                scanned = len(buffer)
                if len(buffer) > limit:
                    raise AgentError(f"a stream event of more than {limit} bytes", retryable=False)
                break
            line, start, scanned = bytes(buffer[start:end]).rstrip(b"\r"), end + 1, 0
            if not line:  # the event's end
                if data:
                    yield _json(b"\n".join(data))
                data, held = [], 0
            elif line.startswith(b"data:"):
                data.append(line[5:].removeprefix(b" "))
                held += len(data[-1]) + 1
                if held > limit:  # many lines, each under the limit, and no event's end
                    raise AgentError(f"a stream event of more than {limit} bytes", retryable=False)
    if data:
        yield _json(b"\n".join(data))


def _json(raw: bytes) -> Any:
    try:
        return json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError):
        raise AgentError("a stream event that is not JSON", retryable=False) from None


def ended(answer: Any, task_id: str, where: str) -> bool:
    """Whether a stream's JSON-RPC answer says the task `task_id` stopped going (final or
    interrupted, or a message), or raises the AgentError it is (a JSON-RPC error, an event
    about another task, one that is not an A2A stream event)."""
    if not isinstance(answer, dict):
        raise AgentError(f"{where}: a stream event that is not a JSON-RPC object")
    if answer.get("error") is not None:
        raise AgentError(f"{where}: the stream answered an error: {str(answer['error'])[:200]}")
    event = parse(answer.get("result"), StreamResponse(), "stream event", where)
    if event.HasField("message"):
        return True
    if event.HasField("task"):
        about, state = event.task.id, event.task.status.state
    elif event.HasField("status_update"):
        about, state = event.status_update.task_id, event.status_update.status.state
    else:  # an artifact update: the state stands
        return False
    if about != task_id:
        raise AgentError(f"{where}: the stream of task {task_id[:100]} told of {about[:100]!r}")
    return state not in PENDING and state != TaskState.TASK_STATE_UNSPECIFIED


async def read_until_end(
    http: httpx.AsyncClient, url: str, task_id: str, where: str, timeout_s: float
) -> str:
    """Subscribe to the task and read its stream until it says the task stopped going (""),
    or why it stopped first; httpx's exceptions and AgentErrors are the caller's to map."""
    body = dumps(
        {"jsonrpc": "2.0", "id": 1, "method": "SubscribeToTask", "params": {"id": task_id}}
    )
    headers = {
        "Content-Type": "application/json",
        "Accept": "text/event-stream",
        "A2A-Version": A2A_VERSION,
    }
    timeout = httpx.Timeout(STREAM_QUIET_S, connect=timeout_s)
    request = http.build_request("POST", url, content=body, headers=headers, timeout=timeout)
    response = await http.send(request, stream=True)
    try:
        kind = response.headers.get("content-type", "")
        if response.status_code != 200 or not kind.startswith("text/event-stream"):
            # An error answered at once (the task ended already, or has no stream left to
            # join): the look that follows says what it is.
            return f"SubscribeToTask answered HTTP {response.status_code} {kind[:60]}"
        async for answer in sse_data(response, MAX_LINE_BYTES):
            if ended(answer, task_id, where):
                return ""
    finally:
        await response.aclose()
    return "its stream ended before the task did"


class HeldStreams:
    """The task streams this process holds, so that `close` can let go of a task's before
    CancelTask (an a2a-sdk agent refuses to cancel a task while a stream of it is held)."""

    def __init__(self) -> None:
        self._stops: dict[str, set[asyncio.Event]] = {}

    async def read(self, task_id: str, reading: Coroutine[Any, Any, str]) -> str:
        """`reading`'s why, or why not once `close` let go of it first."""
        stop = asyncio.Event()
        self._stops.setdefault(task_id, set()).add(stop)
        read = asyncio.ensure_future(reading)
        closing = asyncio.ensure_future(stop.wait())
        try:
            await asyncio.wait({read, closing}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            closing.cancel()
            if not read.done():
                read.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await read
            held = self._stops.get(task_id, set())
            held.discard(stop)
            if not held:
                self._stops.pop(task_id, None)
        if read.cancelled():
            return "its stream was let go to cancel the task"
        return read.result()

    async def cancel(
        self,
        task_id: str,
        ask: Callable[[float], Awaitable[None]],
        look: Callable[[float], Awaitable[Reply]],
        timeout_s: float,
    ) -> None:
        """CancelTask (`ask`, given the seconds left). This process's streams of the task are
        let go first. An a2a-sdk agent answers "not cancelable" when a stream it still holds
        saw the task go on as it cancelled it, though the task ends canceled: refused so,
        `look` (GetTask) decides: canceled is done, still going is asked again a while (a
        stream on another worker lets go too), anything else is the refusal."""
        for stop in self._stops.get(task_id, ()):
            stop.set()
        loop = asyncio.get_running_loop()
        start = loop.time()
        again_until = start + min(timeout_s / 2, CANCEL_AGAIN_FOR_S)
        while True:
            try:
                await ask(timeout_s - (loop.time() - start))
                return
            except AgentError as exc:
                if getattr(exc, "code", None) != -32002:
                    raise
                now = await look(max(0.001, timeout_s - (loop.time() - start)))
                if now.status == "canceled":
                    return
                if now.status != "accepted" or loop.time() > again_until:
                    raise
            await asyncio.sleep(0.25)


async def held(
    stream: Coroutine[Any, Any, str],
    look: Callable[[], Awaitable[Reply]],
    first_s: float = SIDE_LOOK_FIRST_S,
) -> Reply | str:
    """Hold the stream (`stream`: why it stopped, "" when it said the task did) and, while it
    goes on, `look` now and then: the first look that finds the task ended (a Reply that is
    not accepted) is the answer, else the stream's why. A look that gets no answer is let go
    (the stream is still the way to the end); its other errors are the task's and end it."""
    reading = asyncio.ensure_future(stream)
    wait = first_s
    try:
        while True:
            done, _ = await asyncio.wait({reading}, timeout=wait)
            if done:
                return reading.result()
            try:
                reply = await look()
            except ReachError as exc:
                if exc.type not in ("transport_error", "timeout"):
                    raise
            else:
                if reply.status != "accepted":
                    return reply
            wait = min(wait * 2, SIDE_LOOK_MAX_S)
    finally:
        reading.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await reading
