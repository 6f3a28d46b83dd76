"""The Redis backend: each store operation is one Lua script, so it is atomic across gateways.

Key layout under `<prefix>:` — `rec:<id>` a hash (the caller's fields plus `_group`) with a
key TTL, `grp:<group>` the set of its members' ids, `groups` a sorted set of group names scored
by when each is forgotten (ms, Redis's own clock, so gateways' clocks never disagree),
`ctr:<key>` counters. Scripts build the old group's key from the prefix, so all keys of one
prefix must share one hash slot: on a Redis Cluster the prefix is a hash tag, `{<prefix>}:`
(`cluster_prefix`), and so is every key the policy state and the in-flight counts derive from
it (`RedisLink`). `registry.redis_url` picks the topology (`reach.store.redis_connect`).

Failure policy: a command that hits a ConnectionError (typically a pooled connection that a
restarted Redis closed) is retried once on a fresh connection; a TimeoutError (a stuck Redis)
is never retried, so callers get `Unavailable` within about `timeout_s`. The retry can run a
script twice if the connection died after Redis ran it; every script here may run twice (a
counter then skips one number, which round robin does not mind). The retry is also what
carries a command over a failover: on Sentinel a connection still open to the demoted master
fails (closed, or READONLY, which redis-py turns into a ConnectionError) and the fresh one asks
the sentinels where the master is now; on a cluster the retry re-reads the slot map first.
While no master is elected, callers get `Unavailable` (503, retryable).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, cast

from redis.asyncio.cluster import RedisCluster
from redis.commands.core import AsyncScript
from redis.exceptions import NoScriptError, RedisError

from reach.errors import Unavailable
from reach.store import _redis_scripts as lua
from reach.store.base import (
    GROUP_FIELD,
    GroupScan,
    Listener,
    Record,
    Store,
    Subscription,
    check_fields,
)
from reach.store.redis_connect import RedisClient, close_client, cluster_prefix, connect

log = logging.getLogger("reach.store")


@contextlib.contextmanager
def unavailable_on_error(prefix: str) -> Iterator[None]:
    """The one place Redis failures become a Reach error (503 `unavailable`, retryable)."""
    try:
        yield
    except RedisError as exc:
        raise Unavailable(f"registry store (redis, prefix {prefix!r}) unavailable: {exc}") from exc


def ttl_ms(seconds: float) -> int:
    """A TTL for PEXPIRE and the scripts: whole milliseconds, never 0 (0 would not expire)."""
    return max(1, int(seconds * 1000))


@dataclass(frozen=True)
class RedisLink:
    """The Redis a store keeps its data in, lent to the state that must be shared exactly as
    widely as the registry (policy counters, in-flight counts): the same client (its bounded
    pool, its timeouts, `decode_responses=True`) and the same key prefix — on a cluster the
    hash-tagged one, so their multi-key scripts' keys share a slot too."""

    client: RedisClient
    prefix: str

    def key(self, name: str) -> str:
        """`name` under this store's prefix (the module docstring lists the store's own keys)."""
        return f"{self.prefix}:{name}"


def _pairs(fields: Mapping[str, str]) -> list[str]:
    check_fields(fields)
    return [part for item in fields.items() for part in item]


SCAN_COUNT = 100
"""Members a page of a group's scan asks Redis for (SSCAN's COUNT, a hint): each is a record
parsed in Python, ~30 us."""

PRUNE_COUNT = 1000
"""The same for a prune, whose answer is only the ids it removed (Redis: ~1 us a member)."""


def _record(found: Sequence[str] | Mapping[str, str]) -> Record | None:
    """A record from HGETALL: a dict from redis-py, a flat list from a script."""
    if not found:
        return None
    if isinstance(found, Mapping):
        values = dict(found)
    else:
        values = dict(zip(found[::2], found[1::2], strict=True))
    group = values.pop(GROUP_FIELD, "")
    return Record(group, values)


