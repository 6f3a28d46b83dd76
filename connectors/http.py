"""HTTP connector: `POST {service_address}/reach/{operation}` with the JSON payload as body.

The wire contract (what an agent written without the SDK implements: the headers, the body,
what each status means, the size limit, mTLS) is `docs/protocols/http.md`; its names are
`agent_reach_proto.wire`'s. A reply past the negotiated size is refused as soon as that is known,
never held whole; the whole call, reading the reply included, ends at the request's deadline.

Connections: one httpx client (its own keep-alive pool) per instance, opened on first use,
closed when idle past `transport.idle_timeout_s` or when the instance leaves the registry.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable, Iterator

import httpx

from agent_reach_proto import wire
from connectors._address import check_http_address
from connectors._answers import reply_for_status, too_large
from connectors._guard import GuardedTransport, refusal_in
from connectors._pools import ConnectionStats, Pools
from connectors._tls import http_poke, public_context
from connectors.base import PooledConnector
from reach.config import SecuritySettings, TransportSettings
from reach.errors import (
    AgentError,
    DeadlineExceeded,
    InternalError,
    InvalidRequest,
    TransportError,
)
from reach.invocation import Endpoint
from reach.messages import Message, Reply, dumps
from reach.security.netguard import AddressGuard, host_port

# The contract's header names under this module's older names.
HEADER_REQUEST_ID = wire.HTTP_REQUEST_ID
HEADER_CALLER = wire.HTTP_CALLER
HEADER_DEADLINE = wire.HTTP_DEADLINE_MS
HEADER_ATTEMPT = wire.HTTP_ATTEMPT

# Enough for any error an agent means to tell; the rest of a longer body is not read.
MAX_ERROR_BODY_BYTES = 64 * 1024


def base_url(address: str) -> str:
    return address.rstrip("/") if "://" in address else f"http://{address.rstrip('/')}"


def tls_base_url(address: str) -> str | None:
    """The URL to call an agent at under mTLS: `host:port` is https; None for `http://`."""
    if "://" not in address:
        return f"https://{address.rstrip('/')}"
    return address.rstrip("/") if address[:8].lower() == "https://" else None


def wire_headers(message: Message) -> dict[str, str]:
    headers = wire.http_headers(message.header)
    headers["Content-Type"] = message.metadata.content_type
    return headers


@contextlib.contextmanager
def map_httpx_exceptions(address: str) -> Iterator[None]:
    """The one place httpx's exceptions (and failing to encode a request) become Reach errors.

    Whether a failure is retryable is whether sending the same request again could succeed.
    """
    try:
        yield
    except (httpx.TimeoutException, TimeoutError) as exc:  # a phase, or the whole call
        raise DeadlineExceeded(f"agent at {address} did not answer in time") from exc
    except (
        httpx.LocalProtocolError,  # a header value HTTP cannot carry, and the like
        httpx.UnsupportedProtocol,  # a scheme other than http(s)
        httpx.InvalidURL,
        UnicodeEncodeError,
    ) as exc:
        raise TransportError(
            f"cannot send this request to agent at {address}: {exc!r}", retryable=False
        ) from exc
    except (httpx.ConnectError, httpx.ProxyError) as exc:  # nothing was sent
        refused = refusal_in(exc)
        if refused is not None:  # the address guard: the same address is refused every time
            raise TransportError(f"agent at {address}: {refused}", retryable=False) from exc
        raise TransportError(f"cannot reach agent at {address}: {exc!r}") from exc
    except httpx.TransportError as exc:  # read, write, close, remote protocol: mid-call
        raise TransportError(
            f"the connection to agent at {address} broke mid-call: {exc!r}", outcome_unknown=True
        ) from exc
    except (httpx.DecodingError, httpx.TooManyRedirects) as exc:
        # The agent answered, in a form (Content-Encoding, a redirect) it will answer again.
        raise AgentError(f"agent at {address} answered unusably: {exc!r}") from exc
    except httpx.RequestError as exc:  # the base class, should a future httpx raise it bare
        raise TransportError(f"cannot reach agent at {address}: {exc!r}") from exc
    except (httpx.HTTPError, httpx.StreamError, httpx.CookieConflict) as exc:
        # Status errors, stream misuse, cookies: this connector never asks for them.
        raise InternalError(f"HTTP connector misused httpx for {address}: {exc!r}") from exc


async def _read_result(response: httpx.Response, endpoint: Endpoint, limit: int) -> bytes:
    """The body of a 200, refused as soon as it is known to pass `limit` bytes."""
    declared = response.headers.get("content-length")
    # With a Content-Encoding the declared length is the compressed one; the count below holds.
    if declared is not None and "content-encoding" not in response.headers:
        with contextlib.suppress(ValueError):
            if int(declared) > limit:
                raise too_large(endpoint, declared, limit)
    chunks = []
    size = 0
    async for chunk in response.aiter_bytes():
        size += len(chunk)
        if size > limit:
            raise too_large(endpoint, f"more than {limit}", limit)
        chunks.append(chunk)
    return b"".join(chunks)


async def _read_some(response: httpx.Response, limit: int) -> bytes:
    """At most `limit` bytes of a body read only for what it says (202s and errors)."""
    chunks = []
    size = 0
    async for chunk in response.aiter_bytes():
        chunks.append(chunk)
        size += len(chunk)
        if size >= limit:
            break
    return b"".join(chunks)[:limit]


# httpcore's pool does work proportional to (waiting requests x connections) on every event, so
# one pool of 64 busy connections spends more time on bookkeeping than on the calls (1000 calls
# of 0.2 s to one instance: half timed out at 15 s). An instance's connections are therefore
# split over shards of at most this many, and callers past the total wait for a slot here.
SHARD_CONNECTIONS = 16


class _Client:
    """An instance's connections: httpx clients of `SHARD_CONNECTIONS` each, and a slot per
    connection; a call takes a slot, then the shard with the fewest calls in flight."""

    __slots__ = ("busy", "shards", "slots")

    def __init__(self, make: Callable[[int], httpx.AsyncClient], connections: int) -> None:
        sizes = [SHARD_CONNECTIONS] * (connections // SHARD_CONNECTIONS)
        if connections % SHARD_CONNECTIONS:
            sizes.append(connections % SHARD_CONNECTIONS)
        self.shards = [make(size) for size in sizes]
        self.busy = [0] * len(self.shards)
        self.slots = asyncio.Semaphore(connections)

    @contextlib.asynccontextmanager
    async def shard(self) -> AsyncIterator[httpx.AsyncClient]:
        async with self.slots:
            i = min(range(len(self.shards)), key=self.busy.__getitem__)
            self.busy[i] += 1
            try:
                yield self.shards[i]
            finally:
                self.busy[i] -= 1

    async def aclose(self) -> None:
        for shard in self.shards:
            await shard.aclose()


async def _close_client(client: _Client) -> None:
    await client.aclose()


class HttpConnector(PooledConnector):
    protocol = "http"

    def __init__(
        self,
        transport: TransportSettings | None = None,
        *,
        stats: ConnectionStats | None = None,
        security: SecuritySettings | None = None,
        max_connections_per_instance: int = 64,
    ) -> None:
        super().__init__(transport, stats=stats, security=security)
        expiry = self.transport.idle_timeout_s
        # Connections only where the address guard allows (reach.security.netguard), vetted
        # once per new connection. A connector built without security settings (tests,
        # embedding code) has no guard; Reach's processes always pass theirs (ConnectorSet).
        guard = AddressGuard(self.security.allow_networks) if security is not None else None

        def make_client(address: str) -> _Client:
            # mTLS: Reach's certificate and CA; each request names the agent to verify (SNI).
            # Without it, the one public context every client shares (`public_context`).
            url = base_url(address)
            if self.tls.enabled:
                url, verify = tls_base_url(address) or url, self.tls.context()
            else:
                verify = public_context()

            def shard(size: int) -> httpx.AsyncClient:
                limits = httpx.Limits(
                    max_connections=size, max_keepalive_connections=size, keepalive_expiry=expiry
                )
                # A client given a transport ignores its own limits and TLS: the guarded
                # transport takes both.
                guarded = (
                    None if guard is None else GuardedTransport(guard, verify=verify, limits=limits)
                )
                return httpx.AsyncClient(
                    base_url=url, limits=limits, trust_env=False, verify=verify, transport=guarded
                )

            return _Client(shard, max_connections_per_instance)

        self._pools: Pools[_Client] = self._new_pools(make_client, _close_client)

    @classmethod
    def check_address(cls, address: str) -> str:
        return check_http_address(address)

    async def verify_identity(self, address: str, instance_id: str) -> None:
        if not self.tls.enabled:
            return
        url = tls_base_url(address)
        if url is None:
            raise InvalidRequest(self.tls.plaintext(address, instance_id).message)
        parsed = httpx.URL(url)
        await self.tls.probe(
            parsed.host, parsed.port or 443, instance_id, address, poke=http_poke(parsed.host)
        )

    async def invoke(self, endpoint: Endpoint, message: Message, timeout_s: float) -> Reply:
        limit = endpoint.max_message_bytes or self.transport.max_message_bytes
        sni: str | None = None  # mTLS: the name the agent's certificate must carry
        if self.tls.enabled:
            if tls_base_url(endpoint.address) is None:
                raise self.tls.plaintext(endpoint.address, endpoint.instance_id)
            sni = self.tls.server_name(endpoint.instance_id)
        with map_httpx_exceptions(endpoint.address):
            body = dumps(message.payload)
            # Per instance and address: a re-join at a new address gets a fresh client.
            pool = self._pools.acquire(
                f"{endpoint.instance_id} {endpoint.address}",
                endpoint.capability,
                endpoint.address,
                instance_id=endpoint.instance_id,
            )
            try:
                # httpx's timeout bounds each phase; this bounds the call, slow trickles included
                # (and the wait for a free connection).
                async with asyncio.timeout(max(timeout_s, 0.001)), pool.value.shard() as http:
                    request = http.build_request(
                        "POST",
                        f"{wire.HTTP_PATH_PREFIX}{message.header.operation}",
                        content=body,
                        headers=wire_headers(message),
                        timeout=max(timeout_s, 0.001),
                        extensions=None if sni is None else {"sni_hostname": sni},
                    )
                    response = await http.send(request, stream=True)
                    try:
                        if response.status_code == 200:
                            raw = await _read_result(response, endpoint, limit)
                        else:
                            raw = await _read_some(response, MAX_ERROR_BODY_BYTES)
                    finally:
                        await response.aclose()
            except (httpx.ConnectError, httpx.RemoteProtocolError, httpx.ReadError) as exc:
                self.stats.count(endpoint.capability, self.protocol, "failed")
                if sni is not None:
                    sent = not isinstance(exc, httpx.ConnectError)  # past the handshake
                    refused = self.tls.refused(
                        exc, endpoint.address, endpoint.instance_id, sent=sent
                    )
                    if refused is not None:
                        raise refused from exc
                raise
            finally:
                self._pools.release(pool)
        return reply_for_status(endpoint, response.status_code, raw, limit)

    @classmethod
    def address_host_port(cls, address: str) -> tuple[str, int] | None:
        """Where a (checked) address connects: `host:port`, or the URL's host and port."""
        return host_port(address, {"http": 80, "https": 443})
