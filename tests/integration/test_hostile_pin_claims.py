"""Hostile review of the pin claims that tell a run's own claims from a lost task's (88bb2ee,
c52b743), on real processes: a gateway SIGKILLed while an MCP server runs a keyless write, a
second worker taking the request over, and a Redis behind a proxy in this process that drops
the connection of any command on the keys it is told to (`claim:pin:`, `claim:sent:`). The MCP
server's ledger (a line per run of `count`) says what ran; the callback what the caller was told.
"""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest
from temporalio.client import Client

from tests.conftest import new_stack
from tests.helpers import CallbackReceiver, GatewayProcess, Worker, invoke, rid, wait_until
from tests.integration.test_connector_mcp import registered
from tests.integration.test_redis_outages import RedisServer
from tests.mcp_servers import McpServerProcess
from tests.redis_proxy import RedisProxy

pytestmark = pytest.mark.integration

SENT = b"claim:sent:"  # send-once claims (activities._sent.sent_key)
PIN = b"claim:pin:"  # an attempt's pin claims (reach.resolve.pin_key)


class KeyBlocker(RedisProxy):
    """Drops a connection as soon as a command naming one of the `blocked` key prefixes comes
    through it; everything else passes."""

    def __init__(self, upstream_port: int) -> None:
        super().__init__(upstream_port)
        self.blocked: set[bytes] = set()
        self.dropped: dict[bytes, int] = {SENT: 0, PIN: 0}

    async def admit(self, chunk: bytes) -> bool:
        hit = next((key for key in self.blocked if key in chunk), None)
        if hit is None:
            return True
        self.dropped[hit] += 1
        return False


def runs(server: McpServerProcess, tag: str) -> int:
    return server.calls.read_text().splitlines().count(tag)


async def test_a_write_sent_by_a_lost_task_stays_unknown_when_the_next_run_s_pin_met_the_store_away(
    temporal_server: str, tmp_path: Path, http: httpx.AsyncClient
) -> None:
    """A keyless write to an MCP server is refused unsent while send-once claims cannot be
    made, so the workflow resolves it again (pinning attempt 1, claim k on a key of its own)
    after each wait. Then the claims pass: the task that fires the wait's timer pins the
    attempt, claims its send and sends it; the server runs it (ledger), and that task's
    gateway is SIGKILLed. The worker that takes it over resolves the attempt while pin claims
    are dropped: its claim k+1 is counted but its fate unknown, and it waits for the store. Pin
    claims pass again, send-once claims do not: its claim k+2 goes on a key nobody took, so
    resolve says nobody pinned it before (the lost task's pin sits on key k+1, unread), the call
    is 'routed here', and its refused send-once claim reads as 'nothing was sent' until the
    deadline. The server had run it: the caller must be told it may have run (issue 25), not a
    retryable refusal or a plain timeout, which a retry would run a second time."""
    redis = RedisServer()
    redis.start()
    server = McpServerProcess(tmp_path, "stateless").start()
    other: Worker | None = None
    try:
        async with KeyBlocker(redis.port) as blocker:
            stack = new_stack(
                temporal_server,
                tmp_path,
                registry="redis",
                heartbeat_timeout=90.0,
                extra={"REACH_REGISTRY__REDIS_URL": blocker.url},
            )
            doomed = await GatewayProcess(stack, "doomed").ready()
            await server.ready()
            async with registered(http, doomed, server, "tools-lost"), CallbackReceiver() as cb:
                tag = rid()
                blocker.blocked = {SENT}
                r = await invoke(
                    http,
                    doomed,
                    "tools-lost",
                    "count",
                    request_id=rid(),
                    payload={"tag": tag, "sleep_s": 120},
                    timeout_ms=60_000,
                    callback=cb.url,
                )
                assert r.status_code == 202, r.text
                # Refused unsent after the workflow's own resolve pinned it: it waits again.
                await wait_until(lambda: blocker.dropped[SENT] >= 2, 30)
                await wait_until(
                    lambda: doomed.proc.output().count("waiting for the store") >= 2, 30
                )
                blocker.blocked = set()
                await wait_until(lambda: runs(server, tag) == 1, 30)  # sent by this task
                blocker.blocked = {SENT, PIN}
                doomed.proc.kill()
                other = await Worker(stack).ready()
                pins = blocker.dropped[PIN]
                await wait_until(lambda: blocker.dropped[PIN] > pins, 60)  # its resolve: lost
                blocker.blocked = {SENT}
                await cb.wait(1, timeout_s=90)
                envelope = cb.received[0][1]
    finally:
        if other is not None:
            other.proc.stop()
        server.stop()
        redis.stop()
    log = other.proc.output()[-3000:] if other is not None else ""
    assert runs(server, tag) == 1, log  # it ran, once
    error = envelope.get("error") or {}
    assert error.get("retryable") is not True, (envelope, log)
    assert error.get("outcome_unknown") is True, (envelope, log)
    assert envelope.get("instance_id", "").startswith("mcp-"), envelope  # and where it went


