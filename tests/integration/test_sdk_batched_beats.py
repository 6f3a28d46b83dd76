"""An agent process hosting several instances (several AgentRuntimes in one event loop, the
same gateway) sends their heartbeats as one batch a round (POST /reach/heartbeats) instead of
one PUT each; an instance the gateway forgot joins again from inside the batch. A real gateway
process, seen through a byte-counting TCP proxy that tells the two kinds of request apart."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest

from agent_reach_sdk import AgentRuntime
from tests.helpers import GatewayProcess, wait_until

pytestmark = pytest.mark.integration

BATCH = b"POST /reach/heartbeats "
SINGLE = b"/heartbeat HTTP/1.1"


class CountingProxy:
    """Forwards every connection to the gateway and counts the request lines it sees."""

    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self.counts = {BATCH: 0, SINGLE: 0}
        self.server: asyncio.Server | None = None

    @property
    def url(self) -> str:
        assert self.server is not None
        return f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"

    async def __aenter__(self) -> CountingProxy:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self.server is not None
        self.server.close()
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self.server.wait_closed(), 5)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.target_port)

        async def pipe(src: asyncio.StreamReader, dst: asyncio.StreamWriter, count: bool) -> None:
            tail = b""
            try:
                while chunk := await src.read(65536):
                    if count:
                        seen = tail + chunk
                        for mark in self.counts:
                            self.counts[mark] += seen.count(mark) - tail.count(mark)
                        tail = seen[-64:]
                    dst.write(chunk)
                    await dst.drain()
            except (ConnectionError, asyncio.CancelledError):
                pass
            finally:
                dst.close()

        await asyncio.gather(pipe(reader, up_writer, True), pipe(up_reader, writer, False))


@pytest.fixture
async def proxy(gateway: GatewayProcess) -> AsyncIterator[CountingProxy]:
    async with CountingProxy(int(gateway.url.rsplit(":", 1)[1])) as found:
        yield found


def runtime_for(url: str, capability: str, n: int) -> AgentRuntime:
    runtime = AgentRuntime(
        capability,
        reach_address=url,
        instance_id=f"{capability}-{n}",
        protocol="http",
        service_address="127.0.0.1:0",
        heartbeat_interval=0.5,
    )

    @runtime.operation("query")
    async def query(payload: dict[str, Any]) -> dict[str, Any]:
        return {"n": n}

    return runtime


async def test_instances_of_one_process_beat_in_one_batch(
    gateway: GatewayProcess, proxy: CountingProxy, http: httpx.AsyncClient, capability: str
) -> None:
    runtimes = [runtime_for(proxy.url, capability, n) for n in range(3)]
    async with contextlib.AsyncExitStack() as stack:
        for runtime in runtimes:
            await stack.enter_async_context(runtime)

        async def instances() -> dict[str, str]:
            r = await http.get(f"{gateway.url}/reach/capabilities/{capability}")
            return {i["instance_id"]: i["status"] for i in r.json().get("instances", [])}

        async def all_three() -> bool:
            return len(await instances()) == 3

        await wait_until(all_three, 15)
        await wait_until(lambda: proxy.counts[BATCH] >= 2, 15)
        # From now on every round is one batch: no single heartbeat goes out (the stack's
        # heartbeat timeout is 3 s, so a missing beat would also evict an instance).
        singles, batches = proxy.counts[SINGLE], proxy.counts[BATCH]
        await wait_until(lambda: proxy.counts[BATCH] >= batches + 6, 15)
        assert proxy.counts[SINGLE] == singles
        assert await all_three()

        # An instance the gateway forgot hears unknown_instance in its entry and joins again.
        gone = f"{capability}-1"
        r = await http.delete(f"{gateway.url}/reach/agents/{gone}")
        assert r.status_code == 204, r.text

        async def back() -> bool:
            return gone in await instances()

        await wait_until(back, 15)
        batches = proxy.counts[BATCH]
        await wait_until(lambda: proxy.counts[BATCH] >= batches + 3, 15)
        assert await all_three()
