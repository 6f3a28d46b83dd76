"""The invoke suite on every protocol: real gateway, real agent processes, real broker (R1, R4).

The same demo agent serves over HTTP, gRPC, WebSocket and MQTT (one `--protocol` flag); the
caller's requests and the answers it gets are the same whichever protocol the agent speaks.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import signal
import sys
import time
import uuid
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest

from connectors import ConnectorSet
from reach.invocation import Endpoint
from reach.messages import Header, Message
from tests.conftest import new_stack
from tests.helpers import (
    ROOT,
    Agent,
    CallbackReceiver,
    GatewayProcess,
    free_port,
    spawn,
    wait_until,
)

pytestmark = pytest.mark.integration

PROTOCOLS = ["http", "grpc", "websocket", "mqtt"]


@pytest.fixture(params=PROTOCOLS)
def protocol(request: pytest.FixtureRequest) -> str:
    value: str = request.param
    return value


def body(capability: str, **extra: object) -> dict[str, object]:
    return {
        "target": capability,
        "operation": "query",
        "payload": {"text": "durable retries", "top_k": 2},
        "timeout_ms": 5000,
        **extra,
    }


async def agent(
    gateway: GatewayProcess, capability: str, protocol: str, *flags: str, name: str | None = None
) -> Agent:
    instance_id = name or f"{capability}-{protocol}-{uuid.uuid4().hex[:4]}"
    return await Agent(gateway, instance_id, capability, "--protocol", protocol, *flags).ready()


async def instances(http: httpx.AsyncClient, gateway: GatewayProcess, capability: str) -> Any:
    r = await http.get(f"{gateway.url}/reach/capabilities/{capability}")
    assert r.status_code == 200, r.text
    return r.json()


async def test_sync_invoke(
    gateway: GatewayProcess, http: httpx.AsyncClient, capability: str, protocol: str
) -> None:
    a = await agent(gateway, capability, protocol)
    r = await http.post(f"{gateway.url}/reach/invoke", json=body(capability))
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["status"] == "success"
    assert out["instance_id"] == a.instance_id
    assert out["result"]["request_id"] == out["request_id"]
    assert len(out["result"]["passages"]) == 2
    (record,) = (await instances(http, gateway, capability))["instances"]
    assert record["protocol"] == protocol
    # The RequestID is on the agent's own log records, whatever the protocol (R24).
    await until(
        lambda: f"[{out['request_id']}] knowledge_retriever: query from" in a.proc.output(), 5
    )


async def test_async_invoke_delivers_the_callback(
    gateway: GatewayProcess, http: httpx.AsyncClient, capability: str, protocol: str
) -> None:
    await agent(gateway, capability, protocol)
    async with CallbackReceiver() as receiver:
        r = await http.post(
            f"{gateway.url}/reach/invoke", json=body(capability, callback=receiver.url)
        )
        assert r.status_code == 202, r.text
        await receiver.wait(1)
    (_headers, envelope) = receiver.received[0]
    assert envelope["status"] == "success"
    assert envelope["request_id"] == r.json()["request_id"]
    assert envelope["result"]["passages"]


async def test_deadline_is_a_504_on_time(
    gateway: GatewayProcess, http: httpx.AsyncClient, capability: str, protocol: str
) -> None:
    await agent(gateway, capability, protocol, "--delay-ms", "10000")
    started = time.monotonic()
    r = await http.post(f"{gateway.url}/reach/invoke", json=body(capability, timeout_ms=800))
    took = time.monotonic() - started
    assert r.status_code == 504, r.text
    assert r.json()["error"]["type"] == "timeout"
    assert took < 6.0, took  # the 800 ms deadline, not the agent's 10 s


async def test_the_agents_own_error_is_a_502_carrying_its_words(
    gateway: GatewayProcess, http: httpx.AsyncClient, capability: str, protocol: str
) -> None:
    await agent(gateway, capability, protocol)
    r = await http.post(
        f"{gateway.url}/reach/invoke",
        json=body(capability, operation="fail", payload={"message": "no index today"}),
    )
    assert r.status_code == 502, r.text
    error = r.json()["error"]
    assert error["type"] == "agent_error"
    assert error["retryable"] is False
    assert error["agent"]["type"] == "index_unavailable"
    assert "no index today" in error["agent"]["message"]


async def test_an_operation_not_served_is_a_502(
    gateway: GatewayProcess, http: httpx.AsyncClient, capability: str, protocol: str
) -> None:
    await agent(gateway, capability, protocol)
    r = await http.post(
        f"{gateway.url}/reach/invoke", json=body(capability, operation="delete_index")
    )
    assert r.status_code == 502, r.text
    assert r.json()["error"]["type"] == "agent_error"
    assert r.json()["error"]["retryable"] is False


async def test_a_late_answer_completes_the_request(
    gateway: GatewayProcess, http: httpx.AsyncClient, capability: str, protocol: str
) -> None:
    await agent(gateway, capability, protocol, "--defer", "--delay-ms", "300")
    r = await http.post(f"{gateway.url}/reach/invoke", json=body(capability))
    assert r.status_code == 200, r.text
    assert r.json()["status"] == "success"
    assert r.json()["result"]["passages"]


async def test_a_redelivered_request_runs_once(
    gateway: GatewayProcess, http: httpx.AsyncClient, capability: str, protocol: str, tmp_path: Path
) -> None:
    """Activities run at least once: the same RequestID sent twice executes once."""
    ledger = tmp_path / "ledger"
    await agent(gateway, capability, protocol, "--ledger", str(ledger))
    (record,) = (await instances(http, gateway, capability))["instances"]
    endpoint = Endpoint(
        instance_id=record["instance_id"],
        capability=capability,
        protocol=record["protocol"],
        address=record["address"],
        max_message_bytes=record["max_message_bytes"],
    )
    header = Header(
        request_id=f"redelivered-{uuid.uuid4().hex[:8]}",
        caller="tester",
        target=capability,
        operation="create",
        deadline_ms=int(time.time() * 1000) + 10_000,
    )
    message = Message(header=header, payload={"note": "once"})
    connectors = ConnectorSet()
    try:
        conn = connectors.get(protocol)
        first = await conn.invoke(endpoint, message, 5)
        again = await conn.invoke(endpoint, message.model_copy(deep=True), 5)
    finally:
        await connectors.aclose()
    assert first.result is not None
    assert first.result == again.result
    assert ledger.read_text().split() == [header.request_id, record["instance_id"]]


async def test_one_capability_on_every_protocol_looks_the_same_to_the_caller(
    gateway: GatewayProcess, http: httpx.AsyncClient, capability: str
) -> None:
    agents = await asyncio.gather(*(agent(gateway, capability, p) for p in PROTOCOLS))
    seen: Counter[str] = Counter()
    shapes = set()
    for _ in range(2 * len(agents)):
        r = await http.post(f"{gateway.url}/reach/invoke", json=body(capability))
        assert r.status_code == 200, r.text
        out = r.json()
        seen[out["instance_id"]] += 1
        shapes.add((tuple(sorted(out)), tuple(sorted(out["result"]))))
    assert seen == {a.instance_id: 2 for a in agents}  # round robin reached every protocol
    assert len(shapes) == 1  # and nothing in an answer tells them apart
    detail = await instances(http, gateway, capability)
    assert {i["protocol"] for i in detail["instances"]} == set(PROTOCOLS)
    for p in PROTOCOLS:
        counts = detail["connections"][p]
        assert counts["opened"] + counts["reused"] == 2, detail["connections"]
        if p != "mqtt":  # one MQTT client per broker, likely opened for an earlier capability
            assert counts["opened"] == 1, detail["connections"]


async def test_a_payload_over_the_smallest_negotiated_limit_is_refused_before_sending(
    gateway: GatewayProcess, http: httpx.AsyncClient, capability: str, protocol: str, tmp_path: Path
) -> None:
    ledger = tmp_path / "ledger"
    await agent(gateway, capability, protocol, "--ledger", str(ledger))
    await agent(gateway, capability, "http", "--max-message-bytes", "4096", "--ledger", str(ledger))
    payload = {"text": "x" * 5000}
    r = await http.post(f"{gateway.url}/reach/invoke", json=body(capability, payload=payload))
    assert r.status_code == 413, r.text
    message = r.json()["error"]["message"]
    assert r.json()["error"]["type"] == "payload_too_large"
    assert "5011 bytes" in message
    assert "at most 4096" in message
    assert not ledger.exists()  # nothing was sent to either instance


async def test_websocket_agent_killed_mid_request_fails_fast_and_the_retry_goes_elsewhere(
    gateway: GatewayProcess, http: httpx.AsyncClient, capability: str, tmp_path: Path
) -> None:
    ledger = tmp_path / "ledger"
    port = free_port()
    flags = ("--delay-ms", "1500", "--ledger", str(ledger))
    victim, other = await asyncio.gather(
        agent(gateway, capability, "websocket", *flags, "--port", str(port)),
        agent(gateway, capability, "websocket", *flags),
    )

    async def invoke() -> httpx.Response:
        return await http.post(
            f"{gateway.url}/reach/invoke", json=body(capability, timeout_ms=30000)
        )

    # Two requests, one per instance (round robin); kill the victim while both are in flight.
    calls = [asyncio.create_task(invoke()) for _ in range(2)]
    await until(lambda: ledger.exists() and len(ledger.read_text().splitlines()) == 2, 10)
    killed_at = time.monotonic()
    victim.proc.kill()
    results = await asyncio.gather(*calls)
    assert all(r.status_code == 200 for r in results), [r.text for r in results]
    assert {r.json()["instance_id"] for r in results} == {other.instance_id}
    # Failed at once and retried after the 1 s backoff: nowhere near the 30 s deadline.
    assert time.monotonic() - killed_at < 10.0
    # The same instance comes back on the same port: the gateway's connector reconnects.
    await agent(gateway, capability, "websocket", "--port", str(port), name=victim.instance_id)
    seen = set()
    for _ in range(4):
        r = await invoke()
        assert r.status_code == 200, r.text
        seen.add(r.json()["instance_id"])
    assert victim.instance_id in seen
    counts = (await instances(http, gateway, capability))["connections"]["websocket"]
    assert counts["failed"] >= 1, counts


async def test_mqtt_survives_a_broker_restart(
    gateway: GatewayProcess, http: httpx.AsyncClient, capability: str, tmp_path: Path
) -> None:
    async with Broker(tmp_path) as broker:
        await agent(gateway, capability, "mqtt", "--broker", broker.address)
        r = await http.post(f"{gateway.url}/reach/invoke", json=body(capability))
        assert r.status_code == 200, r.text
        await broker.restart()
        r = await http.post(f"{gateway.url}/reach/invoke", json=body(capability, timeout_ms=15000))
        assert r.status_code == 200, r.text
        assert r.json()["status"] == "success"


# An MQTT agent holds no connection of Reach's: both talk to the broker.
@pytest.mark.parametrize("protocol", ["http", "grpc", "websocket"])
async def test_leaving_closes_the_connection(
    gateway: GatewayProcess, http: httpx.AsyncClient, capability: str, protocol: str
) -> None:
    a = await agent(gateway, capability, protocol)
    for _ in range(2):
        r = await http.post(f"{gateway.url}/reach/invoke", json=body(capability))
        assert r.status_code == 200, r.text
    before_address = str(await agent_address(http, gateway, capability, a.instance_id))
    assert established(port_of(before_address)) >= 1
    before = (await instances(http, gateway, capability))["connections"][protocol]
    assert before["reclaimed"] == 0
    a.proc.kill(signal.SIGSTOP)  # frozen: it cannot join again when it hears it is gone
    r = await http.delete(f"{gateway.url}/reach/agents/{a.instance_id}")
    assert r.status_code in (200, 204), r.text

    async def reclaimed() -> bool:
        detail = await instances(http, gateway, capability)
        return bool(detail["connections"][protocol]["reclaimed"] == 1)

    deadline = time.monotonic() + 5
    while not await reclaimed():
        assert time.monotonic() < deadline, "the connection was not closed after the leave"
        await asyncio.sleep(0.1)
    # And from the agent's side: no connection of the gateway's is left open to it.
    await until(lambda: established(port_of(before_address)) == 0, 5)


async def test_eviction_closes_the_connection(
    gateway: GatewayProcess, http: httpx.AsyncClient, capability: str
) -> None:
    """An instance that falls silent is evicted after heartbeat_timeout (3 s here), and the
    gateway's connection to it goes with it: no DELETE, no idle timeout involved."""
    a = await agent(gateway, capability, "websocket")
    r = await http.post(f"{gateway.url}/reach/invoke", json=body(capability))
    assert r.status_code == 200, r.text
    port = port_of(await agent_address(http, gateway, capability, a.instance_id))
    assert established(port) == 1
    a.proc.kill(signal.SIGSTOP)  # alive, connected, silent

    async def evicted_and_closed() -> bool:
        detail = await instances(http, gateway, capability)
        return detail["instances"] == [] and detail["connections"]["websocket"]["reclaimed"] == 1

    await wait_until(evicted_and_closed, 10)
    await until(lambda: established(port) == 0, 5)


