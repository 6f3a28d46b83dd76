"""`GET /mcp` for the MCP front: the session-based generation's server-initiated SSE stream, on
which Reach sends `notifications/tools/list_changed` when the tools the caller may call change;
and the same for 2026-07-28's `subscriptions/listen` (`Listeners.listen`), whose answer is such
a stream: `notifications/subscriptions/acknowledged` first (the honored subset of what it asked:
`toolsListChanged` only, Reach has no prompts or resources), each frame's `_meta` naming the
subscription (the request's JSON-RPC id), and the request's result as its last event when the
gateway stops.

One stream is a held response and a wait: it costs no Temporal read and no store read of its
own. While any stream is open, one watcher per gateway reads the catalog (`Catalog.tools`, its
2 s cache: at most one registry read every 2 s however many streams) at once after a change this
gateway made (`Registry.on_change`) and every `CATALOG_TTL_S` otherwise (another gateway's
changes); when the catalog differs from the last one seen, every stream compares the caller's
own list (`Catalog.listed_for`: rules applied) with the one it last had and says so when it
differs. Each stream also checks on its own every `KEEPALIVE_S` (a reloaded rule changes a
caller's list without changing the catalog), when it sends a keep-alive comment. Its caller's
token is checked again every `RECHECK_S` (an in-memory check): a token revoked or expired since
the stream opened ends it (a listen stream with its request's error, -32000 and the reason).

Bounds: a caller holds at most `MAX_STREAMS_PER_CALLER` open streams on one gateway (past them
429, Retry-After); a stream ends when its client goes away, and at once when the gateway starts
to stop (`http_limits.DRAINING`): uvicorn would wait for every response still being sent.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from typing import Any

from starlette.types import Receive, Scope, Send

from gateway_api import _mcp_http as http
from gateway_api import _mcp_wire as wire
from gateway_api._mcp_tools import CATALOG_TTL_S, Catalog, Tool
from gateway_api.http_limits import DRAINING, disconnected
from gateway_api.steps.identify import identify
from reach.errors import ReachError
from reach.registry import Registry
from reach.security.guard import Guard

log = logging.getLogger("reach.gateway")

MAX_STREAMS_PER_CALLER = 64
"""Open GET streams one caller may hold on one gateway."""
MAX_STREAM_CALLERS = 10_000
"""Callers whose stream counts are kept before the idle ones are forgotten."""
KEEPALIVE_S = 15.0
RECHECK_S = 2.0
"""How often an open stream checks its caller's token again."""
LIST_CHANGED = {"jsonrpc": "2.0", "method": "notifications/tools/list_changed"}
SUBSCRIPTION_META = "io.modelcontextprotocol/subscriptionId"


class Frames:
    """What one stream says: when it opens, when the caller's tools changed, when it ends
    because the gateway stops."""

    __slots__ = ("changed", "closing", "key", "opening")

    def __init__(
        self, opening: bytes, changed: bytes, closing: bytes = b"", key: wire.RequestKey = None
    ) -> None:
        self.opening = opening
        self.changed = changed
        self.closing = closing
        self.key = key  # a listen stream's request id, which its error event answers

    def refused(self, exc: ReachError) -> bytes:
        """The last event of a stream whose caller's token no longer holds: a listen
        stream's request answered with the error; a GET stream just ends."""
        if self.key is None:
            return b""
        data = {"type": exc.type, "status": exc.http_status}
        return wire.sse_event(
            wire.error(self.key, wire.RpcError(wire.REACH_REFUSED, exc.message, data))
        )


GET_FRAMES = Frames(
    b": listening for notifications/tools/list_changed\n\n", wire.sse_event(LIST_CHANGED)
)


