"""Results read as the worker in this process completes the workflow
(gateway_api/temporal_adapter.py), against a real dev server and a real worker: the result is
only ever taken once Temporal has closed the workflow, and every other path goes back to the
long poll. These also guard the SDK internals the module watches (its bridge to core, the
eager-start flag on the handle)."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from datetime import timedelta

import httpx
import pytest
from temporalio import activity, workflow
from temporalio.api.common.v1 import Payload, WorkflowExecution
from temporalio.api.enums.v1 import WorkflowExecutionStatus
from temporalio.api.workflowservice.v1 import ResetWorkflowExecutionRequest
from temporalio.client import Client, WorkflowHandle
from temporalio.common import WorkflowIDConflictPolicy, WorkflowIDReusePolicy
from temporalio.exceptions import ApplicationError
from temporalio.worker import UnsandboxedWorkflowRunner, Worker

from gateway_api.temporal_adapter import Finish, Finishes
from tests.helpers import Agent, GatewayProcess
from tests.integration.test_metrics import get, scrape

pytestmark = pytest.mark.integration


@activity.defn(name="nap")
async def nap(seconds: float) -> str:
    await asyncio.sleep(seconds)
    return f"napped {seconds}"


@workflow.defn(name="FinishesProbe", sandboxed=False)
class Probe:
    def __init__(self) -> None:
        self.pokes = 0

    @workflow.signal
    def poke(self) -> None:
        self.pokes += 1

    @workflow.run
    async def run(self, seconds: float, first_sleep: float = 0) -> str:
        if seconds < 0:
            raise ApplicationError("asked to fail", non_retryable=True)
        if first_sleep:
            await workflow.sleep(first_sleep)
        napped = await workflow.execute_local_activity(
            nap, seconds, schedule_to_close_timeout=timedelta(seconds=30)
        )
        return f"{napped}, poked {self.pokes}"


@dataclass
class Bench:
    client: Client
    finishes: Finishes
    task_queue: str

    async def start(
        self, seconds: float, *, eager: bool = True, first_sleep: float = 0
    ) -> tuple[Finish, WorkflowHandle]:
        workflow_id = f"finishes-{uuid.uuid4()}"
        wait = self.finishes.expect(workflow_id)
        assert wait is not None
        handle = await self.client.start_workflow(
            Probe.run,
            args=[seconds, first_sleep],
            id=workflow_id,
            task_queue=self.task_queue,
            id_reuse_policy=WorkflowIDReusePolicy.REJECT_DUPLICATE,
            id_conflict_policy=WorkflowIDConflictPolicy.USE_EXISTING,
            request_eager_start=eager,
        )
        return wait, handle

    async def decode(self, payload: Payload) -> str:
        (value,) = await self.client.data_converter.decode([payload], [str])
        assert isinstance(value, str)
        return value


@pytest.fixture
async def bench(temporal_server: str) -> AsyncIterator[Bench]:
    client = await Client.connect(temporal_server)
    task_queue = f"finishes-{uuid.uuid4().hex[:8]}"
    worker = Worker(
        client,
        task_queue=task_queue,
        workflows=[Probe],
        activities=[nap],
        workflow_runner=UnsandboxedWorkflowRunner(),
    )
    finishes = Finishes()
    finishes.attach(worker)
    assert finishes.long_poll_after_s == 10.0  # at least the sticky and task timeouts
    async with worker:
        yield Bench(client, finishes, task_queue)
    finishes.close()
    await asyncio.sleep(0.5)  # the SDK worker's shutdown settles (it can abort at exit otherwise)


async def test_a_result_is_read_here_only_once_temporal_closed_the_workflow(
    bench: Bench,
) -> None:
    wait, handle = await bench.start(0.05)
    try:
        payload = await wait.result(handle)
        assert payload is not None, "the eager run's result was not read here"
        # Durable already: the server reports the workflow closed, with this very result.
        described = await handle.describe()
        assert described.raw_description.workflow_execution_info.status == (
            WorkflowExecutionStatus.WORKFLOW_EXECUTION_STATUS_COMPLETED
        )
        assert await bench.decode(payload) == "napped 0.05, poked 0"
        assert await handle.result() == "napped 0.05, poked 0"
    finally:
        bench.finishes.done(wait)
    assert bench.finishes._runs == {}
    assert bench.finishes._results == {}


async def test_a_completion_the_server_refused_is_long_polled(bench: Bench) -> None:
    # A signal lands while the local activity runs: the server refuses the completion that
    # ignores it (unhandled command), and the workflow runs again with the signal.
    wait, handle = await bench.start(0.6)
    try:
        await asyncio.sleep(0.2)
        await handle.signal(Probe.poke)
        assert await wait.result(handle) is None
        assert await handle.result() == "napped 0.6, poked 1"
    finally:
        bench.finishes.done(wait)


async def test_a_start_that_was_not_eager_is_long_polled_at_once(bench: Bench) -> None:
    wait, handle = await bench.start(0.05, eager=False)
    try:
        assert await asyncio.wait_for(wait.result(handle), 0.05) is None
        assert await handle.result() == "napped 0.05, poked 0"
    finally:
        bench.finishes.done(wait)


async def test_a_failed_workflow_is_long_polled(bench: Bench) -> None:
    wait, handle = await bench.start(-1)
    try:
        assert await wait.result(handle) is None
    finally:
        bench.finishes.done(wait)


async def test_a_run_still_going_after_the_wait_is_long_polled(bench: Bench) -> None:
    bench.finishes.long_poll_after_s = 0.3
    wait, handle = await bench.start(1.0)
    try:
        started = asyncio.get_running_loop().time()
        assert await wait.result(handle) is None
        assert asyncio.get_running_loop().time() - started < 0.9
        assert await handle.result() == "napped 1.0, poked 0"
    finally:
        bench.finishes.done(wait)


async def test_a_slow_call_within_the_sticky_timeout_is_still_read_here(bench: Bench) -> None:
    # Under load calls take seconds; long-polling them would make each dearer just then.
    wait, handle = await bench.start(2.5)
    try:
        payload = await wait.result(handle)
        assert payload is not None
        assert await bench.decode(payload) == "napped 2.5, poked 0"
    finally:
        bench.finishes.done(wait)


async def test_one_wait_per_request_id_and_done_forgets_everything(bench: Bench) -> None:
    wait, handle = await bench.start(0.05)
    assert bench.finishes.expect(wait.workflow_id) is None  # a second waiter long-polls
    bench.finishes.done(wait)
    assert await wait.result(handle) is None  # given up: its owner long-polls
    assert await handle.result() == "napped 0.05, poked 0"
    assert bench.finishes._waiting == {}
    assert bench.finishes._runs == {}
    assert bench.finishes._results == {}


async def test_a_reset_run_is_answered_and_every_run_forgotten(bench: Bench) -> None:
    # An operator resets the request to its first workflow task while it sleeps: a new run
    # with the same workflow id carries on (and is seen here), the old one never ends.
    wait, handle = await bench.start(0.05, first_sleep=0.6)
    try:
        await asyncio.sleep(0.3)
        history = [e async for e in handle.fetch_history_events()]
        completed = next(
            e.event_id for e in history if e.HasField("workflow_task_completed_event_attributes")
        )
        await bench.client.workflow_service.reset_workflow_execution(
            ResetWorkflowExecutionRequest(
                namespace=bench.client.namespace,
                workflow_execution=WorkflowExecution(workflow_id=wait.workflow_id),
                reason="test",
                workflow_task_finish_event_id=completed,
                request_id=str(uuid.uuid4()),
            )
        )
        payload = await wait.result(handle)
        assert payload is not None
        assert await bench.decode(payload) == "napped 0.05, poked 0"
        assert len(wait.run_ids) == 2
    finally:
        bench.finishes.done(wait)
    assert bench.finishes._runs == {}
    assert bench.finishes._results == {}


async def test_many_at_once_are_all_read_here(bench: Bench) -> None:
    async def one(n: int) -> str:
        wait, handle = await bench.start(0.01 * (n % 5))
        try:
            payload = await wait.result(handle)
            assert payload is not None
            return await bench.decode(payload)
        finally:
            bench.finishes.done(wait)

    results = await asyncio.gather(*(one(n) for n in range(40)))
    assert results == [f"napped {0.01 * (n % 5)}, poked 0" for n in range(40)]


async def test_the_gateway_answers_sync_invokes_from_its_worker(
    gateway: GatewayProcess, http: httpx.AsyncClient, capability: str
) -> None:
    await Agent(gateway, f"{capability}-01", capability).ready()
    before = await scrape(http, gateway.url)
    body = {"target": capability, "operation": "query", "payload": {"q": "x"}}
    for _ in range(3):
        r = await http.post(f"{gateway.url}/reach/invoke", json=body)
        assert r.status_code == 200, r.text
        assert r.json()["status"] == "success"
        # The same envelope the history holds.
        again = await http.get(f"{gateway.url}/reach/requests/{r.json()['request_id']}")
        assert again.json()["result"] == r.json()["result"]
    # A repeat of a finished request attaches to its workflow: its result is long-polled.
    repeat = await http.post(
        f"{gateway.url}/reach/invoke", json={**body, "request_id": r.json()["request_id"]}
    )
    assert repeat.json()["result"] == r.json()["result"]
    after = await scrape(http, gateway.url)
    name = "reach_sync_results_total"
    assert get(after, name, via="worker") - get(before, name, via="worker") == 3
    assert get(after, name, via="long_poll") - get(before, name, via="long_poll") == 1
