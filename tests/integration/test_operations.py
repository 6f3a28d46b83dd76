"""What operators and scale-out rely on: queue-mode workers, search attributes, the CLI audit
trail, callback delivery that survives a failing receiver, keyed retries."""

from __future__ import annotations

import asyncio
import json
import uuid
from pathlib import Path
from typing import Any

import httpx
import pytest
from temporalio.client import Client

from gateway_api.devserver import temporal_binary
from tests.conftest import new_stack
from tests.helpers import Agent, CallbackReceiver, GatewayProcess, Worker, start_agents, wait_until
from workflows.invoke import SA_CALLER, SA_CAPABILITY, SA_INSTANCE, SA_OPERATION, SA_STATUS

pytestmark = pytest.mark.integration


async def test_queue_mode_capability_is_served_by_its_own_worker(
    temporal_server: str, redis_prefix: str, tmp_path: Path, http: httpx.AsyncClient
) -> None:
    """A `queue` capability runs on reach-cap-<name>, served by `worker.py --capability`."""
    capability = f"gen-{uuid.uuid4().hex[:6]}"
    stack = new_stack(
        temporal_server,
        tmp_path,
        registry="redis",
        key_prefix=redis_prefix,
        extra={"REACH_CAPABILITIES": f'{{"{capability}": {{"mode": "queue"}}}}'},
    )
    gateway = GatewayProcess(stack, worker=True)
    await gateway.ready()
    await Agent(gateway, f"{capability}-01", capability).ready()
    body = {"target": capability, "operation": "query", "payload": {}, "timeout_ms": 2000}
    # No capability worker yet: the activity waits on its queue until the deadline.
    r = await http.post(f"{gateway.url}/reach/invoke", json=body)
    assert r.status_code == 504, r.text
    cap_worker = Worker(stack, "--capability", capability)
    await cap_worker.ready()
    r = await http.post(f"{gateway.url}/reach/invoke", json={**body, "timeout_ms": 10_000})
    assert r.status_code == 200, r.text
    assert r.json()["instance_id"] == f"{capability}-01"
    # It was this process that called: its worker identity took the call's activity task.
    client = await Client.connect(temporal_server)
    history = await client.get_workflow_handle(r.json()["request_id"]).fetch_history()
    takers = [
        e.activity_task_started_event_attributes.identity
        for e in history.events
        if e.HasField("activity_task_started_event_attributes")
    ]
    assert takers, "the call ran as a regular activity"
    assert all(t.startswith(f"{cap_worker.proc.popen.pid}@") for t in takers), takers


async def test_search_attributes_and_cli_audit_trail(
    gateway: GatewayProcess, http: httpx.AsyncClient, capability: str, temporal_server: str
) -> None:
    agents = await start_agents(gateway, capability, 1)
    # The first request of a capability reads its policy view (the door does not wait for it).
    warm = {"target": capability, "operation": "query", "payload": {}}
    assert (await http.post(f"{gateway.url}/reach/invoke", json=warm)).status_code == 200
    rid = f"req-{uuid.uuid4().hex}"
    r = await http.post(
        f"{gateway.url}/reach/invoke",
        headers={"X-Reach-Caller": "orchestrator"},
        json={"request_id": rid, "target": capability, "operation": "query", "payload": {}},
    )
    assert r.status_code == 200
    client = await Client.connect(temporal_server)
    desc = await client.get_workflow_handle(rid).describe()
    sa = desc.typed_search_attributes
    assert sa.get(SA_CALLER) == "orchestrator"
    assert sa.get(SA_CAPABILITY) == capability
    assert sa.get(SA_OPERATION) == "query"
    assert sa.get(SA_STATUS) == "success"
    assert sa.get(SA_INSTANCE) == agents[0].instance_id

    # The UI/CLI filter by them:
    async def listed() -> list[str]:
        return [wf.id async for wf in client.list_workflows(f'ReachCapability="{capability}"')]

    for _ in range(50):
        if rid in await listed():
            break
        await asyncio.sleep(0.1)
    assert rid in await listed()
    cli = await asyncio.create_subprocess_exec(
        temporal_binary(),
        "workflow",
        "show",
        "--workflow-id",
        rid,
        "--address",
        temporal_server,
        stdout=asyncio.subprocess.PIPE,
    )
    out, _ = await asyncio.wait_for(cli.communicate(), 30)
    assert cli.returncode == 0
    shown = out.decode()
    for step in ("WorkflowExecutionStarted", "MarkerRecorded", "WorkflowExecutionCompleted"):
        assert step in shown, shown

    # Routed at the door: the choice is in the input, the call is the only step, and a plain
    # success writes no search attribute at its end (the start set them).
    history = await client.get_workflow_handle(rid).fetch_history()
    started = history.events[0].workflow_execution_started_event_attributes
    assert json.loads(started.input.payloads[0].data)["endpoint"]["instance_id"] == (
        agents[0].instance_id
    )
    markers = [e for e in history.events if e.HasField("marker_recorded_event_attributes")]
    assert len(markers) == 1
    upserts = [
        e
        for e in history.events
        if e.HasField("upsert_workflow_search_attributes_event_attributes")
    ]
    assert upserts == []
    # An outcome other than the one the start assumed is written at the end.
    failed = f"req-{uuid.uuid4().hex}"
    r = await http.post(
        f"{gateway.url}/reach/invoke",
        json={"request_id": failed, "target": capability, "operation": "fail", "payload": {}},
    )
    assert r.status_code == 502, r.text
    sa = (await client.get_workflow_handle(failed).describe()).typed_search_attributes
    assert sa.get(SA_STATUS) == "error"
    assert sa.get(SA_INSTANCE) == agents[0].instance_id


