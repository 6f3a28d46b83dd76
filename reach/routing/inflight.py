"""Requests in flight per instance, as every gateway and worker together sees them (R12, R17).

Each process counts its own calls exactly and at once (`begin`/`end` around the agent call,
and a short `reserve` from the moment routing picks an instance until the call begins, so a
burst of picks does not all land on the one that looked idle). With the Redis store, every
process also writes its calls to one sorted set per capability, `<prefix>:inf:<capability>`,
a member per call scored by its lease's end (Redis's clock): the process renews the leases of
its live calls every third of `lease_s`, so the calls of a process that was killed expire
within `lease_s` instead of leaking. On a Redis Cluster `<prefix>` is the store's hash tag
(`{<prefix>}`), so every capability's set lives in the registry's slot. Writes are
fire-and-forget, gathered for `write_delay_s` into one pipeline (a call that began and ended
within it is never written: nothing to add, nothing to remove); other processes' counts are
re-read in the background when older than `refresh_s`, so routing never waits for the store.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import os
import secrets
import socket
import time
from collections.abc import Iterator, Mapping
from typing import Any

from redis.exceptions import NoScriptError, RedisError

from reach.routing.latency import Latency
from reach.store import Store

log = logging.getLogger("reach.routing.inflight")

RESERVATION_S = 2.0
# How long the in-flight writer gathers begins and ends before one pipeline takes them all:
# a tenth of the default refresh (other processes read the counts at most that often anyway).
WRITE_DELAY_S = 0.01
# A failed call (unreachable, 5xx, timeout) is observed as at least this many times the
# capability's typical latency: an instance failing fast must not look like the fastest.
FAILURE_PENALTY = 5.0
_SEP = "\x1f"

# KEYS: the capability's set. ARGV: lease ms, members... (adds or renews each).
_LEASE = """
local t = redis.call('TIME')
local ends = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000) + tonumber(ARGV[1])
for i = 2, #ARGV do redis.call('ZADD', KEYS[1], ends, ARGV[i]) end
redis.call('PEXPIRE', KEYS[1], 3 * tonumber(ARGV[1]))
return 1
"""

# KEYS: the capability's set. Returns the members whose lease has not ended.
_READ = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
return redis.call('ZRANGE', KEYS[1], 0, -1)
"""


class Call:
    """One call in flight, as `begin` returned it (pass it to `end`)."""

    __slots__ = ("capability", "instance_id", "member", "started")

    def __init__(self, capability: str, instance_id: str, member: str) -> None:
        self.capability = capability
        self.instance_id = instance_id
        self.member = member
        self.started = time.monotonic()


class Loads(Mapping[str, int]):
    """Calls in flight per instance: this process's plus the others' (as last read), summed
    on lookup — never merged whole, so a pick costs the same at 10 or 10,000 busy instances."""

    __slots__ = ("_others", "_own", "total")

    def __init__(self, own: Mapping[str, int], others: Mapping[str, int], total: int) -> None:
        self._own = own
        self._others = others
        self.total = total

    def get(self, key: str, default: int = 0) -> int:  # type: ignore[override]
        n = self._own.get(key, 0) + self._others.get(key, 0)
        return n if n else default

    def __getitem__(self, key: str) -> int:
        n = self.get(key)
        if not n:
            raise KeyError(key)
        return n

    def __iter__(self) -> Iterator[str]:
        yield from self._own
        yield from (k for k in self._others if k not in self._own)

    def __len__(self) -> int:
        return sum(1 for _ in self)


