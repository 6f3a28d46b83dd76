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
                   except reach queue's
  raw Temporal, Reach's search attributes   the floor whose start also carries what Reach's
                   does for the Temporal UI (five search attributes, a one-line summary): the
                   part of Reach's cost that is the engine indexing those
  raw Temporal behind an HTTP front   that labelled floor served over HTTP by a process of its
                   own (bench/raw_front.py: uvicorn, uvloop, activations inline as the
                   gateway's), called as Reach is: everything a gateway is but Reach's own work,
                   so reach inline against it is what Reach itself costs
  raw Temporal, sandboxed    the same workflow in the SDK's sandbox (for reference)
  raw Temporal, queue        the queue-mode floor: eager start + one regular activity doing that
                   HTTP call on another task queue (reach queue's ratios are against it)
  reach inline     POST /reach/invoke, capability in inline mode (local activities), memory
                   registry (the default configuration)
  reach inline, Redis registry   the same through a gateway on the Redis registry
  reach inline, sandboxed    the same with temporal.workflow_sandbox=true
  reach inline, tracing on   the same with telemetry.traces=file (OpenTelemetry spans from the
                   gateway's door through the workflow to the connector, batched to a JSON-lines
                   file; the agent's own spans off): what tracing costs (off, it costs nothing)
  reach inline, production   the configuration the README tells operators to run: the Redis
                   registry, tokens on (the caller's and the agent's, in the shared store, and one
                   R19 rule), audit to a file and Prometheus metrics (both on in every row)
  reach inline, production + OTLP   the same with telemetry.traces=otlp: every span batched
                   over OTLP/gRPC to a collector process of the bench's own (bench/otlp_sink.py,
                   which counts them; the count is printed after the tables)
  Restate, one ctx.run step   the peer: the same durable call on Restate (bench/restate_peer.py:
                   its server from npm with its defaults, WAL fsync on; a Python restate-sdk
                   service whose one journaled step calls the same agent with httpx), called via
                   its ingress; shown when `make bench-peers` has installed the server
  reach queue      POST /reach/invoke, capability in queue mode (regular activities)
  reach inline, MCP front   the same call as reach inline, as an MCP client makes it: one
                   stateless (2026-07-28) tools/call POST to /mcp, tool bench-inline.query,
                   answered with JSON (structuredContent and a text block)
  reach inline, A2A front   the same call as reach inline, as an A2A client makes it: a blocking
                   SendMessage (JSON-RPC) to /a2a/bench-inline, a data part for the payload and
                   the operation in the message's metadata, answered with the completed task
  direct A2A       an a2a-sdk agent (tests/a2a_agents.py, its `echo` skill) called straight
                   through Reach's A2A connector: one SendMessage, answered with a Message
  reach inline via A2A agent   POST /reach/invoke to that agent, registered by URL
  reach inline via A2A agent, a task   the same agent's `slow` skill with 0 seconds: a Task
                   that comes back submitted and is followed durably (a look: GetTask in a
                   regular activity) until it completes
  direct MCP       an MCP server on the `mcp` package (tests/mcp_servers.py, stateless
                   2026-07-28, its `echo` tool) called straight through Reach's MCP connector:
                   one tools/call
  reach inline via MCP server   POST /reach/invoke to that server's `echo`, registered by URL

MQTT runs through a Mosquitto of the bench's own with `set_tcp_nodelay true` (the broker a
deployment should run; without it each call pays ~40 ms of Nagle at the broker).

Sequential p50/p95/p99 over --requests calls after a warm-up (the paths interleaved, in a
shuffled order each round), then throughput with 16 and 64 calls in flight (--concurrency),
--tput-calls calls each. A second table gives the CPU each process spent per call during the
throughput phases (Linux /proc): on a CPU-bound box that, not the rate, is the steady figure.
The caller's HTTP client is aiohttp (httpx costs ~0.5 ms more per call here, which is the
caller's, not Reach's); the floors' activities and Reach's HTTP connector both call the agent
with httpx. --runs N repeats the whole measurement on the same stack and prints each ratio's
median and range. Prints Markdown tables; writes bench/out/invoke.png if matplotlib is installed.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import grpc
import httpx
from temporalio.client import Client
from temporalio.common import (
    SearchAttributePair,
    TypedSearchAttributes,
    WorkflowIDConflictPolicy,
    WorkflowIDReusePolicy,
)
from temporalio.worker import UnsandboxedWorkflowRunner, Worker

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from agent_reach_proto import gateway_pb2  # noqa: E402
from bench import restate_peer  # noqa: E402
from bench.otlp_sink import read_count  # noqa: E402
from bench.raw_activity import PAYLOAD, call_agent, open_client, run_floor  # noqa: E402
from bench.raw_workflow import RawQueueWorkflow, RawWorkflow  # noqa: E402
from connectors import ConnectorSet  # noqa: E402
from gateway_api.devserver import DevServer, free_port  # noqa: E402
from reach.invocation import Endpoint  # noqa: E402
from reach.messages import Header, Message  # noqa: E402
from reach.security.tokens import FileTokenStore, issue, mirror_path  # noqa: E402
from workflows.invoke import SEARCH_ATTRIBUTES  # noqa: E402

