"""Reading a Streamable HTTP response's bytes for `connectors._mcp_wire`: a JSON body bounded
whole, an SSE stream split into its events' data (each event bounded), and a `Budget` that
bounds what several responses read between them (a discovery's pages and whatever their
streams carry beside the answers)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import httpx

from reach.errors import AgentError

# What one discovery reads, its pages and whatever their streams carry beside the answers,
# together: 256 tools with the longest description and input schema kept are ~17 MiB. Without
# it a server could send 32 pages of 4 MiB (a gateway at ~450 MB for each probe of it).
MAX_DISCOVERY_BYTES = 20 * 1024 * 1024
# And the notifications (or answers to other ids) their streams may carry: parsing 20 MiB of
# progress notifications is seconds of a gateway's CPU for every probe.
MAX_SKIPPED_MESSAGES = 1024
# What a tool call's stream may carry beside its answer before it is read at a pace: lines and
# messages that are not the answer (progress, pings, comments) come at most this many a
# second past a burst of `PACE_BURST`. Parsing one costs ~40 us, so a server flooding its
# stream for a call's whole deadline burned a core of the gateway for it; read slower, it is
# held back by TCP instead, and a tool's progress (a few a second) is never slowed.
PACE_BURST = 5000
PACE_PER_S = 1000.0


def too_much(where: str, limit: int) -> AgentError:
    return AgentError(
        f"{where} answered more than {limit} bytes; the negotiated max_message_bytes leaves "
        "no room for more",
        retryable=False,
    )


class Budget:
    """Bytes several responses may read between them, the whole of each stream counted
    (`MAX_DISCOVERY_BYTES` for one discovery), and the messages they may skip (notifications,
    other ids) before their answers; past either the reading stops, not retryable."""

    def __init__(self, left: int, skips: int = MAX_SKIPPED_MESSAGES) -> None:
        self.total = left
        self.left = left
        self.skips = skips

    def skip(self, where: str) -> None:
        self.skips -= 1
        if self.skips < 0:
            raise AgentError(
                f"{where} sent more than {MAX_SKIPPED_MESSAGES} messages that are not the answer "
                "while saying what it serves",
                retryable=False,
            )

    def spend(self, size: int, where: str) -> None:
        self.left -= size
        if self.left < 0:
            raise AgentError(
                f"{where} answered more than {self.total} bytes in all while saying what it serves",
                retryable=False,
            )


class Pace:
    """Paces what a stream carries beside its answer (`PACE_PER_S` past `PACE_BURST`)."""

    __slots__ = ("count", "since")

    def __init__(self) -> None:
        self.count = 0
        self.since = 0.0

    async def tick(self) -> None:
        self.count += 1
        if self.count < PACE_BURST:
            return
        now = asyncio.get_running_loop().time()
        if self.count == PACE_BURST:
            self.since = now
            return
        wait = self.since + (self.count - PACE_BURST) / PACE_PER_S - now
        if wait > 0.001:
            await asyncio.sleep(wait)


async def _chunks(
    response: httpx.Response, budget: Budget | None, where: str
) -> AsyncIterator[bytes]:
    async for chunk in response.aiter_bytes():
        if budget is not None:
            budget.spend(len(chunk), where)
        yield chunk


async def limited(
    response: httpx.Response, limit: int, where: str, budget: Budget | None = None
) -> AsyncIterator[bytes]:
    size = 0
    async for chunk in _chunks(response, budget, where):
        size += len(chunk)
        if size > limit:
            raise too_much(where, limit)
        yield chunk


async def sse_messages(
    response: httpx.Response,
    limit: int,
    where: str,
    budget: Budget | None = None,
    pace: Pace | None = None,
) -> AsyncIterator[bytes]:
    """The `data` of each SSE event (its lines joined), as they arrive. Each event is bounded
    by `limit`, not the stream: a long call may send progress for as long as its deadline
    allows (a `budget`, when given, bounds the stream; a `pace` paces its other lines)."""
    buffer = bytearray()
    scanned = 0  # how much of the buffer holds no newline
    data: list[bytes] = []
    size = 0
    async for chunk in _chunks(response, budget, where):
        buffer += chunk
        while True:
            end = buffer.find(b"\n", scanned)
            if end < 0:
                scanned = len(buffer)
                if size + len(buffer) > limit:
                    raise too_much(where, limit)
                break
            line = bytes(buffer[:end]).rstrip(b"\r")
            del buffer[: end + 1]
            scanned = 0
            if pace is not None and not line.startswith(b"data:"):
                await pace.tick()
            if not line:
                joined = b"\n".join(data)
                data, size = [], 0
                if joined.strip():  # a priming event (an id, empty data) carries no message
                    yield joined
            elif line.startswith(b"data:"):
                piece = line[5:].removeprefix(b" ")
                size += len(piece)
                if size > limit:
                    raise too_much(where, limit)
                data.append(piece)
            # `event:`, `id:`, `retry:` and comments (`: ping`) carry nothing this reads.
    if b"".join(data).strip():
        yield b"\n".join(data)
