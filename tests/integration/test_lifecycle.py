"""A request's life: its result is final as soon as it is known, callback delivery is a fact of
its own, repeats and late answers behave by the final result, and nothing lives forever."""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator
from datetime import timedelta
from typing import Any

import httpx
import pytest
from temporalio.client import Client
from temporalio.contrib.pydantic import pydantic_data_converter

from agent_reach_sdk.wire import Answer, Inbound
from reach.invocation import CallPlan, InvokeInput
from tests.conftest import new_stack
from tests.helpers import (
    CallbackReceiver,
    GatewayProcess,
    Worker,
    agent_server,
    start_agents,
    wait_until,
)

pytestmark = pytest.mark.integration


def body(capability: str, **extra: Any) -> dict[str, Any]:
    return {
        "target": capability,
        "operation": "query",
        "payload": {"text": "final"},
        "timeout_ms": 5000,
        **extra,
    }


# The capability the module's gateway calls in queue mode (a task queue of its own, which a
# gateway with a memory registry serves itself), for the one test that needs it.
QUEUED = f"cap-queued-{uuid.uuid4().hex[:8]}"


@pytest.fixture(scope="module")
async def gateway(
    temporal_server: str, tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[GatewayProcess]:
    """conftest's module gateway, with QUEUED in queue mode (no other test here calls it)."""
    extra = {"REACH_CAPABILITIES": json.dumps({QUEUED: {"mode": "queue"}})}
    stack = new_stack(temporal_server, tmp_path_factory.mktemp("stack"), extra=extra)
    async with GatewayProcess(stack) as gw:
        yield gw


@pytest.fixture(scope="module")
async def workerless(
    temporal_server: str, tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[GatewayProcess]:
    """A gateway without the invoke worker, nobody serving its task queue until a test starts
    a worker.py of its own (stopped at the test's end): the outage tests share it."""
    extra = {"REACH_TEMPORAL__RPC_TIMEOUT_S": "1"}
    stack = new_stack(temporal_server, tmp_path_factory.mktemp("workerless"), extra=extra)
    async with GatewayProcess(stack, "api", worker=False) as api:
        yield api


@pytest.fixture(scope="module")
async def served(gateway: GatewayProcess) -> AsyncIterator[str]:
    """A capability with one plain live agent, for the whole module: the tests that take it
    follow requests of their own (their own RequestIDs, every call a success)."""
    capability = f"cap-{uuid.uuid4().hex[:8]}"
    agents = await start_agents(gateway, capability, 1)
    yield capability
    for agent in agents:
        agent.proc.stop()


async def read(http: httpx.AsyncClient, gateway: GatewayProcess, rid: str) -> dict[str, Any]:
    r = await http.get(f"{gateway.url}/reach/requests/{rid}")
    data: dict[str, Any] = r.json()
    return data


async def test_result_is_final_while_the_callback_is_still_retried(
    gateway: GatewayProcess, http: httpx.AsyncClient, served: str
) -> None:
    """Before: the request read `running` for the whole retry window (up to an hour), a late
    answer was accepted and dropped, and a sync repeat waited for an invented 504."""
    capability = served
    async with CallbackReceiver(fail_first=10**9, fail_status=503) as receiver:
        rid = f"req-{uuid.uuid4().hex}"
        r = await http.post(
            f"{gateway.url}/reach/invoke",
            json=body(capability, request_id=rid, callback=receiver.url),
        )
        assert r.status_code == 202, r.text

        async def result_final_and_delivery_retried() -> bool:
            data = await read(http, gateway, rid)
            return data["status"] == "success" and data["delivery"]["attempts"] >= 2

        await wait_until(result_final_and_delivery_retried, 15)
        data = await read(http, gateway, rid)
        assert data["result"]["request_id"] == rid
        assert data["delivery"]["status"] == "pending"
        assert data["delivery"]["url"] == receiver.url
        assert "503" in data["delivery"]["last_error"]

        # A synchronous repeat (no callback) gets the final result at once.
        start = time.monotonic()
        again = await http.post(
            f"{gateway.url}/reach/invoke", json=body(capability, request_id=rid)
        )
        assert again.status_code == 200, again.text
        assert again.json()["result"] == data["result"]
        assert time.monotonic() - start < 2.0
        # The same async repeat is accepted again (it attaches; nothing runs twice).
        same = await http.post(
            f"{gateway.url}/reach/invoke",
            json=body(capability, request_id=rid, callback=receiver.url),
        )
        assert same.status_code == 202, same.text
        # A late answer now is refused: the result is final.
        late = await http.post(
            f"{gateway.url}/reach/requests/{rid}/result",
            json={"status": "success", "result": {"other": True}},
        )
        assert late.status_code == 409, late.text
        assert late.json()["error"]["type"] == "request_closed"


async def test_delivered_and_given_up_deliveries_are_visible(
    gateway: GatewayProcess, http: httpx.AsyncClient, served: str
) -> None:
    capability = served
    async with CallbackReceiver() as ok, CallbackReceiver(fail_first=5, fail_status=410) as gone:
        ids = {}
        for name, receiver in (("ok", ok), ("gone", gone)):
            ids[name] = f"req-{uuid.uuid4().hex}"
            r = await http.post(
                f"{gateway.url}/reach/invoke",
                json=body(capability, request_id=ids[name], callback=receiver.url),
            )
            assert r.status_code == 202

        async def settled() -> bool:
            states = [(await read(http, gateway, rid))["delivery"] for rid in ids.values()]
            return all(s["status"] != "pending" for s in states)

        await wait_until(settled, 15)
        delivered = await read(http, gateway, ids["ok"])
        assert delivered["status"] == "success"
        assert delivered["delivery"] == {"url": ok.url, "status": "delivered", "attempts": 1}
        given_up = await read(http, gateway, ids["gone"])
        assert given_up["status"] == "success"  # the result is not lost
        assert given_up["delivery"]["status"] == "given_up"
        assert given_up["delivery"]["attempts"] == 1  # a 410 is not retried
        assert "410" in given_up["delivery"]["last_error"]
        assert len(ok.received) == 1


async def test_a_repeat_must_be_the_same_request(
    gateway: GatewayProcess, http: httpx.AsyncClient, served: str
) -> None:
    """Before: a repeat that added a callback got 202 and never a callback; a repeat with
    another payload silently got the first one's result."""
    capability = served
    rid = f"req-{uuid.uuid4().hex}"
    first = await http.post(f"{gateway.url}/reach/invoke", json=body(capability, request_id=rid))
    assert first.status_code == 200, first.text
    async with CallbackReceiver() as receiver:
        added = await http.post(
            f"{gateway.url}/reach/invoke",
            json=body(capability, request_id=rid, callback=receiver.url),
        )
        assert added.status_code == 409, added.text
        assert added.json()["error"]["type"] == "request_conflict"
        assert "without a callback" in added.json()["error"]["message"]
    other = await http.post(
        f"{gateway.url}/reach/invoke",
        json=body(capability, request_id=rid, payload={"text": "something else"}),
    )
    assert other.status_code == 409, other.text
    assert other.json()["error"]["type"] == "request_conflict"
    other_caller = await http.post(
        f"{gateway.url}/reach/invoke",
        json=body(capability, request_id=rid),
        headers={"X-Reach-Caller": "someone-else"},
    )
    assert other_caller.status_code == 409
    same = await http.post(f"{gateway.url}/reach/invoke", json=body(capability, request_id=rid))
    assert same.status_code == 200
    assert same.json() == first.json()


async def test_an_agents_late_error_type_never_chooses_the_status(
    gateway: GatewayProcess, http: httpx.AsyncClient, capability: str
) -> None:
    """Before: a late error_type of 'not_found' made the caller's answer a 404."""
    await start_agents(gateway, capability, 1, "--defer", "--late-error", "not_found")
    r = await http.post(f"{gateway.url}/reach/invoke", json=body(capability))
    assert r.status_code == 502, r.text
    error = r.json()["error"]
    assert error["type"] == "agent_error"
    assert error["agent"] == {"type": "not_found", "message": "the index is rebuilding"}
    assert r.json()["instance_id"] == f"{capability}-00"


async def test_late_answers_first_wins_and_a_resend_is_received_again(
    gateway: GatewayProcess, http: httpx.AsyncClient, capability: str
) -> None:
    await start_agents(gateway, capability, 1, "--defer", "--delay-ms", "4000")
    rid = f"req-{uuid.uuid4().hex}"
    call = asyncio.create_task(
        http.post(f"{gateway.url}/reach/invoke", json=body(capability, request_id=rid))
    )

    async def running() -> bool:
        return (await read(http, gateway, rid)).get("status") == "running"

    await wait_until(running, 5)
    url = f"{gateway.url}/reach/requests/{rid}/result"
    answer = {"status": "success", "result": {"answer": 1}}
    first = await http.post(url, json=answer)
    assert first.status_code == 202, first.text
    assert first.json() == {"request_id": rid, "status": "received"}
    resent = await http.post(url, json=answer)
    assert resent.status_code == 202, resent.text
    assert resent.json()["status"] == "received"  # the same answer: the same acknowledgement
    r = await call
    assert r.status_code == 200, r.text
    assert r.json()["result"] == {"answer": 1}
    # After the end: the same answer is still acknowledged, another one is refused.
    assert (await http.post(url, json=answer)).json()["status"] == "received"
    # ...whatever order its keys come in, and without the instance id.
    same = {"result": {"answer": 1}, "status": "success", "instance_id": "someone"}
    assert (await http.post(url, json=same)).json()["status"] == "received"
    other = await http.post(url, json={"status": "success", "result": {"answer": 2}})
    assert other.status_code == 409
    assert other.json()["error"]["type"] == "request_closed"


class BigReplyAgent:
    """A non-SDK agent that answers with more than it negotiated (the SDK would refuse to)."""

    def __init__(self, reply_bytes: int) -> None:
        self.reply = {"padding": "x" * reply_bytes}
        self.server = agent_server(self._handle)

    async def _handle(self, request: Inbound) -> Answer:
        return Answer(200, self.reply)


async def test_a_reply_over_the_negotiated_size_is_a_typed_agent_error(
    gateway: GatewayProcess, http: httpx.AsyncClient, capability: str
) -> None:
    """Before: the reply broke Temporal's payload limit; the caller got a 504 and the final
    record said `timeout` with no instance."""
    agent = BigReplyAgent(1_200_000)
    await agent.server.start()
    try:
        r = await http.post(
            f"{gateway.url}/reach/agents",
            json={
                "capability": capability,
                "instance_id": f"{capability}-big",
                "service_address": f"127.0.0.1:{agent.server.port}",
                "max_message_bytes": 1_000_000,
            },
        )
        assert r.status_code == 200, r.text
        rid = f"req-{uuid.uuid4().hex}"
        r = await http.post(f"{gateway.url}/reach/invoke", json=body(capability, request_id=rid))
        assert r.status_code == 502, r.text
        assert r.json()["error"]["type"] == "agent_error"
        assert r.json()["error"]["retryable"] is False
        assert "1000000" in r.json()["error"]["message"]
        final = await read(http, gateway, rid)
        assert final["status"] == "error"
        assert final["instance_id"] == f"{capability}-big"
    finally:
        await agent.server.close()


async def test_a_large_result_within_the_limit_goes_end_to_end(
    gateway: GatewayProcess, http: httpx.AsyncClient, capability: str
) -> None:
    await start_agents(gateway, capability, 1, "--reply-bytes", "900000")
    async with CallbackReceiver() as receiver:
        r = await http.post(
            f"{gateway.url}/reach/invoke",
            json=body(capability, payload={"text": "y" * 900_000}, callback=receiver.url),
        )
        assert r.status_code == 202, r.text
        await receiver.wait(1)
        assert len(receiver.received[0][1]["result"]["padding"]) == 900_000


async def _client(gateway: GatewayProcess) -> Client:
    return await Client.connect(gateway.stack.temporal, data_converter=pydantic_data_converter)


async def start_directly(
    gateway: GatewayProcess, *, task_queue: str | None = None, **start: Any
) -> str:
    """Start an InvokeWorkflow past the door, as only a bug or an operator could."""
    fields: dict[str, Any] = {"deadline_ms": int(time.time() * 1000) + 500}
    fields.update({k: start.pop(k) for k in ("deadline_ms", "callback") if k in start})
    rid = f"req-{uuid.uuid4().hex}"
    inp = InvokeInput(
        request_id=rid,
        caller="t",
        target="nobody",
        operation="query",
        accepted_at_ms=int(time.time() * 1000),
        plan=CallPlan(timeout_ms=500, idempotent=True, max_retries=0),
        **fields,
    )
    client = await _client(gateway)
    await client.start_workflow(
        "InvokeWorkflow",
        inp,
        id=rid,
        task_queue=task_queue or gateway.stack.task_queue,
        **start,
    )
    return rid


async def test_input_the_workflow_cannot_decode_ends_typed_not_stuck(
    gateway: GatewayProcess, http: httpx.AsyncClient
) -> None:
    """A backstop behind the door: a workflow whose input fails to decode fails at once with a
    typed, final status, instead of retrying its task forever."""
    client = await _client(gateway)
    rid = f"req-{uuid.uuid4().hex}"
    await client.start_workflow(
        "InvokeWorkflow",
        {"request_id": rid, "plan": "not a plan"},
        id=rid,
        task_queue=gateway.stack.task_queue,
    )

    async def ended() -> bool:
        return (await read(http, gateway, rid))["status"] != "running"

    await wait_until(ended, 10)
    r = await http.get(f"{gateway.url}/reach/requests/{rid}")
    assert r.status_code == 500
    assert r.json()["status"] == "error"
    assert r.json()["error"]["type"] == "internal"
    assert "failed inside Reach" in r.json()["error"]["message"]


async def test_input_that_breaks_workflow_code_ends_typed_not_stuck(
    gateway: GatewayProcess, http: httpx.AsyncClient
) -> None:
    """A backstop behind the door: an input that decodes but makes the workflow code raise (a
    deadline past what a timedelta holds) ends the request with a typed internal error, instead
    of a workflow task that fails and is retried forever."""
    rid = await start_directly(gateway, deadline_ms=10**18)

    async def ended() -> bool:
        return (await read(http, gateway, rid))["status"] != "running"

    await wait_until(ended, 10)
    r = await http.get(f"{gateway.url}/reach/requests/{rid}")
    assert r.status_code == 500
    assert r.json()["error"]["type"] == "internal"
    assert "OverflowError" in r.json()["error"]["message"]


async def test_a_workflow_that_outlives_its_life_reads_as_a_timeout(
    gateway: GatewayProcess, http: httpx.AsyncClient
) -> None:
    """No worker ever takes it (an unserved queue): Temporal ends it, and the request reads as
    a typed, final timeout rather than `running` for good."""
    rid = await start_directly(
        gateway,
        task_queue=f"unserved-{uuid.uuid4().hex[:6]}",
        execution_timeout=timedelta(seconds=1),
    )

    async def ended() -> bool:
        return (await read(http, gateway, rid))["status"] != "running"

    await wait_until(ended, 10)
    r = await http.get(f"{gateway.url}/reach/requests/{rid}")
    assert r.status_code == 504
    assert r.json()["status"] == "timeout"
    assert r.json()["error"]["type"] == "timeout"
    assert "timeout set outside Reach" in r.json()["error"]["message"]


async def test_the_deduplication_window_is_stated_at_start_up(
    gateway: GatewayProcess, temporal_server: str
) -> None:
    client = await Client.connect(temporal_server)
    from temporalio.api.workflowservice.v1 import DescribeNamespaceRequest

    desc = await client.workflow_service.describe_namespace(
        DescribeNamespaceRequest(namespace="default")
    )
    hours = desc.config.workflow_execution_retention_ttl.ToTimedelta() / timedelta(hours=1)
    assert hours == 48  # the session's dev server: DevServer(retention_hours=48)
    assert "deduplicated until its request has been closed for 48 h" in gateway.proc.output()


async def test_a_late_answer_acknowledged_while_the_call_is_out_is_never_discarded(
    gateway: GatewayProcess, http: httpx.AsyncClient
) -> None:
    """Before: the late answer got 202 'received', then the agent's slower 200 became the
    result and a resend of the late answer got 409."""
    capability, gw = QUEUED, gateway  # called in queue mode
    await start_agents(gw, capability, 1, "--delay-ms", "3000")
    rid = f"req-{uuid.uuid4().hex}"
    call = asyncio.create_task(
        http.post(f"{gw.url}/reach/invoke", json=body(capability, request_id=rid, timeout_ms=8000))
    )
    await asyncio.sleep(1.0)  # the agent is still working on it
    answer = {"status": "success", "result": {"from": "late"}}
    late = await http.post(f"{gw.url}/reach/requests/{rid}/result", json=answer)
    assert late.status_code == 202, late.text
    assert late.json()["status"] == "received"
    r = await call
    assert r.status_code == 200, r.text
    assert r.json()["result"] == {"from": "late"}  # acknowledged first, so it is the result
    again = await http.post(f"{gw.url}/reach/requests/{rid}/result", json=answer)
    assert again.json()["status"] == "received"


async def test_an_error_late_answer_sent_again_is_received_again(
    gateway: GatewayProcess, http: httpx.AsyncClient, capability: str
) -> None:
    await start_agents(gateway, capability, 1, "--defer", "--late-error", "index_gone")
    rid = f"req-{uuid.uuid4().hex}"
    r = await http.post(f"{gateway.url}/reach/invoke", json=body(capability, request_id=rid))
    assert r.status_code == 502, r.text
    # What the demo agent sent; sent again after the end, it is recognised, not refused.
    again = await http.post(
        f"{gateway.url}/reach/requests/{rid}/result",
        json={
            "status": "error",
            "error_type": "index_gone",
            "error_message": "the index is rebuilding",
        },
    )
    assert again.status_code == 202, again.text
    assert again.json()["status"] == "received"


async def test_without_a_worker_a_late_answer_is_503_and_a_callback_survives_the_outage(
    workerless: GatewayProcess, http: httpx.AsyncClient, capability: str
) -> None:
    """No worker until well past the deadline: the request waits in Temporal and, once a worker
    is back, ends by its deadline with its callback (the hostile review found it ended by an
    execution timeout and the callback never sent)."""
    api = workerless
    stack = api.stack
    await start_agents(api, capability, 1)
    async with CallbackReceiver() as receiver:
        answered, waiting = f"req-{uuid.uuid4().hex}", f"req-{uuid.uuid4().hex}"
        for rid in (answered, waiting):
            r = await http.post(
                f"{api.url}/reach/invoke",
                json=body(capability, request_id=rid, timeout_ms=1000, callback=receiver.url),
            )
            assert r.status_code == 202, r.text
        # No worker can take the answer now: a 503 says "send it again" (it was a 500).
        start = time.monotonic()
        answer = {"status": "success", "result": {"from": "late"}}
        late = await http.post(f"{api.url}/reach/requests/{answered}/result", json=answer)
        assert late.status_code == 503, late.text
        assert late.json()["error"]["type"] == "unavailable"
        assert time.monotonic() - start < 5
        await asyncio.sleep(2.5)  # well past the deadline
        await Worker(stack).ready()
        await receiver.wait(2, timeout_s=20)
        by_id = {envelope["request_id"]: envelope for _, envelope in receiver.received}
        assert set(by_id) == {answered, waiting}
        assert by_id[waiting]["status"] == "timeout"
        # The answer was kept by Temporal until a worker took it: resending it is harmless.
        assert by_id[answered]["result"] == {"from": "late"}
        again = await http.post(f"{api.url}/reach/requests/{answered}/result", json=answer)
        assert again.json()["status"] == "received"
        assert (await read(http, api, waiting))["status"] == "timeout"

        async def delivered() -> bool:  # recorded a moment after the receiver answered
            return (await read(http, api, waiting))["delivery"]["status"] == "delivered"

        await wait_until(delivered, 5)


async def test_a_request_ended_before_delivery_reads_given_up_not_pending(
    gateway: GatewayProcess, http: httpx.AsyncClient
) -> None:
    """A request whose workflow ended without a result never hands it to delivery."""
    rid = await start_directly(
        gateway,
        callback="http://127.0.0.1:9/cb",
        task_queue=f"unserved-{uuid.uuid4().hex[:6]}",
        execution_timeout=timedelta(seconds=1),
    )

    async def ended() -> bool:
        return (await read(http, gateway, rid))["status"] != "running"

    await wait_until(ended, 10)
    delivery = (await read(http, gateway, rid))["delivery"]
    assert delivery["status"] == "given_up"
    assert "ended (timeout)" in delivery["last_error"]


async def test_a_reused_request_id_gets_its_callback_despite_an_old_delivery(
    gateway: GatewayProcess, http: httpx.AsyncClient, served: str
) -> None:
    """After retention the invoke of a RequestID is gone, but its (later) delivery may linger:
    the new request's delivery must not collide with it (before: 'already started', lost)."""
    capability = served
    rid = f"req-{uuid.uuid4().hex}"
    client = await _client(gateway)
    old = await client.start_workflow(
        "DeliverCallbackWorkflow",
        {"url": "http://127.0.0.1:9/old", "response": {"request_id": rid, "status": "success"}},
        id=f"{rid}/callback",
        task_queue=f"unserved-{uuid.uuid4().hex[:6]}",
    )
    await old.terminate("stands in for a delivery retained from an earlier request")
    async with CallbackReceiver() as receiver:
        r = await http.post(
            f"{gateway.url}/reach/invoke",
            json=body(capability, request_id=rid, callback=receiver.url),
        )
        assert r.status_code == 202, r.text
        await receiver.wait(1)
        assert len(receiver.received) == 1
        assert receiver.received[0][1]["status"] == "success"

    async def delivered() -> bool:  # recorded a moment after the receiver answered
        return (await read(http, gateway, rid))["delivery"]["status"] == "delivered"

    await wait_until(delivered, 5)


async def test_late_answers_piling_up_in_an_outage_cannot_kill_the_request(
    workerless: GatewayProcess, http: httpx.AsyncClient, capability: str
) -> None:
    """Before: every resend of a 1 MB late answer during a worker outage was admitted as an
    update of its own; the workflow task answering them all passed Temporal's 4 MiB message
    limit and the server terminated the request, result and callback lost."""
    api = workerless
    stack = api.stack
    await start_agents(api, capability, 1)
    rid = f"req-{uuid.uuid4().hex}"
    async with CallbackReceiver() as receiver:
        r = await http.post(
            f"{api.url}/reach/invoke",
            json=body(capability, request_id=rid, timeout_ms=60_000, callback=receiver.url),
        )
        assert r.status_code == 202, r.text
        url = f"{api.url}/reach/requests/{rid}/result"
        big = {"status": "success", "result": {"text": "a" * 1_000_000}}
        others = [{"status": "success", "result": {"text": c * 1_000_000}} for c in "bcd"]
        for answer in [big, big, big, *others, big]:  # resends, and rivals, all in the outage
            r = await http.post(url, json=answer)
            assert r.status_code == 503, r.text
        await Worker(stack).ready()
        await receiver.wait(1, timeout_s=30)
        assert len(receiver.received) == 1
        envelope = receiver.received[0][1]
        assert envelope["status"] == "success"
        assert envelope["result"] == big["result"]  # the first answer sent is the result
    final = await read(http, api, rid)
    assert final["status"] == "success"
    assert (await http.post(url, json=big)).json()["status"] == "received"
