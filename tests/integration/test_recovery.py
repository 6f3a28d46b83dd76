"""Nothing accepted is lost: a process running the invoke worker dies mid-request (SIGKILL)."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest

from agent_reach_sdk.wire import Answer, Inbound
from tests.conftest import new_stack
from tests.helpers import (
    Agent,
    CallbackReceiver,
    GatewayProcess,
    Stack,
    Worker,
    agent_server,
    ready_together,
    wait_until,
)

pytestmark = pytest.mark.integration

# Another worker takes a dead worker's request within temporal.workflow_task_timeout_s (the task
# it was running) or temporal.sticky_schedule_to_start_s (the next one), 2 s each: bounded here
# well above that, for a busy box, and well below the SDK's 10 s of each that came before
# (bench/recovery.py prints the figures).
RECOVERY_BOUND_S = 6.0


@pytest.fixture(scope="module")
async def takeover(
    temporal_server: str, module_redis_prefix: str, tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[tuple[Stack, GatewayProcess, Worker]]:
    """What outlives a SIGKILLed gateway, shared by the takeover tests (each kills a doomed
    gateway of its own): the gateway agents join and answer through (no worker), and a
    `worker.py` that takes the dead gateway's requests over."""
    stack = new_stack(
        temporal_server,
        tmp_path_factory.mktemp("takeover"),
        registry="redis",
        key_prefix=module_redis_prefix,
        heartbeat_timeout=30,
    )
    api = GatewayProcess(stack, "api", worker=False)
    worker = Worker(stack)
    try:
        await asyncio.gather(api.ready(), worker.ready())
        yield stack, api, worker
    finally:
        api.proc.stop()
        worker.proc.stop()


async def test_sigkilled_gateway_worker_mid_request_is_finished_elsewhere(
    takeover: tuple[Stack, GatewayProcess, Worker], tmp_path: Path, http: httpx.AsyncClient
) -> None:
    # survivor_api: where the agent joins and heartbeats; survivor: python worker.py, picks
    # the request up after the crash.
    stack, survivor_api, survivor = takeover
    doomed = GatewayProcess(stack, "doomed")  # API + invoke worker: eager start runs the call here
    ledger = tmp_path / "ledger.txt"
    agent = Agent(
        survivor_api, "slow-01", "slow-cap", "--delay-ms", "2000", "--ledger", str(ledger)
    )
    await asyncio.gather(doomed.ready(), agent.ready())  # both start at once

    async with CallbackReceiver() as receiver:
        rid = f"req-{uuid.uuid4().hex}"
        r = await http.post(
            f"{doomed.url}/reach/invoke",
            json={
                "request_id": rid,
                "target": "slow-cap",
                "operation": "query",
                "payload": {"text": "survive"},
                "timeout_ms": 60_000,
                "callback": receiver.url,
            },
        )
        assert r.status_code == 202, r.text

        async def agent_started() -> bool:
            return ledger.exists() and rid in ledger.read_text()

        await wait_until(agent_started, 10, every_s=0.02)
        doomed.proc.kill()  # SIGKILL, mid-call
        killed = time.monotonic()

        await receiver.wait(1, timeout_s=45)
        assert len(receiver.received) == 1, survivor.proc.output()
        # The agent's own 2 s, then its second call (answered from the first) after the task
        # timed out.
        recovered_s = time.monotonic() - killed
        assert recovered_s < RECOVERY_BOUND_S, f"finished {recovered_s:.1f} s after the SIGKILL"
        envelope = receiver.received[0][1]
        assert envelope["request_id"] == rid
        assert envelope["status"] == "success"
        assert envelope["result"]["instance_id"] == agent.instance_id
        await asyncio.sleep(1.0)
        assert len(receiver.received) == 1
    # The worker re-ran the call (at-least-once); the SDK answered it without running it again.
    assert [line.split()[0] for line in ledger.read_text().splitlines()] == [rid]
    status = await http.get(f"{survivor_api.url}/reach/requests/{rid}")
    assert status.json()["status"] == "success"