class InflightTracker:
    """This process's calls, counted exactly (one process: the memory store)."""

    def __init__(self) -> None:
        self.process = f"{socket.gethostname()}:{os.getpid()}:{secrets.token_hex(3)}"
        self._own: dict[str, dict[str, int]] = {}
        self._totals: dict[str, int] = {}
        self._latency: dict[str, Latency] = {}
        self._reserved: dict[str, tuple[str, str, float]] = {}
        self._seq = itertools.count(1)

    # -- counting -------------------------------------------------------------------------

    def reserve(self, capability: str, instance_id: str, key: str) -> None:
        """Count a call routing just sent to `instance_id` until `begin(..., key)` takes it
        over, or for `RESERVATION_S` (its call may run in another process)."""
        self._expire_reservations()
        if key in self._reserved:
            return
        self._reserved[key] = (capability, instance_id, time.monotonic() + RESERVATION_S)
        self._add(capability, instance_id, 1)

    def cancel(self, key: str) -> None:
        """Drop a reservation whose call will not run (its request was already running)."""
        reserved = self._reserved.pop(key, None)
        if reserved is not None:
            self._add(reserved[0], reserved[1], -1)

    def begin(self, capability: str, instance_id: str, key: str | None = None) -> Call:
        reserved = self._reserved.pop(key, None) if key else None
        if reserved is not None:
            self._add(reserved[0], reserved[1], -1)
        self._add(capability, instance_id, 1)
        call = Call(
            capability, instance_id, f"{instance_id}{_SEP}{self.process}{_SEP}{next(self._seq)}"
        )
        self._shared_begin(call)
        return call

    def end(self, call: Call, *, failed: bool = False) -> None:
        """The call is over; its time feeds the instance's latency (`failed`: penalized)."""
        self._add(call.capability, call.instance_id, -1)
        self._shared_end(call)
        now = time.monotonic()
        latency = self.latency(call.capability)
        ms = (now - call.started) * 1000
        if failed:
            ms = max(ms, FAILURE_PENALTY * latency.typical())
        latency.observe(call.instance_id, ms, now)

    def latency(self, capability: str) -> Latency:
        found = self._latency.get(capability)
        if found is None:
            found = self._latency[capability] = Latency()
        return found

    def forget(self, capability: str, instance_id: str) -> None:
        """The instance left `capability` (or was evicted): its latency is not kept (a fleet
        that churns would otherwise leave an entry behind for every instance it ever had)."""
        latency = self._latency.get(capability)
        if latency is not None:
            latency.drop(instance_id)

    def loads(self, capability: str) -> Loads:
        """What routing reads: the calls in flight per instance, and their total."""
        self._expire_reservations()
        return Loads(self._own.get(capability, _EMPTY), _EMPTY, self._totals.get(capability, 0))

    async def refresh(self, capability: str) -> None:
        """Re-read other processes' counts now (none here)."""
        return None

    async def fresh(self, capability: str) -> None:
        """Make sure other processes' counts are recent before routing (none here)."""
        return None

    def recent(self, capability: str) -> bool:
        """Whether routing may use the counts as they are, without waiting (`fresh`)."""
        return True

    def counts(self, capability: str) -> dict[str, int]:
        """Calls in flight per instance of `capability`, merged (instances with none are
        absent); routing reads `loads` instead, which merges nothing."""
        return dict(self.loads(capability))

    def own_counts(self) -> dict[str, dict[str, int]]:
        """This process's own calls in flight, per capability and instance (not the other
        processes' it reads from Redis): what its metrics report, each process its own."""
        self._expire_reservations()  # as routing's own reads do: a lapsed pick is no call
        return {capability: dict(counts) for capability, counts in self._own.items()}

    def _add(self, capability: str, instance_id: str, n: int) -> None:
        total = self._totals.get(capability, 0) + n
        if total > 0:
            self._totals[capability] = total
        else:
            self._totals.pop(capability, None)
        counts = self._own.setdefault(capability, {})
        value = counts.get(instance_id, 0) + n
        if value > 0:
            counts[instance_id] = value
        else:
            counts.pop(instance_id, None)
            if not counts:
                del self._own[capability]

    def _expire_reservations(self) -> None:
        if not self._reserved:
            return
        now = time.monotonic()
        # Insertion order is expiry order (every reservation lasts RESERVATION_S).
        while self._reserved:
            key, (capability, instance_id, ends) = next(iter(self._reserved.items()))
            if ends > now:
                break
            del self._reserved[key]
            self._add(capability, instance_id, -1)

    # -- sharing (none here) --------------------------------------------------------------

    def _shared_begin(self, call: Call) -> None:
        return None

    def _shared_end(self, call: Call) -> None:
        return None

    async def start(self) -> None:
        return None

    async def aclose(self) -> None:
        return None


_EMPTY: Mapping[str, int] = {}