class RedisStore(Store):
    """Keys live under `<prefix>:`; TTLs are Redis key expiries (they survive any gateway)."""

    backend = "redis"

    def __init__(self, client: RedisClient, prefix: str) -> None:
        self._r = client
        self._p = cluster_prefix(prefix) if isinstance(client, RedisCluster) else prefix
        self._groups = self._k("groups")
        # register_script runs EVALSHA and reloads the script after NOSCRIPT (a restarted
        # or flushed Redis), so a restart costs one extra round trip, not an error.
        self._put = client.register_script(lua.PUT)
        self._update = client.register_script(lua.UPDATE)
        self._delete = client.register_script(lua.DELETE)
        self._scan = client.register_script(lua.SCAN)
        self._prune = client.register_script(lua.PRUNE)
        self._known = client.register_script(lua.KNOWN)
        self._list = client.register_script(lua.GROUPS)
        self._expire = client.register_script(lua.EXPIRE)
        self._incr = client.register_script(lua.INCR)
        self._hash_delete = client.register_script(lua.HASH_DELETE)
        # Heartbeats are most of the store's traffic: those that arrive while a batch is on
        # the wire go together in the next one (one pipeline, one round trip).
        self._updates = _GroupCommit(client, self._update)

    @classmethod
    def from_url(
        cls, url: str, prefix: str, *, timeout_s: float = 1.0, max_connections: int = 64
    ) -> RedisStore:
        """On the server, Sentinel master or cluster `url` names (`redis_connect`)."""
        return cls(connect(url, timeout_s=timeout_s, max_connections=max_connections), prefix)

    def shared_redis(self) -> RedisLink:
        return RedisLink(self._r, self._p)

    def _k(self, key: str) -> str:
        return f"{self._p}:{key}"

    def _rec(self, record_id: str) -> str:
        return self._k(f"rec:{record_id}")

    def _grp(self, group: str) -> str:
        return self._k(f"grp:{group}")

    async def _run(self, script: AsyncScript, keys: list[str], args: list[Any]) -> Any:
        with unavailable_on_error(self._p):
            return await script(keys=keys, args=args)

    async def put_record(
        self,
        record_id: str,
        group: str,
        fields: Mapping[str, str],
        *,
        ttl_s: float,
        group_ttl_s: float,
    ) -> Record | None:
        keys = [self._rec(record_id), self._grp(group), self._groups]
        args = [
            self._grp(""),
            record_id,
            group,
            ttl_ms(ttl_s),
            ttl_ms(group_ttl_s),
            *_pairs(fields),
        ]
        return _record(await self._run(self._put, keys, args))

    async def update_record(
        self,
        record_id: str,
        fields: Mapping[str, str],
        *,
        ttl_s: float,
        group_ttl_s: float,
    ) -> Record | None:
        keys = [self._rec(record_id), self._groups]
        args = [self._grp(""), record_id, ttl_ms(ttl_s), ttl_ms(group_ttl_s), *_pairs(fields)]
        with unavailable_on_error(self._p):
            return _record(await self._updates.run(keys, args))

    async def update_records(
        self,
        updates: Sequence[tuple[str, Mapping[str, str]]],
        *,
        ttl_s: float,
        group_ttl_s: float,
    ) -> list[Record | None]:
        ttl, group_ttl, prefix = ttl_ms(ttl_s), ttl_ms(group_ttl_s), self._grp("")
        calls = [
            ([self._rec(i), self._groups], [prefix, i, ttl, group_ttl, *_pairs(fields)])
            for i, fields in updates
        ]
        with unavailable_on_error(self._p):
            return [_record(found) for found in await self._updates.run_many(calls)]

    async def delete_record(self, record_id: str) -> Record | None:
        args = [self._grp(""), record_id]
        return _record(await self._run(self._delete, [self._rec(record_id)], args))

    async def get_records(self, record_ids: Sequence[str]) -> list[Record | None]:
        if not record_ids:
            return []
        with unavailable_on_error(self._p):
            async with self._r.pipeline(transaction=False) as pipe:
                for record_id in record_ids:
                    pipe.hgetall(self._rec(record_id))
                found = await pipe.execute()
        return [_record(values) for values in found]

    async def scan_group(self, group: str) -> GroupScan:
        scan = GroupScan()
        keys, cursor = [self._grp(group)], "0"
        while True:
            cursor, live, evicted = await self._run(
                self._scan, keys, [self._rec(""), group, cursor, SCAN_COUNT]
            )
            for i in range(0, len(live), 2):
                record = _record(live[i + 1])
                if record is not None:
                    scan.live[live[i]] = record
            scan.evicted.extend(evicted)
            if str(cursor) == "0":
                return scan

    async def prune_group(self, group: str) -> list[str]:
        return (await self.prune_group_soonest(group))[0]

    async def prune_group_soonest(self, group: str) -> tuple[list[str], float | None]:
        pruned: list[str] = []
        keys, cursor, soonest_ms = [self._grp(group)], "0", -1
        while True:
            cursor, evicted, page_ms = await self._run(
                self._prune, keys, [self._rec(""), group, cursor, PRUNE_COUNT]
            )
            pruned.extend(evicted)
            if int(page_ms) >= 0 and (soonest_ms < 0 or int(page_ms) < soonest_ms):
                soonest_ms = int(page_ms)
            if str(cursor) == "0":
                # No live record with a TTL: none can expire before one is written.
                return pruned, (soonest_ms / 1000 if soonest_ms >= 0 else math.inf)

    async def group_known(self, group: str) -> bool:
        return bool(await self._run(self._known, [self._groups], [group]))

    async def groups(self) -> list[str]:
        return cast(list[str], await self._run(self._list, [self._groups], []))

    async def expire(self) -> list[str]:
        return cast(list[str], await self._run(self._expire, [self._groups], [self._grp("")]))

    async def incr(self, key: str, ttl_s: float | None = None) -> int:
        ttl = ttl_ms(ttl_s) if ttl_s is not None else 0
        return int(await self._run(self._incr, [self._k(f"ctr:{key}")], [ttl]))

    async def hash_set(self, key: str, field: str, value: str) -> None:
        with unavailable_on_error(self._p):
            await self._r.hset(self._k(f"h:{key}"), field, value)

    async def hash_all(self, key: str) -> dict[str, str]:
        with unavailable_on_error(self._p):
            found = await self._r.hgetall(self._k(f"h:{key}"))
        return {str(k): str(v) for k, v in found.items()}

    async def hash_delete(self, key: str, field: str) -> str | None:
        held = await self._run(self._hash_delete, [self._k(f"h:{key}")], [field])
        return None if held is None else str(held)

    async def publish(self, channel: str, message: str) -> None:
        with unavailable_on_error(self._p):
            await self._r.publish(self._k(f"ch:{channel}"), message)

    async def subscribe(self, channel: str, listener: Listener) -> Subscription:
        return _RedisSubscription(self._r, self._k(f"ch:{channel}"), listener)

    async def ping(self) -> bool:
        try:
            return bool(await self._r.ping())
        except RedisError:
            return False

    async def aclose(self) -> None:
        await close_client(self._r)


