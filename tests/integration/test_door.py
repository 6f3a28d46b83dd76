"""The gateway's door: what no later hop can carry is refused with 413/422 naming the problem,
and every answer, whatever failed, is the documented envelope."""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import AsyncIterator

import httpx
import pytest

from reach.limits import DEFAULT_MAX_MESSAGE_BYTES
from tests.helpers import GatewayProcess, start_agents

pytestmark = pytest.mark.integration

JSON = {"Content-Type": "application/json"}


@pytest.fixture(scope="module")
async def served(gateway: GatewayProcess) -> AsyncIterator[str]:
    """A capability with one live agent, for the whole module: the tests that take it are about
    what the door accepts and refuses, and each request of theirs is its own."""
    capability = f"cap-{uuid.uuid4().hex[:8]}"
    agents = await start_agents(gateway, capability, 1)
    yield capability
    for agent in agents:
        agent.proc.stop()


def raw_invoke(capability: str, payload_json: str, request_id: str) -> bytes:
    return (
        f'{{"request_id": "{request_id}", "target": "{capability}", "operation": "query", '
        f'"timeout_ms": 3000, "payload": {payload_json}}}'
    ).encode()


@pytest.mark.parametrize(
    ("payload_json", "needle"),
    [
        # Accepted before, then its workflow could never decode its own input: stuck forever.
        ('{"deep": ' + "[" * 250 + "]" * 250 + "}", "nested more than 64 levels"),
        ('{"text": "\\ud800"}', "unpaired UTF-16 surrogate"),
        ('{"x": NaN}', "NaN is not a JSON number"),
        ('{"x": 1e999}', "too large for a 64-bit float"),
        ('{"x": ' + "9" * 5000 + "}", "number Reach cannot carry"),
    ],
    ids=["deep", "surrogate", "nan", "inf", "huge-int"],
)
async def test_input_no_hop_can_carry_is_refused_at_the_door(
    gateway: GatewayProcess,
    http: httpx.AsyncClient,
    served: str,
    payload_json: str,
    needle: str,
) -> None:
    capability = served
    rid = f"req-{uuid.uuid4().hex}"
    r = await http.post(
        f"{gateway.url}/reach/invoke",
        content=raw_invoke(capability, payload_json, rid),
        headers=JSON,
    )
    assert r.status_code == 422, r.text
    assert r.json()["status"] == "error"
    assert r.json()["error"]["type"] == "invalid_request"
    assert needle in r.json()["error"]["message"]
    # Nothing was started: no request exists under that id.
    assert (await http.get(f"{gateway.url}/reach/requests/{rid}")).status_code == 404


@pytest.mark.parametrize(
    ("headers", "body_extra", "needle"),
    [
        ({"X-Reach-Caller": "orch\xe9strator".encode("latin-1")}, {}, "X-Reach-Caller"),
        ({"X-Reach-Caller": b"orch\x01"}, {}, "X-Reach-Caller"),
        ({"X-Reach-Caller": b"two words"}, {}, "X-Reach-Caller"),
        ({"traceparent": b"not-a-trace"}, {}, "traceparent"),
        (
            {"traceparent": b"00-00000000000000000000000000000000-b7ad6b7169203331-01"},
            {},
            "traceparent",
        ),
        ({}, {"idempotency_key": "cl\u00e9"}, "idempotency_key"),
        ({}, {"idempotency_key": "a\x7fb"}, "idempotency_key"),
        ({}, {"routing_key": "user\n42"}, "routing_key"),
        ({}, {"callback": "http://127.0.0.1/" + "x" * 3000}, "callback"),
    ],
)
async def test_values_a_header_cannot_carry_are_422(
    gateway: GatewayProcess,
    http: httpx.AsyncClient,
    served: str,
    headers: dict[str, bytes],
    body_extra: dict[str, str],
    needle: str,
) -> None:
    """Before: a 500, or a 502 retried by the workflow (the agent's HTTP client refused)."""
    capability = served
    r = await http.post(
        f"{gateway.url}/reach/invoke",
        json={"target": capability, "operation": "query", "timeout_ms": 3000, **body_extra},
        headers=headers,
    )
    assert r.status_code == 422, r.text
    assert r.json()["error"]["type"] == "invalid_request"
    assert needle in r.json()["error"]["message"]


async def test_a_valid_traceparent_and_caller_pass(
    gateway: GatewayProcess, http: httpx.AsyncClient, served: str
) -> None:
    capability = served
    r = await http.post(
        f"{gateway.url}/reach/invoke",
        json={"target": capability, "operation": "query", "idempotency_key": "order 42/a"},
        headers={
            "X-Reach-Caller": "orchestrator@eu-1",
            "traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
        },
    )
    assert r.status_code == 200, r.text


