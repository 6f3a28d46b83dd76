"""HTTP connector: `POST {service_address}/reach/{operation}` with the JSON payload as body.

Wire contract (what a non-SDK agent implements): headers `X-Reach-Request-Id`, `X-Reach-Caller`,
`X-Reach-Deadline-Ms` (absolute, epoch ms), `X-Reach-Attempt`, `Idempotency-Key`, `traceparent`;
200 with a JSON object = result; 202 = accepted, the answer comes later through
`POST /reach/requests/{request_id}/result`. An error body `{"error": {"type", "message"}}` is
passed on to the caller.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from typing import Any

import httpx

from connectors.base import Connector
from reach.errors import (
    AgentError,
    DeadlineExceeded,
    PayloadTooLarge,
    ReachError,
    TransportError,
)
from reach.invocation import Endpoint
from reach.messages import Message, Reply

HEADER_REQUEST_ID = "X-Reach-Request-Id"
HEADER_CALLER = "X-Reach-Caller"
HEADER_DEADLINE = "X-Reach-Deadline-Ms"
HEADER_ATTEMPT = "X-Reach-Attempt"


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
    """The one place httpx's exceptions become Reach errors."""
    try:
        yield
    except httpx.TimeoutException as exc:
        raise DeadlineExceeded(f"agent at {address} did not answer in time") from exc
    except httpx.TransportError as exc:
        raise TransportError(f"cannot reach agent at {address}: {exc!r}") from exc


def _error_from_body(response: httpx.Response) -> tuple[str, str]:
    try:
        body: Any = response.json()
    except ValueError:
        return "agent_error", response.text[:200] or response.reason_phrase
    err = body.get("error") if isinstance(body, dict) else None
    if isinstance(err, dict):
        return str(err.get("type", "agent_error")), str(err.get("message", ""))
    return "agent_error", json.dumps(body)[:200]


class HttpConnector(Connector):
    protocol = "http"

    def __init__(self, *, max_connections_per_instance: int = 64) -> None:
        self._clients: dict[str, httpx.AsyncClient] = {}
        self._limits = httpx.Limits(
            max_connections=max_connections_per_instance,
            max_keepalive_connections=max_connections_per_instance,
            keepalive_expiry=30.0,
        )

    def _client(self, address: str) -> httpx.AsyncClient:
        url = base_url(address)
        client = self._clients.get(url)
        if client is None:
            client = httpx.AsyncClient(base_url=url, limits=self._limits, trust_env=False)
            self._clients[url] = client
        return client

    async def invoke(self, endpoint: Endpoint, message: Message, timeout_s: float) -> Reply:
        client = self._client(endpoint.address)
        body = json.dumps(message.payload, separators=(",", ":")).encode()
        with map_httpx_exceptions(endpoint.address):
            response = await client.post(
                f"/reach/{message.header.operation}",
                content=body,
                headers=wire_headers(message),
                timeout=max(timeout_s, 0.001),
            )
        return self._reply(endpoint, response)

    @staticmethod
    def _reply(endpoint: Endpoint, response: httpx.Response) -> Reply:
        code = response.status_code
        if code == 202:
            return Reply(status="accepted")
        if code == 200:
            try:
                data: Any = response.json() if response.content else {}
            except ValueError as exc:
                raise AgentError(f"agent {endpoint.instance_id} answered invalid JSON") from exc
            return Reply(status="ok", result=data if isinstance(data, dict) else {"value": data})
        err_type, err_msg = _error_from_body(response)
        where = f"agent {endpoint.instance_id} answered HTTP {code}"
        if code == 413:
            raise PayloadTooLarge(f"{where}: {err_msg}")
        if code == 404:
            raise AgentError(f"{where}: operation not served ({err_msg})")
        if code == 504 or err_type == "timeout":
            raise DeadlineExceeded(f"{where}: {err_msg}")
        error: ReachError = AgentError(f"{where}: {err_msg}", retryable=code >= 500)
        raise error

    async def aclose(self) -> None:
        clients, self._clients = self._clients, {}
        for client in clients.values():
            await client.aclose()