PROTOCOLS = ("grpc", "websocket", "mqtt")
NAMES = {"grpc": "gRPC", "websocket": "WebSocket", "mqtt": "MQTT"}


def percentile(samples: list[float], q: float) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


QUEUE_FLOOR = "raw Temporal, queue"
FLOOR = "raw Temporal"
LABELLED = "raw Temporal, Reach's search attributes"
FRONTED = "raw Temporal behind an HTTP front"
PEER = restate_peer.ROW


# Which processes do a row's work, by the names `main` gives them: the one running its Temporal
# worker (a gateway, or the bench itself for the floors; None: no Temporal), and the agent's (with
# the broker for MQTT). The caller is always the bench process; the server is counted for all.
FLOOR_PROCS = ("bench", ("bench-inline",))
ROW_PROCS: dict[str, tuple[str | None, tuple[str, ...]]] = {
    "direct HTTP": (None, ("bench-inline",)),
    "direct gRPC": (None, ("bench-grpc",)),
    "direct WebSocket": (None, ("bench-websocket",)),
    "direct MQTT": (None, ("bench-mqtt", "broker")),
    FLOOR: FLOOR_PROCS,
    LABELLED: FLOOR_PROCS,
    FRONTED: ("front", ("bench-inline",)),
    "raw Temporal, sandboxed": FLOOR_PROCS,
    QUEUE_FLOOR: FLOOR_PROCS,
    "reach inline": ("gw1", ("bench-inline",)),
    "reach inline, Redis registry": ("gw3", ("bench-inline-3",)),
    "reach inline, auth on": ("gw4", ("bench-inline-4",)),
    "reach inline via gRPC agent": ("gw1", ("bench-grpc",)),
    "reach inline via WebSocket agent": ("gw1", ("bench-websocket",)),
    "reach inline via MQTT agent": ("gw1", ("bench-mqtt", "broker")),
    "reach inline, gRPC front": ("gw1", ("bench-inline",)),
    "reach inline, sandboxed": ("gw2", ("bench-inline-2",)),
    "reach inline, tracing on": ("gw5", ("bench-inline-5",)),
    "reach inline, production": ("gw6", ("bench-inline-6",)),
    "reach inline, production + OTLP": ("gw7", ("bench-inline-7", "collector")),
    "reach queue": ("gw1", ("bench-queue",)),
    # The peer: its server does the engine's work (in the "gateway or floor worker" column),
    # its service the step's; the agent is the floor's.
    PEER: ("restate", ("restate-service", "bench-inline")),
    "reach inline, MCP front": ("gw1", ("bench-inline",)),
    "reach inline, A2A front": ("gw1", ("bench-inline",)),
    "direct A2A": (None, ("bench-a2a",)),
    "reach inline via A2A agent": ("gw1", ("bench-a2a",)),
    "reach inline via A2A agent, a task": ("gw1", ("bench-a2a",)),
    "direct MCP": (None, ("bench-mcp",)),
    "reach inline via MCP server": ("gw1", ("bench-mcp",)),
}
TICK_S = 1 / os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    """User plus system CPU time a process has used (Linux /proc); 0.0 once it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) * TICK_S


def children(pid: int) -> list[int]:
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    if int(f.read().rsplit(")", 1)[1].split()[1]) == pid:
                        found.append(int(entry))
            except (OSError, IndexError, ValueError):
                continue
    return found


@dataclass
class Row:
    name: str
    samples: list[float]  # sequential latencies, ms
    tput: dict[int, float]  # calls per second, by calls in flight
    # CPU ms per call of each process (ROW_PROCS's names, "server", "bench"), by calls in flight
    cpu: dict[int, dict[str, float]]

    @property
    def floor(self) -> str:
        return QUEUE_FLOOR if self.name == "reach queue" else FLOOR

    @property
    def p50(self) -> float:
        return statistics.median(self.samples)

    @property
    def p95(self) -> float:
        return percentile(self.samples, 0.95)

    @property
    def p99(self) -> float:
        return percentile(self.samples, 0.99)


# Every workflow task leaves a timer behind on the server (its start-to-close timeout, 10 s by
# default), which the server loads and drops when it comes due, done or not: work a row's calls
# cause that lands this long after them (0.4-0.65 ms of server CPU per call, measured against
# the floor at 16 in flight, against 0.07 ms for an idle server over the same time).
WORKFLOW_TASK_TIMEOUT_S = 10.0
# Each invoke's own deadline: as long as the floors' activities get (bench/raw_workflow.py), so
# that a slow box makes a slow row, not a failed run (64 in flight can wait past 10 s).
CALL_TIMEOUT_MS = 30_000


async def quiet(
    cpu_now: Callable[[], dict[str, float]], step_s: float = 0.2, most_s: float = 3.0
) -> dict[str, float]:
    """The CPU counters once the Temporal server has gone quiet (under a tenth of a core over a
    step): the work it does after the calls returned (visibility records, task queues) is theirs,
    not the next row's."""
    now = cpu_now()
    deadline = time.monotonic() + most_s
    while time.monotonic() < deadline:
        await asyncio.sleep(step_s)
        last, now = now, cpu_now()
        if now["server"] - last["server"] < 0.1 * step_s:
            break
    return now