async def test_idle_connections_are_closed_and_reopened(
    temporal_server: str, tmp_path: Path, http: httpx.AsyncClient, capability: str
) -> None:
    stack = new_stack(temporal_server, tmp_path, extra={"REACH_TRANSPORT__IDLE_TIMEOUT_S": "1"})
    gateway = await GatewayProcess(stack).ready()
    try:
        protocols = ["http", "grpc", "websocket"]
        agents = await asyncio.gather(*(agent(gateway, capability, p) for p in protocols))
        ports = {}
        for a in agents:
            ports[a.instance_id] = await agent_port(http, gateway, capability, a.instance_id)
        for _ in agents:
            r = await http.post(f"{gateway.url}/reach/invoke", json=body(capability))
            assert r.status_code == 200, r.text
        assert all(established(port) >= 1 for port in ports.values())
        # Seen from each agent: the gateway's connection goes away once idle past 1 s.
        await until(lambda: all(established(p) == 0 for p in ports.values()), 6)
        counts = (await instances(http, gateway, capability))["connections"]
        assert {p: counts[p]["reclaimed"] for p in protocols} == dict.fromkeys(protocols, 1)
        for _ in agents:  # and the next call opens a fresh one
            r = await http.post(f"{gateway.url}/reach/invoke", json=body(capability))
            assert r.status_code == 200, r.text
        counts = (await instances(http, gateway, capability))["connections"]
        assert {p: counts[p]["opened"] for p in protocols} == dict.fromkeys(protocols, 2)
    finally:
        gateway.proc.stop()


