"""The peer row's Restate service: one handler whose one journaled step (`ctx.run_typed`) calls
the bench's agent over HTTP, as the floor's local activity does (bench/raw_activity.py).

    python bench/restate_service.py --port 9080 --agent http://127.0.0.1:8001/reach/query

Served by hypercorn over cleartext HTTP/2 (h2c), the SDK's bidirectional protocol: the step's
result is acknowledged on the open stream, with no second invocation of the handler.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import uuid
from typing import Any

import httpx
import restate
from hypercorn.asyncio import serve
from hypercorn.config import Config

service = restate.Service("bench")
_client: httpx.AsyncClient | None = None


async def _call_agent(payload: dict[str, Any]) -> dict[str, Any]:
    global _client
    if _client is None:  # as the floor's activity's (bench/raw_activity.py)
        limits = httpx.Limits(max_connections=64, max_keepalive_connections=64)
        _client = httpx.AsyncClient(trust_env=False, limits=limits, timeout=30)
    headers = {"X-Reach-Request-Id": str(uuid.uuid4())}
    r = await _client.post(os.environ["BENCH_AGENT_URL"], json=payload, headers=headers)
    r.raise_for_status()
    answer: dict[str, Any] = r.json()
    return answer


@service.handler()
async def invoke(ctx: restate.Context, payload: dict[str, Any]) -> dict[str, Any]:
    return await ctx.run_typed("call the agent", _call_agent, restate.RunOptions(), payload)


async def main(config: Config) -> None:
    # The SDK's app takes SIGTERM over on its first call, to drain its open streams (which
    # hypercorn's graceful shutdown then waits on): the bench kills it if it lingers.
    await serve(restate.app(services=[service]), config, shutdown_trigger=asyncio.Event().wait)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--agent", required=True, help="the agent's URL to POST the payload to")
    args = parser.parse_args()
    os.environ["BENCH_AGENT_URL"] = args.agent
    config = Config()
    config.bind = [f"127.0.0.1:{args.port}"]
    config.accesslog = None
    config.loglevel = "WARNING"
    asyncio.run(main(config))
