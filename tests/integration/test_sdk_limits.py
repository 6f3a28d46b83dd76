"""The agent SDK's bounds over real sockets, against a stand-in Reach that negotiates limits."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest

from agent_reach_sdk import AgentRuntime, OperationError, RequestContext
from agent_reach_sdk.wire import Answer, Inbound
from connectors.http import HttpConnector
from gateway_api.devserver import free_port
from reach.errors import AgentError
from reach.invocation import Endpoint
from reach.limits import DEFAULT_MAX_MESSAGE_BYTES
from reach.messages import Header, Message, dumps, json_size
from tests.helpers import path_server

pytestmark = pytest.mark.integration

NEGOTIATED = 8 * 1024


class StandInReach:
    """Answers Join with an ack lowering max_message_bytes, and records late answers as sent."""

    def __init__(self, max_message_bytes: int = NEGOTIATED) -> None:
        self.max_message_bytes = max_message_bytes
        self.late: list[Inbound] = []
        self.server = path_server(self._handle, 1 << 24)

    async def _handle(self, request: Inbound) -> Answer:
        if request.operation == "/reach/agents":
            ack = {"heartbeat_interval": 60, "max_message_bytes": self.max_message_bytes}
            return Answer(200, ack)
        if request.operation.endswith("/result"):
            self.late.append(request)
        return Answer(200, {})

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.server.port}"


@pytest.fixture
async def reach() -> AsyncIterator[StandInReach]:
    stand_in = StandInReach()
    await stand_in.server.start()
    try:
        yield stand_in
    finally:
        await stand_in.server.close()


def make_runtime(reach: StandInReach, **kw: Any) -> AgentRuntime:
    runtime = AgentRuntime(
        "cap", reach_address=reach.address, instance_id="sdk-1", heartbeat_interval=60, **kw
    )

    @runtime.operation("sized")
    def sized(payload: dict[str, Any]) -> dict[str, Any]:
        # A result of exactly `size` bytes as sent, in characters of `char`.
        char = str(payload.get("char", "x"))
        filler = len(char.encode())
        return {"pad": char * ((int(payload["size"]) - len('{"pad":""}')) // filler)}

    @runtime.operation("opaque")
    def opaque(payload: dict[str, Any]) -> dict[str, Any]:
        return {"when": object() if payload.get("object") else float("nan")}

    @runtime.operation("echo")
    def echo(payload: dict[str, Any], ctx: RequestContext) -> dict[str, Any]:
        return {"attempt": ctx.attempt, "deadline_ms": ctx.deadline_ms}

    return runtime


@pytest.fixture
async def agent(reach: StandInReach) -> AsyncIterator[tuple[AgentRuntime, httpx.AsyncClient]]:
    runtime = make_runtime(reach)
    async with runtime, httpx.AsyncClient(base_url=f"http://{runtime.service_address}") as http:
        assert runtime.max_message_bytes == NEGOTIATED  # the ack's value, not the default
        yield runtime, http


def test_the_default_limit_is_reachs() -> None:
    assert (
        AgentRuntime("c", reach_address="127.0.0.1:1").max_message_bytes
        == DEFAULT_MAX_MESSAGE_BYTES
    )


async def test_the_duplicate_memory_stays_within_its_byte_budget(reach: StandInReach) -> None:
    runtime = make_runtime(reach, max_message_bytes=1 << 20, remember_bytes=64 * 1024)
    reach.max_message_bytes = 1 << 20
    async with runtime, httpx.AsyncClient(base_url=f"http://{runtime.service_address}") as http:

        async def call(rid: str, size: int) -> httpx.Response:
            headers = {"X-Reach-Request-Id": rid}
            r = await http.post("/reach/sized", json={"size": size}, headers=headers)
            assert r.status_code == 200
            return r

        for i in range(40):
            await call(f"r-{i}", 10_000)
            count, size = runtime.remembered
            assert size <= 64 * 1024
        assert count == 6  # 6 answers of 10 000 bytes fit in 64 KiB, 7 do not
        executed = runtime.executed
        latest = await call("r-39", 10_000)
        assert len(latest.content) == 10_000
        assert runtime.executed == executed  # answered from memory, not run again
        await call("r-0", 10_000)  # forgotten long ago: runs again
        assert runtime.executed == executed + 1
        # An answer bigger than the whole budget is not remembered, and pushes nothing out.
        before = runtime.remembered
        await call("huge", 100_000)
        assert runtime.remembered == before
        await call("huge", 100_000)
        assert runtime.executed == executed + 3


async def test_answers_are_sent_as_reach_measures_them(
    agent: tuple[AgentRuntime, httpx.AsyncClient],
) -> None:
    _, http = agent
    r = await http.post("/reach/sized", json={"size": 6000, "char": "語"})
    assert r.status_code == 200
    assert len(r.content) == json_size(r.json())
    assert len(r.content) > 6000 - 3  # UTF-8 as is: escaped it would be twice the limit


async def test_a_result_larger_than_negotiated_is_not_sent(
    agent: tuple[AgentRuntime, httpx.AsyncClient], caplog: pytest.LogCaptureFixture
) -> None:
    _, http = agent
    ok = await http.post("/reach/sized", json={"size": NEGOTIATED})
    assert ok.status_code == 200
    assert len(ok.content) == NEGOTIATED
    with caplog.at_level(logging.ERROR, logger="agent_reach_sdk"):
        r = await http.post("/reach/sized", json={"size": NEGOTIATED + 4000, "char": "é"})
    assert r.status_code == 500
    error = r.json()["error"]
    assert error["type"] == "result_too_large"
    assert error["message"].endswith(f"{NEGOTIATED + 4000} bytes > negotiated {NEGOTIATED}")
    assert any("not sent" in rec.getMessage() for rec in caplog.records)


async def test_the_connector_sees_a_too_large_result_as_the_agents_error(
    agent: tuple[AgentRuntime, httpx.AsyncClient],
) -> None:
    runtime, _ = agent
    ep = Endpoint(
        instance_id="sdk-1",
        capability="cap",
        protocol="http",
        address=runtime.service_address,
        max_message_bytes=NEGOTIATED,
    )
    header = Header(request_id="r-big", caller="t", target="cap", operation="sized")
    async with HttpConnector() as conn:
        with pytest.raises(AgentError) as err:
            await conn.invoke(ep, Message(header=header, payload={"size": NEGOTIATED + 1}), 5)
    assert err.value.fault is not None
    assert err.value.fault.type == "result_too_large"


async def test_a_result_that_is_not_json_is_an_error_answer(
    agent: tuple[AgentRuntime, httpx.AsyncClient],
) -> None:
    _, http = agent
    for payload in ({"object": True}, {}):  # not serializable; NaN is not standard JSON
        r = await http.post("/reach/opaque", json=payload)
        assert r.status_code == 500
        assert r.json()["error"]["type"] == "agent_error"
        assert "not standard JSON" in r.json()["error"]["message"]


@pytest.mark.parametrize(
    "headers",
    [
        {"X-Reach-Deadline-Ms": "soon"},
        {"X-Reach-Deadline-Ms": "1.5e12"},
        {"X-Reach-Attempt": "second"},
    ],
)
async def test_bad_reach_headers_are_a_400(
    agent: tuple[AgentRuntime, httpx.AsyncClient], headers: dict[str, str]
) -> None:
    runtime, http = agent
    r = await http.post("/reach/echo", json={}, headers=headers)
    assert r.status_code == 400
    assert r.json()["error"]["type"] == "invalid_request"
    assert runtime.executed == 0
    good = await http.post("/reach/echo", json={}, headers={"X-Reach-Attempt": "3"})
    assert good.json() == {"attempt": 3, "deadline_ms": None}


async def test_a_late_answer_is_checked_and_sent_as_reach_measures_it(
    agent: tuple[AgentRuntime, httpx.AsyncClient], reach: StandInReach
) -> None:
    runtime, _ = agent
    with pytest.raises(ValueError, match=rf"is 9\d{{3}} bytes > negotiated .* {NEGOTIATED}"):
        await runtime.send_result("r-late", {"text": "語" * 3000})
    assert reach.late == []
    result = {"text": "語" * 2000}
    await runtime.send_result("r-late", result)
    (sent,) = reach.late
    assert sent.operation == "/reach/requests/r-late/result"
    assert sent.body == dumps({"instance_id": "sdk-1", "status": "success", "result": result})


async def test_a_refused_join_leaves_nothing_bound() -> None:
    async def refuse(request: Inbound) -> Answer:
        return Answer(422, {"error": {"type": "invalid_request", "message": "no"}})

    stand_in = path_server(refuse)
    await stand_in.start()
    port = free_port()
    try:
        for _ in range(2):  # the second start finds the port free again
            runtime = AgentRuntime(
                "cap",
                reach_address=f"127.0.0.1:{stand_in.port}",
                service_address=f"127.0.0.1:{port}",
            )
            with pytest.raises(RuntimeError, match="refused the join"):
                await runtime.astart()
    finally:
        await stand_in.close()


def test_an_operation_error_status_says_retry_or_not() -> None:
    """Only 400-599 mean the same on every protocol (a 204 'error' means nothing anywhere)."""
    assert OperationError("x", status=503).status == 503
    for status in (100, 204, 302, 600):
        with pytest.raises(ValueError, match="400-599"):
            OperationError("x", status=status)


async def test_stopping_waits_for_the_cleanup_of_a_handler_past_its_deadline(
    reach: StandInReach,
) -> None:
    runtime = make_runtime(reach)
    events: list[str] = []

    @runtime.operation("tidy")
    async def tidy(payload: dict[str, Any]) -> dict[str, Any]:
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            await asyncio.sleep(0.5)  # a rollback, say
            events.append("cleaned up")
            raise
        return {}

    async with runtime, httpx.AsyncClient(base_url=f"http://{runtime.service_address}") as http:
        soon = str(int(time.time() * 1000) + 200)
        r = await http.post("/reach/tidy", json={}, headers={"X-Reach-Deadline-Ms": soon})
        assert r.status_code == 504
        assert events == []  # answered before the handler's cleanup ended
    # `async with` stopped the runtime: that waited for the cleanup it had given up on.
    assert events == ["cleaned up"]