async def measure(
    paths: dict[str, Callable[[], Awaitable[None]]],
    n: int,
    warmup: int,
    concurrency: list[int],
    tput_calls: int,
    cpu_now: Callable[[], dict[str, float]],
    durable: frozenset[str] = frozenset(),
    reverse: bool = False,
) -> list[Row]:
    """Sequential latency, interleaved across paths, then throughput per path, with the CPU
    each process spent per call meanwhile (the box is CPU-bound there, so throughput follows
    the total).

    Interleaving matters: the dev server slows as its SQLite history grows, so timing the paths
    one after another would charge that drift to whichever path runs last. The order is shuffled
    each round (seeded), so no path always follows the same other one (whose work the server may
    still be finishing). The throughput phases cannot interleave, so they run in the paths'
    order, or in reverse (`reverse`, every other run): over two runs each path is timed once
    early and once late, so the drift lands on no path in particular (the floors come first).
    """
    for call in paths.values():
        for _ in range(warmup):
            await call()
    lat: dict[str, list[float]] = {name: [] for name in paths}
    order = list(paths.items())
    shuffle = random.Random(9).shuffle
    for i in range(n):
        shuffle(order)
        for name, call in order:
            t = time.perf_counter()
            await call()
            lat[name].append((time.perf_counter() - t) * 1000)
        if (i + 1) % 50 == 0:
            print(f"  sequential {i + 1}/{n}", flush=True)
    if durable:  # the sequential calls' timers, before any row's throughput is timed
        await asyncio.sleep(WORKFLOW_TASK_TIMEOUT_S + 1)
    rows = []
    phases = list(paths.items())
    for name, call in reversed(phases) if reverse else phases:
        tput: dict[int, float] = {}
        cpu: dict[int, dict[str, float]] = {}
        for c in concurrency:
            sem = asyncio.Semaphore(c)

            async def one(
                call: Callable[[], Awaitable[None]] = call, sem: asyncio.Semaphore = sem
            ) -> None:
                async with sem:
                    await call()

            calls = max(tput_calls, 4 * c)
            before = cpu_now()
            t = time.perf_counter()
            await asyncio.gather(*(one() for _ in range(calls)))
            tput[c] = calls / (time.perf_counter() - t)
            ended = time.monotonic()
            after = await quiet(cpu_now)
            if name in durable:
                # Its workflow tasks' timers come due after it (~0.5 ms of server CPU a call):
                # waited out, so that no row is timed under the one before's, and not counted
                # (every durable row leaves one per workflow, as the floor does).
                left = ended + WORKFLOW_TASK_TIMEOUT_S + 1 - time.monotonic()
                await asyncio.sleep(max(0.0, left))
            cpu[c] = {k: (after[k] - before[k]) * 1000 / calls for k in after}
        row = Row(name, lat[name], tput, cpu)
        rates = "  ".join(f"c={c}: {v:5.0f}/s" for c, v in tput.items())
        print(f"  {name:<34} p50 {row.p50:6.1f} ms   {rates}", flush=True)
        rows.append(row)
    return sorted(rows, key=lambda r: list(paths).index(r.name))


def spawn(args: list[str], env: dict[str, str], log: Path) -> subprocess.Popen[bytes]:
    with log.open("ab") as out:
        return subprocess.Popen(args, env=env, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT)


async def wait_http(
    url: str,
    ok: Callable[[httpx.Response], bool],
    timeout_s: float = 60,
    headers: dict[str, str] | None = None,
) -> None:
    deadline = time.monotonic() + timeout_s
    async with httpx.AsyncClient(trust_env=False, headers=headers) as c:
        while time.monotonic() < deadline:
            try:
                if ok(await c.get(url, timeout=1)):
                    return
            except httpx.HTTPError:
                pass
            await asyncio.sleep(0.1)
    raise TimeoutError(url)


