"""A Redis that restarts or hangs, seen through the registry.

Each test runs its own throwaway `redis-server` on a free port (never the machine's Redis):
a restart must not reach callers, a stuck Redis must be a quick 503 rather than a hang.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import AsyncIterator, Iterator

import pytest

from gateway_api.devserver import free_port
from reach.config import RegistrySettings
from reach.errors import Unavailable
from reach.registry import HealthReport, JoinRequest, Registry
from reach.store.redis import RedisStore

pytestmark = pytest.mark.integration

TIMEOUT_S = 0.5
SETTINGS = RegistrySettings(heartbeat_timeout=30, heartbeat_interval=5)


class RedisServer:
    def __init__(self) -> None:
        self.port = free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        exe = shutil.which("redis-server")
        if exe is None:
            pytest.fail("redis-server is not on PATH")
        args = [exe, "--port", str(self.port), "--bind", "127.0.0.1"]
        args += ["--save", "", "--appendonly", "no"]
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            with socket.socket() as s:
                s.settimeout(0.2)
                if s.connect_ex(("127.0.0.1", self.port)) == 0:
                    return
            time.sleep(0.02)
        pytest.fail(f"redis-server did not listen on {self.port}")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGCONT)
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def signal(self, sig: signal.Signals) -> None:
        assert self.proc is not None
        os.kill(self.proc.pid, sig)


@pytest.fixture
def server() -> Iterator[RedisServer]:
    srv = RedisServer()
    srv.start()
    try:
        yield srv
    finally:
        srv.stop()


@pytest.fixture
async def store(server: RedisServer) -> AsyncIterator[RedisStore]:
    s = RedisStore.from_url(server.url, prefix="outage", timeout_s=TIMEOUT_S)
    try:
        yield s
    finally:
        await s.aclose()


def join(instance_id: str) -> JoinRequest:
    return JoinRequest(
        capability="retriever", instance_id=instance_id, service_address="127.0.0.1:9000"
    )


async def test_a_restart_does_not_reach_callers(server: RedisServer, store: RedisStore) -> None:
    reg = Registry(store, SETTINGS)
    # Several pooled connections, all of which the restart will close under the client.
    await asyncio.gather(*(reg.join(join(f"i{n}")) for n in range(8)))
    server.stop()
    server.start()
    # Data is gone (no persistence) and so are the loaded scripts: both must be handled.
    results = await asyncio.gather(*(reg.join(join(f"j{n}")) for n in range(8)))
    assert [a.instance_id for a in results] == [f"j{n}" for n in range(8)]
    await reg.heartbeat("j0", HealthReport())
    assert len(await reg.instances("retriever")) == 8
    assert await reg.known("retriever")
    assert await store.ping()


async def test_redis_down_is_unavailable_at_once(server: RedisServer, store: RedisStore) -> None:
    reg = Registry(store, SETTINGS)
    await reg.join(join("a"))
    server.stop()
    started = time.monotonic()
    with pytest.raises(Unavailable):
        await reg.join(join("b"))
    assert await store.ping() is False
    assert time.monotonic() - started < TIMEOUT_S  # refused: no timeout, no backoff


@pytest.mark.parametrize("pooled", [True, False], ids=["pooled", "fresh"])
async def test_a_stuck_redis_is_unavailable_within_the_timeout(
    server: RedisServer, store: RedisStore, pooled: bool
) -> None:
    reg = Registry(store, SETTINGS)
    if pooled:
        await reg.join(join("a"))
    server.signal(signal.SIGSTOP)
    try:
        started = time.monotonic()
        with pytest.raises(Unavailable) as err:
            await reg.join(join("b"))
        assert err.value.http_status == 503
        assert time.monotonic() - started < 2 * TIMEOUT_S
        started = time.monotonic()
        assert await store.ping() is False
        assert time.monotonic() - started < 2 * TIMEOUT_S
    finally:
        server.signal(signal.SIGCONT)
    assert await store.ping()
    await reg.join(join("b"))
    assert {i.instance_id for i in await reg.instances("retriever")} >= {"b"}