async def until(predicate: Callable[[], bool], timeout_s: float) -> None:
    async def holds() -> bool:
        return predicate()

    await wait_until(holds, timeout_s)


def port_of(address: str) -> int:
    match = re.search(r":(\d+)(?:/|$)", address)
    assert match, address
    return int(match.group(1))


async def agent_address(
    http: httpx.AsyncClient, gateway: GatewayProcess, capability: str, instance_id: str
) -> str:
    detail = await instances(http, gateway, capability)
    (record,) = [i for i in detail["instances"] if i["instance_id"] == instance_id]
    return str(record["address"])


async def agent_port(
    http: httpx.AsyncClient, gateway: GatewayProcess, capability: str, instance_id: str
) -> int:
    return port_of(await agent_address(http, gateway, capability, instance_id))


def established(port: int) -> int:
    """TCP connections in ESTABLISHED state whose local port is `port` (the agent's side)."""
    count = 0
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with contextlib.suppress(FileNotFoundError), open(table) as f:
            for line in f.readlines()[1:]:
                fields = line.split()
                local, state = fields[1], fields[3]
                if state == "01" and int(local.rsplit(":", 1)[1], 16) == port:
                    count += 1
    return count


async def test_a_stopping_agent_finishes_what_it_started(
    gateway: GatewayProcess, http: httpx.AsyncClient, capability: str, protocol: str, tmp_path: Path
) -> None:
    """SIGTERM: the agent leaves (no new traffic) and answers the request it is running."""
    ledger = tmp_path / "ledger"
    a = await agent(gateway, capability, protocol, "--delay-ms", "1500", "--ledger", str(ledger))
    call = asyncio.create_task(http.post(f"{gateway.url}/reach/invoke", json=body(capability)))
    await until(ledger.exists, 5)
    a.proc.kill(signal.SIGTERM)
    r = await call
    assert r.status_code == 200, r.text
    assert r.json()["instance_id"] == a.instance_id
    assert await asyncio.to_thread(a.proc.popen.wait, 10) == 0
    assert "left Reach" in a.proc.output()


