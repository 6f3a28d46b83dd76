"""What the gateway's background Redis writes cost, against a real Redis: a command is written
without a task of its own (redis-py's `wait_for` per write), and the shared in-flight counts
(reach.routing.inflight) gather calls that begin meanwhile into one pipeline, never write a
call that began and ended within one gathering, and remove what a closing tracker still holds."""

from __future__ import annotations

import asyncio
from typing import Any

from reach.routing.inflight import SharedInflightTracker
from reach.store.redis import RedisStore
from reach.store.redis_connect import connect
from tests.helpers import wait_until

CAPABILITY = "cap"


class CountingClient:
    """The store's client, counting the pipelines the tracker opens (one per round trip)."""

    def __init__(self, client: Any) -> None:
        self.client = client
        self.pipelines = 0

    def register_script(self, script: str) -> Any:
        return self.client.register_script(script)

    def pipeline(self, **kwargs: Any) -> Any:
        self.pipelines += 1
        return self.client.pipeline(**kwargs)


async def test_a_command_is_written_without_a_task_of_its_own(redis_url: str) -> None:
    client = connect(redis_url, timeout_s=1.0, max_connections=4)
    loop = asyncio.get_running_loop()
    created: list[object] = []
    factory = loop.get_task_factory()

    def counting(loop: asyncio.AbstractEventLoop, coro: Any, **kwargs: Any) -> Any:
        created.append(coro)
        if factory is not None:
            return factory(loop, coro, **kwargs)
        return asyncio.Task(coro, loop=loop, **kwargs)

    try:
        await client.ping()  # connected: the first command's connect is not what is counted
        loop.set_task_factory(counting)
        for _ in range(20):
            await client.ping()
            async with client.pipeline(transaction=False) as pipe:
                pipe.ping()
                await pipe.execute()
        # (A pipeline still hands its connection back in a task: redis-py shields the release.)
        writes = [c for c in created if "send_packed_command" in getattr(c, "__qualname__", "")]
        assert writes == [], f"{len(writes)} writes as tasks of their own"
    finally:
        loop.set_task_factory(factory)
        await client.aclose()


async def test_a_call_over_within_one_gathering_is_never_written(
    redis_url: str, redis_prefix: str
) -> None:
    store = RedisStore.from_url(redis_url, redis_prefix)
    link = store.shared_redis()
    counting = CountingClient(link.client)
    tracker = SharedInflightTracker(counting, link.prefix, write_delay_s=60.0)
    key = link.key(f"inf:{CAPABILITY}")
    try:
        # Began and ended before any write: nothing to add, nothing to remove.
        tracker.end(tracker.begin(CAPABILITY, "i-1"))
        await tracker.flush()
        assert counting.pipelines == 0
        # A call still running when the writer runs is written, and removed once over.
        long = tracker.begin(CAPABILITY, "i-1")
        await tracker.flush()
        assert counting.pipelines == 1
        assert [m.partition("\x1f")[0] for m in await link.client.zrange(key, 0, -1)] == ["i-1"]
        tracker.end(long)
        await tracker.flush()
        assert counting.pipelines == 2
        assert await link.client.zcard(key) == 0
        # A tracker that closes removes what it wrote, ended or not, the ends still gathered
        # first (another process would count them until their leases end).
        ended, running = tracker.begin(CAPABILITY, "i-1"), tracker.begin(CAPABILITY, "i-2")
        await tracker.flush()
        assert await link.client.zcard(key) == 2
        tracker.end(ended)
        await tracker.aclose()
        assert await link.client.zcard(key) == 0, running
    finally:
        await store.aclose()


async def test_calls_that_begin_while_the_writer_gathers_share_one_pipeline(
    redis_url: str, redis_prefix: str
) -> None:
    store = RedisStore.from_url(redis_url, redis_prefix)
    link = store.shared_redis()
    counting = CountingClient(link.client)
    tracker = SharedInflightTracker(counting, link.prefix, write_delay_s=0.05)
    key = link.key(f"inf:{CAPABILITY}")
    await tracker.start()
    try:
        calls = [tracker.begin(CAPABILITY, f"i-{n % 3}") for n in range(10)]

        async def all_written() -> bool:
            return int(await link.client.zcard(key)) == 10

        await wait_until(all_written, 10)
        assert counting.pipelines == 1
        for call in calls:
            tracker.end(call)

        async def all_removed() -> bool:
            return int(await link.client.zcard(key)) == 0

        await wait_until(all_removed, 10)
        assert counting.pipelines == 2
    finally:
        await tracker.aclose()
        await store.aclose()
