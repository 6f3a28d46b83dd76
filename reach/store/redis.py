from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import cast

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from reach.errors import Unavailable
from reach.store.base import Store


@contextlib.contextmanager
def _mapped(prefix: str) -> Iterator[None]:
    """The one place Redis failures become a Reach error (503 `unavailable`, retryable)."""
    try:
        yield
    except RedisError as exc:
        raise Unavailable(f"registry store (redis, prefix {prefix!r}) unavailable: {exc}") from exc


class RedisStore(Store):
    """Keys live under `<prefix>:`; TTLs are Redis key expiries (they survive any gateway)."""

    def __init__(self, client: aioredis.Redis, prefix: str) -> None:
        self._r = client
        self._p = prefix

    @classmethod
    def from_url(cls, url: str, prefix: str) -> RedisStore:
        return cls(
            aioredis.Redis.from_url(url, decode_responses=True, socket_connect_timeout=2),
            prefix,
        )

    def _k(self, key: str) -> str:
        return f"{self._p}:{key}"

    async def put(self, key: str, value: str, ttl_s: float | None = None) -> None:
        px = max(1, int(ttl_s * 1000)) if ttl_s is not None else None
        with _mapped(self._p):
            await self._r.set(self._k(key), value, px=px)

    async def get_many(self, keys: Sequence[str]) -> list[str | None]:
        if not keys:
            return []
        with _mapped(self._p):
            values = await self._r.mget([self._k(k) for k in keys])
        return cast(list[str | None], values)

    async def delete(self, key: str) -> bool:
        with _mapped(self._p):
            return bool(await self._r.delete(self._k(key)))

    async def add_member(self, set_key: str, member: str) -> None:
        with _mapped(self._p):
            await self._r.sadd(self._k(set_key), member)

    async def remove_member(self, set_key: str, member: str) -> None:
        with _mapped(self._p):
            await self._r.srem(self._k(set_key), member)

    async def members(self, set_key: str) -> set[str]:
        with _mapped(self._p):
            found = await self._r.smembers(self._k(set_key))
        return cast(set[str], found)

    async def is_member(self, set_key: str, member: str) -> bool:
        with _mapped(self._p):
            return bool(await self._r.sismember(self._k(set_key), member))

    async def incr(self, key: str) -> int:
        with _mapped(self._p):
            return int(await self._r.incr(self._k(key)))

    async def ping(self) -> bool:
        try:
            return bool(await self._r.ping())
        except RedisError:
            return False

    async def aclose(self) -> None:
        await self._r.aclose()
