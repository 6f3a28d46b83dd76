"""Step 1b, admit: room for this request's body among those in flight, or a 503 before it is read.

Each invoke in flight costs the gateway many times its body in memory until it is answered
(the body, its parsed request, the workflow input on its way to Temporal and back through the
worker, the activity's input, the message to the agent; bench/door_memory.py measures it), so
the bytes of bodies in flight are bounded by `transport.max_inflight_bytes`. Past the bound a
new invoke is refused with 503 `unavailable` and Retry-After before a byte of its body is read:
it was not started, and may be sent again (here, or to another gateway). One invoke is always
admitted when none is in flight, so a bound below one body never refuses everything.

A body's size is what its front declares (HTTP's Content-Length, a gRPC message's length);
a body of unknown size (chunked) holds `transport.max_message_bytes` until it is read, then
its real size. The count is the process's: its memory is one, whichever door a request took.
"""

from __future__ import annotations

from gateway_api.front import Body, Bytes
from gateway_api.steps.identify import Metadata
from reach.config import ReachSettings
from reach.errors import Unavailable

RETRY_AFTER_S = 1
CONTENT_LENGTH = "content-length"


class InFlight:
    """The bytes of invoke bodies this process holds."""

    __slots__ = ("bytes", "requests")

    def __init__(self) -> None:
        self.bytes = 0
        self.requests = 0


IN_FLIGHT = InFlight()


def admitted(settings: ReachSettings, metadata: Metadata, body: Body) -> Admission:
    """`async with admitted(settings, metadata, body) as body:` the request holds room for its
    body while the block runs (its whole way through the door), or `Unavailable` (503,
    Retry-After) is raised on entry, before its body is read. The block reads the body it is
    given (one of unknown size takes its real size once read)."""
    return Admission(settings, metadata, body)


class Admission:
    """One request's room. A class rather than `contextlib.asynccontextmanager`: ~1 µs a
    request instead of ~8 (a generator and its wrapper per call)."""

    __slots__ = ("body", "held", "metadata", "settings")

    def __init__(self, settings: ReachSettings, metadata: Metadata, body: Body) -> None:
        self.settings = settings
        self.metadata = metadata
        self.body: Body = body
        self.held = 0

    async def __aenter__(self) -> Body:
        transport = self.settings.transport
        size = declared_size(self.metadata, self.body)
        want = transport.max_message_bytes if size is None else size
        limit = transport.max_inflight_bytes
        if limit and IN_FLIGHT.requests and IN_FLIGHT.bytes + want > limit:
            raise Unavailable(
                f"the gateway holds {IN_FLIGHT.bytes} bytes of requests in flight "
                f"({IN_FLIGHT.requests}); this one's {want} would pass "
                f"transport.max_inflight_bytes ({limit}). It was not started: retry after "
                f"{RETRY_AFTER_S}s, or on another gateway",
                retry_after_s=RETRY_AFTER_S,
            )
        IN_FLIGHT.bytes += want
        IN_FLIGHT.requests += 1
        self.held = want
        if size is None:
            self.body = _Counted(self.body, self)
        return self.body

    async def __aexit__(self, *exc: object) -> None:
        IN_FLIGHT.bytes -= self.held
        IN_FLIGHT.requests -= 1


def declared_size(metadata: Metadata, body: Body) -> int | None:
    """The body's size before it is read, where the front knows it: a body the front holds
    already says so (`Bytes`, a gRPC message), else HTTP's Content-Length."""
    if isinstance(body, Bytes):
        return len(body.raw)
    held = getattr(body, "held_bytes", None)
    if isinstance(held, int):
        return held
    value = metadata.get(CONTENT_LENGTH)
    if value is not None and value.isascii() and value.isdigit():
        return int(value)
    return None


class _Counted:
    """A body of unknown size: it holds its real size from when it is read."""

    __slots__ = ("body", "room")

    def __init__(self, body: Body, room: Admission) -> None:
        self.body = body
        self.room = room

    async def read(self) -> bytes:
        raw = await self.body.read()
        IN_FLIGHT.bytes += len(raw) - self.room.held
        self.room.held = len(raw)
        return raw