async def test_payload_limit_is_measured_as_sent(
    gateway: GatewayProcess, http: httpx.AsyncClient, served: str
) -> None:
    capability = served
    # 400 000 x "é": 800 000 bytes as sent (UTF-8), 2 400 000 if escaped: within the limit.
    r = await http.post(
        f"{gateway.url}/reach/invoke",
        json={"target": capability, "operation": "query", "payload": {"text": "\u00e9" * 400_000}},
    )
    assert r.status_code == 200, r.text
    # 600 000 x "é" is 1 200 000 bytes as sent: over the 1 MiB default, named in the message.
    r = await http.post(
        f"{gateway.url}/reach/invoke",
        json={"target": capability, "operation": "query", "payload": {"text": "\u00e9" * 600_000}},
    )
    assert r.status_code == 413, r.text
    assert r.json()["error"]["type"] == "payload_too_large"
    assert f"the limit is {DEFAULT_MAX_MESSAGE_BYTES} bytes" in r.json()["error"]["message"]


async def test_temporal_payload_limit_is_a_413_not_a_retryable_503(
    gateway: GatewayProcess, http: httpx.AsyncClient, served: str
) -> None:
    """Before: a 2.5 MB payload passed Reach's 4 MiB check, Temporal refused it (2 MiB), and the
    caller got a retryable 503 forever."""
    capability = served
    r = await http.post(
        f"{gateway.url}/reach/invoke",
        json={"target": capability, "operation": "query", "payload": {"t": "x" * 2_500_000}},
    )
    assert r.status_code == 413, r.text
    assert r.json()["error"]["type"] == "payload_too_large"
    assert r.json()["error"]["retryable"] is False


async def test_a_huge_declared_body_is_refused_without_reading_it(gateway: GatewayProcess) -> None:
    """Content-Length says 1 GB: the 413 comes at once, not after a gigabyte was buffered."""
    port = int(gateway.url.rsplit(":", 1)[1])
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(
            # The gateway's own Host: an open gateway refuses a foreign one first (rebinding).
            f"POST /reach/invoke HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n".encode()
            + b"Content-Type: application/json\r\n"
            b"Content-Length: 1000000000\r\n\r\n" + b'{"target": "x", "payload": "'
        )
        await writer.drain()
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
        assert head.startswith(b"HTTP/1.1 413"), head
        body = await asyncio.wait_for(reader.read(4096), 5)
        assert b'"type":"payload_too_large"' in body
        assert b"1000000000 bytes" in body
    finally:
        writer.close()


async def test_a_chunked_body_over_the_limit_is_a_413_envelope(
    gateway: GatewayProcess, http: httpx.AsyncClient
) -> None:
    async def chunks() -> object:
        for _ in range(80):  # 8 MB: past the 6 MiB + 64 KiB body limit
            yield b"x" * 100_000

    r = await http.post(f"{gateway.url}/reach/invoke", content=chunks(), headers=JSON)
    assert r.status_code == 413, r.text
    assert r.json()["error"]["type"] == "payload_too_large"


@pytest.mark.parametrize(
    ("method", "path", "status", "error_type"),
    [
        ("GET", "/no/such/route", 404, "not_found"),
        ("POST", "/reach/invoke/", 404, "not_found"),
        ("DELETE", "/reach/invoke", 405, "method_not_allowed"),
        ("GET", "/reach/requests/not%20an%20id", 422, "invalid_request"),
        ("PUT", "/reach/agents/%E2%9C%93/heartbeat", 422, "invalid_request"),
        ("GET", "/reach/capabilities/UPPER", 422, "invalid_request"),
    ],
)
async def test_framework_failures_answer_in_the_envelope(
    gateway: GatewayProcess,
    http: httpx.AsyncClient,
    method: str,
    path: str,
    status: int,
    error_type: str,
) -> None:
    r = await http.request(method, f"{gateway.url}{path}", json={})
    assert r.status_code == status, r.text
    assert r.json()["status"] == "error"
    assert r.json()["error"]["type"] == error_type
    assert r.json()["error"]["message"]


@pytest.mark.parametrize(
    ("change", "status", "needle"),
    [
        ({"service_address": "not an address"}, 422, "service_address"),
        ({"service_address": "127.0.0.1:99999"}, 422, "port"),
        ({"service_address": "http://user:pw@127.0.0.1:9"}, 422, "userinfo"),
        ({"service_address": "ftp://127.0.0.1:9"}, 422, "scheme"),
        ({"labels": {f"k{i}": "v" for i in range(40)}}, 422, "labels"),
        ({"operations": ["ok", "not ok!"]}, 422, "operations"),
        ({"heartbeat_interval": 0}, 422, "heartbeat_interval"),
        ({"protocol": "carrier-pigeon"}, 422, "carrier-pigeon"),
    ],
)
async def test_join_refuses_what_a_connector_cannot_use(
    gateway: GatewayProcess,
    http: httpx.AsyncClient,
    change: dict[str, object],
    status: int,
    needle: str,
) -> None:
    body = {
        "capability": "joiner",
        "instance_id": f"j-{uuid.uuid4().hex[:6]}",
        "service_address": "127.0.0.1:9",
        **change,
    }
    r = await http.post(f"{gateway.url}/reach/agents", json=body)
    assert r.status_code == status, r.text
    assert r.json()["status"] == "error"
    assert needle in r.json()["error"]["message"]