async def main(args: argparse.Namespace) -> None:
    tmp = Path(tempfile.mkdtemp(prefix="reach-bench-"))
    server = DevServer(str(tmp / "temporal.db"), free_port(), None, log_file=tmp / "temporal.log")
    server.start()
    procs: dict[str, subprocess.Popen[bytes]] = {}  # by the name the CPU table uses
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
        # The bench's own (empty) token file: auth off, as `make up` runs; audit on, to a file.
        REACH_AUTH__TOKENS_FILE=str(tmp / "tokens.json"),
        REACH_AUDIT__FILE=str(tmp / "audit.jsonl"),
    )

    def other_gateway(**changes: str) -> tuple[str, dict[str, str]]:
        """Another gateway: gateway 1's settings with `changes`, on its own port and task
        queue, no gRPC front, no queue-mode capabilities (reach-cap-* queues are per
        namespace: they stay gateway 1's)."""
        port = free_port()
        return f"http://127.0.0.1:{port}", dict(
            env,
            REACH_LISTEN_PORT=str(port),
            REACH_TEMPORAL__TASK_QUEUE=f"bench-{uuid.uuid4().hex[:6]}",
            REACH_TRANSPORT__PORTS__GRPC="-1",
            REACH_CAPABILITIES="{}",
            **changes,
        )

    # The same with the workflow sandbox on; and on the Redis registry (its own key prefix).
    gw2, env2 = other_gateway(REACH_TEMPORAL__WORKFLOW_SANDBOX="true")
    gw3, env3 = other_gateway(
        REACH_REGISTRY__TYPE="redis", REACH_REGISTRY__KEY_PREFIX=f"bench-{uuid.uuid4().hex[:6]}"
    )
    # Auth on: a token file with the caller's and the agent's tokens, and one R19 rule.
    caller_token, caller_record = issue("bench", "caller")
    agent_token, agent_record = issue("bench-agent", "agent", ["bench-inline"])
    for record in (caller_record, agent_record):
        FileTokenStore(tmp / "tokens-auth.json").write(record)
    gw4, env4 = other_gateway(
        REACH_AUTH__TOKENS_FILE=str(tmp / "tokens-auth.json"),
        REACH_RULES=json.dumps(
            [
                {
                    "caller": "bench",
                    "target_capability": "bench-inline",
                    "allowed_operations": ["query"],
                }
            ]
        ),
    )
    # Tracing on: every span batched to a file (no console exporter).
    gw5, env5 = other_gateway(
        REACH_TELEMETRY__TRACES="file", REACH_TELEMETRY__FILE=str(tmp / "spans.jsonl")
    )
    # Production: the Redis registry (a key prefix each), tokens on (in the shared store, seeded
    # through each gateway's mirror of it) with the auth row's rule, audit and metrics on; the
    # second also exports every span over OTLP to the bench's collector.
    otlp_port = free_port()
    production: list[tuple[str, dict[str, str]]] = []
    for traces in ({}, {"REACH_TELEMETRY__TRACES": "otlp"}):
        prefix = f"bench-{uuid.uuid4().hex[:6]}"
        for record in (caller_record, agent_record):
            FileTokenStore(mirror_path(tmp / "tokens-prod.json", prefix)).write(record)
        production.append(
            other_gateway(
                REACH_REGISTRY__TYPE="redis",
                REACH_REGISTRY__KEY_PREFIX=prefix,
                REACH_AUTH__TOKENS_FILE=str(tmp / "tokens-prod.json"),
                REACH_RULES=env4["REACH_RULES"],
                REACH_METRICS__ENABLED="true",
                REACH_TELEMETRY__OTLP_ENDPOINT=f"http://127.0.0.1:{otlp_port}",
                **traces,
            )
        )
    (gw6, env6), (gw7, env7) = production
    broker_port = free_port()
    (tmp / "mosquitto.conf").write_text(
        f"listener {broker_port} 127.0.0.1\nallow_anonymous true\nset_tcp_nodelay true\n"
    )
    try:
        procs["broker"] = spawn(
            ["mosquitto", "-c", str(tmp / "mosquitto.conf")], env, tmp / "mq.log"
        )
        procs["collector"] = spawn(
            [
                sys.executable,
                str(ROOT / "bench/otlp_sink.py"),
                "--port",
                str(otlp_port),
                "--count",
                str(tmp / "spans.count"),
            ],
            env,
            tmp / "collector.log",
        )
        for n, gw_env in enumerate((env, env2, env3, env4, env5, env6, env7), 1):
            procs[f"gw{n}"] = spawn(
                [sys.executable, "-m", "gateway_api", "gateway"], gw_env, tmp / f"gw{n}.log"
            )
        for base in (gw, gw2, gw3, gw4, gw5, gw6, gw7):
            # Seven gateways start at once: on a busy 2-core box that can take minutes.
            await wait_http(f"{base}/readyz", lambda r: r.status_code == 200, 300)
        for cap in ("bench-inline", "bench-queue"):
            procs[cap] = spawn(
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
        for n, base in ((2, gw2), (3, gw3), (4, gw4), (5, gw5), (6, gw6), (7, gw7)):
            procs[f"bench-inline-{n}"] = spawn(
                [
                    sys.executable,
                    str(ROOT / "examples/knowledge_retriever.py"),
                    "--reach",
                    base,
                    "--capability",
                    "bench-inline",
                    "--instance-id",
                    f"bench-inline-0{n}",
                ],
                dict(env, REACH_AGENT_TOKEN=agent_token) if base in (gw4, gw6, gw7) else env,
                tmp / f"bench-inline-{n}.log",
            )
        for protocol in PROTOCOLS:
            procs[f"bench-{protocol}"] = spawn(
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
        a2a_url = f"http://127.0.0.1:{free_port()}"
        procs["bench-a2a"] = spawn(
            [sys.executable, "-m", "tests.a2a_agents", "--port", a2a_url.rsplit(":", 1)[1]],
            env,
            tmp / "bench-a2a.log",
        )
        await wait_http(f"{a2a_url}/count", lambda r: r.status_code == 200)
        async with httpx.AsyncClient(trust_env=False) as c:
            registered = await c.post(
                f"{gw}/reach/agents",
                json={
                    "capability": "bench-a2a",
                    "instance_id": "bench-a2a-01",
                    "protocol": "a2a",
                    "service_address": a2a_url,
                },
            )
            registered.raise_for_status()
        mcp_port = free_port()
        mcp_url = f"http://127.0.0.1:{mcp_port}/mcp"
        procs["bench-mcp"] = spawn(
            [
                sys.executable,
                "-m",
                "tests.mcp_servers",
                "--port",
                str(mcp_port),
                "--mode",
                "stateless",
                "--calls",
                str(tmp / "mcp.calls"),
            ],
            env,
            tmp / "bench-mcp.log",
        )
        await wait_http(f"http://127.0.0.1:{mcp_port}/_seen", lambda r: r.status_code == 200)
        async with httpx.AsyncClient(trust_env=False) as c:
            registered = await c.post(
                f"{gw}/reach/agents",
                json={"capability": "bench-mcp", "protocol": "mcp", "service_address": mcp_url},
            )
            registered.raise_for_status()
        for base in (gw2, gw3, gw4, gw5, gw6, gw7):
            await wait_http(
                f"{base}/reach/capabilities/bench-inline",
                lambda r: r.status_code == 200 and len(r.json()["instances"]) == 1,
                headers={"Authorization": f"Bearer {caller_token}"},
            )
        for cap in (
            "bench-inline",
            "bench-queue",
            "bench-a2a",
            "bench-mcp",
            *(f"bench-{p}" for p in PROTOCOLS),
        ):
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
            endpoints["a2a"] = Endpoint(
                instance_id="bench-a2a-01",
                capability="bench-a2a",
                protocol="a2a",
                address=a2a_url,
                details={"url": f"{a2a_url}/"},
            )
            endpoints["mcp"] = Endpoint.model_validate(
                {
                    **(await c.get(f"{gw}/reach/capabilities/bench-mcp")).json()["instances"][0],
                    "capability": "bench-mcp",
                }
            )
        agent_url = f"http://{inst['address']}/reach/query"
        peer = restate_peer.installed() and args.peers != "off"
        if args.peers == "on" and not peer:
            raise SystemExit(f"no Restate server at {restate_peer.SERVER}: make bench-peers")
        ingress = 0
        if peer:
            ingress, admin, service_port = free_port(), free_port(), free_port()
            procs["restate"] = restate_peer.start_server(
                tmp, ingress, admin, free_port(), restate_peer.environment(), tmp / "restate.log"
            )
            procs["restate-service"] = restate_peer.start_service(
                service_port, agent_url, env, tmp / "restate-service.log"
            )
            await restate_peer.register(admin, service_port)
            await restate_peer.ready(ingress, PAYLOAD)
        front_http = f"http://127.0.0.1:{free_port()}"
        procs["front"] = spawn(
            [
                sys.executable,
                str(ROOT / "bench/raw_front.py"),
                "--port",
                front_http.rsplit(":", 1)[1],
                "--temporal",
                server.address,
                "--agent-url",
                agent_url,
            ],
            env,
            tmp / "front.log",
        )
        await wait_http(front_http, lambda r: r.status_code == 200)
        connectors = ConnectorSet()
        channel = grpc.aio.insecure_channel(f"127.0.0.1:{front_port}")
        front_invoke = channel.unary_unary(
            "/reach.v1.Reach/Invoke",
            request_serializer=gateway_pb2.InvokeRequest.SerializeToString,
            response_deserializer=gateway_pb2.InvokeResponse.FromString,
        )

        concurrency = [int(c) for c in args.concurrency.split(",")]
        http = open_client()
        caller = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=max(concurrency)),
            timeout=aiohttp.ClientTimeout(total=30),
        )
        client = await Client.connect(server.address)
        queue = f"raw-{uuid.uuid4().hex[:6]}"
        sandboxed_queue = f"raw-sb-{uuid.uuid4().hex[:6]}"
        activity_queue = f"raw-cap-{uuid.uuid4().hex[:6]}"
        print(
            f"{args.runs} run(s) of {args.requests} sequential calls per path, then throughput "
            f"at {args.concurrency} in flight:"
        )

        async def direct() -> None:
            async with caller.post(
                agent_url, json=PAYLOAD, headers={"X-Reach-Request-Id": str(uuid.uuid4())}
            ) as r:
                r.raise_for_status()
                await r.read()

        async def raw_queue() -> None:
            await client.execute_workflow(
                RawQueueWorkflow.run,
                args=[agent_url, activity_queue],
                id=str(uuid.uuid4()),
                task_queue=queue,
                id_reuse_policy=WorkflowIDReusePolicy.REJECT_DUPLICATE,
                id_conflict_policy=WorkflowIDConflictPolicy.USE_EXISTING,
                request_eager_start=True,
            )

        def raw(task_queue: str, labelled: bool = False) -> Callable[[], Awaitable[None]]:
            # labelled: the start carries what Reach's does for the Temporal UI (its five
            # search attributes and a one-line summary), to show what that costs the engine.
            summary = "bench-inline.query from anonymous" if labelled else None
            attributes = (
                TypedSearchAttributes(
                    [SearchAttributePair(key, "bench-inline") for key in SEARCH_ATTRIBUTES]
                )
                if labelled
                else None
            )

            async def call() -> None:
                await run_floor(
                    client, agent_url, task_queue, summary=summary, attributes=attributes
                )

            return call

        def direct_via(protocol: str, operation: str = "query") -> Callable[[], Awaitable[None]]:
            connector = connectors.get(protocol)
            endpoint = endpoints[protocol]

            async def call() -> None:
                header = Header(
                    request_id=str(uuid.uuid4()),
                    caller="bench",
                    target=endpoint.capability,
                    operation=operation,
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
                    timeout_ms=CALL_TIMEOUT_MS,
                )
            )
            if r.status != "success":
                raise RuntimeError(r)

        a2a_send = {
            "jsonrpc": "2.0",
            "id": 1,
            "method": "SendMessage",
            "params": {
                "message": {
                    "messageId": "bench",
                    "role": "ROLE_USER",
                    "parts": [{"data": PAYLOAD}],
                    "metadata": {"operation": "query", "timeout_ms": CALL_TIMEOUT_MS},
                }
            },
        }

        async def a2a_front() -> None:
            async with caller.post(
                f"{gw}/a2a/bench-inline", json=a2a_send, headers={"A2A-Version": "1.0"}
            ) as r:
                answer = await r.json()
                task = answer.get("result", {}).get("task", {})
                if task.get("status", {}).get("state") != "TASK_STATE_COMPLETED":
                    raise RuntimeError(answer)

        mcp_call = {
            "jsonrpc": "2.0",
            "id": 1,
            "method": "tools/call",
            "params": {
                "name": "bench-inline.query",
                "arguments": PAYLOAD,
                "_meta": {
                    "io.modelcontextprotocol/protocolVersion": "2026-07-28",
                    "io.modelcontextprotocol/clientCapabilities": {},
                    "reach/timeoutMs": CALL_TIMEOUT_MS,
                },
            },
        }
        mcp_headers = {
            "Accept": "application/json",
            "MCP-Protocol-Version": "2026-07-28",
            "Mcp-Method": "tools/call",
            "Mcp-Name": "bench-inline.query",
        }

        async def mcp_front() -> None:
            async with caller.post(f"{gw}/mcp", json=mcp_call, headers=mcp_headers) as r:
                answer = await r.json()
                if answer.get("result", {}).get("isError") is not False:
                    raise RuntimeError(answer)

        def reach(
            cap: str,
            base: str = gw,
            token: str | None = None,
            operation: str = "query",
            payload: dict[str, object] = PAYLOAD,
        ) -> Callable[[], Awaitable[None]]:
            body = {
                "target": cap,
                "operation": operation,
                "payload": payload,
                "timeout_ms": CALL_TIMEOUT_MS,
            }
            headers = {"Authorization": f"Bearer {token}"} if token else {}

            async def call() -> None:
                async with caller.post(f"{base}/reach/invoke", json=body, headers=headers) as r:
                    text = await r.read()
                    if r.status != 200:
                        raise RuntimeError(text)

            return call

        async def restate_call() -> None:
            async with caller.post(f"http://127.0.0.1:{ingress}/bench/invoke", json=PAYLOAD) as r:
                text = await r.read()
                if r.status != 200:
                    raise RuntimeError(text)

        paths: dict[str, Callable[[], Awaitable[None]]] = {
            "direct HTTP": direct,
            **{f"direct {NAMES[p]}": direct_via(p) for p in PROTOCOLS},
            FLOOR: raw(queue),
            LABELLED: raw(queue, labelled=True),
            FRONTED: reach("bench-inline", front_http),
            "raw Temporal, sandboxed": raw(sandboxed_queue),
            QUEUE_FLOOR: raw_queue,
            "reach inline": reach("bench-inline"),
            "reach inline, Redis registry": reach("bench-inline", gw3),
            "reach inline, auth on": reach("bench-inline", gw4, caller_token),
            **{f"reach inline via {NAMES[p]} agent": reach(f"bench-{p}") for p in PROTOCOLS},
            "reach inline, gRPC front": front,
            "reach inline, sandboxed": reach("bench-inline", gw2),
            "reach inline, tracing on": reach("bench-inline", gw5),
            "reach inline, production": reach("bench-inline", gw6, caller_token),
            "reach inline, production + OTLP": reach("bench-inline", gw7, caller_token),
            **({PEER: restate_call} if peer else {}),
            "reach queue": reach("bench-queue"),
            "reach inline, MCP front": mcp_front,
            "reach inline, A2A front": a2a_front,
            "direct A2A": direct_via("a2a", "echo"),
            "reach inline via A2A agent": reach("bench-a2a", operation="echo"),
            "reach inline via A2A agent, a task": reach(
                "bench-a2a", operation="slow", payload={"seconds": 0}
            ),
            "direct MCP": direct_via("mcp", "echo"),
            "reach inline via MCP server": reach("bench-mcp", operation="echo"),
        }
        if args.only:
            wanted = {FLOOR, LABELLED, FRONTED, *(n.strip() for n in args.only.split(";"))}
            if "reach queue" in wanted:
                wanted.add(QUEUE_FLOOR)
            paths = {k: v for k, v in paths.items() if k in wanted}
        floor = Worker(
            client,
            task_queue=queue,
            workflows=[RawWorkflow, RawQueueWorkflow],
            activities=[call_agent],
            workflow_runner=UnsandboxedWorkflowRunner(),
        )
        # The queue floor's activity worker, as Reach's capability queue has one of its own.
        activity_worker = Worker(client, task_queue=activity_queue, activities=[call_agent])
        sandboxed = Worker(
            client, task_queue=sandboxed_queue, workflows=[RawWorkflow], activities=[call_agent]
        )
        assert server.process is not None
        server_pids = [server.process.pid, *children(server.process.pid)]

        def cpu_now() -> dict[str, float]:
            now = {name: cpu_seconds(proc.pid) for name, proc in procs.items()}
            now["server"] = sum(cpu_seconds(pid) for pid in server_pids)
            now["bench"] = cpu_seconds(os.getpid())
            return now

        runs: list[list[Row]] = []
        async with floor, sandboxed, activity_worker:
            for i in range(args.runs):
                if args.runs > 1:
                    print(f"run {i + 1}/{args.runs}", flush=True)
                runs.append(
                    await measure(
                        paths,
                        args.requests,
                        20,
                        concurrency,
                        args.tput_calls,
                        cpu_now,
                        durable=frozenset(
                            n for n in paths if ROW_PROCS[n][0] not in (None, "restate")
                        ),
                        reverse=i % 2 == 1,
                    )
                )
        await caller.close()
        await http.aclose()
        await connectors.aclose()
        await channel.close()
        report(runs, concurrency, args)
        if "reach inline, production + OTLP" in paths:
            await asyncio.sleep(2)  # the gateway's last batch, and the sink's next count
            spans, exports = read_count(tmp / "spans.count")
            print(f"\nThe OTLP collector received {spans} spans in {exports} exports.")
    finally:
        for p in procs.values():
            p.terminate()
        for p in procs.values():
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:  # the Restate service drains its streams
                p.kill()
                p.wait(10)
        server.stop()


