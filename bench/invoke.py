"""Latency and throughput of Reach's durable sync invoke, against its floors, in one run.

    make bench                     # or: python bench/invoke.py --requests 200 --concurrency 16

Rows (same Temporal dev server, same agent process kind, all on loopback):
  direct HTTP      the agent called straight, no Reach (the network/agent floor)
  direct gRPC / WebSocket / MQTT    the same agent on that protocol, called straight through
                   Reach's connector (one connection, reused), no Temporal
  reach inline via <protocol> agent   POST /reach/invoke to a capability served on <protocol>
  reach inline, gRPC front   reach.v1.Reach/Invoke on the gateway's gRPC port instead of HTTP
  raw Temporal     the floor: a minimal workflow, eager start + one local activity doing that
                   HTTP call, unsandboxed (as Reach runs by default); every ratio is against it
  raw Temporal, sandboxed    the same workflow in the SDK's sandbox (for reference)
  reach inline     POST /reach/invoke, capability in inline mode (local activities)
  reach inline, sandboxed    the same with temporal.workflow_sandbox=true
  reach queue      POST /reach/invoke, capability in queue mode (regular activities)

MQTT runs through a Mosquitto of the bench's own with `set_tcp_nodelay true` (the broker a
deployment should run; without it each call pays ~40 ms of Nagle at the broker).

Sequential p50/p95/p99 over --requests calls after a warm-up, then throughput with
--concurrency calls in flight. Prints a Markdown table; writes bench/out/invoke.png if
matplotlib is installed.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

import grpc
import httpx
from temporalio import activity
from temporalio.client import Client
from temporalio.common import WorkflowIDConflictPolicy, WorkflowIDReusePolicy
from temporalio.worker import UnsandboxedWorkflowRunner, Worker

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from agent_reach_proto import gateway_pb2  # noqa: E402
from bench.raw_workflow import RawWorkflow  # noqa: E402
from connectors import ConnectorSet  # noqa: E402
from gateway_api.devserver import DevServer, free_port  # noqa: E402
from reach.invocation import Endpoint  # noqa: E402
from reach.messages import Header, Message  # noqa: E402

PAYLOAD = {"text": "durable retries", "top_k": 2}
PROTOCOLS = ("grpc", "websocket", "mqtt")
NAMES = {"grpc": "gRPC", "websocket": "WebSocket", "mqtt": "MQTT"}
_http: httpx.AsyncClient | None = None


@activity.defn(name="call_agent")
async def call_agent(url: str) -> dict[str, object]:
    assert _http is not None
    r = await _http.post(url, json=PAYLOAD, headers={"X-Reach-Request-Id": str(uuid.uuid4())})
    result: dict[str, object] = r.json()
    return result


def percentile(samples: list[float], q: float) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


@dataclass
class Row:
    name: str
    samples: list[float]  # sequential latencies, ms
    tput: float  # calls per second at the given concurrency

    @property
    def p50(self) -> float:
        return statistics.median(self.samples)

    @property
    def p95(self) -> float:
        return percentile(self.samples, 0.95)

    @property
    def p99(self) -> float:
        return percentile(self.samples, 0.99)


async def measure(
    paths: dict[str, Callable[[], Awaitable[None]]], n: int, warmup: int, concurrency: int
) -> list[Row]:
    """Sequential latency, interleaved across paths, then throughput per path.

    Interleaving matters: the dev server slows as its SQLite history grows, so timing the paths
    one after another would charge that drift to whichever path runs last.
    """
    for call in paths.values():
        for _ in range(warmup):
            await call()
    lat: dict[str, list[float]] = {name: [] for name in paths}
    for i in range(n):
        for name, call in paths.items():
            t = time.perf_counter()
            await call()
            lat[name].append((time.perf_counter() - t) * 1000)
        if (i + 1) % 50 == 0:
            print(f"  sequential {i + 1}/{n}", flush=True)
    rows = []
    for name, call in paths.items():
        sem = asyncio.Semaphore(concurrency)

        async def one(
            call: Callable[[], Awaitable[None]] = call, sem: asyncio.Semaphore = sem
        ) -> None:
            async with sem:
                await call()

        t = time.perf_counter()
        await asyncio.gather(*(one() for _ in range(n)))
        row = Row(name, lat[name], n / (time.perf_counter() - t))
        print(f"  {name:<26} p50 {row.p50:6.1f} ms   {row.tput:6.0f}/s", flush=True)
        rows.append(row)
    return rows


def spawn(args: list[str], env: dict[str, str], log: Path) -> subprocess.Popen[bytes]:
    with log.open("ab") as out:
        return subprocess.Popen(args, env=env, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT)


async def wait_http(url: str, ok: Callable[[httpx.Response], bool], timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    async with httpx.AsyncClient(trust_env=False) as c:
        while time.monotonic() < deadline:
            try:
                if ok(await c.get(url, timeout=1)):
                    return
            except httpx.HTTPError:
                pass
            await asyncio.sleep(0.1)
    raise TimeoutError(url)


async def main(args: argparse.Namespace) -> None:
    global _http
    tmp = Path(tempfile.mkdtemp(prefix="reach-bench-"))
    server = DevServer(str(tmp / "temporal.db"), free_port(), None, log_file=tmp / "temporal.log")
    server.start()
    procs: list[subprocess.Popen[bytes]] = []
    gw_port = free_port()
    gw = f"http://127.0.0.1:{gw_port}"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("REACH_", "TEMPORAL_"))}
    front_port = free_port()
    env.update(
        TEMPORAL_ADDRESS=server.address,
        REACH_LISTEN_PORT=str(gw_port),
        REACH_TRANSPORT__PORTS__GRPC=str(front_port),
        REACH_TEMPORAL__TASK_QUEUE=f"bench-{uuid.uuid4().hex[:6]}",
        REACH_CAPABILITIES='{"bench-queue": {"mode": "queue"}}',
        REACH_CONFIG=str(ROOT / "reach.yaml"),
    )
    # A second gateway, same settings but the workflow sandbox on, on its own task queue.
    gw2_port = free_port()
    gw2 = f"http://127.0.0.1:{gw2_port}"
    env2 = dict(
        env,
        REACH_LISTEN_PORT=str(gw2_port),
        REACH_TEMPORAL__TASK_QUEUE=f"bench-{uuid.uuid4().hex[:6]}",
        REACH_TEMPORAL__WORKFLOW_SANDBOX="true",
        REACH_TRANSPORT__PORTS__GRPC="-1",
        REACH_CAPABILITIES="{}",  # reach-cap-* queues are per namespace: leave them to gateway 1
    )
    broker_port = free_port()
    (tmp / "mosquitto.conf").write_text(
        f"listener {broker_port} 127.0.0.1\nallow_anonymous true\nset_tcp_nodelay true\n"
    )
    try:
        procs.append(spawn(["mosquitto", "-c", str(tmp / "mosquitto.conf")], env, tmp / "mq.log"))
        procs.append(spawn([sys.executable, "-m", "gateway_api", "gateway"], env, tmp / "gw.log"))
        procs.append(spawn([sys.executable, "-m", "gateway_api", "gateway"], env2, tmp / "gw2.log"))
        await wait_http(f"{gw}/readyz", lambda r: r.status_code == 200)
        await wait_http(f"{gw2}/readyz", lambda r: r.status_code == 200)
        for cap in ("bench-inline", "bench-queue"):
            procs.append(
                spawn(
                    [
                        sys.executable,
                        str(ROOT / "examples/knowledge_retriever.py"),
                        "--reach",
                        gw,
                        "--capability",
                        cap,
                        "--instance-id",
                        f"{cap}-01",
                    ],
                    env,
                    tmp / f"{cap}.log",
                )
            )
        procs.append(
            spawn(
                [
                    sys.executable,
                    str(ROOT / "examples/knowledge_retriever.py"),
                    "--reach",
                    gw2,
                    "--capability",
                    "bench-inline",
                    "--instance-id",
                    "bench-inline-02",
                ],
                env,
                tmp / "bench-inline-2.log",
            )
        )
        for protocol in PROTOCOLS:
            procs.append(
                spawn(
                    [
                        sys.executable,
                        str(ROOT / "examples/knowledge_retriever.py"),
                        "--reach",
                        gw,
                        "--capability",
                        f"bench-{protocol}",
                        "--instance-id",
                        f"bench-{protocol}-01",
                        "--protocol",
                        protocol,
                        "--broker",
                        f"127.0.0.1:{broker_port}",
                    ],
                    env,
                    tmp / f"bench-{protocol}.log",
                )
            )
        await wait_http(
            f"{gw2}/reach/capabilities/bench-inline",
            lambda r: r.status_code == 200 and len(r.json()["instances"]) == 1,
        )
        for cap in ("bench-inline", "bench-queue", *(f"bench-{p}" for p in PROTOCOLS)):
            await wait_http(
                f"{gw}/reach/capabilities/{cap}",
                lambda r: r.status_code == 200 and len(r.json()["instances"]) == 1,
            )
        async with httpx.AsyncClient(trust_env=False) as c:
            inst = (await c.get(f"{gw}/reach/capabilities/bench-inline")).json()["instances"][0]
            endpoints = {
                p: Endpoint.model_validate(
                    {
                        **(await c.get(f"{gw}/reach/capabilities/bench-{p}")).json()["instances"][
                            0
                        ],
                        "capability": f"bench-{p}",
                    }
                )
                for p in PROTOCOLS
            }
        agent_url = f"http://{inst['address']}/reach/query"
        connectors = ConnectorSet()
        channel = grpc.aio.insecure_channel(f"127.0.0.1:{front_port}")
        front_invoke = channel.unary_unary(
            "/reach.v1.Reach/Invoke",
            request_serializer=gateway_pb2.InvokeRequest.SerializeToString,
            response_deserializer=gateway_pb2.InvokeResponse.FromString,
        )

        limits = httpx.Limits(max_connections=64, max_keepalive_connections=64)
        _http = httpx.AsyncClient(trust_env=False, limits=limits, timeout=30)
        client = await Client.connect(server.address)
        queue = f"raw-{uuid.uuid4().hex[:6]}"
        sandboxed_queue = f"raw-sb-{uuid.uuid4().hex[:6]}"
        print(f"{args.requests} sequential + {args.requests} at concurrency {args.concurrency}:")

        async def direct() -> None:
            r = await _http.post(
                agent_url, json=PAYLOAD, headers={"X-Reach-Request-Id": str(uuid.uuid4())}
            )
            r.raise_for_status()

        def raw(task_queue: str) -> Callable[[], Awaitable[None]]:
            async def call() -> None:
                await client.execute_workflow(
                    RawWorkflow.run,
                    agent_url,
                    id=str(uuid.uuid4()),
                    task_queue=task_queue,
                    id_reuse_policy=WorkflowIDReusePolicy.REJECT_DUPLICATE,
                    id_conflict_policy=WorkflowIDConflictPolicy.USE_EXISTING,
                    request_eager_start=True,
                )

            return call

        def direct_via(protocol: str) -> Callable[[], Awaitable[None]]:
            connector = connectors.get(protocol)
            endpoint = endpoints[protocol]

            async def call() -> None:
                header = Header(
                    request_id=str(uuid.uuid4()),
                    caller="bench",
                    target=endpoint.capability,
                    operation="query",
                    deadline_ms=int(time.time() * 1000) + 10_000,
                )
                reply = await connector.invoke(
                    endpoint, Message(header=header, payload=PAYLOAD), 10
                )
                if reply.status != "ok":
                    raise RuntimeError(reply)

            return call

        async def front() -> None:
            r = await front_invoke(
                gateway_pb2.InvokeRequest(
                    target="bench-inline",
                    operation="query",
                    payload_json=json.dumps(PAYLOAD),
                    timeout_ms=10000,
                )
            )
            if r.status != "success":
                raise RuntimeError(r)

        def reach(cap: str, base: str = gw) -> Callable[[], Awaitable[None]]:
            async def call() -> None:
                r = await _http.post(
                    f"{base}/reach/invoke",
                    json={
                        "target": cap,
                        "operation": "query",
                        "payload": PAYLOAD,
                        "timeout_ms": 10000,
                    },
                )
                if r.status_code != 200:
                    raise RuntimeError(r.text)

            return call

        paths = {
            "direct HTTP": direct,
            **{f"direct {NAMES[p]}": direct_via(p) for p in PROTOCOLS},
            "raw Temporal": raw(queue),
            "raw Temporal, sandboxed": raw(sandboxed_queue),
            "reach inline": reach("bench-inline"),
            **{f"reach inline via {NAMES[p]} agent": reach(f"bench-{p}") for p in PROTOCOLS},
            "reach inline, gRPC front": front,
            "reach inline, sandboxed": reach("bench-inline", gw2),
            "reach queue": reach("bench-queue"),
        }
        floor = Worker(
            client,
            task_queue=queue,
            workflows=[RawWorkflow],
            activities=[call_agent],
            workflow_runner=UnsandboxedWorkflowRunner(),
        )
        sandboxed = Worker(
            client, task_queue=sandboxed_queue, workflows=[RawWorkflow], activities=[call_agent]
        )
        async with floor, sandboxed:
            rows = await measure(paths, args.requests, 20, args.concurrency)
        await _http.aclose()
        await connectors.aclose()
        await channel.close()
        report(rows, args)
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            p.wait(10)
        server.stop()


def report(rows: list[Row], args: argparse.Namespace) -> None:
    floor = next(r for r in rows if r.name == "raw Temporal")
    print()
    print(
        f"| path | p50 ms | p95 ms | p99 ms | x floor p50 | x floor p99 "
        f"| throughput /s (c={args.concurrency}) | x floor throughput |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(
            f"| {r.name} | {r.p50:.1f} | {r.p95:.1f} | {r.p99:.1f} "
            f"| {r.p50 / floor.p50:.2f} | {r.p99 / floor.p99:.2f} "
            f"| {r.tput:.0f} | {r.tput / floor.tput:.2f} |"
        )
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("\n(matplotlib not installed: no plot)")
        return
    out = ROOT / "bench" / "out"
    out.mkdir(parents=True, exist_ok=True)
    fig, (lat_ax, tput_ax) = plt.subplots(1, 2, figsize=(12, 4.5))
    names = [r.name for r in rows]
    lat_ax.boxplot([r.samples for r in rows], tick_labels=names, showfliers=False)
    lat_ax.set_ylabel("latency, ms (sequential)")
    lat_ax.set_title(f"sync invoke latency ({args.requests} calls each)")
    tput_ax.bar(names, [r.tput for r in rows])
    tput_ax.set_ylabel(f"calls/s at concurrency {args.concurrency}")
    tput_ax.set_title("throughput")
    for ax in (lat_ax, tput_ax):
        ax.tick_params(axis="x", labelrotation=20)
        ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(out / "invoke.png", dpi=110)
    print(f"\nplot: {out / 'invoke.png'}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--concurrency", type=int, default=16)
    asyncio.run(main(parser.parse_args()))
    sys.stdout.flush()
    os._exit(0)  # Worker teardown can abort at interpreter exit (known SDK issue)
