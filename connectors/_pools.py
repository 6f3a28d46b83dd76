"""One `httpx.AsyncClient` per agent address, bounded in number and in idle time.

A client per address keeps httpx's connection limits per instance (one slow agent cannot take
every connection), but agents come and go: without a bound a long-lived worker would keep a
client, and its sockets, for every address it ever called. So a client unused for
`idle_timeout_s` is closed by one reaper task (alive only while clients are), and past
`max_pools` addresses the least recently used is closed first. A client with a request in
flight is never closed: the bound may be passed for as long as every older client is busy.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict
from collections.abc import Callable

import httpx

log = logging.getLogger("connectors.pools")


class Pool:
    __slots__ = ("client", "in_flight", "last_used")

    def __init__(self, client: httpx.AsyncClient) -> None:
        self.client = client
        self.in_flight = 0
        self.last_used = time.monotonic()


class ClientPools:
    def __init__(
        self,
        make_client: Callable[[str], httpx.AsyncClient],
        *,
        idle_timeout_s: float,
        max_pools: int,
    ) -> None:
        self._make_client = make_client
        self.idle_timeout_s = idle_timeout_s
        self.max_pools = max_pools
        self._pools: OrderedDict[str, Pool] = OrderedDict()  # least recently used first
        self._reaper: asyncio.Task[None] | None = None
        self._closing: set[asyncio.Task[None]] = set()

    def __len__(self) -> int:
        return len(self._pools)

    def __contains__(self, url: object) -> bool:
        return url in self._pools

    def acquire(self, url: str) -> Pool:
        """The pool for `url`, counted in flight until `release`."""
        pool = self._pools.get(url)
        if pool is not None:
            self._pools.move_to_end(url)
            pool.in_flight += 1
            return pool
        pool = Pool(self._make_client(url))
        pool.in_flight = 1  # before evicting, so the new pool is never the one evicted
        self._pools[url] = pool
        if len(self._pools) > self.max_pools:
            self._close_later(self._take(time.monotonic()))
        if self._reaper is None:
            self._reaper = asyncio.get_running_loop().create_task(self._reap())
        return pool

    @staticmethod
    def release(pool: Pool) -> None:
        pool.in_flight -= 1
        pool.last_used = time.monotonic()

    def _take(self, now: float) -> list[httpx.AsyncClient]:
        """Remove and return the clients to close: idle too long, then beyond `max_pools`."""
        over = len(self._pools) - self.max_pools
        taken = []
        for url, pool in list(self._pools.items()):
            if pool.in_flight:
                continue
            if over > 0 or now - pool.last_used >= self.idle_timeout_s:
                del self._pools[url]
                taken.append(pool.client)
                over -= 1
        return taken

    def _close_later(self, clients: list[httpx.AsyncClient]) -> None:
        # Off the caller's path, and in a task of its own so that cancelling the caller or the
        # reaper cannot leave a removed client open.
        if clients:
            task = asyncio.get_running_loop().create_task(self._close(clients))
            self._closing.add(task)
            task.add_done_callback(self._closing.discard)

    @staticmethod
    async def _close(clients: list[httpx.AsyncClient]) -> None:
        for client in clients:
            try:
                await client.aclose()
            except Exception as exc:  # its sockets are gone either way; nothing to retry
                log.debug("closing the client for %s failed: %r", client.base_url, exc)

    async def _reap(self) -> None:
        try:
            while self._pools:
                await asyncio.sleep(self.idle_timeout_s / 2)
                self._close_later(self._take(time.monotonic()))
        finally:
            self._reaper = None

    async def aclose(self) -> None:
        if self._reaper is not None:
            self._reaper.cancel()
            await asyncio.gather(self._reaper, return_exceptions=True)
        pools, self._pools = self._pools, OrderedDict()
        self._close_later([pool.client for pool in pools.values()])
        await asyncio.gather(*self._closing, return_exceptions=True)
