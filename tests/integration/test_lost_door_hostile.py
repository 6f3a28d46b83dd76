"""Hostile review of the lost-task outcomes (e099c8c, 40534e0), on real processes: a gateway
SIGKILLed mid-call after a wait, its agent killed with it, a throwaway redis-server stopped
and resumed; the agent's ledger says what ran, the callback what the caller was told."""

from __future__ import annotations

import json
import signal
import uuid
from pathlib import Path

import httpx
import pytest

from tests.conftest import new_stack
from tests.helpers import (
    Agent,
    CallbackReceiver,
    GatewayProcess,
    Stack,
    Worker,
    executions,
    invoke,
    rid,
    wait_until,
)
from tests.integration.test_redis_outages import RedisServer

pytestmark = pytest.mark.integration


def door_stack(temporal_server: str, tmp_path: Path, redis: RedisServer, capability: str) -> Stack:
    """A stack on `redis` whose capability has no breaker or ejection to read: the door routes
    attempt 1 without the store."""
    unread = {"circuit_breaker": {"enabled": False}, "outlier": {"enabled": False}}
    return new_stack(
        temporal_server,
        tmp_path,
        registry="redis",
        heartbeat_timeout=60.0,
        extra={
            "REACH_REGISTRY__REDIS_URL": redis.url,
            "REACH_POLICY__CAPABILITIES": json.dumps({capability: unread}),
        },
    )


async def sent_after_a_key_wait(
    http: httpx.AsyncClient,
    doomed: GatewayProcess,
    capability: str,
    redis: RedisServer,
    receiver: CallbackReceiver,
    ledger: Path,
    timeout_ms: int,
) -> str:
    """A keyed write routed at the door whose key claim meets Redis stopped and waits; once
    the agent runs it (sent by the task that fired the wait's timer), `doomed` is SIGKILLed."""
    request_id = rid()
    redis.signal(signal.SIGSTOP)
    try:
        r = await invoke(
            http,
            doomed,
            capability,
            "create",
            request_id=request_id,
            idempotency_key=rid(),
            timeout_ms=timeout_ms,
            callback=receiver.url,
        )
        assert r.status_code == 202, r.text
        await wait_until(lambda: "reach.claim_key failed" in doomed.proc.output(), 20)
    finally:
        redis.signal(signal.SIGCONT)
    await wait_until(lambda: bool(executions(ledger, request_id)), 30)
    assert "chosen at the door" in doomed.proc.output()  # the door's route, pinned
    doomed.proc.kill()
    return request_id


async def test_a_door_routed_keyed_write_lost_after_its_key_s_store_wait_may_have_run(
    temporal_server: str, tmp_path: Path, http: httpx.AsyncClient
) -> None:
    """The door routes attempt 1 (no breaker or ejection to read: it needs no store); the
    idempotency key's claim meets a stopped Redis and waits on a timer; the task that fires it
    claims the key, pins the door's route (check_first, not fresh) and sends the write; its
    gateway and the agent are SIGKILLed. The worker that takes it over before the deadline
    goes back to the agent (its record lives on), cannot connect, and sends nothing itself: the
    lost task had sent it, so the caller must be told it may have run, and where; not a plain,
    retryable transport_error (as before: the caller was told that, though the ledger
    shows it ran; and the key was freed for a repeat to run it again)."""
    capability = f"doorkey-{uuid.uuid4().hex[:8]}"
    redis = RedisServer()
    redis.start()
    try:
        stack = door_stack(temporal_server, tmp_path, redis, capability)
        doomed = await GatewayProcess(stack, "doomed").ready()
        ledger = tmp_path / "ledger.txt"
        agent = await Agent(
            doomed, f"{capability}-01", capability, "--delay-ms", "60000", "--ledger", str(ledger)
        ).ready()
        warm = await invoke(http, doomed, capability, "get_metadata")  # the door's view holds it
        assert warm.status_code == 200, warm.text
        async with CallbackReceiver() as receiver:
            request_id = await sent_after_a_key_wait(
                http, doomed, capability, redis, receiver, ledger, timeout_ms=60_000
            )
            agent.proc.kill()  # its record lives on (heartbeat_timeout): routed back, refused
            other = await Worker(stack).ready()
            await receiver.wait(1, timeout_s=60)
            envelope = receiver.received[0][1]
    finally:
        redis.stop()
    log = other.proc.output()[-3000:]
    assert executions(ledger, request_id) == [agent.instance_id]  # it ran, once
    assert envelope["status"] in ("error", "timeout"), (envelope, log)
    assert envelope["error"].get("outcome_unknown") is True, (envelope, log)
    assert envelope["instance_id"] == agent.instance_id, envelope


async def test_a_door_routed_keyed_write_whose_instance_left_after_a_lost_task_may_have_run(
    temporal_server: str, tmp_path: Path, http: httpx.AsyncClient
) -> None:
    """As above, but the agent's record is gone by the time another worker takes the request
    over (an operator removed it): the door's route is stale on a re-run, and the request may
    move (keyed), so it is routed again; nothing is left to route it to. The lost task had sent
    it: the caller must be told it may have run (before: a plain, retryable no_instance)."""
    capability = f"doorleft-{uuid.uuid4().hex[:8]}"
    redis = RedisServer()
    redis.start()
    try:
        stack = door_stack(temporal_server, tmp_path, redis, capability)
        doomed = await GatewayProcess(stack, "doomed").ready()
        api = await GatewayProcess(stack, "api", worker=False).ready()
        ledger = tmp_path / "ledger.txt"
        agent = await Agent(
            doomed, f"{capability}-01", capability, "--delay-ms", "60000", "--ledger", str(ledger)
        ).ready()
        warm = await invoke(http, doomed, capability, "get_metadata")
        assert warm.status_code == 200, warm.text
        async with CallbackReceiver() as receiver:
            request_id = await sent_after_a_key_wait(
                http, doomed, capability, redis, receiver, ledger, timeout_ms=40_000
            )
            agent.proc.kill()
            gone = await http.delete(f"{api.url}/reach/agents/{agent.instance_id}")
            assert gone.status_code == 204, gone.text  # before a worker takes the request over
            other = await Worker(stack).ready()
            await receiver.wait(1, timeout_s=60)
            envelope = receiver.received[0][1]
    finally:
        redis.stop()
    log = other.proc.output()[-3000:]
    assert "left before request" in other.proc.output(), log  # the re-run found it stale
    assert executions(ledger, request_id) == [agent.instance_id]
    assert envelope["error"].get("outcome_unknown") is True, (envelope, log)
