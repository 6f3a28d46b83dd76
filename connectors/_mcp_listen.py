"""A session-based MCP server's GET stream, or a 2026-07-28 server's `subscriptions/listen`
stream, held by the process whose prober watches the connector (`Connector.watch`): the
server's `notifications/tools/list_changed` sent outside any call arrives there, and the prober
discovers the server again at once.

A 2026-07-28 server is asked for `toolsListChanged` only; a stream it ends (its result) or
that breaks is opened again, and the server discovered again once it is back (nothing is
replayed: a change said in the gap would be missed); a server that answers the request with
anything but an event stream (-32601: it has no such method) is not asked again.

One stream per server with a session, in the session negotiated last: it follows a renewed
session, reconnects after a break with growing pauses (0.5 s doubling to 30 s, both kinds of
stream; back to 0.5 s only after a stream held `STEADY_S`), and stops for good when the
server offers no stream (405, or any other answer than an event stream) or its client closes.
What it carries is read at the pace of a call stream's extras (`_mcp_stream.Pace`), each event
bounded by `ENVELOPE_BYTES`.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

import httpx

from connectors import _mcp_wire as w
from connectors._mcp_stream import Pace, sse_messages
from reach.errors import ReachError

if TYPE_CHECKING:
    from connectors._mcp_client import McpServer

log = logging.getLogger("connectors.mcp")

MAX_PAUSE_S = 30.0
# A stream held at least this long was a working one: the pause after it ends is the shortest
# again. One ended sooner (a server or proxy that answers 200 and closes at once, or sends an
# event past ENVELOPE_BYTES) keeps the pause growing: reset on every 200, it was a listen (and
# for 2026-07-28 a rediscovery) every 0.5 s for as long as the server did so.
STEADY_S = 5.0
LIST_CHANGED = "notifications/tools/list_changed"


async def listen(server: McpServer, changed: Callable[[], None]) -> None:
    """Hold the server's GET stream until it offers none or the task is cancelled."""
    pause = 0.5
    while True:
        held: float | None = None  # when a 200 event stream was opened
        negotiated = server.negotiated
        if negotiated is not None and negotiated.modern:
            await _subscribe(server, changed)
            return
        if negotiated is None or negotiated.session is None:
            return
        headers = w.request_headers(negotiated.version, negotiated.session, "", None)
        headers["Accept"] = "text/event-stream"
        headers.pop("Content-Type", None)
        try:
            async with server.http.stream("GET", server.url, headers=headers) as response:
                kind = response.headers.get("content-type", "").split(";")[0].strip().lower()
                if response.status_code == 404 and server.negotiated is not negotiated:
                    continue  # a renewed session: its own stream, at once
                if response.status_code != 200 or kind != "text/event-stream":
                    if response.status_code != 404:  # no stream offered: never again
                        log.info("%s offers no GET stream (%d)", server.where, response.status_code)
                        return
                else:
                    held = asyncio.get_running_loop().time()
                    await _read(server, response, changed)
        except (httpx.HTTPError, ReachError) as exc:
            log.debug("%s: its GET stream broke: %r", server.where, exc)
        pause = await _pause(pause, held)


async def _pause(pause: float, held: float | None) -> float:
    """Wait before opening the stream again: the shortest pause after a stream held
    `STEADY_S` (`held`: when it opened), else `pause`; the next pause (doubled) returned."""
    if held is not None and asyncio.get_running_loop().time() - held >= STEADY_S:
        pause = 0.5
    await asyncio.sleep(pause)
    return min(MAX_PAUSE_S, pause * 2)


async def _read(server: McpServer, response: httpx.Response, changed: Callable[[], None]) -> None:
    pace = Pace()
    async for data in sse_messages(response, w.ENVELOPE_BYTES, server.where, pace=pace):
        message = None
        with contextlib.suppress(ValueError, RecursionError):
            message = json.loads(data)
        if isinstance(message, dict) and message.get("method") == LIST_CHANGED:
            log.info("%s says its tools changed (outside any call)", server.where)
            changed()
        await pace.tick()


async def _subscribe(server: McpServer, changed: Callable[[], None]) -> None:
    """Hold a 2026-07-28 server's `subscriptions/listen` stream (see the module docstring)."""
    pause, heard = 0.5, False
    while True:
        held: float | None = None  # when its event stream was opened
        rpc_id = server.next_id()
        params = {"notifications": {"toolsListChanged": True}, "_meta": w.envelope_meta(w.MODERN)}
        headers = w.request_headers(w.MODERN, None, "subscriptions/listen", None)
        content = w.body(rpc_id, "subscriptions/listen", params)
        try:
            async with server.http.stream(
                "POST", server.url, content=content, headers=headers
            ) as response:
                kind = response.headers.get("content-type", "").split(";")[0].strip().lower()
                if response.status_code != 200 or kind != "text/event-stream":
                    log.info(
                        "%s offers no subscriptions/listen (%d)", server.where, response.status_code
                    )
                    return
                if heard:  # back after a gap in which a change may have been said
                    changed()
                heard, held = True, asyncio.get_running_loop().time()
                await _read(server, response, changed)
        except (httpx.HTTPError, ReachError) as exc:
            log.debug("%s: its subscriptions/listen stream broke: %r", server.where, exc)
        pause = await _pause(pause, held)