async def test_a_late_answer_to_a_sigkilled_gateways_request_is_taken_elsewhere_soon(
    takeover: tuple[Stack, GatewayProcess, Worker], http: httpx.AsyncClient
) -> None:
    """The request waits for a late answer (202) when the gateway whose worker ran it dies:
    the answer's workflow task is scheduled on that worker's sticky queue, and moves to the
    survivor after temporal.sticky_schedule_to_start_s, not the SDK's 10 s."""
    stack, survivor_api, survivor = takeover
    doomed = GatewayProcess(stack, "doomed")
    ledger = stack.tmp / f"ledger-{uuid.uuid4().hex[:8]}.txt"
    flags = ("--defer", "--delay-ms", "500", "--ledger", str(ledger))
    agent = Agent(survivor_api, "late-01", "late-cap", *flags)
    await asyncio.gather(doomed.ready(), agent.ready())  # both start at once
    async with CallbackReceiver() as receiver:
        rid = f"req-{uuid.uuid4().hex}"
        r = await http.post(
            f"{doomed.url}/reach/invoke",
            json={
                "request_id": rid,
                "target": "late-cap",
                "operation": "query",
                "payload": {"text": "answer later"},
                "timeout_ms": 60_000,
                "callback": receiver.url,
            },
        )
        assert r.status_code == 202, r.text

        async def waiting_for_the_answer() -> bool:
            # The call's 202 is in history (its task completed): the attempt is listed. Only
            # "running" and the ledger let the kill land inside that task, whose answer then
            # takes the lost-task path (the test below).
            got = (await http.get(f"{survivor_api.url}/reach/requests/{rid}")).json()
            return got["status"] == "running" and [
                a["outcome"] for a in got.get("attempts") or []
            ] == ["accepted"]

        await wait_until(waiting_for_the_answer, 10, every_s=0.02)
        doomed.proc.kill()  # its worker holds the run in its cache; the answer comes 0.5 s on
        killed = time.monotonic()
        await receiver.wait(1, timeout_s=45)
        recovered_s = time.monotonic() - killed
        assert len(receiver.received) == 1, survivor.proc.output()
        envelope = receiver.received[0][1]
    assert envelope["status"] == "success", envelope
    assert envelope["result"]["instance_id"] == agent.instance_id
    assert recovered_s < RECOVERY_BOUND_S, f"finished {recovered_s:.1f} s after the SIGKILL"


class HeldAgent:
    """A non-SDK agent whose first call is never answered (its gateway dies holding it); it
    accepts (202) the re-run's call, and the test answers late for it."""

    def __init__(self) -> None:
        self.calls: list[str] = []
        self.server = agent_server(self._handle)

    async def _handle(self, request: Inbound) -> Answer:
        self.calls.append(request.headers.get("x-reach-attempt", ""))
        if len(self.calls) == 1:
            await asyncio.sleep(60)
        return Answer(202, {"status": "accepted"})


async def test_an_answer_that_comes_while_a_lost_task_is_taken_over_is_not_refused(
    takeover: tuple[Stack, GatewayProcess, Worker], http: httpx.AsyncClient
) -> None:
    """The gateway dies inside the task that calls the agent: nothing of that task is in
    history. The agent's late answer, sent meanwhile, reaches the worker that takes over
    before that worker has run the call again. It was refused 403 'not sent to instance'
    (the worker knew no call yet; the SDK does not resend a 403, and the request waited out
    its deadline); now a 503 says send it again, and the resend is taken."""
    stack, survivor_api, survivor = takeover
    doomed = GatewayProcess(stack, "doomed")
    agent = HeldAgent()
    await asyncio.gather(doomed.ready(), agent.server.start())
    try:
        instance = "held-01"
        join = {"capability": "held-cap", "instance_id": instance}
        join["service_address"] = f"127.0.0.1:{agent.server.port}"
        assert (await http.post(f"{survivor_api.url}/reach/agents", json=join)).status_code == 200
        async with CallbackReceiver() as receiver:
            rid = f"req-{uuid.uuid4().hex}"
            r = await http.post(
                f"{doomed.url}/reach/invoke",
                json={
                    "request_id": rid,
                    "target": "held-cap",
                    "operation": "query",
                    "payload": {},
                    "timeout_ms": 60_000,
                    "callback": receiver.url,
                },
            )
            assert r.status_code == 202, r.text
            await wait_until(lambda: len(agent.calls) == 1, 10, every_s=0.01)
            doomed.proc.kill()  # inside the task that holds the call
            killed = time.monotonic()
            answer = {"instance_id": instance, "status": "success", "result": {"late": True}}
            said: list[int] = []
            while time.monotonic() - killed < 30:  # as the SDK does: a 503 is sent again
                late = await http.post(
                    f"{survivor_api.url}/reach/requests/{rid}/result", json=answer
                )
                said.append(late.status_code)
                if late.status_code != 503:
                    break
                assert late.json()["error"]["type"] == "unavailable", late.text
                await asyncio.sleep(0.2)
            assert said[-1] == 202, (said, late.text, survivor.proc.output())
            await receiver.wait(1, timeout_s=30)
            recovered_s = time.monotonic() - killed
            envelope = receiver.received[0][1]
    finally:
        await agent.server.close()
    assert envelope["status"] == "success", envelope
    assert envelope["result"] == {"late": True}
    assert envelope["instance_id"] == instance
    assert len(agent.calls) == 2  # the lost task's call, then the re-run's (answered 202)
    assert recovered_s < RECOVERY_BOUND_S, f"finished {recovered_s:.1f} s after the SIGKILL"


