"""Step 1b, admit: room for this request's body among those in flight, or a 503 before it is read.

Each invoke in flight costs the gateway many times its body in memory until it is answered
(the body, its parsed request, the workflow input on its way to Temporal and back through the
worker, the activity's input, the message to the agent; bench/door_memory.py measures it), so
the bytes of bodies in flight are bounded by `transport.max_inflight_bytes`. Past the bound a
new invoke is refused with 503 `unavailable` and Retry-After before a byte of its body is read:
it was not started, and may be sent again (here, or to another gateway). One invoke is always
admitted when none is in flight, so a bound below one body never refuses everything.

**A caller's share.** One caller may hold at most `transport.caller_inflight_share` of the
bound (half, by default) while it holds anything: past it, its next invoke is refused the same
way (503, naming the setting) while the rest of the room stays for the others, so a caller
sending many large bodies cannot starve everyone else. A caller holding nothing is admitted
whenever the whole bound allows. The caller is the door's identity (the token's principal; the
caller header in open mode).

**Only while held.** A request holds its room while the gateway holds it: until it is answered,
or until its front lets it go (an A2A returnImmediately, an MCP task, an HTTP client that went
away: `steps/wait.py`), or a callback request's 202. Its workflow then runs on outside this
bound.

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
    """The bytes of invoke bodies this process holds, in all and by caller."""

    __slots__ = ("by_caller", "bytes", "requests")

    def __init__(self) -> None:
        self.bytes = 0
        self.requests = 0
        self.by_caller: dict[str, int] = {}  # caller -> bytes it holds (callers holding some)

    def take(self, caller: str, size: int) -> None:
        self.bytes += size
        self.requests += 1
        self.by_caller[caller] = self.by_caller.get(caller, 0) + size

    def grow(self, caller: str, by: int) -> None:
        self.bytes += by
        self.by_caller[caller] = self.by_caller.get(caller, 0) + by

    def give_back(self, caller: str, size: int) -> None:
        self.bytes -= size
        self.requests -= 1
        left = self.by_caller.get(caller, 0) - size
        if left > 0:
            self.by_caller[caller] = left
        else:
            self.by_caller.pop(caller, None)


IN_FLIGHT = InFlight()


def admitted(settings: ReachSettings, metadata: Metadata, body: Body, caller: str) -> Admission:
    """`async with admitted(settings, metadata, body) as body:` the request holds room for its
    body while the block runs (its whole way through the door), or `Unavailable` (503,
    Retry-After) is raised on entry, before its body is read. The block reads the body it is
    given (one of unknown size takes its real size once read)."""
    return Admission(settings, metadata, body, caller)


class Admission:
    """One request's room. A class rather than `contextlib.asynccontextmanager`: ~1 µs a
    request instead of ~8 (a generator and its wrapper per call)."""

    __slots__ = ("body", "caller", "held", "metadata", "settings")

    def __init__(
        self, settings: ReachSettings, metadata: Metadata, body: Body, caller: str
    ) -> None:
        self.settings = settings
        self.metadata = metadata
        self.body: Body = body
        self.caller = caller
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
        if limit and IN_FLIGHT.requests:
            mine = IN_FLIGHT.by_caller.get(self.caller, 0)
            share = int(limit * transport.caller_inflight_share)
            if mine and mine + want > share:
                raise Unavailable(
                    f"you hold {mine} bytes of requests in flight on this gateway; this one's "
                    f"{want} would pass your share of transport.max_inflight_bytes ({limit}): "
                    f"transport.caller_inflight_share ({transport.caller_inflight_share:g}). "
                    f"It was not started: retry after {RETRY_AFTER_S}s, once some of yours "
                    "are answered",
                    retry_after_s=RETRY_AFTER_S,
                )
        IN_FLIGHT.take(self.caller, want)
        self.held = want
        if size is None:
            self.body = _Counted(self.body, self)
        return self.body

    async def __aexit__(self, *exc: object) -> None:
        IN_FLIGHT.give_back(self.caller, self.held)


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
        IN_FLIGHT.grow(self.room.caller, len(raw) - self.room.held)
        self.room.held = len(raw)
        return raw