def listen_frames(message: wire.Message) -> Frames:
    """A `subscriptions/listen` stream's frames, or -32602 for a filter that is no object."""
    asked = message.params.get("notifications")
    if not isinstance(asked, dict):
        raise wire.RpcError(wire.INVALID_PARAMS, "params.notifications is an object")
    meta = {SUBSCRIPTION_META: message.id}
    honored = {"toolsListChanged": True} if asked.get("toolsListChanged") is True else {}
    ack = {
        "jsonrpc": "2.0",
        "method": "notifications/subscriptions/acknowledged",
        "params": {"notifications": honored, "_meta": meta},
    }
    change = {**LIST_CHANGED, "params": {"_meta": meta}}
    end = wire.result(message.id, {"_meta": meta, "resultType": "complete"})
    # Nothing honored: the stream says nothing but its acknowledgment and keep-alives.
    changed = wire.sse_event(change) if honored else b""
    return Frames(wire.sse_event(ack), changed, wire.sse_event(end), message.id)


class Listeners:
    """The GET streams of one gateway's MCP front."""

    def __init__(self, catalog: Callable[[], Catalog], registry: Callable[[], Registry]) -> None:
        self._catalog = catalog
        self._registry = registry
        self.open: dict[str, int] = {}  # caller -> its open streams here
        self._tick = asyncio.Event()  # replaced (and the old one set) when the catalog changes
        self._poke = asyncio.Event()  # a change this gateway made: read the catalog now
        self._watcher: asyncio.Task[None] | None = None
        self._watched: Registry | None = None

    async def get(
        self,
        scope: Scope,
        headers: dict[str, str],
        caller: str,
        guard: Guard | None,
        receive: Receive,
        send: Send,
    ) -> None:
        """`GET /mcp` from an identified caller: its stream, or the `Answer` that says why
        not. 2026-07-28 has no GET stream (405, as its spec says); a GET that does not accept
        an event stream is 406, one naming a session that is not the caller's 404."""
        if headers.get(wire.VERSION_HEADER) in wire.MODERN:
            raise http.Answer(405, None, {"allow": "POST"})
        if not wire.accepts(headers, "text/event-stream"):
            said = "GET /mcp is an SSE stream: its Accept names text/event-stream"
            raise http.Answer(406, http.refusal("invalid_request", said), {})
        session = headers.get(wire.SESSION_HEADER)
        if session is not None and wire.session_version(session, caller) is None:
            gone = wire.RpcError(wire.SESSION_NOT_FOUND, "no such session: initialize again")
            raise http.Answer(404, wire.error(None, gone), {})
        self.room(caller)
        draining = scope.get("state", {}).get(DRAINING)
        check = token_check(guard, headers)
        await self.stream(caller, guard, receive, send, draining, check=check)

    async def listen(
        self,
        scope: Scope,
        message: wire.Message,
        headers: dict[str, str],
        caller: str,
        guard: Guard | None,
        receive: Receive,
        send: Send,
    ) -> None:
        """`subscriptions/listen` (2026-07-28) from an identified caller: its stream, or the
        `RpcError` or `Answer` that says why not (an Accept without text/event-stream is
        -32600: the answer can only be a stream)."""
        if not wire.accepts(headers, "text/event-stream"):
            said = "subscriptions/listen is answered as an SSE stream: Accept text/event-stream"
            raise wire.RpcError(wire.INVALID_REQUEST, said, http_status=406)
        frames = listen_frames(message)
        self.room(caller)
        draining = scope.get("state", {}).get(DRAINING)
        check = token_check(guard, headers)
        await self.stream(caller, guard, receive, send, draining, frames, check)

    def room(self, caller: str) -> None:
        """Room for one more of the caller's streams, else the 429 `Answer`."""
        if len(self.open) > MAX_STREAM_CALLERS:
            self.open = {name: n for name, n in self.open.items() if n}
        held = self.open.get(caller, 0)
        if held >= MAX_STREAMS_PER_CALLER:
            said = (
                f"caller {caller!r} holds {held} open GET /mcp streams on this gateway, its "
                "most: close one (each says only that the tools changed)"
            )
            body = http.refusal("rate_limited", said)
            body["error"]["data"].update(status=429, retryable=True, retry_after_s=1)
            raise http.Answer(429, body, {"retry-after": "1"})

    def _start_watching(self) -> None:
        registry = self._registry()
        if self._watched is not registry:
            self._watched = registry
            registry.on_change(self._changed)
        if self._watcher is None or self._watcher.done():
            self._watcher = asyncio.get_running_loop().create_task(self._watch())

    def _changed(self, _capability: str, _instance_id: str) -> None:
        self._poke.set()

    async def _watch(self) -> None:
        """While streams are open: the catalog read after each local change and every TTL,
        and the streams woken when it differs."""
        last: dict[str, Tool] | None = None
        while any(self.open.values()):
            tools: dict[str, Tool] | None
            try:
                tools = await self._catalog().tools()
            except ReachError as exc:  # the store's trouble: try again at the next turn
                log.debug("MCP streams: the catalog could not be read: %s", exc.message)
                tools = last
            if last is not None and tools is not None and tools != last:
                tick, self._tick = self._tick, asyncio.Event()
                tick.set()
            last = tools
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._poke.wait(), CATALOG_TTL_S)
            self._poke.clear()

    async def stream(
        self,
        caller: str,
        guard: Guard | None,
        receive: Receive,
        send: Send,
        draining: asyncio.Event | None,
        frames: Frames = GET_FRAMES,
        check: Callable[[], object] | None = None,
    ) -> None:
        """Hold one stream until the client goes away, the gateway stops or `check` (the
        caller's identification again: it raises `ReachError` once the token is revoked or
        expired) refuses (`room` first)."""
        catalog = self._catalog()
        # Counted before the first await: streams asked for at once all passed `room` while
        # the first list was read (a Redis registry's), 67 of 192 held where 64 may be.
        self.open[caller] = self.open.get(caller, 0) + 1
        gone = asyncio.ensure_future(disconnected(receive))
        stopping = asyncio.ensure_future((draining or asyncio.Event()).wait())
        try:
            seen = await _listed(catalog, caller, guard)
            self._start_watching()
            await send(
                {
                    "type": "http.response.start",
                    "status": 200,
                    "headers": [
                        (b"content-type", b"text/event-stream"),
                        (b"cache-control", b"no-cache, no-transform"),
                        (b"x-accel-buffering", b"no"),
                    ],
                }
            )
            await http.chunk(send, frames.opening)
            loop = asyncio.get_running_loop()
            said_at = loop.time()
            every = KEEPALIVE_S if check is None else min(RECHECK_S, KEEPALIVE_S)
            while True:
                tick = asyncio.ensure_future(self._tick.wait())
                try:
                    waits: set[asyncio.Future[Any]] = {tick, gone, stopping}
                    done, _ = await asyncio.wait(
                        waits, timeout=every, return_when=asyncio.FIRST_COMPLETED
                    )
                finally:
                    tick.cancel()
                if gone in done:
                    break
                if stopping in done:
                    if frames.closing:
                        await http.chunk(send, frames.closing)
                    break
                if check is not None:
                    try:
                        check()
                    except ReachError as exc:  # revoked or expired since the stream opened
                        if last := frames.refused(exc):
                            await http.chunk(send, last)
                        break
                if not done and loop.time() - said_at < KEEPALIVE_S:
                    continue  # only the token's check was due
                said_at = loop.time()
                now = await _listed(catalog, caller, guard)
                if now is not None and seen is not None and now != seen and frames.changed:
                    await http.chunk(send, frames.changed)
                elif not done:
                    await http.chunk(send, b": keep-alive\n\n")
                seen = now if now is not None else seen
            with contextlib.suppress(OSError):
                await send({"type": "http.response.body", "body": b"", "more_body": False})
        except OSError:  # the client went away mid-send
            pass
        finally:
            gone.cancel()
            stopping.cancel()
            self.open[caller] -= 1
            if not self.open[caller]:
                self._poke.set()  # the watcher ends at once when it was the last


def token_check(guard: Guard | None, headers: dict[str, str]) -> Callable[[], object] | None:
    """An open stream's check that its caller's token still holds (None: tokens not required)."""
    if guard is None or not guard.auth.required:
        return None
    auth = guard.auth
    return lambda: identify(headers, auth)


async def _listed(catalog: Catalog, caller: str, guard: Guard | None) -> list[Any] | None:
    try:
        return await catalog.listed_for(caller, guard)
    except ReachError:
        return None
