"""HTTP connector: `POST {service_address}/reach/{operation}` with the JSON payload as body.

Wire contract (what a non-SDK agent implements): headers `X-Reach-Request-Id`, `X-Reach-Caller`,
`X-Reach-Deadline-Ms` (absolute, epoch ms), `X-Reach-Attempt`, `Idempotency-Key`, `traceparent`;
the body is the payload as `reach.messages.dumps` encodes it (compact UTF-8 JSON), so it is never
larger than the size Reach accepted. 200 with a JSON object = result (any other JSON value is
wrapped as `{"value": ...}`); 202 = accepted, the answer comes later through
`POST /reach/requests/{request_id}/result`.

The reply body may be at most the `max_message_bytes` negotiated at Join, as sent: a bigger one
is refused (non-retryable `agent_error`) before or while it is read, never held whole, because
Temporal could not carry it. Agents should answer in compact UTF-8 JSON for the same reason.

Any other status is an `agent_error` that carries the agent's error body
`{"error": {"type", "message"}}` as its `AgentFault`; the agent's words never choose Reach's
error type. The status does, deliberately:

    504             timeout (the agent ran out of the request's deadline)
    404             agent_error, not retryable (operation not served)
    413             agent_error, not retryable (the payload was within what was negotiated;
                    the agent disagrees, and another attempt would send the same bytes)
    429, 5xx        agent_error, retryable
    other           agent_error, not retryable

An agent that knows another attempt cannot help says so with `"retryable": false` in its error
body (it can only withhold a retry, never ask for one). The whole call, reading the reply
included, ends at the request's deadline.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterator
from typing import Any

import httpx

from connectors._address import check_http_address
from connectors._pools import ClientPools
from connectors.base import Connector
from reach.acceptance import check_json, parse_json
from reach.config import TransportSettings
from reach.errors import (
    AgentError,
    AgentFault,
    DeadlineExceeded,
    InternalError,
    ReachError,
    TransportError,
)
from reach.invocation import Endpoint
from reach.messages import Message, Reply, dumps

HEADER_REQUEST_ID = "X-Reach-Request-Id"
HEADER_CALLER = "X-Reach-Caller"
HEADER_DEADLINE = "X-Reach-Deadline-Ms"
HEADER_ATTEMPT = "X-Reach-Attempt"

# Enough for any error an agent means to tell; the rest of a longer body is not read.
MAX_ERROR_BODY_BYTES = 64 * 1024


def base_url(address: str) -> str:
    return address.rstrip("/") if "://" in address else f"http://{address.rstrip('/')}"


def wire_headers(message: Message) -> dict[str, str]:
    h = message.header
    headers = {
        HEADER_REQUEST_ID: h.request_id,
        HEADER_CALLER: h.caller,
        HEADER_ATTEMPT: str(h.attempt),
        "Content-Type": message.metadata.content_type,
    }
    if h.deadline_ms is not None:
        headers[HEADER_DEADLINE] = str(h.deadline_ms)
    if h.idempotency_key:
        headers["Idempotency-Key"] = h.idempotency_key
    if h.traceparent:
        headers["traceparent"] = h.traceparent
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
    except httpx.TransportError as exc:  # connect, read, write, close, proxy, remote protocol
        raise TransportError(f"cannot reach agent at {address}: {exc!r}") from exc
    except (httpx.DecodingError, httpx.TooManyRedirects) as exc:
        # The agent answered, in a form (Content-Encoding, a redirect) it will answer again.
        raise AgentError(f"agent at {address} answered unusably: {exc!r}") from exc
    except httpx.RequestError as exc:  # the base class, should a future httpx raise it bare
        raise TransportError(f"cannot reach agent at {address}: {exc!r}") from exc
    except (httpx.HTTPError, httpx.StreamError, httpx.CookieConflict) as exc:
        # Status errors, stream misuse, cookies: this connector never asks for them.
        raise InternalError(f"HTTP connector misused httpx for {address}: {exc!r}") from exc


def _too_large(endpoint: Endpoint, size: str, limit: int) -> AgentError:
    return AgentError(
        f"agent {endpoint.instance_id} answered {size} bytes; the negotiated "
        f"max_message_bytes is {limit}",
        retryable=False,
    )


async def _read_result(response: httpx.Response, endpoint: Endpoint, limit: int) -> bytes:
    """The body of a 200, refused as soon as it is known to pass `limit` bytes."""
    declared = response.headers.get("content-length")
    # With a Content-Encoding the declared length is the compressed one; the count below holds.
    if declared is not None and "content-encoding" not in response.headers:
        with contextlib.suppress(ValueError):
            if int(declared) > limit:
                raise _too_large(endpoint, declared, limit)
    chunks = []
    size = 0
    async for chunk in response.aiter_bytes():
        size += len(chunk)
        if size > limit:
            raise _too_large(endpoint, f"more than {limit}", limit)
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


def _text(value: object) -> str:
    # A JSON escape can smuggle in a lone surrogate, which no later hop could encode.
    return str(value).encode("utf-8", "replace").decode("utf-8")


def _fault(raw: bytes, code: int) -> tuple[AgentFault, bool]:
    """What the agent said about its failure, whatever shape it said it in, and whether it
    said another attempt could not help."""
    try:
        body = parse_json(raw, what="error body")
    except ReachError:
        body = None
    err = body.get("error") if isinstance(body, dict) else None
    if isinstance(err, dict):
        fault = AgentFault(
            type=_text(err.get("type") or "agent_error"),
            message=_text(err.get("message") or ""),
            status=code,
        )
        return fault, err.get("retryable") is False
    return AgentFault(message=raw.decode("utf-8", "replace").strip(), status=code), False


def _reply(endpoint: Endpoint, code: int, raw: bytes, limit: int) -> Reply:
    where = f"agent {endpoint.instance_id} answered HTTP {code}"
    if code == 200:
        try:
            data: Any = parse_json(raw, what="result") if raw else {}
            result = data if isinstance(data, dict) else {"value": data}
            # As Reach will carry it: re-encoded, within the limit, nesting and charset rules.
            check_json(result, what="its result", limit=limit)
        except ReachError as exc:
            raise AgentError(f"{where}; {exc.message}", retryable=False) from exc
        return Reply(status="ok", result=result)
    if code == 202:
        return Reply(status="accepted")
    fault, final = _fault(raw, code)
    said = f": {fault.message}" if fault.message else ""
    if code == 504:
        raise DeadlineExceeded(f"{where}{said}")
    if code == 404:
        raise AgentError(f"{where}: operation not served{said}", retryable=False, fault=fault)
    if code == 413:
        raise AgentError(
            f"{where}: it refused the payload as too large{said}", retryable=False, fault=fault
        )
    retryable = (code >= 500 or code == 429) and not final
    raise AgentError(f"{where}{said}", retryable=retryable, fault=fault)


class HttpConnector(Connector):
    protocol = "http"

    def __init__(
        self,
        transport: TransportSettings | None = None,
        *,
        max_connections_per_instance: int = 64,
    ) -> None:
        super().__init__(transport)
        limits = httpx.Limits(
            max_connections=max_connections_per_instance,
            max_keepalive_connections=max_connections_per_instance,
            keepalive_expiry=self.transport.idle_timeout_s,
        )

        def make_client(url: str) -> httpx.AsyncClient:
            return httpx.AsyncClient(base_url=url, limits=limits, trust_env=False)

        self._pools = ClientPools(
            make_client,
            idle_timeout_s=self.transport.idle_timeout_s,
            max_pools=self.transport.max_pools,
        )

    @classmethod
    def check_address(cls, address: str) -> str:
        return check_http_address(address)

    async def invoke(self, endpoint: Endpoint, message: Message, timeout_s: float) -> Reply:
        limit = endpoint.max_message_bytes or self.transport.max_message_bytes
        with map_httpx_exceptions(endpoint.address):
            body = dumps(message.payload)
            pool = self._pools.acquire(base_url(endpoint.address))
            try:
                # httpx's timeout bounds each phase; this bounds the call, slow trickles included.
                async with asyncio.timeout(max(timeout_s, 0.001)):
                    request = pool.client.build_request(
                        "POST",
                        f"/reach/{message.header.operation}",
                        content=body,
                        headers=wire_headers(message),
                        timeout=max(timeout_s, 0.001),
                    )
                    response = await pool.client.send(request, stream=True)
                    try:
                        if response.status_code == 200:
                            raw = await _read_result(response, endpoint, limit)
                        else:
                            raw = await _read_some(response, MAX_ERROR_BODY_BYTES)
                    finally:
                        await response.aclose()
            finally:
                self._pools.release(pool)
        return _reply(endpoint, response.status_code, raw, limit)

    async def aclose(self) -> None:
        await self._pools.aclose()
