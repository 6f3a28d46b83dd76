"""The agent SDK over real sockets: RequestID in logs, re-delivery, deadlines, both run modes."""

from __future__ import annotations

import asyncio
import logging
import socket
import time
import uuid
from pathlib import Path
from typing import Any

import httpx
import pytest

from agent_reach_sdk import AgentRuntime, OperationError, RequestContext
from tests.helpers import Agent, CallbackReceiver, GatewayProcess, wait_until

pytestmark = pytest.mark.integration


TRACEPARENT = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"


class Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


def make_runtime(gateway: GatewayProcess, capability: str) -> tuple[AgentRuntime, list[str]]:
    runtime = AgentRuntime(
        capability,
        reach_address=gateway.url,
        instance_id=f"{capability}-sdk",
        protocol="http",
        service_address="127.0.0.1:0",
        heartbeat_interval=0.5,
    )
    executed: list[str] = []
    agent_log = logging.getLogger("test.agent")

    @runtime.operation("query")
    async def query(payload: dict[str, Any], ctx: RequestContext) -> dict[str, Any]:
        executed.append(ctx.request_id)
        agent_log.warning("serving %s", payload.get("text"))
        await asyncio.sleep(float(payload.get("sleep", 0)))
        return {
            "echo": payload.get("text"),
            "caller": ctx.caller,
            "traceparent": ctx.headers.get("traceparent"),
        }

    @runtime.operation("refuse")
    def refuse(payload: dict[str, Any]) -> dict[str, Any]:
        raise OperationError("not today", type="agent_error", status=422)

    return runtime, executed


async def test_request_id_is_on_the_agents_own_log_records(
    gateway: GatewayProcess, http: httpx.AsyncClient, capability: str
) -> None:
    handler = Records()
    logging.getLogger("test.agent").addHandler(handler)
    runtime, _ = make_runtime(gateway, capability)
    try:
        async with runtime:
            rid = f"req-{uuid.uuid4().hex}"
            r = await http.post(
                f"{gateway.url}/reach/invoke",
                headers={"X-Reach-Caller": "orchestrator", "traceparent": TRACEPARENT},
                json={
                    "request_id": rid,
                    "target": capability,
                    "operation": "query",
                    "payload": {"text": "hi"},
                },
            )
            assert r.status_code == 200, r.text
            # The caller's identity and trace context reach the agent unchanged.
            assert r.json()["result"] == {
                "echo": "hi",
                "caller": "orchestrator",
                "traceparent": TRACEPARENT,
            }
    finally:
        logging.getLogger("test.agent").removeHandler(handler)
    served = [rec for rec in handler.records if rec.getMessage() == "serving hi"]
    assert [rec.request_id for rec in served] == [rid]  # type: ignore[attr-defined]


async def test_redelivered_request_is_answered_without_running_again(
    gateway: GatewayProcess, capability: str
) -> None:
    runtime, executed = make_runtime(gateway, capability)
    async with runtime, httpx.AsyncClient(base_url=f"http://{runtime.service_address}") as agent:
        headers = {"X-Reach-Request-Id": "req-dup-1"}
        first, second = await asyncio.gather(
            agent.post("/reach/query", json={"text": "a", "sleep": 0.2}, headers=headers),
            agent.post("/reach/query", json={"text": "a", "sleep": 0.2}, headers=headers),
        )
        third = await agent.post("/reach/query", json={"text": "a"}, headers=headers)
        assert first.json() == second.json() == third.json()
        assert executed == ["req-dup-1"]
        # An operation error is answered, typed, and not remembered as a result.
        bad = await agent.post("/reach/refuse", json={}, headers={"X-Reach-Request-Id": "r2"})
        assert bad.status_code == 422
        assert bad.json()["error"] == {"type": "agent_error", "message": "not today"}
        missing = await agent.post("/reach/nothing", json={})
        assert missing.status_code == 404


async def test_deadline_is_enforced_by_the_agent(gateway: GatewayProcess, capability: str) -> None:
    runtime, executed = make_runtime(gateway, capability)
    async with runtime, httpx.AsyncClient(base_url=f"http://{runtime.service_address}") as agent:
        past = str(int(time.time() * 1000) - 1)
        r = await agent.post(
            "/reach/query",
            json={"text": "late"},
            headers={"X-Reach-Request-Id": "r-past", "X-Reach-Deadline-Ms": past},
        )
        assert r.status_code == 504
        assert executed == []
        soon = str(int(time.time() * 1000) + 200)
        r = await agent.post(
            "/reach/query",
            json={"text": "slow", "sleep": 2},
            headers={"X-Reach-Request-Id": "r-soon", "X-Reach-Deadline-Ms": soon},
        )
        assert r.status_code == 504
        assert r.json()["error"]["type"] == "timeout"


async def test_start_and_stop_for_plain_scripts(
    gateway: GatewayProcess, http: httpx.AsyncClient, capability: str
) -> None:
    runtime, _ = make_runtime(gateway, capability)
    await asyncio.to_thread(runtime.start)
    try:
        assert runtime.wait_joined(5)
        assert runtime.ack is not None
        assert runtime.ack["heartbeat_timeout"] == gateway.stack.heartbeat_timeout

        async def registered() -> bool:
            r = await http.get(f"{gateway.url}/reach/capabilities/{capability}")
            return r.status_code == 200 and len(r.json()["instances"]) == 1

        await wait_until(registered, 5)
    finally:
        await asyncio.to_thread(runtime.stop)
    r = await http.get(f"{gateway.url}/reach/capabilities/{capability}")
    assert r.json()["instances"] == []  # stop() leaves


def test_unsupported_protocol_is_refused_up_front() -> None:
    with pytest.raises(ValueError, match="known: grpc, http, mqtt, websocket"):
        AgentRuntime("c", protocol="carrier-pigeon")


def test_instance_ids_default_to_unique_names() -> None:
    first, second = AgentRuntime("retriever"), AgentRuntime("retriever")
    assert first.instance_id.startswith(f"retriever-{socket.gethostname().split('.')[0].lower()}")
    assert first.instance_id != second.instance_id


async def test_late_answer_after_the_agent_crashed_and_restarted(
    gateway: GatewayProcess, http: httpx.AsyncClient, capability: str, tmp_path: Path
) -> None:
    """R3: the agent accepted (202), died, and a new process answers with the kept RequestID."""
    ledger = tmp_path / "ledger.txt"
    agent = await Agent(
        gateway,
        f"{capability}-01",
        capability,
        "--defer",
        "--delay-ms",
        "60000",
        "--ledger",
        str(ledger),
    ).ready()
    async with CallbackReceiver() as receiver:
        r = await http.post(
            f"{gateway.url}/reach/invoke",
            json={
                "target": capability,
                "operation": "query",
                "timeout_ms": 30_000,
                "callback": receiver.url,
            },
        )
        rid = r.json()["request_id"]

        async def accepted() -> bool:
            return ledger.exists() and rid in ledger.read_text()

        await wait_until(accepted, 10)
        agent.proc.kill()
        restarted = AgentRuntime(
            capability, reach_address=gateway.url, instance_id=agent.instance_id
        )  # never started
        await restarted.send_result(rid, {"answer": "after restart"})
        await receiver.wait(1)
        assert receiver.received[0][1]["status"] == "success"
        assert receiver.received[0][1]["result"] == {"answer": "after restart"}
