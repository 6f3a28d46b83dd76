"""WebSocket connector: one persistent, multiplexed connection per agent instance, JSON frames.

The wire contract (what an agent written without the SDK implements: the address, the request
and reply frames, what each status means, limits, which malformed frames cost what, keepalive,
mTLS) is `docs/protocols/websocket.md`; its names are `agent_reach_proto.wire`'s. Here: Reach
pings every `PING_INTERVAL_S` and closes a connection whose pong is `PING_TIMEOUT_S` late; a
frame Reach cannot use costs one request at most (the one it names, if it names one), never the
connection, except a frame past `frame_limit`, which ends it (close 1009); replies carrying the
same `request_id` go to the oldest request waiting for that id on the connection.

Connections
-----------

Opened on the first request to an instance (`opened`), shared by every later one (`reused`),
closed (code 1000) when idle past `transport.idle_timeout_s` or when the instance leaves the
registry (`reclaimed`). When a connection breaks (the agent died, closed it, or missed its pongs)
every request in flight on it fails at once with a retryable `transport_error`; the workflow and
its policy decide the rest. The next request connects again (`reconnected`). A connect attempt
that fails (`failed`, as is a connection that drops without a clean close) starts a backoff of
0.1 s, doubling to 5 s, reset by the next success: while it lasts, requests fail at once with a
retryable `transport_error` naming the wait, rather than spending their deadline on an agent that
just refused them (the retry policy, which can pick another instance, chooses what happens
next). A clean close by the agent (code 1000/1001, e.g. a graceful shutdown) is not a failure.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import random
import time
from collections import deque
from collections.abc import Iterator
from typing import Any

import httpx
from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import (
    ConnectionClosed,
    ConnectionClosedOK,
    InvalidHandshake,
    InvalidMessage,
    InvalidStatus,
    InvalidURI,
    WebSocketException,
)
from websockets.frames import CloseCode
from websockets.protocol import State

from agent_reach_proto import wire
from connectors._address import check_http_address
from connectors._answers import reply_for_status
from connectors._pools import ConnectionStats, Pools
from connectors._tls import ReachTls, http_poke
from connectors.base import PooledConnector
from reach.config import SecuritySettings, TransportSettings
from reach.errors import (
    AgentError,
    DeadlineExceeded,
    InternalError,
    InvalidRequest,
    ReachError,
    TransportError,
)
from reach.invocation import Endpoint
from reach.messages import Message, Reply, dumps
from reach.security.netguard import host_port

log = logging.getLogger("connectors.websocket")

DEFAULT_PATH = wire.WS_DEFAULT_PATH
PING_INTERVAL_S = 20.0
PING_TIMEOUT_S = 20.0
OPEN_TIMEOUT_S = 10.0  # TCP connect and handshake; the request's own deadline may end it sooner
CLOSE_TIMEOUT_S = 2.0  # for the closing handshake before the TCP connection is dropped
BACKOFF_FIRST_S = 0.1
BACKOFF_MAX_S = 5.0
# Room for the frame around a result, and for an agent escaping its non-ASCII text (\uXXXX is
# six bytes for a one-byte character): a reply past this ends the connection (close 1009).
FRAME_GROWTH = 6
FRAME_OVERHEAD = 64 * 1024

# The contract's metadata names under this module's older names.
HEADER_REQUEST_ID = wire.REQUEST_ID
HEADER_CALLER = wire.CALLER
HEADER_ATTEMPT = wire.ATTEMPT
HEADER_DEADLINE = wire.DEADLINE_MS
HEADER_IDEMPOTENCY_KEY = wire.IDEMPOTENCY_KEY
HEADER_TRACEPARENT = wire.TRACEPARENT

Frame = dict[str, Any]


# -- addresses ------------------------------------------------------------------------------------


def _refuse(address: str, why: str) -> InvalidRequest:
    shown = address[:80].encode("unicode_escape").decode()
    return InvalidRequest(f"service address {shown!r}: {why}")


def check_ws_address(address: str) -> str:
    """`address` normalized (lower-case scheme and host), or `InvalidRequest` naming the fault.

    The host, port and path rules are the HTTP connector's; only the schemes differ.
    """
    scheme, sep, rest = address.partition("://")
    if not sep:
        if "/" in address:
            raise _refuse(address, "a path needs the URL form: ws://host:port/path")
        return check_http_address(address)
    kind = scheme.lower()
    if kind not in ("ws", "wss"):
        raise _refuse(address, f"scheme {scheme!r} is not ws or wss")
    normalized = check_http_address(f"{'http' if kind == 'ws' else 'https'}://{rest}")
    return kind + normalized[normalized.index("://") :]


def ws_url(address: str) -> str:
    """The URL Reach connects to for a (checked) service address."""
    if "://" not in address:
        return f"ws://{address}{DEFAULT_PATH}"
    scheme, _, rest = address.partition("://")
    authority, slash, path = rest.partition("/")
    return (
        f"{scheme}://{authority}/{path}"
        if slash and path
        else f"{scheme}://{authority}{DEFAULT_PATH}"
    )


def wss_url(address: str) -> str:
    """The URL Reach connects to under mTLS: `host:port` is wss:// (ws:// is refused)."""
    return ws_url(address if "://" in address else f"wss://{address}")


