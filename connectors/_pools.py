"""Live connections to agent instances, bounded in number and in idle time, with counters.

Every connector holds something per instance (an httpx client and its keep-alive pool, a gRPC
channel, a WebSocket) or per broker (an MQTT client). `Pools` keeps them by key:

- opened lazily on first use (`acquire`), reused after (`opened` / `reused` counters);
- closed when unused for `idle_timeout_s` by one reaper task (alive only while entries are),
  and past `max_pools` entries the least recently used goes first (`reclaimed`);
- closed when their instance leaves the registry (`discard`, `reclaimed`);
- never closed under a request in flight: the bound may be passed for as long as every older
  entry is busy, and a discarded busy entry closes when its last request ends.

`ConnectionStats` counts per (capability, protocol); connectors add `reconnected` and `failed`
themselves, since only they know what a break is in their protocol.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from typing import Generic, Literal, TypeVar

log = logging.getLogger("connectors.pools")

T = TypeVar("T")

Counter = Literal["opened", "reused", "reconnected", "reclaimed", "failed"]
COUNTERS: tuple[Counter, ...] = ("opened", "reused", "reconnected", "reclaimed", "failed")


class ConnectionStats:
    """Connection lifecycle counters of one process, per capability and protocol."""

    def __init__(self) -> None:
        self._counts: dict[tuple[str, str], dict[Counter, int]] = {}

    def count(self, capability: str, protocol: str, counter: Counter, n: int = 1) -> None:
        counts = self._counts.get((capability, protocol))
        if counts is None:
            counts = self._counts[(capability, protocol)] = dict.fromkeys(COUNTERS, 0)
        counts[counter] += n

    def snapshot(self) -> dict[tuple[str, str], dict[str, int]]:
        """(capability, protocol) -> counter -> value, a copy (for the metrics)."""
        return {
            key: {name: n for name, n in counts.items()} for key, counts in self._counts.items()
        }

    def of(self, capability: str) -> dict[str, dict[str, int]]:
        """protocol -> counter -> value, for one capability."""
        return {
            protocol: {name: value for name, value in counts.items()}
            for (cap, protocol), counts in sorted(self._counts.items())
            if cap == capability
        }


class Entry(Generic[T]):
    __slots__ = (
        "capability",
        "discarded",
        "in_flight",
        "instance_id",
        "key",
        "last_used",
        "value",
    )

    def __init__(self, key: str, capability: str, value: T, instance_id: str | None) -> None:
        self.key = key
        self.capability = capability
        self.instance_id = instance_id
        self.value = value
        self.in_flight = 0
        self.last_used = time.monotonic()
        self.discarded = False


class Pools(Generic[T]):
    def __init__(
        self,
        protocol: str,
        make: Callable[[str], T],
        close: Callable[[T], Awaitable[None]],
        *,
        idle_timeout_s: float,
        max_pools: int,
        stats: ConnectionStats | None = None,
    ) -> None:
        self.protocol = protocol
        self._make = make
        self._close_one = close
        self.idle_timeout_s = idle_timeout_s
        self.max_pools = max_pools
        self.stats = stats if stats is not None else ConnectionStats()
        self._entries: OrderedDict[str, Entry[T]] = OrderedDict()  # least recently used first
        self._reaper: asyncio.Task[None] | None = None
        self._closing: set[asyncio.Task[None]] = set()

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: object) -> bool:
        return key in self._entries

    def get(self, key: str) -> Entry[T] | None:
        return self._entries.get(key)

    def held_keys(self) -> list[str]:
        return list(self._entries)

    def instances(self) -> dict[str, str]:
        """instance_id -> capability of every entry held for one instance."""
        return {
            entry.instance_id: entry.capability
            for entry in self._entries.values()
            if entry.instance_id is not None
        }

    def discard_instance(self, instance_id: str) -> int:
        """Close every entry held for `instance_id` (see `discard`); how many."""
        keys = [k for k, e in self._entries.items() if e.instance_id == instance_id]
        return sum(self.discard(key) for key in keys)

    def acquire(
        self,
        key: str,
        capability: str,
        target: str | None = None,
        *,
        instance_id: str | None = None,
    ) -> Entry[T]:
        """The entry for `key` (made from `target`, default the key), in flight until
        `release`. `instance_id`: the one instance it serves (None: shared, like a broker); an
        entry made for none becomes the first instance's that acquires it."""
        entry = self._entries.get(key)
        if entry is not None:
            if entry.instance_id is None and instance_id is not None:
                # Opened for no instance (an MCP server's discovery, under `discovery`): the
                # instance's from now on, under its capability, the one the connection sweep
                # asks the registry about. Left under `discovery`, the sweep found no such
                # instance there and closed a live one's connections after each call.
                entry.instance_id = instance_id
                entry.capability = capability
            self._entries.move_to_end(key)
            entry.in_flight += 1
            self.stats.count(capability, self.protocol, "reused")
            return entry
        value = self._make(target if target is not None else key)
        entry = Entry(key, capability, value, instance_id)
        entry.in_flight = 1  # before evicting, so the new entry is never the one evicted
        self._entries[key] = entry
        self.stats.count(capability, self.protocol, "opened")
        if len(self._entries) > self.max_pools:
            self._close_later(self._take(time.monotonic()))
        if self._reaper is None:
            self._reaper = asyncio.get_running_loop().create_task(self._reap())
        return entry

    def release(self, entry: Entry[T]) -> None:
        entry.in_flight -= 1
        entry.last_used = time.monotonic()
        if entry.discarded and entry.in_flight == 0:
            self._close_later([entry])

    def discard(self, key: str) -> bool:
        """Close the entry for `key` now (or when its last request ends); False if none."""
        entry = self._entries.pop(key, None)
        if entry is None:
            return False
        entry.discarded = True
        if entry.in_flight == 0:
            self._close_later([entry])
        return True

    def _take(self, now: float) -> list[Entry[T]]:
        """Remove and return the entries to close: idle too long, then beyond `max_pools`."""
        over = len(self._entries) - self.max_pools
        taken = []
        for key, entry in list(self._entries.items()):
            if entry.in_flight:
                continue
            if over > 0 or now - entry.last_used >= self.idle_timeout_s:
                del self._entries[key]
                taken.append(entry)
                over -= 1
        return taken

    def _close_later(self, entries: list[Entry[T]]) -> None:
        # Off the caller's path, and in a task of its own so that cancelling the caller or the
        # reaper cannot leave a removed connection open.
        if entries:
            for entry in entries:
                self.stats.count(entry.capability, self.protocol, "reclaimed")
            task = asyncio.get_running_loop().create_task(self._close(entries))
            self._closing.add(task)
            task.add_done_callback(self._closing.discard)

    async def _close(self, entries: list[Entry[T]]) -> None:
        for entry in entries:
            try:
                await self._close_one(entry.value)
            except Exception as exc:  # its sockets are gone either way; nothing to retry
                log.debug("closing the %s connection %s failed: %r", self.protocol, entry.key, exc)

    async def _reap(self) -> None:
        try:
            while self._entries:
                await asyncio.sleep(self.idle_timeout_s / 2)
                self._close_later(self._take(time.monotonic()))
        finally:
            self._reaper = None

    async def aclose(self) -> None:
        if self._reaper is not None:
            self._reaper.cancel()
            await asyncio.gather(self._reaper, return_exceptions=True)
        entries, self._entries = self._entries, OrderedDict()
        for entry in entries.values():
            entry.discarded = True
        if entries:
            task = asyncio.get_running_loop().create_task(self._close(list(entries.values())))
            self._closing.add(task)
        await asyncio.gather(*self._closing, return_exceptions=True)