STUCK_AGENT = """
import logging, sys, time
from agent_reach_sdk import AgentRuntime
runtime = AgentRuntime(sys.argv[1], protocol=sys.argv[2])
log = logging.getLogger("stuck")

@runtime.operation("block")
def block(payload):
    log.info("blocking")  # a plain handler's records carry the RequestID too
    time.sleep(600)

runtime.run()
"""


async def test_sigterm_stops_an_agent_whose_plain_handler_never_returns(
    gateway: GatewayProcess, http: httpx.AsyncClient, capability: str, tmp_path: Path
) -> None:
    script = tmp_path / "stuck_agent.py"
    script.write_text(STUCK_AGENT)
    proc = spawn(
        [sys.executable, str(script), capability, "http"],
        {"REACH_ADDRESS": gateway.url},
        tmp_path / "stuck.log",
    )

    async def joined() -> bool:
        r = await http.get(f"{gateway.url}/reach/capabilities/{capability}")
        return r.status_code == 200 and len(r.json()["instances"]) == 1

    await wait_until(joined, 20)
    rid = f"stuck-{uuid.uuid4().hex[:8]}"
    call = asyncio.create_task(
        http.post(
            f"{gateway.url}/reach/invoke",
            json={
                "request_id": rid,
                "target": capability,
                "operation": "block",
                "timeout_ms": 20000,
            },
        )
    )
    await until(lambda: f"[{rid}] blocking" in proc.output(), 10)
    assert "joined Reach" in proc.output()
    assert "HTTP Request:" not in proc.output()  # httpx's line per join and heartbeat
    proc.popen.send_signal(signal.SIGTERM)
    started = time.monotonic()
    code = await asyncio.to_thread(proc.popen.wait, 30)
    # Gone after the 5 s grace, not after the handler's 600 s.
    assert time.monotonic() - started < 15
    assert code == 0, proc.output()
    r = await call
    assert r.status_code in (502, 504), r.text