def frame_limit(limit: int) -> int:
    """The largest frame accepted from an agent whose results may be `limit` bytes."""
    return FRAME_GROWTH * limit + FRAME_OVERHEAD


def backoff_s(failures: int) -> float:
    """The wait before connect attempt `failures + 1` (with 20 % jitter, so that the
    connectors of many processes do not knock on a restarting agent in step)."""
    base: float = min(BACKOFF_MAX_S, BACKOFF_FIRST_S * 2.0 ** max(failures - 1, 0))
    return base * random.uniform(0.8, 1.0)


# -- frames ---------------------------------------------------------------------------------------


def request_frame(message: Message) -> bytes:
    """The request frame for `message`, encoded once as sent."""
    h = message.header
    frame = {
        wire.WS_TYPE: wire.WS_REQUEST,
        wire.WS_REQUEST_ID: h.request_id,
        wire.WS_OPERATION: h.operation,
        wire.WS_HEADERS: dict(wire.metadata(h)),
        wire.WS_PAYLOAD: message.payload,
    }
    try:
        return dumps(frame)
    except (ValueError, RecursionError) as exc:  # UnicodeEncodeError is a ValueError
        raise TransportError(
            f"cannot encode this request as a WebSocket frame: {exc}", retryable=False
        ) from exc


# The one RequestID named in a frame that could not be parsed (the SDK's server reads it too).
request_id_in = wire.request_id_in


def read_reply(endpoint: Endpoint, frame: Frame, limit: int) -> Reply:
    """The Reply a reply frame stands for, or the typed error (the shared status table)."""
    status = frame.get(wire.WS_STATUS)
    if not isinstance(status, int) or isinstance(status, bool) or not 100 <= status <= 599:
        raise AgentError(
            f"agent {endpoint.instance_id} sent a reply frame whose status {status!r:.40} is not "
            "an HTTP-style integer",
            retryable=False,
        )
    body = frame.get(wire.WS_BODY)
    try:
        raw = b"" if body is None else dumps(body)
    except (ValueError, RecursionError) as exc:  # NaN, Infinity, lone surrogates
        raise AgentError(
            f"agent {endpoint.instance_id} answered {status} with a body that is not "
            f"standard JSON: {exc}",
            retryable=False,
        ) from None
    return reply_for_status(endpoint, status, raw, limit)


# -- exceptions -----------------------------------------------------------------------------------


@contextlib.contextmanager
def map_websocket_exceptions(address: str) -> Iterator[None]:
    """The one place websockets' exceptions (and the call's deadline) become Reach errors.

    Whether a failure is retryable is whether sending the same request again could succeed.
    """
    try:
        yield
    except TimeoutError as exc:  # the call's own deadline
        raise DeadlineExceeded(f"agent at {address} did not answer in time") from exc
    except ConnectionClosed as exc:
        raise TransportError(f"the connection to agent at {address} broke: {exc}") from exc
    except InvalidURI as exc:
        raise TransportError(
            f"cannot connect to agent at {address}: {exc}", retryable=False
        ) from exc
    except InvalidStatus as exc:
        # 404: no WebSocket endpoint there, and there will not be one on the next attempt.
        code = exc.response.status_code
        raise TransportError(
            f"agent at {address} refused the WebSocket handshake: HTTP {code}",
            retryable=code >= 500 or code == 429,
        ) from exc
    except InvalidHandshake as exc:  # not a WebSocket server (yet): starting, or a proxy's page
        raise TransportError(
            f"agent at {address} did not complete a WebSocket handshake: {exc}"
        ) from exc
    except OSError as exc:  # refused, reset, unreachable, name resolution, TLS
        raise TransportError(f"cannot reach agent at {address}: {exc!r}") from exc
    except WebSocketException as exc:
        # Protocol and state errors surface as ConnectionClosed; these mean misuse here.
        raise InternalError(
            f"WebSocket connector misused websockets for {address}: {exc!r}"
        ) from exc