def _ratios(runs: list[list[Row]], name: str, value: Callable[[Row], float]) -> str:
    """The ratio of a row's value to its floor's: the median over runs, and the range."""
    ratios = []
    for rows in runs:
        by_name = {r.name: r for r in rows}
        row = by_name[name]
        ratios.append(value(row) / value(by_name[row.floor]))
    mid = statistics.median(ratios)
    if len(ratios) == 1:
        return f"{mid:.2f}"
    return f"{mid:.2f} ({min(ratios):.2f}-{max(ratios):.2f})"


def report(runs: list[list[Row]], concurrency: list[int], args: argparse.Namespace) -> None:
    # Latency figures pool every run's samples; throughput is the median over runs.
    rows = [
        Row(
            name,
            [x for rows in runs for x in _by(rows, name).samples],
            {c: statistics.median(_by(rows, name).tput[c] for rows in runs) for c in concurrency},
            {},  # the CPU table reads the runs themselves
        )
        for name in (r.name for r in runs[0])
    ]
    print()
    print(
        "| path | p50 ms | p95 ms | p99 ms | x floor p50 | x floor p99 | "
        + " | ".join(f"/s c={c} | x floor c={c}" for c in concurrency)
        + " |"
    )
    print("|---|---:|---:|---:|---:|---:|" + "---:|---:|" * len(concurrency))
    for r in rows:
        cells = [
            f"{r.p50:.1f}",
            f"{r.p95:.1f}",
            f"{r.p99:.1f}",
            _ratios(runs, r.name, lambda x: x.p50),
            _ratios(runs, r.name, lambda x: x.p99),
        ]
        for c in concurrency:

            def rate(x: Row, c: int = c) -> float:
                return x.tput[c]

            cells += [f"{r.tput[c]:.0f}", _ratios(runs, r.name, rate)]
        print(f"| {r.name} | " + " | ".join(cells) + " |")
    print(
        f"\nRatios are against {FLOOR!r}, reach queue's against {QUEUE_FLOOR!r}"
        + (f"; median (range) over {len(runs)} runs." if len(runs) > 1 else ".")
    )
    cpu_report(runs, concurrency)
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
    lat_ax.set_title(f"sync invoke latency ({args.requests * len(runs)} calls each)")
    width = 0.8 / len(concurrency)
    for i, c in enumerate(concurrency):
        tput_ax.bar(
            [x + i * width for x in range(len(rows))],
            [r.tput[c] for r in rows],
            width=width,
            label=f"{c} in flight",
        )
    tput_ax.set_xticks([x + width * (len(concurrency) - 1) / 2 for x in range(len(rows))], names)
    tput_ax.legend()
    tput_ax.set_ylabel("calls/s")
    tput_ax.set_title("throughput")
    for ax in (lat_ax, tput_ax):
        ax.tick_params(axis="x", labelrotation=20)
        ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(out / "invoke.png", dpi=110)
    print(f"\nplot: {out / 'invoke.png'}")


