"""Revocation that outlives Redis (issue 25): a revoked token stays revoked when the Redis that
holds the tokens restarts empty under a running gateway, when it is restored from a snapshot
taken before the revocation and a gateway starts on it, and `reach tokens revoke` still finds a
token a flushed Redis forgot. A Redis of the test's own, on a free port (never the machine's)."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from gateway_api.devserver import free_port
from tests.conftest import new_stack
from tests.helpers import GatewayProcess, wait_until
from tests.integration.test_auth import bearer, cli, issue_cli
from tests.redis_servers import HOST, RedisProcess

pytestmark = pytest.mark.integration


@pytest.fixture
def redis_server(tmp_path: Path) -> Iterator[RedisProcess]:
    port = free_port()
    work = tmp_path / "redis"
    args = ["--port", str(port), "--bind", HOST, "--dir", str(work), "--save", ""]
    server = RedisProcess(port, work, [*args, "--appendonly", "no"]).start()
    try:
        yield server
    finally:
        server.stop()


def restart(server: RedisProcess, snapshot: Path | None) -> None:
    """SIGKILL, then start on `snapshot` (None: empty)."""
    server.kill()
    dump = server.workdir / "dump.rdb"
    dump.unlink(missing_ok=True)
    if snapshot is not None:
        shutil.copy(snapshot, dump)
    server.start()


def stored(server: RedisProcess) -> dict[str, dict[str, object]]:
    """The token records Redis holds now, by id."""
    client = server.client()
    try:
        found: dict[str, dict[str, object]] = {}
        for key in client.keys("*h:auth:tokens"):
            found.update({i: json.loads(v) for i, v in client.hgetall(key).items()})
        return found
    finally:
        client.close()


async def test_a_revocation_survives_redis_restarted_empty_or_from_an_older_snapshot(
    temporal_server: str, tmp_path: Path, http: httpx.AsyncClient, redis_server: RedisProcess
) -> None:
    stack = new_stack(
        temporal_server,
        tmp_path,
        registry="redis",
        key_prefix="durable",
        extra={
            "REACH_REGISTRY__REDIS_URL": f"redis://{HOST}:{redis_server.port}/0",
            "REACH_AUTH__RESYNC_S": "0.5",
        },
    )
    caller, caller_id = issue_cli(stack, "--principal", "orchestrator")
    former, former_id = issue_cli(stack, "--principal", "former")
    client = redis_server.client()
    client.save()
    client.close()
    before = tmp_path / "before-revocation.rdb"
    shutil.copy(redis_server.workdir / "dump.rdb", before)

    async def status(gateway: GatewayProcess, token: str | None) -> int:
        headers = bearer(token) if token else {}
        return (await http.get(f"{gateway.url}/reach/capabilities", headers=headers)).status_code

    async with GatewayProcess(stack, "first") as gateway:
        assert await status(gateway, former) == 200
        done = cli(stack, "tokens", "revoke", former_id)
        assert done.returncode == 0, done.stderr

        async def refused() -> bool:
            return await status(gateway, former) == 401

        await wait_until(refused, 10)

        # Redis restarts empty under the running gateway: it keeps its copy and writes it back.
        restart(redis_server, None)
        await wait_until(lambda: stored(redis_server).keys() == {caller_id, former_id}, 15)
        assert stored(redis_server)[former_id]["revoked_at"] is not None
        assert await status(gateway, former) == 401
        assert await status(gateway, caller) == 200
        assert await status(gateway, None) == 401  # the door stays closed
        assert "writing this gateway's copy back" in gateway.proc.output()

    # Restored from the snapshot taken before the revocation, with no gateway running: the
    # host's mirror of the records still knows, and the next gateway re-asserts it.
    restart(redis_server, before)
    assert stored(redis_server)[former_id]["revoked_at"] is None
    async with GatewayProcess(stack, "second") as gateway:
        assert await status(gateway, former) == 401
        assert await status(gateway, caller) == 200
        await wait_until(lambda: stored(redis_server)[former_id]["revoked_at"] is not None, 10)

    # A flushed Redis and no gateway: `reach tokens revoke` finds the id in the mirror.
    restart(redis_server, None)
    done = cli(stack, "tokens", "revoke", caller_id)
    assert done.returncode == 0, done.stderr
    assert stored(redis_server)[caller_id]["revoked_at"] is not None