async def test_heartbeat_reports_are_bounded(
    gateway: GatewayProcess, http: httpx.AsyncClient
) -> None:
    iid = f"hb-{uuid.uuid4().hex[:6]}"
    r = await http.post(
        f"{gateway.url}/reach/agents",
        json={"capability": "beater", "instance_id": iid, "service_address": "127.0.0.1:9"},
    )
    assert r.status_code == 200, r.text
    url = f"{gateway.url}/reach/agents/{iid}/heartbeat"
    deep: object = {}
    for _ in range(80):
        deep = {"d": deep}
    for body, status, needle in (
        ({"checks": deep}, 422, "nested more than 64"),
        ({"checks": {"log": "x" * 20_000}}, 413, "checks is"),
        ({"inflight": -1}, 422, "inflight"),
        ({"status": "fine"}, 422, "status"),
    ):
        r = await http.put(url, json=body)
        assert r.status_code == status, r.text
        assert needle in r.json()["error"]["message"]
    assert (await http.put(url, content=b"")).status_code == 200  # empty: 'ok'


async def test_late_answers_are_bounded(gateway: GatewayProcess, http: httpx.AsyncClient) -> None:
    url = f"{gateway.url}/reach/requests/req-{uuid.uuid4().hex}/result"
    for body, status, needle in (
        ({"status": "error", "error_type": "has spaces"}, 422, "error_type"),
        ({"status": "error", "error_message": "x" * 5000}, 422, "error_message"),
        ({"status": "success", "result": {"t": "x" * 1_100_000}}, 413, "result is"),
        ({"status": "success", "surprise": 1}, 422, "surprise"),
    ):
        r = await http.post(url, json=body)
        assert r.status_code == status, r.text
        assert needle in r.json()["error"]["message"]


async def test_a_payload_within_the_limit_passes_however_it_was_escaped(
    gateway: GatewayProcess, http: httpx.AsyncClient, served: str
) -> None:
    """Python's json.dumps escapes every 'é' as six bytes: the body is three times the payload
    as sent, and still accepted (before: a 413 for a payload within the limit)."""
    capability = served
    raw = json.dumps(
        {"target": capability, "operation": "query", "payload": {"text": "\u00e9" * 500_000}}
    ).encode()
    assert len(raw) > 3_000_000
    r = await http.post(f"{gateway.url}/reach/invoke", content=raw, headers=JSON)
    assert r.status_code == 200, r.text


async def test_an_error_never_echoes_an_invalid_request_id(
    gateway: GatewayProcess, http: httpx.AsyncClient
) -> None:
    r = await http.get(f"{gateway.url}/reach/requests/{'x' * 300}")
    assert r.status_code == 422
    assert r.json()["request_id"] is None
    r = await http.post(f"{gateway.url}/reach/requests/%C3%A9/result", json={"status": "success"})
    assert r.status_code == 422
    assert r.json()["request_id"] is None


async def test_the_idempotency_key_header_is_the_body_field(
    gateway: GatewayProcess, http: httpx.AsyncClient, served: str
) -> None:
    capability = served
    url = f"{gateway.url}/reach/invoke"
    body = {"target": capability, "operation": "create", "payload": {"note": "n"}}
    r = await http.post(url, json=body, headers={"Idempotency-Key": "order-7"})
    assert r.status_code == 200, r.text
    r = await http.post(
        url, json={**body, "idempotency_key": "order-8"}, headers={"Idempotency-Key": "order-7"}
    )
    assert r.status_code == 422
    assert "differ" in r.json()["error"]["message"]
    r = await http.post(url, json=body, headers={"Idempotency-Key": "caf\u00e9".encode()})
    assert r.status_code == 422
    assert "Idempotency-Key" in r.json()["error"]["message"]


async def test_an_idle_connection_outlives_the_clients_own_idle_timeout(
    gateway: GatewayProcess,
) -> None:
    """Clients close an idle pooled connection first (httpx after 5 s, aiohttp after 15 s):
    had the gateway closed it at 5 s, one reusing it just then would fail to send."""
    host, port = gateway.url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    request = f"GET /readyz HTTP/1.1\r\nHost: {host}\r\n\r\n".encode()
    try:
        for pause in (0.0, 6.0):
            await asyncio.sleep(pause)
            writer.write(request)
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
            assert head.startswith(b"HTTP/1.1 200 "), head
            length = next(
                int(line.split(b":")[1])
                for line in head.split(b"\r\n")
                if line.lower().startswith(b"content-length:")
            )
            await reader.readexactly(length)
    finally:
        writer.close()
