"""Production runs the invoke workflow unsandboxed with its activations on the event loop
(`temporal.inline_activations`); the rest of the suite runs it in the sandbox, on threads. These
tests cover the production path: every kind of activation (start, a local activity's result, a
timer, an update, a query, eviction) while the same loop serves HTTP."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
from temporalio.client import Client

from reach.config import ReachSettings
from tests.conftest import new_stack
from tests.helpers import CallbackReceiver, GatewayProcess, start_agents, wait_until
from worker import build_services, build_workers, inline_activations

pytestmark = pytest.mark.integration


@pytest.mark.parametrize(
    ("sandbox", "inline", "expected"),
    [(False, True, True), (True, True, False), (False, False, False), (True, False, False)],
)
async def test_the_invoke_worker_runs_activations_inline_only_unsandboxed(
    temporal_server: str, sandbox: bool, inline: bool, expected: bool
) -> None:
    settings = ReachSettings.model_validate(
        {
            "temporal": {
                "address": temporal_server,
                "workflow_sandbox": sandbox,
                "inline_activations": inline,
            }
        }
    )
    assert inline_activations(settings.temporal) is expected
    client = await Client.connect(temporal_server)
    [invoke_worker] = build_workers(client, build_services(settings, sweep=False))
    assert invoke_worker.config()["debug_mode"] is expected  # the SDK's inline path


def test_inline_activations_are_the_default() -> None:
    assert ReachSettings().temporal.inline_activations is True
    assert inline_activations(ReachSettings().temporal)


@pytest.fixture(scope="module")
async def inline_gateway(
    temporal_server: str, tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[GatewayProcess]:
    extra = {
        "REACH_TEMPORAL__WORKFLOW_SANDBOX": "false",  # as production runs it: inline
        "REACH_POLICY__RETRY__BACKOFF_BASE_MS": "200",
    }
    stack = new_stack(temporal_server, tmp_path_factory.mktemp("inline"), extra=extra)
    async with GatewayProcess(stack) as gateway:
        yield gateway


def body(capability: str, **fields: object) -> dict[str, object]:
    return {"target": capability, "operation": "query", "payload": {"text": "durable"}, **fields}


async def test_many_invokes_in_flight_all_succeed_while_the_loop_keeps_serving(
    inline_gateway: GatewayProcess, http: httpx.AsyncClient, capability: str
) -> None:
    await start_agents(inline_gateway, capability, 2)
    url = f"{inline_gateway.url}/reach/invoke"
    calls = [asyncio.create_task(http.post(url, json=body(capability))) for _ in range(48)]
    ready = await http.get(f"{inline_gateway.url}/readyz")  # answered among them
    assert ready.status_code == 200, ready.text
    answers = await asyncio.gather(*calls)
    assert [r.status_code for r in answers] == [200] * 48, [r.text for r in answers]
    assert {r.json()["instance_id"] for r in answers} == {f"{capability}-00", f"{capability}-01"}
    assert len({r.json()["request_id"] for r in answers}) == 48


async def test_retries_wait_on_timers_and_a_running_request_answers_queries(
    inline_gateway: GatewayProcess, http: httpx.AsyncClient, capability: str
) -> None:
    # Every call fails: the workflow waits out its backoffs on durable timers, and a read while
    # it runs is a query answered by the workflow itself.
    await start_agents(inline_gateway, capability, 1, "--fail-first", "99")
    async with CallbackReceiver() as receiver:
        request_id = f"req-{uuid.uuid4().hex}"
        r = await http.post(
            f"{inline_gateway.url}/reach/invoke",
            json=body(capability, request_id=request_id, callback=receiver.url),
        )
        assert r.status_code == 202, r.text
        seen: list[int] = []
        state: dict[str, Any] = {}

        async def ended() -> bool:
            nonlocal state
            state = (await http.get(f"{inline_gateway.url}/reach/requests/{request_id}")).json()
            if state["status"] == "running":
                seen.append(len(state.get("attempts", [])))
                return False
            return True

        await wait_until(ended, 30, every_s=0.02)
        assert state["status"] == "error", state
        assert len(state["attempts"]) == 3
        assert set(seen) & {1, 2}, seen  # the query saw the attempts so far
        await receiver.wait()  # the callback's own workflow, started by this one
        [(_, delivered)] = receiver.received
        assert delivered["request_id"] == request_id
        assert delivered["status"] == "error"


async def test_a_late_answer_is_an_update_the_workflow_takes(
    inline_gateway: GatewayProcess, http: httpx.AsyncClient, capability: str
) -> None:
    await start_agents(inline_gateway, capability, 1, "--defer", "--delay-ms", "4000")
    request_id = f"req-{uuid.uuid4().hex}"
    call = asyncio.create_task(
        http.post(
            f"{inline_gateway.url}/reach/invoke", json=body(capability, request_id=request_id)
        )
    )

    async def running() -> bool:
        read = await http.get(f"{inline_gateway.url}/reach/requests/{request_id}")
        return bool(read.json().get("status") == "running")

    await wait_until(running, 5)
    answer = {"status": "success", "result": {"answer": 42}}
    late = await http.post(f"{inline_gateway.url}/reach/requests/{request_id}/result", json=answer)
    assert late.status_code == 202, late.text
    r = await call
    assert r.status_code == 200, r.text
    assert r.json()["result"] == {"answer": 42}
    # The validator runs inline too: a different answer after the end is refused.
    other = await http.post(
        f"{inline_gateway.url}/reach/requests/{request_id}/result",
        json={"status": "success", "result": {"answer": 7}},
    )
    assert other.status_code == 409, other.text
