"""How `registry.redis_url` becomes a Redis client: one server, a Sentinel-watched master, or a
Redis Cluster, each with the same failure policy (`RedisStore`'s docstring).

The URL's scheme names the topology (one way to say it, one string to set):

- `redis://`, `rediss://`, `unix://` — one server (redis-py's own URL forms);
- `redis+sentinel://[user:password@]host[:port][,host[:port]...]/<master name>[/<db>]` — the
  master the sentinels (default port 26379) name; `?sentinel_password=` (and
  `sentinel_username=`) when the sentinels require their own credentials; the URL's are the
  master's;
- `redis+cluster://[user:password@]host[:port][,host[:port]...]` — a Redis Cluster, from any of
  its nodes (default port 6379; a cluster has only database 0).

On a cluster every key of one prefix lives in one hash slot (`cluster_prefix`): the store's
scripts read and write several records at once, and a script's keys must share a slot.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import time
from collections.abc import AsyncIterator, Iterable
from dataclasses import dataclass
from typing import Any, Literal
from urllib.parse import parse_qs, unquote

import redis.asyncio as aioredis
from redis.asyncio.cluster import ClusterNode, ClusterPipeline, RedisCluster
from redis.asyncio.retry import Retry
from redis.asyncio.sentinel import Sentinel, SentinelConnectionPool
from redis.backoff import NoBackoff
from redis.exceptions import ConnectionError, RedisError
from redis.exceptions import TimeoutError as RedisTimeoutError

RedisClient = aioredis.Redis | RedisCluster
"""What the store, the policy state and the in-flight counts talk to."""

Topology = Literal["server", "sentinel", "cluster"]
SCHEMES: dict[str, Topology] = {
    "redis": "server",
    "rediss": "server",
    "unix": "server",
    "redis+sentinel": "sentinel",
    "redis+cluster": "cluster",
}
SENTINEL_PORT = 26379
REDIS_PORT = 6379
# Subscriptions hold a cluster node's connection for as long as they last, outside the
# commands' budget (`max_connections`): this many more per node, so they never starve it.
SUBSCRIPTION_CONNECTIONS = 16


@dataclass(frozen=True)
class RedisTarget:
    """A parsed `registry.redis_url`."""

    topology: Topology
    url: str
    hosts: tuple[tuple[str, int], ...] = ()
    master: str = ""
    db: int = 0
    username: str | None = None
    password: str | None = None
    sentinel_username: str | None = None
    sentinel_password: str | None = None


def _bad(url: str, why: str) -> ValueError:
    # The URL may hold a password: name its scheme and the problem, never the whole string.
    scheme = url.partition("://")[0]
    return ValueError(f"registry.redis_url ({scheme}://…): {why}")


def _host_port(part: str, default: int, url: str) -> tuple[str, int]:
    if part.startswith("["):  # [IPv6]:port
        host, _, rest = part[1:].partition("]")
        port = rest.removeprefix(":")
    else:
        host, _, port = part.rpartition(":") if ":" in part else (part, "", "")
    if not host:
        raise _bad(url, f"a host is missing in {part!r}")
    try:
        number = int(port) if port else default
    except ValueError:
        raise _bad(url, f"port {port!r} is not a number") from None
    if not 0 < number < 65536:
        raise _bad(url, f"port {number} is out of range")
    return host, number


def parse_redis_url(url: str) -> RedisTarget:
    """Which topology `url` names, and where; ValueError naming what is wrong."""
    scheme, sep, rest = url.partition("://")
    topology = SCHEMES.get(scheme.lower()) if sep else None
    if topology is None:
        known = ", ".join(f"{s}://" for s in SCHEMES)
        raise _bad(url, f"the scheme must be one of {known}")
    if topology == "server":
        return RedisTarget("server", url)
    rest, _, query = rest.partition("?")
    netloc, _, path = rest.partition("/")
    credentials, at, hosts_part = netloc.rpartition("@")
    if not at:
        hosts_part, credentials = netloc, ""
    username = password = None
    if credentials:
        user, colon, secret = credentials.partition(":")
        username = unquote(user) or None
        password = unquote(secret) if colon else None
    default = SENTINEL_PORT if topology == "sentinel" else REDIS_PORT
    hosts = tuple(_host_port(p, default, url) for p in hosts_part.split(",") if p)
    if not hosts:
        raise _bad(url, "name at least one host")
    params = {k: v[-1] for k, v in parse_qs(query, keep_blank_values=True).items()}
    segments = [unquote(s) for s in path.split("/") if s]
    if topology == "cluster":
        if params:
            raise _bad(url, f"unknown parameters {sorted(params)}")
        if segments not in ([], ["0"]):
            raise _bad(url, "a Redis Cluster has only database 0")
        return RedisTarget("cluster", url, hosts, username=username, password=password)
    unknown = set(params) - {"sentinel_username", "sentinel_password"}
    if unknown:
        raise _bad(url, f"unknown parameters {sorted(unknown)}")
    if not segments or len(segments) > 2:
        raise _bad(url, "name the master after the hosts: redis+sentinel://host:26379/mymaster")
    try:
        db = int(segments[1]) if len(segments) == 2 else 0
    except ValueError:
        raise _bad(url, f"database {segments[1]!r} is not a number") from None
    return RedisTarget(
        "sentinel",
        url,
        hosts,
        master=segments[0],
        db=db,
        username=username,
        password=password,
        sentinel_username=params.get("sentinel_username") or None,
        sentinel_password=params.get("sentinel_password") or None,
    )


def cluster_prefix(prefix: str) -> str:
    """The prefix every key of a store on a cluster starts with: `{prefix}`, a hash tag, so
    all of them share one slot. A prefix that already holds a `{tag}` is kept as it is."""
    opened = prefix.find("{")
    if opened >= 0 and prefix.find("}", opened + 1) > opened + 1:  # `{}` is no tag
        return prefix
    return "{" + prefix + "}"


def _retry() -> Retry:
    # Once, at once, only when the connection dropped (see RedisStore's failure policy).
    return Retry(NoBackoff(), 1, supported_errors=(ConnectionError,))


def connect(url: str, *, timeout_s: float, max_connections: int) -> RedisClient:
    """A client for `url` that waits (up to `timeout_s`) for one of `max_connections`
    connections, times every command out after `timeout_s` and decodes replies to str."""
    target = parse_redis_url(url)
    common: dict[str, Any] = {
        "decode_responses": True,
        "socket_timeout": timeout_s,
        "socket_connect_timeout": timeout_s,
    }
    if target.topology == "server":
        # A bounded pool that makes a command wait for a free connection: redis-py's default
        # pool fails at once past its size ("Too many connections"), turning a burst of
        # heartbeats into 503s. redis-py 8.1 defaults: a `from_url` client never retries
        # (the first command after a Redis restart fails on its dead pooled connection),
        # `Redis()` retries TimeoutError too, ten times with backoff.
        # `_Connection` for redis:// (the URL's own class wins for unix:// and rediss://).
        pool = aioredis.BlockingConnectionPool.from_url(
            url,
            max_connections=max_connections,
            timeout=timeout_s,
            retry=_retry(),
            connection_class=_Connection,
            **common,
        )
        return aioredis.Redis.from_pool(pool)
    if target.topology == "sentinel":
        sentinel_kwargs: dict[str, Any] = {
            "socket_timeout": timeout_s,
            "socket_connect_timeout": timeout_s,
            "decode_responses": True,
            "username": target.sentinel_username,
            "password": target.sentinel_password,
        }
        sentinel = Sentinel(list(target.hosts), sentinel_kwargs=sentinel_kwargs)  # type: ignore[no-untyped-call]
        client: aioredis.Redis = sentinel.master_for(
            target.master,
            redis_class=aioredis.Redis,
            connection_pool_class=_BlockingSentinelPool,
            max_connections=max_connections,
            timeout=timeout_s,
            retry=_retry(),
            db=target.db,
            username=target.username,
            password=target.password,
            **common,
        )
        return client
    return _BoundedCluster(
        startup_nodes=[ClusterNode(host, port) for host, port in target.hosts],
        username=target.username,
        password=target.password,
        max_connections=max_connections + SUBSCRIPTION_CONNECTIONS,
        retry=Retry(NoBackoff(), 1),
        max_in_flight=max_connections,
        wait_s=timeout_s,
        **common,
    )


async def close_client(client: RedisClient) -> None:
    """Close the client and what it opened for itself (a Sentinel's own connections)."""
    await client.aclose()
    pool = getattr(client, "connection_pool", None)
    if isinstance(pool, SentinelConnectionPool):
        await pool.sentinel_manager.aclose()


class _Connection(aioredis.Connection):
    """redis-py's TCP connection, writing a command under its socket timeout without a task
    of its own: redis-py bounds each write with `asyncio.wait_for`, which on Python 3.11 runs
    it as a new task (a task, a future and a timer handle for every command and pipeline, most
    of the Redis client's CPU in the gateway's background writes). Here the write is queued
    on the transport at once and only a drain that has to wait (a full socket buffer: a stuck
    Redis) waits under `asyncio.timeout`; failures end as redis-py's do (the connection
    dropped; TimeoutError, ConnectionError), so the store's failure policy holds."""

    async def send_packed_command(
        self, command: bytes | str | Iterable[bytes], check_health: bool = True
    ) -> None:
        writer = self._writer
        if not self.socket_timeout or writer is None or not self.is_connected:
            await super().send_packed_command(command, check_health)  # connects first
            return
        if check_health:
            await self.check_health()  # type: ignore[no-untyped-call]
        if isinstance(command, str):
            command = command.encode()
        try:
            if isinstance(command, bytes):
                writer.write(command)
            else:
                writer.writelines(command)
            async with asyncio.timeout(self.socket_timeout):
                await writer.drain()
        except TimeoutError:
            await self.disconnect(nowait=True)
            raise RedisTimeoutError("Timeout writing to socket") from None
        except OSError as exc:
            await self.disconnect(nowait=True)
            raise ConnectionError(f"Error while writing to socket: {exc}") from exc
        except BaseException:
            await self.disconnect(nowait=True)  # a write cut off midway: never reuse it
            raise


class _BlockingSentinelPool(SentinelConnectionPool, aioredis.BlockingConnectionPool):
    """The sentinels' master, with BlockingConnectionPool's wait for a free connection. A
    connection opened after a failover asks the sentinels again; one still open to the old
    master fails (closed by the server, or READONLY, which redis-py turns into a
    ConnectionError) and the one retry reconnects to the new master."""

    MASTER_CHECK_S = 1.0

    def __init__(self, service_name: str, sentinel_manager: Sentinel, **kwargs: Any) -> None:
        super().__init__(service_name, sentinel_manager, **kwargs)  # type: ignore[no-untyped-call]
        self._check_at = 0.0
        self._checking: asyncio.Task[None] | None = None

    async def get_connection(self, *args: Any, **kwargs: Any) -> Any:
        # A failover the sentinels ran while the old master stayed up leaves it taking writes
        # until they demote it (up to seconds), and every one of them is lost then. Asking the
        # sentinels once a second, off the command's path, moves this process over within a
        # second of the switch (and `min-replicas-to-write` on the master closes the window).
        now = time.monotonic()
        if now >= self._check_at and self._checking is None:
            self._check_at = now + self.MASTER_CHECK_S
            self._checking = asyncio.get_running_loop().create_task(self._check_master())
        return await super().get_connection(*args, **kwargs)  # type: ignore[no-untyped-call]

    async def _check_master(self) -> None:
        try:
            # When it moved, redis-py drops the idle connections (and `release` the others).
            await self.get_master_address()  # type: ignore[no-untyped-call]
        except (RedisError, OSError):
            pass  # no sentinel answers: the commands themselves will say so
        finally:
            self._checking = None

    async def disconnect(self, inuse_connections: bool = True) -> None:
        checking = self._checking
        if inuse_connections and checking is not None and checking is not asyncio.current_task():
            checking.cancel()  # the client is closing: no check outlives it
            await asyncio.gather(checking, return_exceptions=True)
        await super().disconnect(inuse_connections)

    async def release(self, connection: Any) -> None:
        # A demoted master still answers reads (it is a replica now): a connection that only
        # read would stay on it for good, reading behind the master. Once a reconnection has
        # learnt the new master, every connection to another address is dropped when it
        # comes back (redis-py's async pool never asks `owns_connection`).
        moved = self.master_address is not None and self.master_address != (
            connection.host,
            connection.port,
        )
        if moved:
            await connection.disconnect()
        await super().release(connection)


_HOLDING: contextvars.ContextVar[bool] = contextvars.ContextVar("reach_redis_slot", default=False)


class _BoundedCluster(RedisCluster):
    """A cluster client whose commands wait (up to `wait_s`) for one of `max_in_flight`
    slots, as `BlockingConnectionPool` makes them wait for a connection: redis-py's cluster
    nodes refuse a command at once past their pool size (MaxConnectionsError)."""

    def __init__(self, *, max_in_flight: int, wait_s: float, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._slots = asyncio.Semaphore(max_in_flight)
        self._wait_s = wait_s

    @contextlib.asynccontextmanager
    async def slot(self) -> AsyncIterator[None]:
        if _HOLDING.get():  # a command run from inside a pipeline's execute: already counted
            yield
            return
        try:
            async with asyncio.timeout(self._wait_s):
                await self._slots.acquire()
        except TimeoutError:
            raise ConnectionError("no free Redis connection within the timeout") from None
        token = _HOLDING.set(True)
        try:
            yield
        finally:
            _HOLDING.reset(token)
            self._slots.release()

    async def execute_command(self, *args: Any, **kwargs: Any) -> Any:
        async with self.slot():
            return await super().execute_command(*args, **kwargs)

    def pipeline(self, transaction: Any | None = None, shard_hint: Any | None = None) -> Any:
        if shard_hint:
            return super().pipeline(transaction, shard_hint)  # refused, with redis-py's words
        # redis-py's stubs call ClusterPipeline abstract; redis-py itself builds one the same way.
        return _BoundedPipeline(self, transaction)  # type: ignore[abstract]


class _BoundedPipeline(ClusterPipeline):
    async def execute(self, raise_on_error: bool = True, allow_redirections: bool = True) -> Any:
        client = self.cluster_client
        assert isinstance(client, _BoundedCluster)
        async with client.slot():
            return await super().execute(raise_on_error, allow_redirections)