class _RedisSubscription(Subscription):
    """A channel read by a task of its own that reconnects (with backoff) whenever the
    connection drops, telling the listener (None) that it may have missed messages. A quiet
    connection is pinged, and one whose ping gets no answer within `PING_AFTER_S` is dropped and
    made again, so one that died silently (a half-open socket, a frozen proxy) is noticed too."""

    PING_AFTER_S = 5.0

    def __init__(self, client: RedisClient, channel: str, listener: Listener) -> None:
        self._client = client
        self._channel = channel
        self._listener = listener
        self._task = asyncio.create_task(self._run(), name=f"subscription {channel}")

    async def _run(self) -> None:
        delay_s = 0.1
        while True:
            # Every reply is read, not only messages: a ping's answer is the proof of life, and
            # with decoded responses redis-py reads a bare PONG as a bogus message it would drop
            # among the subscribe confirmations if asked to ignore those.
            pubsub = self._client.pubsub()
            try:
                await pubsub.subscribe(self._channel)
                self._listener(None)
                delay_s = 0.1
                clock = asyncio.get_running_loop().time
                quiet_since, pinged_at = clock(), None
                while True:
                    # One wait for the whole quiet spell (not a wake-up a second: three
                    # subscriptions a gateway woke its loop three times a second for nothing).
                    # Only a spell that lasted is pinged; anything read (a message, a pong, a
                    # confirmation) ends it.
                    message = await pubsub.get_message(timeout=self.PING_AFTER_S)
                    if message is None:
                        now = clock()
                        if pinged_at is not None and now - pinged_at >= self.PING_AFTER_S:
                            raise ConnectionError(
                                f"no answer to a ping within {self.PING_AFTER_S:g} s"
                            )
                        if pinged_at is None and now - quiet_since >= self.PING_AFTER_S:
                            await pubsub.ping()
                            pinged_at = now
                        continue
                    quiet_since, pinged_at = clock(), None  # it answered: alive
                    if message.get("type") == "message":
                        self._listener(str(message["data"]))
            except asyncio.CancelledError:
                raise
            except (RedisError, OSError) as exc:
                log.warning("subscription %s lost (%s); reconnecting", self._channel, exc)
            except Exception:
                log.exception("subscription %s failed; reconnecting", self._channel)
            finally:
                with contextlib.suppress(Exception):
                    await asyncio.shield(pubsub.aclose())  # type: ignore[no-untyped-call]
            await asyncio.sleep(delay_s)
            delay_s = min(2.0, delay_s * 2)

    async def aclose(self) -> None:
        self._task.cancel()
        await asyncio.gather(self._task, return_exceptions=True)