def _processes(name: str) -> tuple[str | None, tuple[str, ...]]:
    return ROW_PROCS.get(name, (None, ()))


def _cpu(row: Row, c: int, names: tuple[str, ...]) -> float:
    return sum(row.cpu[c].get(n, 0.0) for n in names)


def _total(row: Row, c: int) -> float:
    worker, agents = _processes(row.name)
    names = {"server", "bench", *agents} | ({worker} if worker else set())
    return _cpu(row, c, tuple(names))


def cpu_report(runs: list[list[Row]], concurrency: list[int]) -> None:
    """CPU ms per call of each process during the throughput phases: what bounds throughput on
    a CPU-bound box, and steadier than the rate itself."""
    first = concurrency[0]

    def median(name: str, value: Callable[[Row], float]) -> float:
        return statistics.median(value(_by(rows, name)) for rows in runs)

    def part(name: str, names: tuple[str, ...]) -> float:
        return statistics.median(_cpu(_by(rows, name), first, names) for rows in runs)

    print(
        f"\nCPU ms per call while {first} calls are in flight (median over runs): the Temporal "
        "server; the gateway serving the row (for the floors: the bench process, which is also "
        "their caller); the caller (the bench's aiohttp or gRPC client); the agent (and the MQTT "
        "broker). The total at each concurrency, and its ratio to the floor's (lower is "
        "cheaper):\n"
    )
    print(
        "| path | server | gateway or floor worker | caller | agent | "
        + " | ".join(f"total c={c} | x floor c={c}" for c in concurrency)
        + " |"
    )
    print("|---|---:|---:|---:|---:|" + "---:|---:|" * len(concurrency))
    for name in (r.name for r in runs[0]):
        worker, agents = _processes(name)
        in_bench = worker == "bench"
        cells = [
            f"{part(name, ('server',)):.2f}",
            "—" if worker is None else f"{part(name, (worker,)):.2f}",
            "(in worker)" if in_bench else f"{part(name, ('bench',)):.2f}",
            f"{part(name, agents):.2f}",
        ]
        for c in concurrency:

            def total(r: Row, c: int = c) -> float:
                return _total(r, c)

            cells += [f"{median(name, total):.2f}", _ratios(runs, name, total)]
        print(f"| {name} | " + " | ".join(cells) + " |")
    names = {r.name for r in runs[0]}
    for more, less, what in (
        (LABELLED, FLOOR, "indexing Reach's search attributes and summary costs the engine"),
        (FRONTED, LABELLED, "an HTTP front in a process of its own costs"),
        ("reach inline", FRONTED, "Reach's own work costs"),
        ("reach inline, MCP front", "reach inline", "the MCP front costs over POST /reach/invoke"),
        ("reach inline, A2A front", "reach inline", "the A2A front costs over POST /reach/invoke"),
    ):
        if {more, less} <= names:
            print(
                f"\nWhat {what} ({more!r} less {less!r}): " + _difference(runs, more, less, first)
            )