EXAMPLES = {
    "http": ("http_agent.py", "summarizer", "summarize", {"text": "Reach is durable. It retries."}),
    "grpc": ("grpc_agent.py", "intent-classifier", "classify", {"text": "can I get a refund?"}),
    "websocket": ("websocket_agent.py", "content-generator", "generate", {"topic": "routing"}),
    "mqtt": ("mqtt_agent.py", "translator", "translate", {"text": "hello world"}),
}
EXPECTED = {
    "http": {"summary": "Reach is durable."},
    "grpc": {"intent": "refund"},
    "websocket": {"text": "A short note on routing: reach them by name, never by address."},
    "mqtt": {"text": "bonjour monde", "to": "fr"},
}


async def test_each_protocols_example_runs_with_one_command_and_leaves_on_sigterm(
    gateway: GatewayProcess, http: httpx.AsyncClient, protocol: str, tmp_path: Path
) -> None:
    script, capability, operation, payload = EXAMPLES[protocol]
    proc = spawn(
        [sys.executable, str(ROOT / "examples" / script)],
        {"REACH_ADDRESS": gateway.url},
        tmp_path / "example.log",
    )

    async def joined() -> bool:
        r = await http.get(f"{gateway.url}/reach/capabilities/{capability}")
        return r.status_code == 200 and len(r.json()["instances"]) == 1

    await wait_until(joined, 20)
    r = await http.post(
        f"{gateway.url}/reach/invoke",
        json={"target": capability, "operation": operation, "payload": payload},
    )
    assert r.status_code == 200, r.text
    assert r.json()["result"] == EXPECTED[protocol]
    proc.popen.send_signal(signal.SIGTERM)
    assert await asyncio.to_thread(proc.popen.wait, 10) == 0, proc.output()
    assert "left Reach" in proc.output()
    r = await http.get(f"{gateway.url}/reach/capabilities/{capability}")
    assert r.json()["instances"] == []


