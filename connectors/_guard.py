"""HTTP connections that go only where the address guard allows (`reach.security.netguard`).

`GuardedBackend` is an httpcore network backend: for each new connection it resolves the host
itself, refuses the connection unless every address the name resolves to is allowed, and then
connects to one of those very addresses (the IP, not the name), so a name that resolves to
something else a moment later (DNS rebinding) cannot slip between the check and the connect.
Only new connections pay for this; a kept-alive connection is reused as it is.

TLS still verifies the name: httpcore calls `start_tls(server_hostname=<the URL's host>)` on the
stream `connect_tcp` returns (httpcore/_async/connection.py, `_connect`), whatever address the
stream was opened to, so SNI and certificate checks use the original hostname.

`vetted_addresses` is the same check for the connectors that open their own connections
(gRPC, WebSocket): they dial one of the addresses it returns, never the name.

`GuardedTransport` is httpx's own transport around an httpcore pool with that backend: the
request conversion and exception mapping stay httpx's. A refusal raises `AddressRefused`, an
`httpcore.ConnectError`, which httpx turns into `httpx.ConnectError` caused by it; `refusal_in`
finds the reason again in such an exception. Redirects are never followed: httpx follows none
unless asked (`follow_redirects=False` by default), and Reach never asks.
"""

from __future__ import annotations

import asyncio
import ssl
import typing

import httpcore
import httpx

from reach.errors import TransportError
from reach.security.netguard import AddressGuard, refused_message, resolve

SocketOption = (
    tuple[int, int, int] | tuple[int, int, bytes | bytearray] | tuple[int, int, None, int]
)


# httpx's own defaults (a client without `limits=`).
DEFAULT_LIMITS = httpx.Limits(max_connections=100, max_keepalive_connections=20)


class AddressRefused(httpcore.ConnectError):
    """The guard refused every connection to this host; nothing was sent."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


def refusal_in(exc: BaseException) -> str | None:
    """The guard's reason when `exc` (or what caused it) is an `AddressRefused`."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        if isinstance(current, AddressRefused):
            return current.reason
        seen.add(id(current))
        current = current.__cause__ or current.__context__
    return None


async def vetted_addresses(
    guard: AddressGuard, host: str, port: int, address: str, timeout_s: float | None = None
) -> list[str]:
    """Every address `host` resolves to now, each allowed, for a connection about to be opened
    to one of them (DNS rebinding: the name is not resolved again by whoever dials). A refusal
    is a final `TransportError` naming the address (the same one is refused every time); a
    resolver that fails or is slow, a retryable one. `address` is the agent's, for messages."""
    try:
        async with asyncio.timeout(timeout_s):
            ips = await resolve(host, port)
    except TimeoutError as exc:
        raise TransportError(
            f"cannot reach agent at {address}: resolving {host!r} timed out"
        ) from exc
    except (OSError, UnicodeError) as exc:
        raise TransportError(
            f"cannot reach agent at {address}: cannot resolve {host!r}: {exc}"
        ) from exc
    for ip in ips:
        reason = guard.refusal(ip)
        if reason is not None:
            raise TransportError(
                f"agent at {address}: {refused_message(host, ip, reason)}", retryable=False
            )
    return ips