def _difference(runs: list[list[Row]], more: str, less: str, c: int) -> str:
    """p50, and CPU per call in all and the server's: more's less less's (median over runs)."""

    def delta(value: Callable[[Row], float]) -> float:
        return statistics.median(value(_by(rows, more)) - value(_by(rows, less)) for rows in runs)

    p50 = delta(lambda r: statistics.median(r.samples))
    total = delta(lambda r: _total(r, c))
    server = delta(lambda r: _cpu(r, c, ("server",)))
    return (
        f"p50 {p50:+.2f} ms; CPU {total:+.2f} ms per call at c={c}, of which the server's "
        f"{server:+.2f} ms."
    )


def _by(rows: list[Row], name: str) -> Row:
    return next(r for r in rows if r.name == name)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument(
        "--concurrency", default="16,64", help="calls in flight for throughput, comma-separated"
    )
    parser.add_argument("--runs", type=int, default=1, help="repeat the measurement N times")
    parser.add_argument(
        "--tput-calls",
        type=int,
        default=600,
        help="calls per path and concurrency in the throughput phase (at least 4x in flight)",
    )
    parser.add_argument(
        "--peers",
        choices=("auto", "on", "off"),
        default="auto",
        help="the Restate row: auto (when `make bench-peers` installed its server), on, off",
    )
    parser.add_argument(
        "--only", default="", help="';'-separated path names to run (the floors always run)"
    )
    asyncio.run(main(parser.parse_args()))
    sys.stdout.flush()
    os._exit(0)  # Worker teardown can abort at interpreter exit (known SDK issue)