class SharedInflightTracker(InflightTracker):
    """Counts shared through Redis by every process on the same prefix."""

    def __init__(
        self,
        client: Any,
        prefix: str,
        *,
        lease_s: float = 10.0,
        refresh_s: float = 0.1,
        write_delay_s: float = WRITE_DELAY_S,
    ) -> None:
        super().__init__()
        self._r = client
        self._prefix = prefix
        self.lease_s = lease_s
        self.refresh_s = refresh_s
        self.write_delay_s = write_delay_s
        self._lease = client.register_script(_LEASE)
        self._read = client.register_script(_READ)
        self._live: dict[str, dict[str, Call]] = {}  # capability -> member -> call
        # ("begin" | "add" (a renewal) | "rem", capability, member), in the order they happened
        self._ops: list[tuple[str, str, str]] = []
        self._wake = asyncio.Event()
        self._others: dict[str, tuple[float, dict[str, int], int]] = {}
        self._refreshing: dict[str, asyncio.Task[None]] = {}
        self._tasks: list[asyncio.Task[None]] = []
        self._write_lock = asyncio.Lock()  # one pipeline at a time: writes land in order
        self._warned = 0.0

    def _key(self, capability: str) -> str:
        return f"{self._prefix}:inf:{capability}"

    async def start(self) -> None:
        self._tasks = [
            asyncio.create_task(self._writer(), name="inflight writer"),
            asyncio.create_task(self._renewer(), name="inflight leases"),
        ]

    async def aclose(self) -> None:
        for task in [*self._tasks, *self._refreshing.values()]:
            task.cancel()
        await asyncio.gather(*self._tasks, *self._refreshing.values(), return_exceptions=True)
        # The removals still gathered go first (their calls' members were written before);
        # then leave nothing behind for the others to count until the leases end.
        await self._write()
        if any(self._live.values()):
            with contextlib.suppress(RedisError, OSError):
                async with self._r.pipeline(transaction=False) as pipe:
                    for capability, calls in self._live.items():
                        if calls:
                            pipe.zrem(self._key(capability), *calls)
                    await pipe.execute()

    def _shared_begin(self, call: Call) -> None:
        self._live.setdefault(call.capability, {})[call.member] = call
        self._ops.append(("begin", call.capability, call.member))
        self._wake.set()

    def _shared_end(self, call: Call) -> None:
        calls = self._live.get(call.capability)
        if calls is None or calls.pop(call.member, None) is None:
            return
        if not calls:
            del self._live[call.capability]
        self._ops.append(("rem", call.capability, call.member))
        self._wake.set()

    def loads(self, capability: str) -> Loads:
        self._expire_reservations()
        own = self._own.get(capability, _EMPTY)
        own_total = self._totals.get(capability, 0)
        self._maybe_refresh(capability)
        seen = self._others.get(capability)
        # Counts older than a lease may belong to calls long over: better none than those.
        if seen is None or not seen[1] or time.monotonic() - seen[0] > self.lease_s:
            return Loads(own, _EMPTY, own_total)
        return Loads(own, seen[1], own_total + seen[2])

    def _maybe_refresh(self, capability: str) -> None:
        seen = self._others.get(capability)
        if (
            seen is None or time.monotonic() - seen[0] >= self.refresh_s
        ) and capability not in self._refreshing:
            task = asyncio.get_running_loop().create_task(self._refresh(capability))
            self._refreshing[capability] = task

    async def _refresh(self, capability: str) -> None:
        try:
            members = await self._read(keys=[self._key(capability)], args=[])
            others: dict[str, int] = {}
            mine = f"{_SEP}{self.process}{_SEP}"
            for member in members:
                if mine in member:
                    continue
                instance_id = member.partition(_SEP)[0]
                others[instance_id] = others.get(instance_id, 0) + 1
            self._others[capability] = (time.monotonic(), others, sum(others.values()))
        except (RedisError, OSError) as exc:
            self._warn(f"in-flight counts of {capability!r} not read: {exc}")
            # Keep what was known; try again after the usual interval.
            old = self._others.get(capability)
            self._others[capability] = (time.monotonic(), *(old[1:] if old else ({}, 0)))
        finally:
            self._refreshing.pop(capability, None)

    async def refresh(self, capability: str) -> None:
        """Re-read the other processes' counts now (status pages, tests, benchmarks)."""
        await self._refresh(capability)

    def recent(self, capability: str) -> bool:
        seen = self._others.get(capability)
        if seen is not None and time.monotonic() - seen[0] < 3 * self.refresh_s:
            return True
        self._maybe_refresh(capability)
        return False

    async def fresh(self, capability: str) -> None:
        """Before routing: counts read within the last few `refresh_s` are used as they are
        (re-read in the background); older ones — a capability not routed here for a while —
        are re-read first, one round trip, so a quiet process does not route on old news."""
        seen = self._others.get(capability)
        if seen is not None and time.monotonic() - seen[0] < 3 * self.refresh_s:
            return
        running = self._refreshing.get(capability)
        if running is not None:
            await asyncio.shield(running)
        else:
            await self._refresh(capability)

    async def flush(self) -> None:
        """Write what is queued now (tests, benchmarks)."""
        async with self._write_lock:
            await self._write()

    async def _writer(self) -> None:
        while True:
            await self._wake.wait()
            # Off the calls' path: what begins and ends meanwhile goes in the same pipeline.
            await asyncio.sleep(self.write_delay_s)
            self._wake.clear()
            async with self._write_lock:
                await self._write()

    async def _write(self) -> None:
        ops, self._ops = _unwritten(self._ops), []
        if not ops:
            return
        try:
            try:
                await self._send(ops)
            except NoScriptError:
                # A Redis that restarted (or a cluster node that never saw the script): load
                # it and send the same writes again, each of which may run twice.
                await self._r.script_load(_LEASE)
                await self._send(ops)
        except (RedisError, OSError) as exc:
            # Lost adds undercount until the next renewal; lost removals end with their lease.
            self._warn(f"in-flight counts not written: {exc}")

    async def _send(self, ops: list[tuple[str, str, str]]) -> None:
        # EVALSHA queued by hand: a plain pipeline handed the script would first ask the
        # server whether it knows it (SCRIPT EXISTS, a round trip per write), and a cluster
        # pipeline refuses `evalsha()` though it routes the raw command by its keys. NOSCRIPT
        # is handled once, by the caller.
        lease_ms = int(self.lease_s * 1000)
        async with self._r.pipeline(transaction=False) as pipe:
            for op, capability, member in ops:
                if op != "rem":
                    pipe.execute_command(
                        "EVALSHA", self._lease.sha, 1, self._key(capability), lease_ms, member
                    )
                else:
                    pipe.zrem(self._key(capability), member)
            await pipe.execute()

    async def _renewer(self) -> None:
        # Renewals go through the writer's queue like every other write: one writer, in
        # order, so a renewal can never land after the removal of the call it renews.
        while True:
            await asyncio.sleep(self.lease_s / 3)
            for capability, calls in list(self._live.items()):
                for member in list(calls):
                    self._ops.append(("add", capability, member))
            self._wake.set()

    def _warn(self, message: str) -> None:
        now = time.monotonic()
        if now - self._warned >= 10.0:
            self._warned = now
            log.warning("%s", message)


def _unwritten(ops: list[tuple[str, str, str]]) -> list[tuple[str, str, str]]:
    """`ops` without the calls that began and ended among them: never written, so there is
    nothing to add and nothing to remove (a renewal of one of them neither)."""
    begun = {member for op, _, member in ops if op == "begin"}
    if not begun:
        return ops
    over = {member for op, _, member in ops if op == "rem" and member in begun}
    return [entry for entry in ops if entry[2] not in over] if over else ops


def create_inflight(
    store: Store,
    *,
    lease_s: float = 10.0,
    refresh_s: float = 0.1,
) -> InflightTracker:
    """Shared through the store's Redis when it has one; this process alone otherwise."""
    redis = store.shared_redis()
    if redis is not None:
        return SharedInflightTracker(
            redis.client, redis.prefix, lease_s=lease_s, refresh_s=refresh_s
        )
    return InflightTracker()


__all__ = [
    "Call",
    "InflightTracker",
    "Latency",
    "Loads",
    "SharedInflightTracker",
    "create_inflight",
]
