"""A request that ends in error or timeout is a Failed workflow where operators look (the
Temporal UI, `temporal workflow list` and `show`), and every reader of Reach still reads its
envelope: the answer, GET /reach/requests/{id}, the list, the timeline, a repeat, an
idempotency key's follower, a late answer after the end, a callback (issue 26).
"""

from __future__ import annotations

import asyncio
import json
import os
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest
from temporalio.client import Client, WorkflowExecutionStatus, WorkflowFailureError
from temporalio.exceptions import ApplicationError

from reach.outcome import FAILED_OUTCOME
from tests.conftest import new_stack
from tests.helpers import ROOT, CallbackReceiver, GatewayProcess, invoke, rid, start_agents
from tests.integration.test_metrics import get, scrape

pytestmark = pytest.mark.integration

TEMPORAL_CLI = ROOT / ".venv" / "bin" / "temporal"


@pytest.fixture(scope="module")
async def served(
    temporal_server: str, tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[tuple[GatewayProcess, str, Client]]:
    """One gateway and one agent that answers after 300 ms (so a 100 ms budget times out)."""
    stack = new_stack(temporal_server, tmp_path_factory.mktemp("failed"))
    capability = f"cap-{rid()[4:12]}"
    async with GatewayProcess(stack, "failed") as gw:
        agents = await start_agents(gw, capability, 1, "--delay-ms", "300")
        try:
            yield gw, capability, await Client.connect(temporal_server)
        finally:
            for agent in agents:
                agent.proc.stop()


async def _closed(client: Client, request_id: str) -> WorkflowExecutionStatus | None:
    return (await client.get_workflow_handle(request_id).describe()).status


async def test_an_error_and_a_timeout_are_failed_workflows_that_read_as_before(
    served: tuple[GatewayProcess, str, Client], http: httpx.AsyncClient
) -> None:
    gw, capability, client = served
    ok = await invoke(http, gw, capability, request_id=(good := rid()))
    assert ok.json()["status"] == "success", ok.text
    assert await _closed(client, good) == WorkflowExecutionStatus.COMPLETED

    before = await scrape(http, gw.url)
    bad = rid()
    refused = await invoke(http, gw, capability, "fail", request_id=bad)
    assert refused.json()["status"] == "error", refused.text
    assert refused.json()["error"]["type"] == "agent_error"
    slow = rid()
    late = await invoke(http, gw, capability, request_id=slow, timeout_ms=100)
    assert late.json()["status"] == "timeout", late.text
    # Read from this gateway's worker as a success is (the fast path), not long-polled.
    after = await scrape(http, gw.url)
    name = "reach_sync_results_total"
    assert get(after, name, via="worker") - get(before, name, via="worker") == 2
    assert get(after, name, via="long_poll") == get(before, name, via="long_poll")

    # Failed in Temporal, with the status and error as its message, the envelope its detail.
    for request_id, status in ((bad, "error"), (slow, "timeout")):
        assert await _closed(client, request_id) == WorkflowExecutionStatus.FAILED
        with pytest.raises(WorkflowFailureError) as failed:
            await client.get_workflow_handle(request_id).result()
        cause = failed.value.cause
        assert isinstance(cause, ApplicationError)
        assert cause.type == FAILED_OUTCOME
        assert cause.message.startswith(status)
        assert cause.details[0]["status"] == status

    # GET, a repeat of the same RequestID, the list and the timeline read the envelope.
    got = (await http.get(f"{gw.url}/reach/requests/{bad}")).json()
    assert (got["status"], got["error"]["type"]) == ("error", "agent_error")
    again = await invoke(http, gw, capability, "fail", request_id=bad)
    assert again.json()["error"] == refused.json()["error"]
    got = (await http.get(f"{gw.url}/reach/requests/{slow}")).json()
    assert got["status"] == "timeout"
    for status, request_id in (("error", bad), ("timeout", slow)):
        listed = await http.get(
            f"{gw.url}/reach/requests", params={"capability": capability, "status": status}
        )
        rows = {row["request_id"]: row["status"] for row in listed.json()["requests"]}
        assert rows.get(request_id) == status, listed.text
        assert good not in rows
    timeline = (await http.get(f"{gw.url}/reach/requests/{bad}/timeline")).json()
    assert timeline["status"] == "error"
    assert timeline["events"][-1]["kind"] == "result"
    assert "inside Reach" not in json.dumps(timeline)

    # A late answer after the end is refused as for a completed request.
    answer = await http.post(
        f"{gw.url}/reach/requests/{slow}/result", json={"status": "success", "result": {}}
    )
    assert answer.status_code == 409, answer.text
    assert answer.json()["error"]["type"] == "request_closed"

    # What an operator runs: `temporal workflow show` says Failed and why.
    shown = await asyncio.create_subprocess_exec(
        str(TEMPORAL_CLI), "workflow", "show", "--workflow-id", bad, "--output", "json",
        env={**os.environ, "TEMPORAL_ADDRESS": gw.stack.temporal},
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    out, err = await asyncio.wait_for(shown.communicate(), 60)
    assert shown.returncode == 0, err.decode()
    last = json.loads(out)["events"][-1]
    assert last["eventType"] == "EVENT_TYPE_WORKFLOW_EXECUTION_FAILED"
    message = last["workflowExecutionFailedEventAttributes"]["failure"]["message"]
    assert message.startswith("error agent_error: agent ")


async def test_an_idempotency_keys_follower_and_a_callback_read_a_failed_outcome(
    served: tuple[GatewayProcess, str, Client], http: httpx.AsyncClient
) -> None:
    gw, capability, client = served
    key = f"order-{rid()[4:12]}"
    first = await invoke(http, gw, capability, "fail", idempotency_key=key)
    assert first.json()["error"]["type"] == "agent_error", first.text
    # The agent's definitive refusal keeps the key: a repeat gets it, read from the failure.
    second = await invoke(http, gw, capability, "fail", idempotency_key=key)
    body = second.json()
    assert body["replayed_from"] == first.json()["request_id"], second.text
    assert (body["status"], body["error"]["type"]) == ("error", "agent_error")

    async with CallbackReceiver() as receiver:
        request_id = rid()
        accepted = await invoke(
            http, gw, capability, "fail", request_id=request_id, callback=receiver.url
        )
        assert accepted.status_code == 202, accepted.text
        await receiver.wait()
        [(_, delivered)] = receiver.received
        assert (delivered["status"], delivered["error"]["type"]) == ("error", "agent_error")
        assert await _closed(client, request_id) == WorkflowExecutionStatus.FAILED
        # A repeat of a callback request that failed is accepted again, not answered inline.
        repeat = await invoke(
            http, gw, capability, "fail", request_id=request_id, callback=receiver.url
        )
        assert repeat.status_code == 202, repeat.text
        got = (await http.get(f"{gw.url}/reach/requests/{request_id}")).json()
        assert got["status"] == "error"
        assert got["delivery"]["status"] == "delivered"


def test_the_recorded_failed_histories_end_failed() -> None:
    for name in ("failed-error", "failed-timeout"):
        events = json.loads((Path(__file__).parents[1] / "histories" / f"{name}.json").read_text())
        assert events["events"][-1]["eventType"] == "EVENT_TYPE_WORKFLOW_EXECUTION_FAILED"
