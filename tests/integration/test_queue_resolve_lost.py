"""Queue mode: a capability worker lost in the middle of a resolve is noticed by the resolve's
heartbeat timeout, and another worker routes the request, as an inline resolve lost with its
worker is run again once the workflow task times out.

Before the resolve heartbeated, it had no timeout but the request's deadline: a worker lost
mid-resolve left the request waiting for its deadline, then timing out, whoever else served
the queue."""

from __future__ import annotations

import asyncio
import json
import sys
import time
import uuid
from pathlib import Path

import httpx
import pytest

from reach.invocation import ACTIVITY_RESOLVE
from tests.conftest import new_stack
from tests.helpers import Agent, GatewayProcess, Worker, invoke, spawn, wait_until
from workflows.invoke import capability_queue

pytestmark = pytest.mark.integration

HEARTBEAT_TIMEOUT_S = 10  # the resolve's, as the call's (workflows._attempts)


async def test_a_worker_lost_mid_resolve_is_noticed_and_another_routes_the_request(
    temporal_server: str, tmp_path: Path, redis_prefix: str
) -> None:
    capability = f"cap-{uuid.uuid4().hex[:8]}"
    # Redis: the gateway then serves no capability queue itself; worker.py processes do.
    stack = new_stack(
        temporal_server,
        tmp_path,
        registry="redis",
        key_prefix=redis_prefix,
        extra={"REACH_CAPABILITIES": json.dumps({capability: {"mode": "queue"}})},
    )
    # The only worker of the capability's queue at first: it takes the resolve and holds it.
    stuck = spawn(
        [sys.executable, "-m", "tests.stuck_workers", "--queue", capability_queue(capability)],
        stack.env(),
        tmp_path / "stuck.log",
    )
    gateway = await GatewayProcess(stack).ready()
    # An in-flight limit: routing reads loads, so a queue-mode door leaves attempt 1 to the
    # workflow's resolve rather than choosing it at the door.
    await Agent(gateway, f"{capability}-01", capability, "--max-inflight", "8").ready()
    await wait_until(lambda: "stuck worker polling" in stuck.output(), 30)
    async with httpx.AsyncClient(trust_env=False, timeout=150) as http:
        request = asyncio.create_task(invoke(http, gateway, capability, timeout_ms=120_000))
        await wait_until(lambda: f"started {ACTIVITY_RESOLVE}" in stuck.output(), 30)
        stuck.kill()
        stuck.popen.wait()
        lost_at = time.monotonic()
        await Worker(stack, "--capability", capability).ready()
        # Well before the request's deadline (120 s), whose timeout was all that ended it.
        done, _ = await asyncio.wait({request}, timeout=HEARTBEAT_TIMEOUT_S + 30)
        assert done, "the request still waits on the lost worker's resolve"
        r = request.result()
        took = time.monotonic() - lost_at
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["status"] == "success", out
    assert out["instance_id"] == f"{capability}-01"
    assert HEARTBEAT_TIMEOUT_S - 1 <= took < HEARTBEAT_TIMEOUT_S + 30, took
    # Nothing was sent before the loss: the same attempt routed again, no retry spent on it.
    tried = [(a["attempt"], a["outcome"]) for a in out["attempts"]]
    assert tried == [(1, "unavailable"), (1, "success")], out["attempts"]