class _GroupCommit:
    """Runs one script for many callers: a call made while `max_on_wire` batches are out
    waits for the next batch, sent as one pipeline of EVALSHA. Under load a round trip carries
    many calls; alone, a call goes at once. Each caller gets its own result or error."""

    def __init__(
        self,
        client: RedisClient,
        script: AsyncScript,
        max_batch: int = 256,
        max_on_wire: int = 4,
    ) -> None:
        self._client = client
        self._script = script
        self._max_batch = max_batch
        self._max_on_wire = max_on_wire
        self._queue: list[tuple[list[str], list[Any], asyncio.Future[Any]]] = []
        self._on_wire = 0
        self._tasks: set[asyncio.Task[None]] = set()

    async def run(self, keys: list[str], args: list[Any]) -> Any:
        future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._queue.append((keys, args, future))
        if self._on_wire < self._max_on_wire:
            self._on_wire += 1
            task = asyncio.create_task(self._drain())
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
        return await future

    async def run_many(self, calls: Sequence[tuple[list[str], list[Any]]]) -> list[Any]:
        """Many calls of one caller: queued together, so they share the next round trips
        (`max_batch` to a pipeline); the first error is raised."""
        if not calls:
            return []
        loop = asyncio.get_running_loop()
        futures: list[asyncio.Future[Any]] = []
        for keys, args in calls:
            future: asyncio.Future[Any] = loop.create_future()
            self._queue.append((keys, args, future))
            futures.append(future)
        wanted = -(-len(self._queue) // self._max_batch)  # batches waiting, rounded up
        while self._on_wire < min(self._max_on_wire, wanted):
            self._on_wire += 1
            task = asyncio.create_task(self._drain())
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
        return list(await asyncio.gather(*futures))

    async def _drain(self) -> None:
        try:
            while self._queue:
                batch = self._queue[: self._max_batch]
                del self._queue[: self._max_batch]
                await self._send(batch)
        finally:
            self._on_wire -= 1

    async def _send(self, batch: list[tuple[list[str], list[Any], asyncio.Future[Any]]]) -> None:
        try:
            if len(batch) == 1:
                keys, args, future = batch[0]
                results: list[Any] = [await self._script(keys=keys, args=args)]
            else:
                async with self._client.pipeline(transaction=False) as pipe:
                    for keys, args, _ in batch:
                        # The raw command: a cluster pipeline refuses `evalsha()`, though it
                        # routes EVALSHA by its keys like any other command.
                        pipe.execute_command("EVALSHA", self._script.sha, len(keys), *keys, *args)
                    results = await pipe.execute(raise_on_error=False)
                for n, result in enumerate(results):
                    if isinstance(result, NoScriptError):  # a restarted Redis: load it again
                        keys, args, _ = batch[n]
                        results[n] = await self._script(keys=keys, args=args)
        except BaseException as exc:
            for _, _, future in batch:
                if not future.done():
                    future.set_exception(exc)
            if not isinstance(exc, Exception):
                raise
            return
        for (_, _, future), result in zip(batch, results, strict=True):
            if future.done():
                continue
            if isinstance(result, BaseException):
                future.set_exception(result)
            else:
                future.set_result(result)
