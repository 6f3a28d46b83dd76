"""The floor as someone would serve it over HTTP without Reach, in a process of its own: a bare
ASGI app on uvicorn (h11, uvloop, the gateway's keep-alive) that starts the floor's workflow with
Reach's search attributes and summary, eager, runs it on a worker in the same process (as the
gateway's runs: activations on the event loop, the settled heap) and answers with the result as
JSON.

Everything a gateway is except Reach itself (no door, routing, policy, envelope or audit), so
`reach inline` against this row is what Reach's own work costs.

    python bench/raw_front.py --port 7700 --temporal 127.0.0.1:7233 --agent-url http://...
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import uuid
from pathlib import Path
from typing import Any

import uvicorn
from temporalio.client import Client
from temporalio.common import SearchAttributePair, TypedSearchAttributes
from temporalio.worker import UnsandboxedWorkflowRunner, Worker

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.raw_activity import call_agent, open_client, run_floor
from bench.raw_workflow import RawWorkflow
from gateway_api.cli import KEEP_ALIVE_S
from reach.process import loop_factory, settle_heap
from workflows.invoke import (
    SA_CALLER,
    SA_CAPABILITY,
    SA_INSTANCE,
    SA_OPERATION,
    SA_STATUS,
)


def front(client: Client, task_queue: str, agent_url: str) -> Any:
    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        assert scope["type"] == "http"
        if scope["method"] != "POST":  # readiness
            await send({"type": "http.response.start", "status": 200, "headers": []})
            await send({"type": "http.response.body", "body": b"ready"})
            return
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body", False):
                break
        request = json.loads(body)
        target, operation = request["target"], request["operation"]
        result = await run_floor(
            client,
            agent_url,
            task_queue,
            summary=f"{target}.{operation} from anonymous",
            attributes=TypedSearchAttributes(
                [
                    SearchAttributePair(SA_CALLER, "anonymous"),
                    SearchAttributePair(SA_CAPABILITY, target),
                    SearchAttributePair(SA_OPERATION, operation),
                    SearchAttributePair(SA_STATUS, "success"),
                    SearchAttributePair(SA_INSTANCE, "bench-inline-01"),
                ]
            ),
        )
        out = json.dumps({"status": "success", "result": result}).encode()
        headers = [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(out))]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        await send({"type": "http.response.body", "body": out})

    return app


async def main(args: argparse.Namespace) -> None:
    client = await Client.connect(args.temporal)
    task_queue = f"raw-front-{uuid.uuid4().hex[:6]}"
    open_client()
    worker = Worker(
        client,
        task_queue=task_queue,
        workflows=[RawWorkflow],
        activities=[call_agent],
        workflow_runner=UnsandboxedWorkflowRunner(),
        debug_mode=True,  # activations on the event loop, as temporal.inline_activations does
    )
    config = uvicorn.Config(
        front(client, task_queue, args.agent_url),
        host="127.0.0.1",
        port=args.port,
        http="h11",
        lifespan="off",
        log_config=None,
        access_log=False,
        timeout_keep_alive=KEEP_ALIVE_S,
    )
    async with worker:
        settle_heap()
        await uvicorn.Server(config).serve()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--temporal", required=True, help="the Temporal frontend, host:port")
    parser.add_argument("--agent-url", required=True)
    args = parser.parse_args()
    with asyncio.Runner(loop_factory=loop_factory("auto")) as runner:
        runner.run(main(args))