def _why_closed(exc: ConnectionClosed, max_size: int) -> str:
    if exc.sent is not None and exc.sent.code == CloseCode.MESSAGE_TOO_BIG:
        return f"the agent sent a frame over {max_size} bytes (close 1009)"
    if exc.rcvd is not None:
        reason = f" {exc.rcvd.reason!r}" if exc.rcvd.reason else ""
        return f"the agent closed it (code {exc.rcvd.code}{reason})"
    if exc.sent is not None:
        return f"Reach closed it (code {exc.sent.code} {exc.sent.reason!r})"
    cause = f": {exc.__cause__!r}" if exc.__cause__ is not None else ""
    return f"it dropped without a close frame{cause}"


# -- connections ----------------------------------------------------------------------------------


class _connect(connect):
    def process_redirect(self, exc: Exception) -> Exception | str:
        """Never follow a redirect: an agent is called at the address it joined with (as over
        HTTP), so a 3xx is a refused handshake rather than a way to point Reach elsewhere."""
        return exc


def _retrieve(task: asyncio.Task[Any]) -> None:
    # Every caller of a shared connect may have given up; its failure is recorded, not lost.
    if not task.cancelled():
        task.exception()


class _Socket:
    """One open WebSocket, the task reading it, and the requests waiting for replies on it."""

    def __init__(self, link: _Link, ws: ClientConnection, capability: str, max_size: int) -> None:
        self.link = link
        self.ws = ws
        self.capability = capability
        self.max_size = max_size
        # request_id -> the requests waiting for it, oldest first (see the module docstring).
        self.pending: dict[str, deque[asyncio.Future[Frame]]] = {}
        self.closed_by_us = False
        self.reader = asyncio.get_running_loop().create_task(self._read())

    @property
    def usable(self) -> bool:
        return self.ws.state is State.OPEN and not self.reader.done()

    def waiting(self) -> int:
        return sum(len(queue) for queue in self.pending.values())

    async def call(self, request_id: str, frame: bytes) -> Frame:
        waiter: asyncio.Future[Frame] = asyncio.get_running_loop().create_future()
        queue = self.pending.setdefault(request_id, deque())
        queue.append(waiter)  # before sending: the reply may come before send() returns
        try:
            await self.ws.send(frame, text=True)
            return await waiter
        finally:
            queue.remove(waiter)
            if not queue and self.pending.get(request_id) is queue:
                del self.pending[request_id]
            if waiter.done() and not waiter.cancelled():
                waiter.exception()  # settled as the caller gave up: nobody else will look

    async def close(self) -> None:
        self.closed_by_us = True
        await self.ws.close()
        await asyncio.gather(self.reader, return_exceptions=True)

    async def _read(self) -> None:
        why = "it ended"
        clean = False
        try:
            while True:
                data = await self.ws.recv(decode=False)
                try:
                    self._route(data)
                except Exception:  # a bug here must not leave the others hanging
                    log.exception("could not route a frame from agent at %s", self.link.address)
        except ConnectionClosed as exc:
            why = _why_closed(exc, self.max_size)
            clean = isinstance(exc, ConnectionClosedOK)
        finally:
            self._fail_all(why)
            self.link.ended(self, clean=clean)

    def _oldest(self, request_id: str) -> asyncio.Future[Frame] | None:
        for waiter in self.pending.get(request_id, ()):
            if not waiter.done():
                return waiter
        return None

    def _route(self, data: bytes) -> None:
        try:
            frame = json.loads(data.decode("utf-8"))
        except (ValueError, RecursionError) as exc:  # not UTF-8, not JSON, nested too deep
            self._refuse(data, f"a frame that is not UTF-8 JSON ({type(exc).__name__})")
            return
        if not isinstance(frame, dict):
            self._refuse(data, "a frame that is not a JSON object")
            return
        kind = frame.get(wire.WS_TYPE)
        request_id = frame.get(wire.WS_REQUEST_ID)
        if kind != wire.WS_REPLY:
            if isinstance(kind, str):  # reserved for extensions
                log.debug("agent at %s sent a %r frame; ignored", self.link.address, kind[:40])
            else:
                self._refuse(data, 'a frame without "type": "reply"', request_id)
            return
        if not isinstance(request_id, str):
            self._refuse(data, "a reply frame without a string request_id")
            return
        waiter = self._oldest(request_id)
        if waiter is None:  # routine after a deadline passed; a stray otherwise
            log.debug(
                "agent at %s answered %.140s, which no request waits for; dropped",
                self.link.address,
                request_id,
            )
            return
        waiter.set_result(frame)

    def _refuse(self, data: bytes, what: str, request_id: object = None) -> None:
        """Fail the one request a malformed frame names, or log and drop the frame."""
        named = request_id if isinstance(request_id, str) else request_id_in(data)
        waiter = self._oldest(named) if named is not None else None
        if waiter is None:
            log.warning("agent at %s sent %s; dropped: %r", self.link.address, what, data[:200])
            return
        waiter.set_exception(
            AgentError(f"agent at {self.link.address} sent {what} for {named}", retryable=False)
        )

    def _fail_all(self, why: str) -> None:
        if self.closed_by_us:
            message = f"the connection to agent at {self.link.address} was closed by Reach"
        else:
            message = f"the connection to agent at {self.link.address} broke: {why}"
        for queue in self.pending.values():
            for waiter in queue:
                if not waiter.done():
                    # Sent and unanswered: the agent may have run it.
                    waiter.set_exception(
                        TransportError(message, retryable=True, outcome_unknown=True)
                    )


