"""The door's bounds against a real gateway (issue 25, "Unbounded at the door"): what one
connection may hold (slowloris), how many connections, how many bytes of invokes in flight, and
how many capabilities an agent token may create."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest

from reach.security.tokens import SharedTokenStore, issue
from reach.store.redis import RedisStore
from tests.conftest import new_stack
from tests.helpers import Agent, GatewayProcess, rid, wait_until

pytestmark = pytest.mark.integration

HEADER_S, BODY_S, KEEP_ALIVE_S = 1.0, 2.0, 2
INFLIGHT_BYTES = 1_500_000  # two ~700 KB invokes fit, a third does not
SLOW_MS = 3000  # the agent's answer: a second past the body deadline, never cut by it


@pytest.fixture(scope="module")
async def tight(
    temporal_server: str, tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[GatewayProcess]:
    """A gateway with short request deadlines and a small in-flight bound, and a slow agent."""
    stack = new_stack(
        temporal_server,
        tmp_path_factory.mktemp("tight"),
        extra={
            "REACH_TRANSPORT__HTTP_HEADER_TIMEOUT_S": str(HEADER_S),
            "REACH_TRANSPORT__HTTP_BODY_TIMEOUT_S": str(BODY_S),
            "REACH_TRANSPORT__HTTP_KEEP_ALIVE_S": str(KEEP_ALIVE_S),
            "REACH_TRANSPORT__MAX_INFLIGHT_BYTES": str(INFLIGHT_BYTES),
            # The whole bound, one caller (anonymous) filling it: shares are test_door_held's.
            "REACH_TRANSPORT__CALLER_INFLIGHT_SHARE": "1",
        },
    )
    async with GatewayProcess(stack) as gw:
        # Started here, not per test: it lives as long as the module's gateway.
        agent = Agent(gw, "slow-01", "slow", "--delay-ms", str(SLOW_MS))
        await agent.ready()
        yield gw
        agent.proc.stop()


async def _connect(gw: GatewayProcess) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    return await asyncio.open_connection("127.0.0.1", gw.port)


async def _until_closed(reader: asyncio.StreamReader, within_s: float) -> bytes:
    """Everything the server sends until it closes the connection; fails past `within_s`."""
    got = b""
    deadline = time.monotonic() + within_s
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            pytest.fail(f"the gateway still holds the connection after {within_s}s: {got!r}")
        try:
            chunk = await asyncio.wait_for(reader.read(65536), left)
        except TimeoutError:
            continue
        except ConnectionResetError:
            return got
        if not chunk:
            return got
        got += chunk


def _invoke_head(gw: GatewayProcess, length: int) -> bytes:
    return (
        f"POST /reach/invoke HTTP/1.1\r\nhost: 127.0.0.1:{gw.port}\r\n"
        f"content-type: application/json\r\ncontent-length: {length}\r\n\r\n"
    ).encode()


async def _one_response(reader: asyncio.StreamReader) -> bytes:
    """One whole response (its head and its Content-Length of body), however it is split."""
    head = await reader.readuntil(b"\r\n\r\n")
    length = 0
    for line in head.decode("latin-1").split("\r\n")[1:]:
        name, _, value = line.partition(":")
        if name.strip().lower() == "content-length":
            length = int(value)
    return head + await reader.readexactly(length)


def _status_and_body(raw: bytes) -> tuple[int, dict[str, str], dict[str, object]]:
    head, _, body = raw.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = dict(line.lower().split(": ", 1) for line in lines[1:])
    return int(lines[0].split()[1]), headers, json.loads(body) if body else {}


async def test_a_connection_that_sends_nothing_is_closed(tight: GatewayProcess) -> None:
    connections = [await _connect(tight) for _ in range(20)]
    started = time.monotonic()
    for reader, _ in connections:
        assert await _until_closed(reader, within_s=HEADER_S + 5) == b""  # quietly, as idle
    assert time.monotonic() - started >= HEADER_S * 0.8
    for _, writer in connections:
        writer.close()


async def test_trickled_headers_are_answered_408_and_closed(tight: GatewayProcess) -> None:
    reader, writer = await _connect(tight)
    head = _invoke_head(tight, 2)
    sent = 0

    async def trickle() -> None:
        nonlocal sent
        for byte in head[:-4]:  # never the blank line that ends the headers
            writer.write(bytes([byte]))
            sent += 1
            await asyncio.sleep(0.05)

    task = asyncio.create_task(trickle())
    try:
        raw = await _until_closed(reader, within_s=HEADER_S + 5)
    finally:
        task.cancel()
        writer.close()
    status, headers, body = _status_and_body(raw)
    assert status == 408
    assert headers["connection"] == "close"
    assert "transport.http_header_timeout_s" in str(body["error"])
    assert sent < len(head) - 4  # cut while it still trickled


async def test_a_trickled_body_is_cut_and_nothing_is_started(
    tight: GatewayProcess, http: httpx.AsyncClient
) -> None:
    request_id = rid()
    body = json.dumps(
        {"target": "slow", "operation": "query", "payload": {}, "request_id": request_id}
    ).encode()
    reader, writer = await _connect(tight)
    writer.write(_invoke_head(tight, len(body)))

    async def trickle() -> None:
        for byte in body[:-1]:
            writer.write(bytes([byte]))
            await asyncio.sleep(0.1)

    task = asyncio.create_task(trickle())
    started = time.monotonic()
    try:
        await _until_closed(reader, within_s=BODY_S + 5)
    finally:
        task.cancel()
        writer.close()
    assert time.monotonic() - started < BODY_S + 5
    r = await http.get(f"{tight.url}/reach/requests/{request_id}")
    assert r.status_code == 404, r.text


async def test_an_idle_keep_alive_connection_is_closed_and_a_slow_answer_is_not_cut(
    tight: GatewayProcess,
) -> None:
    reader, writer = await _connect(tight)
    body = json.dumps(
        {"target": "slow", "operation": "query", "payload": {}, "timeout_ms": 30_000}
    ).encode()
    writer.write(_invoke_head(tight, len(body)) + body)
    started = time.monotonic()
    raw = await _until_closed(reader, within_s=SLOW_MS / 1000 + KEEP_ALIVE_S + 10)
    writer.close()
    status, _, answer = _status_and_body(raw)
    assert status == 200, answer  # served past the body deadline: it runs once the body is in
    assert answer["status"] == "success"
    assert time.monotonic() - started >= SLOW_MS / 1000 + KEEP_ALIVE_S * 0.8


def _big(size: int, request_id: str | None = None) -> bytes:
    fields: dict[str, object] = {
        "target": "slow",
        "operation": "query",
        "payload": {"text": "word " * (size // 5)},
        "timeout_ms": 30_000,
    }
    if request_id:
        fields["request_id"] = request_id
    return json.dumps(fields).encode()


async def _started(http: httpx.AsyncClient, gw: GatewayProcess, ids: list[str]) -> bool:
    for request_id in ids:
        if (await http.get(f"{gw.url}/reach/requests/{request_id}")).status_code == 404:
            return False
    return True


async def test_past_the_inflight_bound_an_invoke_is_refused_before_its_body_is_read(
    tight: GatewayProcess, http: httpx.AsyncClient
) -> None:
    ids = [rid(), rid()]
    first = [
        asyncio.create_task(
            http.post(f"{tight.url}/reach/invoke", content=_big(700_000, i), timeout=30)
        )
        for i in ids
    ]
    await wait_until(lambda: _started(http, tight, ids), timeout_s=10)
    # Both hold their room until answered; a third is refused on its headers alone.
    reader, writer = await _connect(tight)
    writer.write(_invoke_head(tight, 700_000))  # no body is ever sent
    raw = await asyncio.wait_for(_one_response(reader), 5)
    writer.close()
    status, headers, body = _status_and_body(raw)
    assert status == 503, raw
    error = body["error"]
    assert isinstance(error, dict)
    assert error["type"] == "unavailable"
    assert error["retryable"] is True
    assert "transport.max_inflight_bytes" in error["message"]
    assert headers["retry-after"] == "1"
    assert body["request_id"] is None  # never read, never named, never started

    refused_id = rid()
    r = await http.post(f"{tight.url}/reach/invoke", content=_big(700_000, refused_id), timeout=30)
    assert r.status_code == 503, r.text
    assert r.headers["retry-after"] == "1"
    for done in await asyncio.gather(*first):
        assert done.status_code == 200, done.text
    missing = await http.get(f"{tight.url}/reach/requests/{refused_id}")
    assert missing.status_code == 404  # not started
    again = await http.post(f"{tight.url}/reach/invoke", content=_big(700_000), timeout=30)
    assert again.status_code == 200, again.text  # the room came back


async def test_past_max_connections_a_request_is_answered_503(
    temporal_server: str, tmp_path: Path, http: httpx.AsyncClient
) -> None:
    stack = new_stack(
        temporal_server,
        tmp_path,
        extra={
            "REACH_TRANSPORT__MAX_CONNECTIONS": "4",
            "REACH_TRANSPORT__HTTP_HEADER_TIMEOUT_S": "60",
        },
    )
    async with GatewayProcess(stack) as gw:
        # Four held (with any the readiness probe left): the fifth is past the cap.
        held = [await _connect(gw) for _ in range(4)]
        reader, writer = await _connect(gw)
        writer.write(f"GET /healthz HTTP/1.1\r\nhost: 127.0.0.1:{gw.port}\r\n\r\n".encode())
        raw = await _until_closed(reader, within_s=10)
        writer.close()
        status, headers, body = _status_and_body(raw)
        assert status == 503
        assert headers["retry-after"] == "1"
        assert headers["connection"] == "close"
        error = body["error"]
        assert isinstance(error, dict)
        assert error["type"] == "unavailable"
        assert "transport.max_connections" in error["message"]
        for _, w in held:
            w.close()
        deadline = time.monotonic() + 10
        while True:  # the cap frees as the held connections close
            r = await http.get(f"{gw.url}/healthz")
            if r.status_code == 200:
                break
            assert time.monotonic() < deadline, r.text
            await asyncio.sleep(0.1)


async def test_an_agent_token_may_create_only_so_many_capabilities(
    temporal_server: str, tmp_path: Path, redis_url: str, redis_prefix: str
) -> None:
    tokens = {}
    async with RedisStore.from_url(redis_url, redis_prefix) as store:
        for name, kind in (("minter", "agent"), ("other", "agent"), ("ops", "admin")):
            token, record = issue(name, kind, ["*"] if kind == "agent" else [])  # type: ignore[arg-type]
            await SharedTokenStore(store).save(record)
            tokens[name] = token
    stack = new_stack(
        temporal_server,
        tmp_path,
        registry="redis",
        key_prefix=redis_prefix,
        extra={
            "REACH_REGISTRY__REDIS_URL": redis_url,
            "REACH_REGISTRY__MAX_CAPABILITIES": "3",
            "REACH_REGISTRY__NEW_CAPABILITIES_PER_MINUTE": "2",
        },
    )
    async with GatewayProcess(stack) as gw, httpx.AsyncClient(trust_env=False) as http:

        async def join(who: str, capability: str, instance: str) -> httpx.Response:
            return await http.post(
                f"{gw.url}/reach/agents",
                json={
                    "capability": capability,
                    "instance_id": instance,
                    "service_address": "127.0.0.1:1",
                    "operations": ["query"],
                },
                headers={"Authorization": f"Bearer {tokens[who]}"},
            )

        # The per-minute count is per clock minute: not across one's turn.
        await wait_until(lambda: time.time() % 60 < 50, timeout_s=15, every_s=0.5)
        for n in (1, 2):
            r = await join("minter", f"minted-{n}", f"minted-{n}-a")
            assert r.status_code == 200, r.text
        r = await join("minter", "minted-3", "minted-3-a")
        assert r.status_code == 429, r.text
        assert "registry.new_capabilities_per_minute" in r.json()["error"]["message"]
        assert int(r.headers["retry-after"]) >= 1
        # A new instance of a capability that exists is no new capability.
        r = await join("minter", "minted-1", "minted-1-b")
        assert r.status_code == 200, r.text
        r = await join("other", "minted-3", "minted-3-a")
        assert r.status_code == 200, r.text  # another principal, its own count
        r = await join("other", "minted-4", "minted-4-a")
        assert r.status_code == 503, r.text  # three held: the registry's most
        assert "registry.max_capabilities" in r.json()["error"]["message"]
        assert "retry-after" in r.headers
        listed = await http.get(
            f"{gw.url}/reach/capabilities", headers={"Authorization": f"Bearer {tokens['ops']}"}
        )
        assert listed.status_code == 200, listed.text
        names = {c["name"] for c in listed.json()["capabilities"]}
        assert names == {"minted-1", "minted-2", "minted-3"}
