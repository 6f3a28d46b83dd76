"""The reliability suite's agents: SDK agents on any protocol whose ledgers record every
execution (request id, idempotency key, attempt, instance, operation), one JSON line each.

    python -m tests.reliability.agent --reach URL[,URL] --ledgers DIR \
        --serve PROTOCOL:INSTANCE [--serve ...] [--broker HOST:PORT]

Each `--serve` is one instance (its own AgentRuntime and server) of capability
`rel-<protocol>` (http, grpc, websocket, mqtt), its ledger `DIR/<instance>.jsonl`; the instances
of one process heartbeat together (one batch), as an SDK process hosting several does.

Each call sleeps the payload's `delay_ms` (else --delay-ms) after the line is written, so a
fault can land mid-call. `read` is declared idempotent, `write` is not: Reach retries a write
only if it has a key.
A line is written with one O_APPEND write before the handler answers, so a SIGKILL after it
leaves the line whole, and one before it leaves the execution unrecorded and unanswered.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import signal
import time
from typing import Any

from agent_reach_sdk import AgentRuntime, RequestContext


def main() -> None:
    p = argparse.ArgumentParser(description="reliability ledger agents")
    p.add_argument("--reach", required=True, help="gateway URLs, comma separated")
    p.add_argument("--ledgers", required=True, help="the directory of the ledgers")
    p.add_argument("--serve", action="append", required=True, help="PROTOCOL:INSTANCE")
    p.add_argument("--broker", default="127.0.0.1:1883")
    p.add_argument("--heartbeat-interval", type=float, default=1.0)
    p.add_argument("--delay-ms", type=int, default=20)
    args = p.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    asyncio.run(serve(args))


def runtime_for(args: argparse.Namespace, protocol: str, instance_id: str) -> AgentRuntime:
    runtime = AgentRuntime(
        f"rel-{protocol}",
        reach_address=args.reach.split(","),
        instance_id=instance_id,
        protocol=protocol,
        service_address=args.broker if protocol == "mqtt" else "127.0.0.1:0",
        heartbeat_interval=args.heartbeat_interval,
    )
    path = os.path.join(args.ledgers, f"{instance_id}.jsonl")
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)

    def record(op: str, ctx: RequestContext) -> None:
        line = {
            "request_id": ctx.request_id,
            "idempotency_key": ctx.idempotency_key,
            "attempt": ctx.attempt,
            "instance": instance_id,
            "op": op,
            "t": time.time(),
        }
        os.write(fd, (json.dumps(line) + "\n").encode())

    @runtime.operation("read", idempotent=True)
    async def read(payload: dict[str, Any], ctx: RequestContext) -> dict[str, Any]:
        record("read", ctx)
        await asyncio.sleep(int(payload.get("delay_ms", args.delay_ms)) / 1000)
        return {"instance_id": instance_id, "n": payload.get("n")}

    @runtime.operation("write")
    async def write(payload: dict[str, Any], ctx: RequestContext) -> dict[str, Any]:
        record("write", ctx)
        await asyncio.sleep(int(payload.get("delay_ms", args.delay_ms)) / 1000)
        return {"instance_id": instance_id, "n": payload.get("n")}

    return runtime


async def serve(args: argparse.Namespace) -> None:
    runtimes = [runtime_for(args, *spec.split(":", 1)) for spec in args.serve]
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    async with contextlib.AsyncExitStack() as stack:
        for runtime in runtimes:
            await stack.enter_async_context(runtime)
            print(f"agent {runtime.instance_id} serving at {runtime.service_address}", flush=True)
        await stop.wait()


if __name__ == "__main__":
    main()