async def test_a_write_a_lost_task_sent_then_cancelled_says_it_may_have_run(
    temporal_server: str, tmp_path: Path, http: httpx.AsyncClient
) -> None:
    """A keyless write routed at the door is sent to an MCP server in the request's first task
    (the server's ledger has it); that task's gateway is SIGKILLed and the caller cancels the
    request before any worker takes it over. The worker that does finds the cancel in its first
    task: the request ends canceled, and the caller must be told the server may have run it
    (the lost task sent it), not a cancel of a request nothing ran."""
    redis = RedisServer()
    redis.start()
    server = McpServerProcess(tmp_path, "stateless").start()
    other: Worker | None = None
    capability = "tools-cancel"
    unread = {"circuit_breaker": {"enabled": False}, "outlier": {"enabled": False}}
    try:
        stack = new_stack(
            temporal_server,
            tmp_path,
            registry="redis",
            heartbeat_timeout=90.0,
            extra={
                "REACH_REGISTRY__REDIS_URL": redis.url,
                "REACH_POLICY__CAPABILITIES": json.dumps({capability: unread}),
            },
        )
        doomed = await GatewayProcess(stack, "doomed").ready()
        await server.ready()
        async with registered(http, doomed, server, capability), CallbackReceiver() as cb:
            warm = await invoke(
                http, doomed, capability, "echo", payload={"text": "x"}, timeout_ms=20_000
            )
            assert warm.status_code == 200, warm.text
            tag, request_id = rid(), rid()
            r = await invoke(
                http,
                doomed,
                capability,
                "count",
                request_id=request_id,
                payload={"tag": tag, "sleep_s": 120},
                timeout_ms=40_000,
                callback=cb.url,
            )
            assert r.status_code == 202, r.text
            await wait_until(lambda: runs(server, tag) == 1, 30)
            doomed.proc.kill()
            client = await Client.connect(temporal_server)
            await client.get_workflow_handle(request_id).cancel()
            other = await Worker(stack).ready()
            await cb.wait(1, timeout_s=60)
            envelope = cb.received[0][1]
    finally:
        if other is not None:
            other.proc.stop()
        server.stop()
        redis.stop()
    log = other.proc.output()[-3000:] if other is not None else ""
    assert runs(server, tag) == 1, log  # it ran, once
    error = envelope.get("error") or {}
    assert error.get("outcome_unknown") is True, (envelope, log)


async def test_a_write_a_lost_task_sent_after_a_wait_then_cancelled_says_it_may_have_run(
    temporal_server: str, tmp_path: Path, http: httpx.AsyncClient
) -> None:
    """As above, but the write was sent by the task that fired a wait's timer (its send-once
    claims were refused while the store was away, then passed): the lost task's only trace is
    its pin and send-once claim. The cancel comes before another worker takes the request
    over: it must still say the server may have run it."""
    redis = RedisServer()
    redis.start()
    server = McpServerProcess(tmp_path, "stateless").start()
    other: Worker | None = None
    try:
        async with KeyBlocker(redis.port) as blocker:
            stack = new_stack(
                temporal_server,
                tmp_path,
                registry="redis",
                heartbeat_timeout=90.0,
                extra={"REACH_REGISTRY__REDIS_URL": blocker.url},
            )
            doomed = await GatewayProcess(stack, "doomed").ready()
            await server.ready()
            async with registered(http, doomed, server, "tools-lc"), CallbackReceiver() as cb:
                tag, request_id = rid(), rid()
                blocker.blocked = {SENT}
                r = await invoke(
                    http,
                    doomed,
                    "tools-lc",
                    "count",
                    request_id=request_id,
                    payload={"tag": tag, "sleep_s": 120},
                    timeout_ms=60_000,
                    callback=cb.url,
                )
                assert r.status_code == 202, r.text
                await wait_until(lambda: blocker.dropped[SENT] >= 2, 30)
                await wait_until(
                    lambda: doomed.proc.output().count("waiting for the store") >= 2, 30
                )
                blocker.blocked = set()
                await wait_until(lambda: runs(server, tag) == 1, 30)  # sent by this task
                doomed.proc.kill()
                client = await Client.connect(temporal_server)
                await client.get_workflow_handle(request_id).cancel()
                other = await Worker(stack).ready()
                await cb.wait(1, timeout_s=60)
                envelope = cb.received[0][1]
    finally:
        if other is not None:
            other.proc.stop()
        server.stop()
        redis.stop()
    log = other.proc.output()[-3000:] if other is not None else ""
    assert runs(server, tag) == 1, log  # it ran, once
    error = envelope.get("error") or {}
    assert error.get("outcome_unknown") is True, (envelope, log)
    assert str(envelope.get("instance_id")).startswith("mcp-"), envelope  # and where it went