class _Link:
    """What `Pools` holds for one instance: its current connection, and how to get the next.

    Opening is one task shared by every request that needs it, so that requests arriving
    together open one connection, and a caller giving up does not abort it for the others.
    """

    def __init__(
        self,
        address: str,
        protocol: str,
        stats: ConnectionStats,
        *,
        instance_id: str = "",
        tls: ReachTls | None = None,
    ) -> None:
        self.address = address
        self.url = ws_url(address)
        self.instance_id = instance_id
        # mTLS: wss:// with Reach's certificate; the agent must prove `server_hostname`.
        self.tls = tls
        self.server_hostname = ""
        if tls is not None:
            self.url = wss_url(address)
            self.server_hostname = tls.server_name(instance_id)
        self.protocol = protocol
        self.stats = stats
        self.socket: _Socket | None = None
        self.opening: asyncio.Task[_Socket] | None = None
        self.connected_before = False
        self.failures = 0
        self.retry_at = 0.0
        self.last_failure = ""
        self.last_retryable = True
        self.closed = False

    def waiting(self) -> int:
        return self.socket.waiting() if self.socket is not None else 0

    async def call(self, capability: str, request_id: str, frame: bytes, max_size: int) -> Frame:
        socket = await self._connected(capability, max_size)
        return await socket.call(request_id, frame)

    async def _connected(self, capability: str, max_size: int) -> _Socket:
        if self.closed:
            raise TransportError(f"the connection to agent at {self.address} was closed by Reach")
        socket = self.socket
        if socket is not None and socket.usable:
            return socket
        if self.opening is None:
            wait = self.retry_at - time.monotonic()
            if wait > 0:
                # As retryable as the failure it repeats (a 404 handshake stays final).
                raise TransportError(
                    f"cannot reach agent at {self.address} ({self.last_failure}); "
                    f"next connect attempt in {wait:.1f}s",
                    retryable=self.last_retryable,
                )
            self.opening = asyncio.get_running_loop().create_task(self._open(capability, max_size))
            self.opening.add_done_callback(_retrieve)
        try:
            return await asyncio.shield(self.opening)
        except TransportError as exc:  # one error per caller, not one shared by all
            raise TransportError(exc.message, retryable=exc.retryable) from exc.__cause__

    async def _open(self, capability: str, max_size: int) -> _Socket:
        try:
            try:
                tls: dict[str, Any] = {}
                if self.tls is not None:  # the context anew: renewed files are picked up
                    tls = {"ssl": self.tls.context(), "server_hostname": self.server_hostname}
                with map_websocket_exceptions(self.address):
                    ws = await _connect(
                        self.url,
                        compression=None,
                        proxy=None,
                        open_timeout=OPEN_TIMEOUT_S,
                        ping_interval=PING_INTERVAL_S,
                        ping_timeout=PING_TIMEOUT_S,
                        close_timeout=CLOSE_TIMEOUT_S,
                        max_size=max_size,
                        **tls,
                    )
            except DeadlineExceeded as exc:  # open_timeout, not the request's deadline
                raise TransportError(
                    f"agent at {self.address} did not accept a WebSocket in {OPEN_TIMEOUT_S}s"
                ) from exc.__cause__
            except TransportError as exc:
                tls_error = self.tls and self.tls.refused(exc, self.address, self.instance_id)
                if tls_error:  # a failed mTLS handshake, in words naming the identity
                    raise tls_error from exc.__cause__
                if self.tls and isinstance(exc.__cause__, InvalidMessage | ConnectionResetError):
                    # Under TLS 1.3 an agent that refuses Reach's certificate just closes it;
                    # a server without TLS drops the handshake.
                    why = f"{exc.__cause__!r} (the agent closed the connection)"
                    raise TransportError(
                        self.tls.handshake_failed(self.address, self.instance_id, why)
                    ) from exc.__cause__
                raise
        except ReachError as exc:
            self.failures += 1
            self.retry_at = time.monotonic() + backoff_s(self.failures)
            self.last_failure = exc.message
            self.last_retryable = exc.retryable
            self.stats.count(capability, self.protocol, "failed")
            raise
        finally:
            self.opening = None
        if self.closed:  # reclaimed while connecting
            await ws.close()
            raise TransportError(f"the connection to agent at {self.address} was closed by Reach")
        self.failures = 0
        self.retry_at = 0.0
        if self.connected_before:
            self.stats.count(capability, self.protocol, "reconnected")
        self.connected_before = True
        self.socket = _Socket(self, ws, capability, max_size)
        return self.socket

    def ended(self, socket: _Socket, *, clean: bool) -> None:
        """`socket` is gone: the next request connects again."""
        if self.socket is socket:
            self.socket = None
        if not socket.closed_by_us and not clean:
            self.stats.count(socket.capability, self.protocol, "failed")

    async def close(self) -> None:
        self.closed = True
        if self.opening is not None:  # let it finish: it closes what it opened
            await asyncio.wait([self.opening])
        if self.socket is not None:
            await self.socket.close()


