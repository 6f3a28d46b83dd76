"""What a finished request leaves in its history, and what the Temporal server spends per call.

One dev server, one gateway with the invoke worker (memory registry), two agents. For each kind
of request — `sync` (a synchronous invoke that succeeds: the hot path), `callback` (the same,
asynchronous, with a callback URL), `error` (no such operation: the agent refuses it), `slow`
(a synchronous invoke of an agent that takes 2.5 s: longer than 80% of a 2 s workflow task
timeout) — it sends `--calls`
requests at `--concurrency` in flight, reads the server's CPU time (/proc/<pid>/stat, with its
children) before and after, and prints the event types of one finished request's history: how
many markers (local activities, patches) and search attribute upserts it holds.

`python bench/history_cost.py [--calls 300] [--concurrency 8] [--task-timeout 2]`;
docs/benchmarks.md holds the figures.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import os
import sys
import tempfile
import uuid
from pathlib import Path
from typing import Any

import httpx
from temporalio.api.enums.v1 import EventType
from temporalio.client import Client

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.invoke import children, cpu_seconds  # noqa: E402
from gateway_api.devserver import DevServer, free_port  # noqa: E402
from tests.helpers import (  # noqa: E402
    Agent,
    CallbackReceiver,
    GatewayProcess,
    Stack,
    stop_spawned,
)


def server_cpu(pid: int) -> float:
    return cpu_seconds(pid) + sum(cpu_seconds(c) for c in children(pid))


def events_of(history: Any) -> list[str]:
    out = []
    for event in history.events:
        name = EventType.Name(event.event_type).removeprefix("EVENT_TYPE_")
        if event.HasField("marker_recorded_event_attributes"):
            name = f"MARKER({event.marker_recorded_event_attributes.marker_name})"
        elif event.HasField("upsert_workflow_search_attributes_event_attributes"):
            fields = event.upsert_workflow_search_attributes_event_attributes
            name = f"UPSERT({','.join(sorted(fields.search_attributes.indexed_fields))})"
        out.append(name)
    return out


async def run_kind(
    http: httpx.AsyncClient, url: str, body: dict[str, Any], calls: int, concurrency: int
) -> list[str]:
    sem = asyncio.Semaphore(concurrency)
    ids: list[str] = []

    async def one() -> None:
        rid = f"req-{uuid.uuid4().hex}"
        ids.append(rid)
        async with sem:
            r = await http.post(f"{url}/reach/invoke", json={**body, "request_id": rid})
            assert r.status_code in (200, 202, 400, 502), r.text

    await asyncio.gather(*(one() for _ in range(calls)))
    return ids


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=300)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--kinds", default="sync,callback,error,slow")
    parser.add_argument("--task-timeout", type=float, help="temporal.workflow_task_timeout_s")
    parser.add_argument("--slow-calls", type=int, default=40, help="calls of the `slow` kind")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmpdir:
        tmp = Path(tmpdir)
        server = DevServer(str(tmp / "t.db"), free_port(), None, log_file=tmp / "server.log")
        server.start()
        assert server.process is not None
        pid = server.process.pid
        try:
            stack = Stack(
                temporal=server.address,
                tmp=tmp,
                task_queue=f"tq-{uuid.uuid4().hex[:12]}",
                extra={"REACH_TEMPORAL__WORKFLOW_SANDBOX": "false"}
                | (
                    {"REACH_TEMPORAL__WORKFLOW_TASK_TIMEOUT_S": str(args.task_timeout)}
                    if args.task_timeout
                    else {}
                ),
            )
            gw = await GatewayProcess(stack, "gw").ready()
            await Agent(gw, "hc-01", "hc").ready()
            await Agent(gw, "hc-slow-01", "hc-slow", "--delay-ms", "2500").ready()
            client = await Client.connect(server.address)
            async with (
                httpx.AsyncClient(trust_env=False, timeout=30) as http,
                CallbackReceiver() as receiver,
            ):
                base = {"target": "hc", "payload": {"text": "x"}, "timeout_ms": 10_000}
                bodies = {
                    "sync": {**base, "operation": "query"},
                    "callback": {**base, "operation": "query", "callback": receiver.url},
                    "error": {**base, "operation": "no-such-operation"},
                    "slow": {**base, "target": "hc-slow", "operation": "query"},
                }
                kinds = args.kinds.split(",")
                for kind in kinds:  # warm up
                    if kind != "slow":
                        await run_kind(http, gw.url, bodies[kind], 50, args.concurrency)
                per_call: dict[str, list[float]] = collections.defaultdict(list)
                sample: dict[str, str] = {}
                for _ in range(args.rounds):
                    for kind in kinds:
                        calls = args.slow_calls if kind == "slow" else args.calls
                        delivered, before = len(receiver.received), server_cpu(pid)
                        ids = await run_kind(http, gw.url, bodies[kind], calls, args.concurrency)
                        if kind == "callback":  # the deliveries are part of its cost
                            await receiver.wait(delivered + calls, timeout_s=60)
                        per_call[kind].append((server_cpu(pid) - before) / calls * 1000)
                        sample[kind] = ids[-1]
                for kind in kinds:
                    history = await client.get_workflow_handle(sample[kind]).fetch_history()
                    names = events_of(history)
                    markers = sum(n.startswith("MARKER") for n in names)
                    upserts = sum(n.startswith("UPSERT") for n in names)
                    cpu = ", ".join(f"{v:.2f}" for v in per_call[kind])
                    print(
                        f"{kind:9s} server CPU/call {cpu} ms; {len(names)} events, "
                        f"{markers} markers, {upserts} upserts: {' '.join(names)}",
                        flush=True,
                    )
        finally:
            stop_spawned(0)
            server.stop()
            os.sync()


if __name__ == "__main__":
    asyncio.run(main())
