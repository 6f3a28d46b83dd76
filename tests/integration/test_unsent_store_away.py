"""A write to an agent that would run it twice (here an MCP server) whose send-once claim meets
the store away was never sent: it must not be reported as one that may have run (issue 25:
false alarms make callers give up on requests that never started).

The store is a real Redis behind a proxy in this process that drops every connection carrying
a command on a send-once claim (`sent:` keys): to the gateway the store is away exactly when the
call activity claims the send, and there for everything else (registry, routing, the attempt's
pin). Two stories through one real gateway (Temporal dev server, MCP server):

- the store comes back while the request waits for it: the request is then sent, runs once and
  succeeds. Before, the second run of the call (routed by the workflow's resolve, a local
  activity) answered `outcome_unknown` at once, the server never called;
- the store never comes back before the deadline: the request ends a retryable `unavailable`,
  not `outcome_unknown`, and the server was never called. Before, each wait re-routed the same
  attempt and resolve read this run's own pin as a lost run's (`pinned_before`), so the request
  ended "an earlier run ... may have sent it".
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest

from tests.helpers import GatewayProcess, invoke, redis_stack, rid, runs, wait_until
from tests.integration.test_connector_mcp import registered
from tests.integration.test_redis_outages import RedisServer
from tests.mcp_servers import McpServerProcess
from tests.redis_proxy import RedisProxy

pytestmark = pytest.mark.integration

SENT = b"claim:sent:"  # the send-once claims' keys (activities._sent.sent_key, in the claim space)


class ClaimBlocker(RedisProxy):
    """Drops a connection as soon as a command on a send-once claim comes through it, while
    `blocking`; everything else passes."""

    def __init__(self, upstream_port: int) -> None:
        super().__init__(upstream_port)
        self.blocking = True
        self.dropped = 0

    async def admit(self, chunk: bytes) -> bool:
        if self.blocking and SENT in chunk:
            self.dropped += 1
            return False  # the claim is not made
        return True


@pytest.fixture
async def stack(
    temporal_server: str, tmp_path: Path, http: httpx.AsyncClient
) -> AsyncIterator[tuple[GatewayProcess, McpServerProcess, ClaimBlocker]]:
    """One gateway whose Redis is behind a `ClaimBlocker`, the MCP server registered through it
    as `tools-away`."""
    redis = RedisServer()
    redis.start()
    server = McpServerProcess(tmp_path, "stateless").start()
    try:
        async with ClaimBlocker(redis.port) as blocker:
            stack = redis_stack(temporal_server, tmp_path, blocker.url, heartbeat_timeout=60.0)
            async with GatewayProcess(stack) as gateway:
                await server.ready()
                async with registered(http, gateway, server, "tools-away"):
                    yield gateway, server, blocker
    finally:
        server.stop()
        redis.stop()


async def count(
    http: httpx.AsyncClient, gateway: GatewayProcess, tag: str, timeout_ms: int
) -> httpx.Response:
    """A keyless write (the server's `count`, ledgered under `tag`), answered in the call."""
    return await invoke(
        http,
        gateway,
        "tools-away",
        "count",
        request_id=rid(),
        payload={"tag": tag},
        timeout_ms=timeout_ms,
    )


async def test_a_write_that_waited_for_its_send_claim_runs_once_when_the_store_is_back(
    stack: tuple[GatewayProcess, McpServerProcess, ClaimBlocker], http: httpx.AsyncClient
) -> None:
    gateway, server, blocker = stack
    tag = rid()
    call = asyncio.create_task(count(http, gateway, tag, 40_000))
    # Refused unsent twice (the door's route, then the workflow's own): it waits again.
    await wait_until(lambda: call.done() or blocker.dropped >= 2, 30)
    await wait_until(
        lambda: call.done() or gateway.proc.output().count("waiting for the store") >= 2, 30
    )
    blocker.blocking = False
    r = await call
    assert r.status_code == 200, r.text
    assert r.json()["status"] == "success", r.text
    assert runs(server, tag) == 1


async def test_a_write_whose_send_claim_never_met_the_store_is_retryable_not_unknown(
    stack: tuple[GatewayProcess, McpServerProcess, ClaimBlocker], http: httpx.AsyncClient
) -> None:
    gateway, server, blocker = stack
    tag = rid()
    r = await count(http, gateway, tag, 8_000)
    assert blocker.dropped >= 3, blocker.dropped  # re-routed after each wait for the store
    body = r.json()
    error = body["error"]
    assert not error.get("outcome_unknown"), body  # nothing was sent, by any run
    assert error["type"] in ("unavailable", "timeout"), body
    assert runs(server, tag) == 0
    if error["type"] == "unavailable":
        assert error["retryable"] is True, body