class GuardedBackend(httpcore.AsyncNetworkBackend):
    """Resolves, vets every address, connects to a vetted one (in the resolver's order)."""

    def __init__(
        self, guard: AddressGuard, inner: httpcore.AsyncNetworkBackend | None = None
    ) -> None:
        self.guard = guard
        self.inner = inner if inner is not None else httpcore.AnyIOBackend()

    async def vetted(self, host: str, port: int, timeout_s: float | None) -> list[str]:
        """Every address of `host`, each allowed; else `AddressRefused` (or ConnectError)."""
        try:
            async with asyncio.timeout(timeout_s):
                ips = await resolve(host, port)
        except TimeoutError as exc:
            raise httpcore.ConnectTimeout(f"resolving {host!r} timed out") from exc
        except (OSError, UnicodeError) as exc:  # socket.gaierror is an OSError
            raise httpcore.ConnectError(f"cannot resolve {host!r}: {exc}") from exc
        for ip in ips:
            reason = self.guard.refusal(ip)
            if reason is not None:
                raise AddressRefused(refused_message(host, ip, reason))
        return ips

    async def connect_tcp(
        self,
        host: str,
        port: int,
        timeout: float | None = None,  # noqa: ASYNC109 (httpcore's signature)
        local_address: str | None = None,
        socket_options: typing.Iterable[SocketOption] | None = None,
    ) -> httpcore.AsyncNetworkStream:
        loop = asyncio.get_running_loop()
        deadline = None if timeout is None else loop.time() + timeout
        ips = await self.vetted(host, port, timeout)
        options = list(socket_options) if socket_options is not None else None
        failure: httpcore.ConnectError | httpcore.ConnectTimeout | None = None
        for ip in ips:
            left = None if deadline is None else max(0.0, deadline - loop.time())
            if left == 0.0 and failure is not None:
                break
            try:
                return await self.inner.connect_tcp(
                    ip, port, timeout=left, local_address=local_address, socket_options=options
                )
            except (httpcore.ConnectError, httpcore.ConnectTimeout) as exc:
                failure = exc  # the next address (e.g. ::1 refused, then 127.0.0.1)
        assert failure is not None  # `vetted` never returns an empty list
        raise failure

    async def connect_unix_socket(
        self,
        path: str,
        timeout: float | None = None,  # noqa: ASYNC109 (httpcore's signature)
        socket_options: typing.Iterable[SocketOption] | None = None,
    ) -> httpcore.AsyncNetworkStream:
        raise AddressRefused(f"unix socket {path!r}: only TCP connections pass the guard")

    async def sleep(self, seconds: float) -> None:
        await self.inner.sleep(seconds)


class GuardedTransport(httpx.AsyncHTTPTransport):
    """`httpx.AsyncHTTPTransport` whose connections open through `GuardedBackend`; no
    environment (proxies, SSL_CERT_FILE) is read. Pass TLS settings here (`verify`, `cert`):
    an `httpx.AsyncClient` given a transport ignores its own."""

    def __init__(
        self,
        guard: AddressGuard,
        *,
        verify: ssl.SSLContext | str | bool = True,
        cert: typing.Any = None,
        limits: httpx.Limits | None = None,
        http1: bool = True,
        http2: bool = False,
        retries: int = 0,
        socket_options: typing.Iterable[SocketOption] | None = None,
        inner: httpcore.AsyncNetworkBackend | None = None,
    ) -> None:
        limits = limits if limits is not None else DEFAULT_LIMITS
        # The base class builds a pool without a custom backend; its SSL context would be
        # built for nothing, so it gets the cheap one, and the pool is replaced below.
        super().__init__(verify=False, trust_env=False, limits=limits)
        ssl_context = (
            verify
            if isinstance(verify, ssl.SSLContext)
            else httpx.create_ssl_context(verify=verify, cert=cert, trust_env=False)
        )
        self.backend = GuardedBackend(guard, inner)
        self._pool = httpcore.AsyncConnectionPool(
            ssl_context=ssl_context,
            max_connections=limits.max_connections,
            max_keepalive_connections=limits.max_keepalive_connections,
            keepalive_expiry=limits.keepalive_expiry,
            http1=http1,
            http2=http2,
            retries=retries,
            socket_options=socket_options,
            network_backend=self.backend,
        )


def guarded_client(
    guard: AddressGuard, *, limits: httpx.Limits | None = None, **kwargs: typing.Any
) -> httpx.AsyncClient:
    """An `httpx.AsyncClient` over a `GuardedTransport` (never following redirects)."""
    return httpx.AsyncClient(
        transport=GuardedTransport(guard, limits=limits),
        trust_env=False,
        follow_redirects=False,
        **kwargs,
    )
