"""WebSocket connector: one persistent, multiplexed connection per agent instance, JSON frames.

The wire contract (what an agent written without the SDK implements: the address, the request
and reply frames, what each status means, limits, which malformed frames cost what, keepalive,
mTLS) and the connections' lifecycle are docs/protocols/websocket.md; its names are
`agent_reach_proto.wire`'s. Here the connection to each instance (`_Link`: opened on first use
by one task every waiting request shares, pinged every `PING_INTERVAL_S` and closed when a pong
is `PING_TIMEOUT_S` late, reopened after a break, a failed connect backing off 0.1 s doubling to
5 s; kept and reclaimed in `connectors._pools.Pools`) and the call on it
(`WebSocketConnector.invoke`). The requests multiplexed on one open connection are
`connectors._websocket_socket`'s; one request's translation (address, frames, reply reading,
errors) is `connectors._websocket_call`'s.
"""

from __future__ import annotations

import asyncio
import random
import time
from typing import Any

import httpx
from websockets.asyncio.client import connect
from websockets.exceptions import InvalidMessage

from agent_reach_proto import wire
from connectors._guard import vetted_addresses
from connectors._pools import ConnectionStats, Pools
from connectors._tls import ReachTls, http_poke
from connectors._websocket_call import (
    Frame,
    check_ws_address,
    frame_limit,
    map_websocket_exceptions,
    read_reply,
    request_frame,
    request_id_in,
    ws_url,
    wss_url,
)
from connectors._websocket_socket import Socket
from connectors.base import PooledConnector
from reach.config import SecuritySettings, TransportSettings
from reach.errors import DeadlineExceeded, InvalidRequest, ReachError, TransportError
from reach.invocation import Endpoint
from reach.messages import Message, Reply
from reach.security.netguard import AddressGuard, host_port

# This module's names and those that moved to the role modules (importable from here as before).
# The older names of the contract's constants below stay importable, unlisted: their home is wire.
__all__ = [
    "BACKOFF_FIRST_S",
    "BACKOFF_MAX_S",
    "CLOSE_TIMEOUT_S",
    "OPEN_TIMEOUT_S",
    "PING_INTERVAL_S",
    "PING_TIMEOUT_S",
    "WebSocketConnector",
    "backoff_s",
    "check_ws_address",
    "frame_limit",
    "map_websocket_exceptions",
    "read_reply",
    "request_frame",
    "request_id_in",
    "ws_url",
    "wss_url",
]

PING_INTERVAL_S = 20.0
PING_TIMEOUT_S = 20.0
OPEN_TIMEOUT_S = 10.0  # TCP connect and handshake; the request's own deadline may end it sooner
CLOSE_TIMEOUT_S = 2.0  # for the closing handshake before the TCP connection is dropped
BACKOFF_FIRST_S = 0.1
BACKOFF_MAX_S = 5.0

# The contract's names under this module's older names.
DEFAULT_PATH = wire.WS_DEFAULT_PATH
HEADER_REQUEST_ID = wire.REQUEST_ID
HEADER_CALLER = wire.CALLER
HEADER_ATTEMPT = wire.ATTEMPT
HEADER_DEADLINE = wire.DEADLINE_MS
HEADER_IDEMPOTENCY_KEY = wire.IDEMPOTENCY_KEY
HEADER_TRACEPARENT = wire.TRACEPARENT


def backoff_s(failures: int) -> float:
    """The wait before connect attempt `failures + 1` (with 20 % jitter, so that the
    connectors of many processes do not knock on a restarting agent in step)."""
    base: float = min(BACKOFF_MAX_S, BACKOFF_FIRST_S * 2.0 ** max(failures - 1, 0))
    return base * random.uniform(0.8, 1.0)


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
        guard: AddressGuard | None = None,
    ) -> None:
        self.address = address
        self.url = ws_url(address)
        # The address guard, vetting the host's addresses at every connect (DNS rebinding).
        self.guard = guard
        self.instance_id = instance_id
        # mTLS: wss:// with Reach's certificate; the agent must prove `server_hostname`.
        self.tls = tls
        self.server_hostname = ""
        if tls is not None:
            self.url = wss_url(address)
            self.server_hostname = tls.server_name(instance_id)
        self.protocol = protocol
        self.stats = stats
        self.socket: Socket | None = None
        self.opening: asyncio.Task[Socket] | None = None
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

    async def _connected(self, capability: str, max_size: int) -> Socket:
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

    async def _open(self, capability: str, max_size: int) -> Socket:
        try:
            try:
                tls: dict[str, Any] = {}
                if self.tls is not None:  # the context anew: renewed files are picked up
                    tls = {"ssl": self.tls.context(), "server_hostname": self.server_hostname}
                ws = await self._connect_vetted(max_size, tls)
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
        self.socket = Socket(self, ws, capability, max_size)
        return self.socket

    async def _connect_vetted(self, max_size: int, tls: dict[str, Any]) -> Any:
        """The WebSocket, opened to an address the guard allowed when the host was resolved
        just now (the URL's host stays the Host header and TLS name); each vetted address in
        turn while they refuse the connection. Without a guard, to the URL's host."""
        dials: list[dict[str, Any]] = [{}]
        if self.guard is not None:
            host, port = host_port(self.url, {"ws": 80, "wss": 443}) or ("", 0)
            ips = await vetted_addresses(self.guard, host, port, self.address, OPEN_TIMEOUT_S)
            dials = [{"host": ip, "port": port} for ip in ips]
        for index, dial in enumerate(dials):
            try:
                with map_websocket_exceptions(self.address):
                    return await _connect(
                        self.url,
                        compression=None,
                        proxy=None,
                        open_timeout=OPEN_TIMEOUT_S,
                        ping_interval=PING_INTERVAL_S,
                        ping_timeout=PING_TIMEOUT_S,
                        close_timeout=CLOSE_TIMEOUT_S,
                        max_size=max_size,
                        **tls,
                        **dial,
                    )
            except TransportError as exc:
                refused = isinstance(exc.__cause__, ConnectionRefusedError)
                if not refused or index == len(dials) - 1:
                    raise
        raise AssertionError("unreachable: the last dial raises")

    def ended(self, socket: Socket, *, clean: bool) -> None:
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

        # Connections only where the address guard allows (reach.security.netguard), as over
        # HTTP; a connector built without security settings (tests, embedding code) has none.
        guard = AddressGuard(self.security.allow_networks) if security is not None else None

        def make_link(target: str) -> _Link:
            instance_id, _, address = target.partition(" ")
            tls = self.tls if self.tls.enabled else None
            return _Link(
                address, self.protocol, self.stats, instance_id=instance_id, tls=tls, guard=guard
            )

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
