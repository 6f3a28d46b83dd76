"""An agent for bench/routing.py: `query` answers after --delay-ms, or, with --stall, accepts
the request and then blocks until the request's deadline (the header's deadline_ms), while its
heartbeat keeps saying `ok` (the seed's outage: alive, healthy by its own report, useless).

    python bench/stall_agent.py --reach 127.0.0.1:7600 --capability outage --instance-id a
    python bench/stall_agent.py ... --stall

`query` declares nothing (no idempotency, no timeout), so whether Reach retries it is the
configuration's call alone. Logs only warnings: one line per request would cost more than the
request.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from agent_reach_sdk import AgentRuntime, RequestContext


def build(args: argparse.Namespace) -> AgentRuntime:
    runtime = AgentRuntime(
        args.capability,
        reach_address=args.reach,
        instance_id=args.instance_id,
        heartbeat_interval=args.heartbeat_interval,
        health_check=lambda: {"status": "ok", "checks": {"stalled": args.stall}},
    )

    @runtime.operation("query")
    async def query(payload: dict[str, Any], ctx: RequestContext) -> dict[str, Any]:
        if args.stall:
            # Past the deadline on purpose: the SDK answers 504 at the deadline itself.
            left_s = (ctx.deadline_ms / 1000 - time.time()) if ctx.deadline_ms else 3600.0
            await asyncio.sleep(max(0.0, left_s) + 1.0)
        elif args.delay_ms:
            await asyncio.sleep(args.delay_ms / 1000)
        return {"instance_id": args.instance_id, "echo": payload.get("text", "")}

    return runtime


async def amain(args: argparse.Namespace) -> None:
    runtime = build(args)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    async with runtime:
        print(f"agent {args.instance_id} serving at {runtime.service_address}", flush=True)
        await stop.wait()


def main() -> None:
    p = argparse.ArgumentParser(description="bench agent: answers, or stalls until the deadline")
    p.add_argument("--reach", default="127.0.0.1:7600")
    p.add_argument("--capability", required=True)
    p.add_argument("--instance-id", required=True)
    p.add_argument("--heartbeat-interval", type=float, default=2.0)
    p.add_argument("--delay-ms", type=int, default=0, help="service time of a healthy answer")
    p.add_argument("--stall", action="store_true", help="block every request until its deadline")
    args = p.parse_args()
    logging.basicConfig(level=logging.WARNING)
    asyncio.run(amain(args))


if __name__ == "__main__":
    main()
