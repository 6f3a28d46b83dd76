from __future__ import annotations

import time
from collections.abc import Callable, Sequence

from reach.store.base import Store


class MemoryStore(Store):
    """One process only. Single-threaded asyncio access needs no locks: no method awaits."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._values: dict[str, tuple[str, float | None]] = {}
        self._sets: dict[str, set[str]] = {}
        self._counters: dict[str, int] = {}

    def _live(self, key: str) -> str | None:
        item = self._values.get(key)
        if item is None:
            return None
        value, expires = item
        if expires is not None and self._clock() >= expires:
            del self._values[key]
            return None
        return value

    async def put(self, key: str, value: str, ttl_s: float | None = None) -> None:
        expires = self._clock() + ttl_s if ttl_s is not None else None
        self._values[key] = (value, expires)

    async def get_many(self, keys: Sequence[str]) -> list[str | None]:
        return [self._live(k) for k in keys]

    async def delete(self, key: str) -> bool:
        return self._values.pop(key, None) is not None

    async def add_member(self, set_key: str, member: str) -> None:
        self._sets.setdefault(set_key, set()).add(member)

    async def remove_member(self, set_key: str, member: str) -> None:
        self._sets.get(set_key, set()).discard(member)

    async def members(self, set_key: str) -> set[str]:
        return set(self._sets.get(set_key, ()))

    async def is_member(self, set_key: str, member: str) -> bool:
        return member in self._sets.get(set_key, ())

    async def incr(self, key: str) -> int:
        self._counters[key] = self._counters.get(key, 0) + 1
        return self._counters[key]
