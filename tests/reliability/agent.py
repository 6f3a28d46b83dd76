"""The reliability suite's agent: an SDK agent on any protocol whose ledger records every
execution (request id, idempotency key, attempt, instance, operation), one JSON line each.

    python -m tests.reliability.agent --reach URL[,URL] --capability C --instance-id I \
        --ledger DIR/I.jsonl [--protocol http|grpc|websocket|mqtt --broker HOST:PORT]

Each call sleeps the payload's `delay_ms` (else --delay-ms) after the line is written, so a
fault can land mid-call. `read` is declared idempotent, `write` is not: Reach retries a write
only if it has a key.
A line is written with one O_APPEND write before the handler answers, so a SIGKILL after it
leaves the line whole, and one before it leaves the execution unrecorded and unanswered.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import signal
import time
from typing import Any

from agent_reach_sdk import AgentRuntime, RequestContext


def main() -> None:
    p = argparse.ArgumentParser(description="reliability ledger agent")
    p.add_argument("--reach", required=True, help="gateway URLs, comma separated")
    p.add_argument("--capability", required=True)
    p.add_argument("--instance-id", required=True)
    p.add_argument("--ledger", required=True)
    p.add_argument("--protocol", default="http", choices=["http", "grpc", "websocket", "mqtt"])
    p.add_argument("--broker", default="127.0.0.1:1883")
    p.add_argument("--heartbeat-interval", type=float, default=0.5)
    p.add_argument("--delay-ms", type=int, default=20)
    args = p.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    asyncio.run(serve(args))


async def serve(args: argparse.Namespace) -> None:
    runtime = AgentRuntime(
        args.capability,
        reach_address=args.reach.split(","),
        instance_id=args.instance_id,
        protocol=args.protocol,
        service_address=args.broker if args.protocol == "mqtt" else "127.0.0.1:0",
        heartbeat_interval=args.heartbeat_interval,
    )
    fd = os.open(args.ledger, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)

    def record(op: str, ctx: RequestContext) -> None:
        line = {
            "request_id": ctx.request_id,
            "idempotency_key": ctx.idempotency_key,
            "attempt": ctx.attempt,
            "instance": args.instance_id,
            "op": op,
            "t": time.time(),
        }
        os.write(fd, (json.dumps(line) + "\n").encode())

    @runtime.operation("read", idempotent=True)
    async def read(payload: dict[str, Any], ctx: RequestContext) -> dict[str, Any]:
        record("read", ctx)
        await asyncio.sleep(int(payload.get("delay_ms", args.delay_ms)) / 1000)
        return {"instance_id": args.instance_id, "n": payload.get("n")}

    @runtime.operation("write")
    async def write(payload: dict[str, Any], ctx: RequestContext) -> dict[str, Any]:
        record("write", ctx)
        await asyncio.sleep(int(payload.get("delay_ms", args.delay_ms)) / 1000)
        return {"instance_id": args.instance_id, "n": payload.get("n")}

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    async with runtime:
        print(f"agent {args.instance_id} serving at {runtime.service_address}", flush=True)
        await stop.wait()
    os.close(fd)


if __name__ == "__main__":
    main()