async def test_the_readmes_smallest_agent_runs_as_written(
    gateway: GatewayProcess, http: httpx.AsyncClient, tmp_path: Path
) -> None:
    readme = (ROOT / "README.md").read_text()
    section = readme.split("## Write an agent", 1)[1]
    code = section.split("```python\n", 1)[1].split("```", 1)[0]
    assert len(code.strip().splitlines()) <= 8  # the bar: MCP's MCPServer takes about 5
    script = tmp_path / "smallest.py"
    script.write_text(code)
    proc = spawn([sys.executable, str(script)], {"REACH_ADDRESS": gateway.url}, tmp_path / "s.log")

    async def joined() -> bool:
        r = await http.get(f"{gateway.url}/reach/capabilities/echo")
        return r.status_code == 200 and len(r.json()["instances"]) == 1

    await wait_until(joined, 20)
    r = await http.post(
        f"{gateway.url}/reach/invoke",
        json={"target": "echo", "operation": "echo", "payload": {"hello": "reach"}},
    )
    assert r.status_code == 200, r.text
    assert r.json()["result"] == {"hello": "reach"}
    proc.popen.send_signal(signal.SIGTERM)
    assert await asyncio.to_thread(proc.popen.wait, 10) == 0, proc.output()


class Broker:
    """A Mosquitto of this test's own, on a free port (the machine's broker is left alone)."""

    def __init__(self, tmp: Path) -> None:
        self.port = free_port()
        self.address = f"127.0.0.1:{self.port}"
        self.conf = tmp / "mosquitto.conf"
        self.conf.write_text(f"listener {self.port} 127.0.0.1\nallow_anonymous true\n")
        self.proc: asyncio.subprocess.Process | None = None

    async def start(self) -> None:
        self.proc = await asyncio.create_subprocess_exec(
            "mosquitto",
            "-c",
            str(self.conf),
            stdout=asyncio.subprocess.DEVNULL,
            stderr=asyncio.subprocess.DEVNULL,
        )
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                _, writer = await asyncio.open_connection("127.0.0.1", self.port)
                writer.close()
                return
            except OSError:
                await asyncio.sleep(0.05)
        raise TimeoutError("mosquitto did not listen")

    async def stop(self) -> None:
        if self.proc is not None and self.proc.returncode is None:
            self.proc.send_signal(signal.SIGTERM)
            await self.proc.wait()

    async def restart(self) -> None:
        await self.stop()
        await asyncio.sleep(0.5)
        await self.start()

    async def __aenter__(self) -> Broker:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()


BY_URL_EXAMPLES = {
    "a2a": ("a2a_agent.py", "", "greet", {"name": "Ada"}, {"greeting": "Hello, Ada!"}),
    "mcp": ("mcp_server.py", "/mcp", "convert", {"value": 2, "unit": "km"}, None),
}


@pytest.mark.parametrize("kind", sorted(BY_URL_EXAMPLES))
async def test_each_example_registered_by_url_answers_an_invoke(
    gateway: GatewayProcess, http: httpx.AsyncClient, kind: str, tmp_path: Path
) -> None:
    """examples/a2a_agent.py and examples/mcp_server.py run as their docstrings say: started
    alone, registered by URL, invoked by capability name."""
    script, path, operation, payload, expected = BY_URL_EXAMPLES[kind]
    port = free_port()
    proc = spawn(
        [sys.executable, str(ROOT / "examples" / script), "--port", str(port)],
        {},
        tmp_path / "example.log",
    )
    capability = f"example-{kind}-{uuid.uuid4().hex[:6]}"
    registration = {
        "protocol": kind,
        "service_address": f"http://127.0.0.1:{port}{path}",
        "capability": capability,
    }

    async def registered() -> bool:
        r = await http.post(f"{gateway.url}/reach/agents", json=registration)
        return r.status_code in (200, 201)

    try:
        await wait_until(registered, 30)
        r = await http.post(
            f"{gateway.url}/reach/invoke",
            json={"target": capability, "operation": operation, "payload": payload},
        )
        assert r.status_code == 200, r.text
        result = r.json()["result"]
        if expected is not None:
            assert result == expected
        else:  # 2 km in every unit the server knows
            assert result["m"] == 2000.0
            assert result["km"] == 2.0
    finally:
        proc.popen.terminate()
        await asyncio.to_thread(proc.popen.wait, 10)
