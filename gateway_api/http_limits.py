"""What one connection to the gateway's HTTP port may hold: the bounds uvicorn does not set.

uvicorn times out only an idle keep-alive connection (`timeout_keep_alive`), and only after a
response: a connection that sends nothing, or trickles its request a byte at a time, is held
for ever (slowloris), and so are as many of them as the process has file descriptors. ASGI
middleware cannot help, since the app first sees a request once its headers are complete. So
the bounds live in uvicorn's own h11 protocol, subclassed (`bounded_h11`):

- **header deadline** (`transport.http_header_timeout_s`): a request's headers must arrive
  within this long of its first byte, and a new connection's first request within this long
  of the connection; else a 408 (when part of a request came) and the connection is closed.
- **body deadline** (`transport.http_body_timeout_s`): the whole body within this long of the
  headers; else the connection is closed and the app reads a disconnect, so nothing is
  accepted. The deadline ends once the body is in: a slow answer (a sync invoke waiting for
  its agent) is never cut.
- **connection cap** (`transport.max_connections`): a request on a connection past the cap is
  answered 503 `unavailable` in the envelope, with Retry-After, and the connection closed.
  uvicorn's own `limit_concurrency` would answer a bare text/plain 503.
- **draining** (`DRAINING`): when the server stops, an event in the app's state is set, so that
  a stream ends itself instead of holding the shutdown until its task ends.

The idle keep-alive bound is uvicorn's (`transport.http_keep_alive_s`, set in
`gateway_api.cli`). The gRPC front has its own transport and is not covered here.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import h11
from starlette.types import Receive, Scope, Send
from uvicorn.protocols.http.h11_impl import H11Protocol

from gateway_api.errors import error_body, error_response
from reach.config import TransportSettings
from reach.errors import Unavailable
from reach.messages import dumps

log = logging.getLogger("reach.gateway")

RETRY_AFTER_S = 1
# The key, in the app's state (each request's `scope["state"]`), of an `asyncio.Event` set when
# the server starts to stop: uvicorn then waits for every response still being sent, so a
# response that lasts (a stream) ends itself when it is set.
DRAINING = "reach.draining"


def bounded_h11(transport: TransportSettings) -> type[H11Protocol]:
    """uvicorn's h11 protocol with `transport`'s deadlines and connection cap, for
    `uvicorn.Config(http=...)`."""

    class Bounded(BoundedH11Protocol):
        header_timeout_s = transport.http_header_timeout_s
        body_timeout_s = transport.http_body_timeout_s
        max_connections = transport.max_connections

    return Bounded


class BoundedH11Protocol(H11Protocol):
    """One connection: a deadline runs while a request is arriving, none while it is served
    or while the connection idles between requests (uvicorn's keep-alive bounds that)."""

    header_timeout_s: float = 10.0
    body_timeout_s: float = 60.0
    max_connections: int = 1000

    _deadline: asyncio.TimerHandle | None = None
    _phase: str = ""

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        # Before the connection's first request, whose state is a copy of the app's.
        self.app_state.setdefault(DRAINING, asyncio.Event())
        if len(self.connections) > self.max_connections:
            # Served no further than its refusal: the app is never called on it.
            self.app = _refusal(len(self.connections) - 1, self.max_connections)
        self._arm("headers", self.header_timeout_s)

    def data_received(self, data: bytes) -> None:
        if self._deadline is None and self.conn.their_state is h11.IDLE:
            self._arm("headers", self.header_timeout_s)  # a new request's first byte
        super().data_received(data)
        self._follow()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._follow()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def shutdown(self) -> None:
        """The server stops (uvicorn calls this for every connection): responses still being
        sent are told (`DRAINING`)."""
        draining = self.app_state.get(DRAINING)
        if draining is not None:
            draining.set()
        super().shutdown()

    def handle_websocket_upgrade(self, event: h11.Request) -> None:
        self._disarm()  # the connection is the WebSocket protocol's from here on
        super().handle_websocket_upgrade(event)

    def _follow(self) -> None:
        """Move the deadline along with the request: headers, then body, then none."""
        state = self.conn.their_state
        if state is h11.SEND_BODY:
            if self._phase != "body":
                self._arm("body", self.body_timeout_s)
        elif state is h11.IDLE:
            # Between requests: a body answered before it was read has been drained (uvicorn
            # drops it), and part of a pipelined request waits under its own deadline. A new
            # connection's first request keeps the deadline armed when it was made.
            if self._phase == "body":
                self._disarm()
            if self._phase != "headers" and self._buffered():
                self._arm("headers", self.header_timeout_s)
        else:  # DONE, MUST_CLOSE, CLOSED, ERROR: nothing more is awaited from the client
            self._disarm()

    def _buffered(self) -> bool:
        return bool(self.conn.trailing_data[0])

    def _arm(self, phase: str, after_s: float) -> None:
        self._disarm()
        self._phase = phase
        self._deadline = self.loop.call_later(after_s, self._expired)

    def _disarm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
        self._deadline = None
        self._phase = ""

    def _expired(self) -> None:
        phase, self._deadline, self._phase = self._phase, None, ""
        if self.transport.is_closing():
            return
        client = f"{self.client[0]}:{self.client[1]}" if self.client else "?"
        if phase == "headers":
            if self._buffered() or self.conn.their_state is not h11.IDLE:
                log.info(
                    "HTTP request headers from %s incomplete after %.1fs "
                    "(transport.http_header_timeout_s): 408, closed",
                    client,
                    self.header_timeout_s,
                )
                self.transport.write(_request_timeout(self.header_timeout_s))
            # A connection that never sent a byte is closed quietly, as an idle one.
        else:
            log.info(
                "HTTP request body from %s incomplete after %.1fs "
                "(transport.http_body_timeout_s): closed",
                client,
                self.body_timeout_s,
            )
        self.transport.close()


def _request_timeout(after_s: float) -> bytes:
    """A 408 written straight to the socket: h11 sends no response to a request whose headers
    it has not read."""
    message = (
        f"the request's headers did not arrive within {after_s:g}s "
        "(transport.http_header_timeout_s); nothing was started"
    )
    body = dumps(error_body(None, "timeout", message, True))
    head = (
        "HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\n"
        f"content-length: {len(body)}\r\nconnection: close\r\n\r\n"
    )
    return head.encode("ascii") + body


def _refusal(held: int, cap: int) -> Any:
    """The ASGI app a connection past the cap is answered by: 503 in the envelope."""
    message = (
        f"the gateway holds {held} HTTP connections, its most (transport.max_connections = "
        f"{cap}); nothing was started: retry after {RETRY_AFTER_S}s or on another gateway"
    )

    async def refuse(scope: Scope, receive: Receive, send: Send) -> None:
        response = error_response(None, Unavailable(message, retry_after_s=RETRY_AFTER_S))
        response.headers["connection"] = "close"
        await response(scope, receive, send)

    return refuse


async def disconnected(receive: Receive) -> None:
    """Until the client disconnects, for a request whose body was read whole (nothing else
    comes): run beside a long answer, so that a caller gone lets go of what it held."""
    while (await receive())["type"] != "http.disconnect":
        pass
