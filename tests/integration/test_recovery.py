"""Nothing accepted is lost: a process running the invoke worker dies mid-request (SIGKILL)."""

from __future__ import annotations

import asyncio
import time
import uuid
from pathlib import Path

import httpx
import pytest

from tests.conftest import new_stack
from tests.helpers import Agent, CallbackReceiver, GatewayProcess, Worker, wait_until

pytestmark = pytest.mark.integration

# Another worker takes a dead worker's request within temporal.workflow_task_timeout_s (the task
# it was running) or temporal.sticky_schedule_to_start_s (the next one), 2 s each: bounded here
# well above that, for a busy box, and well below the SDK's 10 s of each that came before
# (bench/recovery.py prints the figures).
RECOVERY_BOUND_S = 6.0


async def test_sigkilled_gateway_worker_mid_request_is_finished_elsewhere(
    temporal_server: str, redis_prefix: str, tmp_path: Path, http: httpx.AsyncClient
) -> None:
    stack = new_stack(
        temporal_server,
        tmp_path,
        registry="redis",
        key_prefix=redis_prefix,
        heartbeat_timeout=5.0,
    )
    doomed = GatewayProcess(stack, "doomed")  # API + invoke worker: eager start runs the call here
    # Where the agent joins and heartbeats:
    survivor_api = GatewayProcess(stack, "api", worker=False)
    survivor = Worker(stack)  # python worker.py: picks the request up after the crash
    await asyncio.gather(doomed.ready(), survivor_api.ready(), survivor.ready())
    ledger = tmp_path / "ledger.txt"
    agent = await Agent(
        survivor_api, "slow-01", "slow-cap", "--delay-ms", "2000", "--ledger", str(ledger)
    ).ready()

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
    temporal_server: str, redis_prefix: str, tmp_path: Path, http: httpx.AsyncClient
) -> None:
    """The request waits for a late answer (202) when the gateway whose worker ran it dies:
    the answer's workflow task is scheduled on that worker's sticky queue, and moves to the
    survivor after temporal.sticky_schedule_to_start_s, not the SDK's 10 s."""
    stack = new_stack(
        temporal_server, tmp_path, registry="redis", key_prefix=redis_prefix, heartbeat_timeout=30
    )
    doomed = GatewayProcess(stack, "doomed")
    survivor_api = GatewayProcess(stack, "api", worker=False)
    survivor = Worker(stack)
    await asyncio.gather(doomed.ready(), survivor_api.ready(), survivor.ready())
    ledger = tmp_path / "ledger.txt"
    flags = ("--defer", "--delay-ms", "500", "--ledger", str(ledger))
    agent = await Agent(survivor_api, "late-01", "late-cap", *flags).ready()
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
            got = await http.get(f"{survivor_api.url}/reach/requests/{rid}")
            return (
                ledger.exists() and rid in ledger.read_text() and got.json()["status"] == "running"
            )

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


async def test_a_write_routed_at_the_door_goes_elsewhere_if_its_instance_left_before_the_call(
    temporal_server: str, redis_prefix: str, tmp_path: Path, http: httpx.AsyncClient
) -> None:
    """The door chose an instance, no worker ran the request before that instance left: nothing
    was sent, so even a non-idempotent write goes to the instance that is there."""
    stack = new_stack(temporal_server, tmp_path, registry="redis", key_prefix=redis_prefix)
    api = await GatewayProcess(stack, "api", worker=False).ready()
    ledger = tmp_path / "ledger.txt"
    first = await Agent(api, "w-01", "writes", "--ledger", str(ledger)).ready()
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
    await asyncio.gather(doomed.ready(), api.ready())
    ledger = tmp_path / "ledger.txt"
    lost = Agent(api, "lw-01", "lost-writes", "--delay-ms", "30000", "--ledger", str(ledger))
    await lost.ready()
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
