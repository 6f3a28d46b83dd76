"""Hostile review of the pin claims that tell a run's own claims from a lost task's (88bb2ee,
c52b743), on real processes: a gateway SIGKILLed while an MCP server runs a keyless write, a
second worker taking the request over, and a Redis behind a proxy in this process that drops
the connection of any command on the keys it is told to (`claim:pin:`, `claim:sent:`). The MCP
server's ledger (a line per run of `count`) says what ran; the callback what the caller was told.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from temporalio.client import Client

from tests.helpers import (
    CallbackReceiver,
    GatewayProcess,
    Stack,
    Worker,
    invoke,
    redis_stack,
    rid,
    runs,
    wait_until,
)
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


@dataclass
class Scene:
    """One story's real processes: a private Redis (`redis`), the proxy in front of it
    (`blocker`), an MCP server registered as `capability` through `gateway`, a callback
    receiver, and the worker a story starts to take a request over (`other`)."""

    redis: RedisServer
    blocker: KeyBlocker
    stack: Stack
    gateway: GatewayProcess
    server: McpServerProcess
    capability: str
    cb: CallbackReceiver
    other: Worker | None = None

    def log(self) -> str:
        return self.other.proc.output()[-3000:] if self.other is not None else ""


@contextlib.asynccontextmanager
async def keyless_writes(
    temporal_server: str,
    tmp_path: Path,
    http: httpx.AsyncClient,
    capability: str,
    *,
    gateway: str = "doomed",
    proxy: type[KeyBlocker] = KeyBlocker,
    through_proxy: bool = True,
    **extra: str,
) -> AsyncIterator[Scene]:
    """A `Scene` whose gateway's Redis is behind `proxy` (or, not `through_proxy`, the
    private Redis itself); every process stopped when the block ends."""
    redis = RedisServer()
    redis.start()
    server = McpServerProcess(tmp_path, "stateless").start()
    scene: Scene | None = None
    try:
        async with proxy(redis.port) as blocker:
            url = blocker.url if through_proxy else redis.url
            stack = redis_stack(temporal_server, tmp_path, url, **extra)
            process = await GatewayProcess(stack, gateway).ready()
            await server.ready()
            async with registered(http, process, server, capability), CallbackReceiver() as cb:
                scene = Scene(redis, blocker, stack, process, server, capability, cb)
                yield scene
    finally:
        if scene is not None and scene.other is not None:
            scene.other.proc.stop()
        server.stop()
        redis.stop()


async def refused_unsent_twice(
    http: httpx.AsyncClient, scene: Scene, request_id: str, *, sleep_s: float = 120
) -> str:
    """Starts a keyless write (`count`, its tag returned) while the gateway's send-once claims
    are dropped, and waits until it was refused unsent twice (the door's route, then the
    workflow's own resolve, which pinned it) and waits for the store again."""
    tag = rid()
    scene.blocker.blocked = {SENT}
    r = await invoke(
        http,
        scene.gateway,
        scene.capability,
        "count",
        request_id=request_id,
        payload={"tag": tag, "sleep_s": sleep_s},
        timeout_ms=60_000,
        callback=scene.cb.url,
    )
    assert r.status_code == 202, r.text
    await wait_until(lambda: scene.blocker.dropped[SENT] >= 2, 30)
    await wait_until(lambda: scene.gateway.proc.output().count("waiting for the store") >= 2, 30)
    return tag


async def sent_after_a_wait(http: httpx.AsyncClient, scene: Scene, request_id: str) -> str:
    """`refused_unsent_twice`, then the claims pass: the task that fires the wait's timer
    sends it, and the server runs it."""
    tag = await refused_unsent_twice(http, scene, request_id)
    scene.blocker.blocked = set()
    await wait_until(lambda: runs(scene.server, tag) == 1, 30)  # sent by this task
    return tag


async def cancelled_then_taken_over(
    temporal_server: str, scene: Scene, request_id: str
) -> dict[str, Any]:
    """SIGKILLs the gateway, cancels `request_id`, then starts a worker that takes it over:
    the envelope the caller was sent."""
    scene.gateway.proc.kill()
    client = await Client.connect(temporal_server)
    await client.get_workflow_handle(request_id).cancel()
    scene.other = await Worker(scene.stack).ready()
    await scene.cb.wait(1, timeout_s=60)
    return scene.cb.received[0][1]


def said_it_may_have_run(scene: Scene, tag: str, envelope: dict[str, Any]) -> dict[str, Any]:
    """Asserts the server ran it once and the caller was told it may have run; its error."""
    assert runs(scene.server, tag) == 1, scene.log()  # it ran, once
    error = envelope.get("error") or {}
    assert error.get("outcome_unknown") is True, (envelope, scene.log())
    return error


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
    async with keyless_writes(temporal_server, tmp_path, http, "tools-lost") as scene:
        blocker = scene.blocker
        tag = await sent_after_a_wait(http, scene, rid())
        blocker.blocked = {SENT, PIN}
        scene.gateway.proc.kill()
        scene.other = await Worker(scene.stack).ready()
        pins = blocker.dropped[PIN]
        await wait_until(lambda: blocker.dropped[PIN] > pins, 60)  # its resolve: lost
        blocker.blocked = {SENT}
        await scene.cb.wait(1, timeout_s=90)
        envelope = scene.cb.received[0][1]
    error = said_it_may_have_run(scene, tag, envelope)
    assert error.get("retryable") is not True, (envelope, scene.log())
    assert envelope.get("instance_id", "").startswith("mcp-"), envelope  # and where it went


async def test_a_write_a_lost_task_sent_then_cancelled_says_it_may_have_run(
    temporal_server: str, tmp_path: Path, http: httpx.AsyncClient
) -> None:
    """A keyless write routed at the door is sent to an MCP server in the request's first task
    (the server's ledger has it); that task's gateway is SIGKILLed and the caller cancels the
    request before any worker takes it over. The worker that does finds the cancel in its first
    task: the request ends canceled, and the caller must be told the server may have run it
    (the lost task sent it), not a cancel of a request nothing ran."""
    capability = "tools-cancel"
    unread = {"circuit_breaker": {"enabled": False}, "outlier": {"enabled": False}}
    policy = json.dumps({capability: unread})
    async with keyless_writes(
        temporal_server,
        tmp_path,
        http,
        capability,
        through_proxy=False,  # the store as it is: nothing blocked
        REACH_POLICY__CAPABILITIES=policy,
    ) as scene:
        doomed = scene.gateway
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
            callback=scene.cb.url,
        )
        assert r.status_code == 202, r.text
        await wait_until(lambda: runs(scene.server, tag) == 1, 30)
        envelope = await cancelled_then_taken_over(temporal_server, scene, request_id)
    said_it_may_have_run(scene, tag, envelope)


async def test_a_write_a_lost_task_sent_after_a_wait_then_cancelled_says_it_may_have_run(
    temporal_server: str, tmp_path: Path, http: httpx.AsyncClient
) -> None:
    """As above, but the write was sent by the task that fired a wait's timer (its send-once
    claims were refused while the store was away, then passed): the lost task's only trace is
    its pin and send-once claim. The cancel comes before another worker takes the request
    over: it must still say the server may have run it."""
    async with keyless_writes(temporal_server, tmp_path, http, "tools-lc") as scene:
        request_id = rid()
        tag = await sent_after_a_wait(http, scene, request_id)
        envelope = await cancelled_then_taken_over(temporal_server, scene, request_id)
    error = said_it_may_have_run(scene, tag, envelope)
    assert str(envelope.get("instance_id")).startswith("mcp-"), envelope  # and where it went
    # Cancelled with no reason, from outside the fronts: not blamed on the caller.
    assert "cancelled (no reason given: an operator's cancel)" in error["message"], error