class WebSocketConnector(PooledConnector):
    protocol = "websocket"

    def __init__(
        self,
        transport: TransportSettings | None = None,
        *,
        stats: ConnectionStats | None = None,
        security: SecuritySettings | None = None,
    ) -> None:
        super().__init__(transport, stats=stats, security=security)

        def make_link(target: str) -> _Link:
            instance_id, _, address = target.partition(" ")
            tls = self.tls if self.tls.enabled else None
            return _Link(address, self.protocol, self.stats, instance_id=instance_id, tls=tls)

        self._pools: Pools[_Link] = self._new_pools(make_link, _close_link)

    @classmethod
    def check_address(cls, address: str) -> str:
        return check_ws_address(address)

    async def verify_identity(self, address: str, instance_id: str) -> None:
        if not self.tls.enabled:
            return
        if address[:5].lower() == "ws://":
            raise InvalidRequest(self.tls.plaintext(address, instance_id).message)
        url = httpx.URL(wss_url(address).replace("wss://", "https://", 1))
        await self.tls.probe(
            url.host, url.port or 443, instance_id, address, poke=http_poke(url.host)
        )

    def waiting(self) -> int:
        """Requests waiting for a reply, over every connection held (none leak: a request
        that ends, by any path, stops waiting)."""
        total = 0
        for key in self._pools.held_keys():
            entry = self._pools.get(key)
            if entry is not None:
                total += entry.value.waiting()
        return total

    async def invoke(self, endpoint: Endpoint, message: Message, timeout_s: float) -> Reply:
        limit = endpoint.max_message_bytes or self.transport.max_message_bytes
        if self.tls.enabled and endpoint.address[:5].lower() == "ws://":
            raise self.tls.plaintext(endpoint.address, endpoint.instance_id)
        frame = request_frame(message)
        # Per instance and address: a re-join at a new address gets a fresh connection.
        key = f"{endpoint.instance_id} {endpoint.address}"
        entry = self._pools.acquire(key, endpoint.capability, key, instance_id=endpoint.instance_id)
        try:
            with map_websocket_exceptions(endpoint.address):
                async with asyncio.timeout(max(timeout_s, 0.001)):
                    answer = await entry.value.call(
                        endpoint.capability,
                        message.header.request_id,
                        frame,
                        frame_limit(limit),
                    )
        finally:
            self._pools.release(entry)
        return read_reply(endpoint, answer, limit)

    @classmethod
    def address_host_port(cls, address: str) -> tuple[str, int] | None:
        """`host:port`, or the ws(s) URL's host and port."""
        return host_port(address, {"ws": 80, "wss": 443})


async def _close_link(link: _Link) -> None:
    await link.close()
