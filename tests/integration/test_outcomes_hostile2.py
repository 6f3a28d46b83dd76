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
from tests.helpers import Agent, CallbackReceiver, GatewayProcess, invoke, rid
from tests.integration.test_redis_outages import RedisServer

pytestmark = pytest.mark.integration


async def test_answers_that_leave_the_door_while_the_store_stalls_say_what_happened(
    temporal_server: str, tmp_path: Path, http: httpx.AsyncClient
) -> None:
    """The door counts a request that did not succeed under its capability's declared
    operations, read from the store: with Redis stopped (SIGSTOP) that read timed out after
    the request was started, and the caller was answered 503 `unavailable`, retryable, for a
    request accepted and running (a callback's 202), or instead of its own outcome (a timeout
    that may have run). A metric label must never change an answer."""
    capability = f"stall-{uuid.uuid4().hex[:8]}"
    unread = {"circuit_breaker": {"enabled": False}, "outlier": {"enabled": False}}
    redis = RedisServer()
    redis.start()
    try:
        stack = new_stack(
            temporal_server,
            tmp_path,
            registry="redis",
            heartbeat_timeout=60.0,
            extra={
                "REACH_REGISTRY__REDIS_URL": redis.url,
                "REACH_POLICY__CAPABILITIES": json.dumps({capability: unread}),
            },
        )
        gw = await GatewayProcess(stack).ready()
        ledger = tmp_path / "ledger.txt"
        agent = await Agent(
            gw, f"{capability}-01", capability, "--delay-ms", "3000", "--ledger", str(ledger)
        ).ready()
        warm = await invoke(http, gw, capability, "get_metadata")  # the door's view holds it
        assert warm.status_code == 200, warm.text
        async with CallbackReceiver() as receiver:
            accepted, timed = rid(), rid()
            redis.signal(signal.SIGSTOP)
            try:
                r = await invoke(
                    http, gw, capability, "query", request_id=accepted, callback=receiver.url
                )
                sync = await invoke(
                    http, gw, capability, "query", request_id=timed, timeout_ms=1500
                )
            finally:
                redis.signal(signal.SIGCONT)
            assert r.status_code == 202, r.text
            assert sync.status_code == 504, sync.text
            assert sync.json()["error"].get("outcome_unknown") is True, sync.text
            assert sync.json()["instance_id"] == agent.instance_id, sync.text
            await receiver.wait(1, timeout_s=30)
            assert receiver.received[0][1]["status"] == "success"
    finally:
        redis.stop()