async def test_a_callback_request_routed_at_the_door_writes_no_status_at_its_end(
    gateway: GatewayProcess, http: httpx.AsyncClient, capability: str, temporal_server: str
) -> None:
    """It starts as 'success' like a synchronous one: one upsert fewer in its history (a
    running request reads as running whatever ReachStatus says: reach.listing.status_of)."""
    agents = await start_agents(gateway, capability, 1)
    warm = {"target": capability, "operation": "query", "payload": {}}
    assert (await http.post(f"{gateway.url}/reach/invoke", json=warm)).status_code == 200
    client = await Client.connect(temporal_server)
    async with CallbackReceiver() as receiver:
        rid = f"req-{uuid.uuid4().hex}"
        body = {"request_id": rid, "target": capability, "operation": "query", "payload": {}}
        r = await http.post(f"{gateway.url}/reach/invoke", json={**body, "callback": receiver.url})
        assert r.status_code == 202, r.text
        await receiver.wait(1, timeout_s=30)
    assert receiver.received[0][1]["status"] == "success"
    history = await client.get_workflow_handle(rid).fetch_history()
    started = history.events[0].workflow_execution_started_event_attributes
    inp = json.loads(started.input.payloads[0].data)
    assert inp["endpoint"]["instance_id"] == agents[0].instance_id  # routed at the door
    assert inp["status_at_start"] == "success"
    upserted = [
        sorted(
            e.upsert_workflow_search_attributes_event_attributes.search_attributes.indexed_fields
        )
        for e in history.events
        if e.HasField("upsert_workflow_search_attributes_event_attributes")
    ]
    assert upserted == [["TemporalChangeVersion"]]  # the callback workflow's patch, no status
    sa = (await client.get_workflow_handle(rid).describe()).typed_search_attributes
    assert sa.get(SA_STATUS) == "success"
    status = await http.get(f"{gateway.url}/reach/requests/{rid}")
    assert status.json()["status"] == "success"


async def test_callback_is_retried_until_the_receiver_accepts(
    gateway: GatewayProcess, http: httpx.AsyncClient, capability: str
) -> None:
    await start_agents(gateway, capability, 1)
    async with CallbackReceiver(fail_first=2) as receiver:
        r = await http.post(
            f"{gateway.url}/reach/invoke",
            json={"target": capability, "operation": "query", "callback": receiver.url},
        )
        assert r.status_code == 202
        await receiver.wait(1, timeout_s=20)
        assert receiver.refused == 2
        assert len(receiver.received) == 1
        headers, envelope = receiver.received[0]
        assert headers["x-reach-delivery-attempt"] == "3"
        assert envelope["status"] == "success"


async def test_callback_rejected_with_4xx_is_not_retried_and_the_result_stays(
    gateway: GatewayProcess, http: httpx.AsyncClient, capability: str
) -> None:
    await start_agents(gateway, capability, 1)
    async with CallbackReceiver(fail_first=5, fail_status=410) as receiver:
        r = await http.post(
            f"{gateway.url}/reach/invoke",
            json={"target": capability, "operation": "query", "callback": receiver.url},
        )
        rid = r.json()["request_id"]
        # Delivery is a workflow of its own that starts as the request ends: wait for its
        # verdict, not only the request's (under load the POST can come well after the end).
        status: dict[str, Any] = {}

        async def settled() -> bool:
            nonlocal status
            status = (await http.get(f"{gateway.url}/reach/requests/{rid}")).json()
            return bool(status["status"] != "running" and status["delivery"]["status"] != "pending")

        await wait_until(settled, 20)
        # Refused for good after one POST (not retried), and the result is not lost: it stays
        # readable by id.
        assert status["delivery"]["status"] == "given_up"
        assert status["delivery"]["attempts"] == 1
        assert receiver.refused == 1
        assert status["status"] == "success"
        assert receiver.received == []


async def test_non_idempotent_operation_with_a_key_is_retried_elsewhere(
    gateway: GatewayProcess, http: httpx.AsyncClient, capability: str, tmp_path: Path
) -> None:
    """R13: `create` is not idempotent; with an idempotency_key it is retried (once, elsewhere),
    without one it is reported at once."""
    ledger = tmp_path / "ledger.txt"
    agents = await start_agents(gateway, capability, 2, "--ledger", str(ledger))
    agents[0].proc.kill()  # still registered: round robin sends it every other attempt
    retried = []
    for _ in range(2):
        r = await http.post(
            f"{gateway.url}/reach/invoke",
            json={
                "target": capability,
                "operation": "create",
                "payload": {"note": "hello"},
                "idempotency_key": f"k-{uuid.uuid4().hex}",
            },
        )
        assert r.status_code == 200, r.text
        assert r.json()["instance_id"] == agents[1].instance_id
        retried.append(r.json()["request_id"])
    # At least one of the two first went to the dead instance and was retried on the live one.
    log = gateway.proc.output().splitlines()
    assert any(
        "failed (transport_error); retrying" in line and any(rid in line for rid in retried)
        for line in log
    )
    executed = [line.split()[0] for line in ledger.read_text().splitlines()]
    assert executed == retried  # each ran once, on the live instance
    # Without a key, the same failure is reported, never retried.
    outcomes = []
    for _ in range(2):
        r = await http.post(
            f"{gateway.url}/reach/invoke",
            json={"target": capability, "operation": "create", "payload": {"note": "x"}},
        )
        outcomes.append((r.status_code, r.json().get("error", {}).get("type")))
    assert (502, "transport_error") in outcomes, outcomes
