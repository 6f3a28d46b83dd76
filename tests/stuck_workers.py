"""A Temporal worker that takes every activity of one task queue and never ends it nor
heartbeats: a worker lost mid-step (frozen, partitioned, killed) for the tests that kill it.

    python -m tests.stuck_workers --queue reach-cap-NAME

It prints `stuck worker polling <queue>` once it serves the queue, then `started <activity
type>` as each activity starts. It reads TEMPORAL_ADDRESS and TEMPORAL_NAMESPACE (default
`default`), as `tests.helpers.Stack.env` sets them. Any activity type is taken (a dynamic
activity), with its arguments left undecoded."""

from __future__ import annotations

import argparse
import asyncio
import os
from collections.abc import Sequence

from temporalio import activity
from temporalio.client import Client
from temporalio.common import RawValue
from temporalio.worker import Worker


@activity.defn(dynamic=True)
async def hold(args: Sequence[RawValue]) -> None:
    """Say which activity started, then hold it forever, silent."""
    del args
    print(f"started {activity.info().activity_type}", flush=True)
    await asyncio.Event().wait()


async def serve(queue: str) -> None:
    client = await Client.connect(
        os.environ["TEMPORAL_ADDRESS"], namespace=os.environ.get("TEMPORAL_NAMESPACE", "default")
    )
    async with Worker(client, task_queue=queue, activities=[hold]):
        print(f"stuck worker polling {queue}", flush=True)
        await asyncio.Event().wait()


def main() -> None:
    parser = argparse.ArgumentParser(description="a worker whose activities never end")
    parser.add_argument("--queue", required=True, help="the task queue it takes activities of")
    asyncio.run(serve(parser.parse_args().queue))


if __name__ == "__main__":
    main()