async def test_a_write_routed_at_the_door_goes_elsewhere_if_its_instance_left_before_the_call(
    temporal_server: str, redis_prefix: str, tmp_path: Path, http: httpx.AsyncClient
) -> None:
    """The door chose an instance, no worker ran the request before that instance left: nothing
    was sent, so even a non-idempotent write goes to the instance that is there."""
    stack = new_stack(temporal_server, tmp_path, registry="redis", key_prefix=redis_prefix)
    api = GatewayProcess(stack, "api", worker=False)
    ledger = tmp_path / "ledger.txt"
    first = Agent(api, "w-01", "writes", "--ledger", str(ledger))
    await ready_together(api, first)
    async with CallbackReceiver() as receiver:
        rid = f"req-{uuid.uuid4().hex}"
        r = await http.post(
            f"{api.url}/reach/invoke",
            json={
                "request_id": rid,
                "target": "writes",
                "operation": "create",
                "payload": {"note": "once"},
                "timeout_ms": 60_000,
                "callback": receiver.url,
            },
        )
        assert r.status_code == 202, r.text
        first.proc.kill()  # gone for good (a live agent would join again at its next beat)
        left = await http.delete(f"{api.url}/reach/agents/{first.instance_id}")
        assert left.status_code in (200, 204), left.text
        second = await Agent(api, "w-02", "writes", "--ledger", str(ledger)).ready()
        await Worker(stack).ready()
        await receiver.wait(1, timeout_s=30)
        envelope = receiver.received[0][1]
        assert envelope["status"] == "success", envelope
        assert envelope["instance_id"] == second.instance_id
        assert [a["instance_id"] for a in envelope["attempts"]] == [second.instance_id]
    assert [line.split()[0] for line in ledger.read_text().splitlines()] == [rid]


async def test_a_repeat_that_attached_does_not_let_a_lost_write_run_again_elsewhere(
    temporal_server: str, redis_prefix: str, tmp_path: Path, http: httpx.AsyncClient
) -> None:
    """A write is sent, its RequestID is repeated through another gateway (it attaches), then
    the first gateway and the agent die. The re-run must not send it to another instance: it
    may have run, so the request reports that instead."""
    stack = new_stack(
        temporal_server,
        tmp_path,
        registry="redis",
        key_prefix=redis_prefix,
        heartbeat_timeout=2.0,
        # The re-run comes after the dead instance was evicted (2 s without a heartbeat): the
        # lost task's time-out outlasts that. (With the 2 s default it may come first, reach
        # the dead instance again and report its connection error.)
        extra={"REACH_TEMPORAL__WORKFLOW_TASK_TIMEOUT_S": "10"},
    )
    doomed = GatewayProcess(stack, "doomed")
    # The repeat's gateway runs the invoke worker that re-runs the request after the crash.
    api = GatewayProcess(stack, "api")
    ledger = tmp_path / "ledger.txt"
    lost = Agent(api, "lw-01", "lost-writes", "--delay-ms", "30000", "--ledger", str(ledger))
    await asyncio.gather(doomed.ready(), ready_together(api, lost))  # all three at once
    async with CallbackReceiver() as receiver:
        body = {
            "request_id": f"req-{uuid.uuid4().hex}",
            "target": "lost-writes",
            "operation": "create",
            "payload": {"note": "at most once"},
            "timeout_ms": 60_000,
            "callback": receiver.url,
        }
        assert (await http.post(f"{doomed.url}/reach/invoke", json=body)).status_code == 202

        async def sent() -> bool:
            return ledger.exists() and body["request_id"] in ledger.read_text()

        await wait_until(sent, 10, every_s=0.02)
        repeat = await http.post(f"{api.url}/reach/invoke", json=body)
        assert repeat.status_code == 202, repeat.text  # attached, routed at that door too
        other = await Agent(api, "lw-02", "lost-writes", "--ledger", str(ledger)).ready()
        doomed.proc.kill()
        lost.proc.kill()
        await receiver.wait(1, timeout_s=45)
        envelope = receiver.received[0][1]
    assert envelope["status"] == "error", envelope
    assert envelope["error"]["outcome_unknown"] is True, envelope
    assert other.instance_id not in ledger.read_text()
    assert [line.split()[0] for line in ledger.read_text().splitlines()] == [body["request_id"]]
