"""The stack under test and the faults done to it, all real processes on free ports.

One Temporal dev server (its own db file, restarted on it after a SIGKILL), one redis-server of
the suite's own (AOF with fsync always: a SIGKILLed Redis comes back with what it acknowledged,
as a durable production Redis does; never the machine's 6379), one Mosquitto for the MQTT
agents, two gateways (API + invoke worker), extra `worker.py` processes, ledger agents on every
SDK protocol (the instances a fault kills or stops each in a process of its own, the others in
one), an MCP server and an A2A agent registered by URL with ledgers of their own
(tests/reliability/mcp_server.py, a2a_agent.py), and a callback receiver that can be taken down
and brought back on its port.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from agent_reach_sdk.wire import Answer, Inbound
from gateway_api.devserver import DevServer, free_port
from tests.helpers import ROOT, GatewayProcess, PathServer, Proc, Stack, Worker, spawn
from tests.redis_servers import RedisProcess
from tests.reliability.a2a_agent import A2ALedgerAgent
from tests.reliability.mcp_server import McpLedgerServer

PROTOCOLS = ("http", "grpc", "websocket", "mqtt")
# Agents' heartbeats and the registry's eviction: a busy box's gateway may answer a beat late.
HEARTBEAT_S, HEARTBEAT_TIMEOUT_S = 1.0, 5.0


class LedgerAgent:
    """One tests/reliability/agent.py process hosting `instances` ((protocol, instance id)
    each); restartable under the same ids."""

    def __init__(self, cluster: Cluster, instances: list[tuple[str, str]]) -> None:
        self.cluster = cluster
        self.instances = instances
        self.name = "+".join(i for _, i in instances)
        self.proc: Proc | None = None

    def start(self) -> None:
        c = self.cluster
        args = [sys.executable, "-m", "tests.reliability.agent", "--reach", c.gateway_urls]
        args += ["--ledgers", str(c.ledgers), "--broker", f"127.0.0.1:{c.mqtt_port}"]
        args += ["--heartbeat-interval", str(HEARTBEAT_S)]
        for protocol, instance_id in self.instances:
            args += ["--serve", f"{protocol}:{instance_id}"]
        self.proc = spawn(args, {}, c.tmp / f"agent-{self.name}.log")

    async def ready(self, timeout_s: float = 90.0) -> None:
        """Until each of its instances serves and has joined (this process's own lines)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            assert self.proc is not None
            out = self.proc.own_output()
            if all(
                f"agent {i} serving at" in out and f"instance={i} address=" in out
                for _, i in self.instances
            ):
                return
            if self.proc.popen.poll() is not None:
                raise RuntimeError(f"agent {self.name} exited:\n{out}")
            await asyncio.sleep(0.1)
        raise TimeoutError(f"agent {self.name} not ready")


class Receiver:
    """The callback receiver: records (webhook-id, envelope) for every POST while it is up."""

    def __init__(self) -> None:
        self.port = free_port()
        self.deliveries: list[tuple[str, dict[str, object], float]] = []
        self._server: PathServer | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/callback"

    async def _handle(self, request: Inbound) -> Answer:
        headers = {k.lower(): v for k, v in request.headers.items()}
        envelope = json.loads(request.body)
        self.deliveries.append((headers.get("webhook-id", ""), envelope, time.monotonic()))
        return Answer(200, {"ok": True})

    async def up(self) -> None:
        address = f"127.0.0.1:{self.port}"
        self._server = PathServer(
            self._handle,
            listen=address,
            advertise=address,
            instance_id="receiver",
            max_body_bytes=1 << 20,
        )
        await self._server.start()

    async def down(self) -> None:
        if self._server is not None:
            await self._server.close()
            self._server = None


@dataclass
class Cluster:
    tmp: Path
    workers: int = 1
    # SDK agents per protocol: two where a fault takes one away (its peer serves meanwhile).
    per_protocol: dict[str, int] = field(default_factory=lambda: dict.fromkeys(PROTOCOLS, 2))
    with_mcp: bool = True  # an MCP server registered by URL (capability rel-mcp)
    with_a2a: bool = True  # an A2A agent registered by URL (capability rel-a2a)
    # The instances a fault kills or stops, each in a process of its own; the others share one.
    alone: tuple[str, ...] = ("rel-grpc-00", "rel-http-00", "rel-websocket-01")
    gateways: list[GatewayProcess] = field(default_factory=list)
    worker_procs: list[Worker] = field(default_factory=list)
    agents: list[LedgerAgent] = field(default_factory=list)
    receiver: Receiver = field(default_factory=Receiver)
    temporal: DevServer | None = None
    redis: RedisProcess | None = None
    mosquitto: subprocess.Popen[bytes] | None = None
    mcp: McpLedgerServer | None = None
    a2a: A2ALedgerAgent | None = None
    stack: Stack | None = None
    gateway_ports: list[int] = field(default_factory=list)
    mqtt_port: int = 0
    phases: dict[str, float] = field(default_factory=dict)  # seconds each step of start took

    @property
    def ledgers(self) -> Path:
        return self.tmp / "ledgers"

    @property
    def gateway_urls(self) -> str:
        return ",".join(f"http://127.0.0.1:{p}" for p in self.gateway_ports)

    @property
    def protocols(self) -> list[str]:
        """The capabilities' protocols the load spreads over."""
        by_url = [p for p, on in (("mcp", self.with_mcp), ("a2a", self.with_a2a)) if on]
        return [p for p in PROTOCOLS if self.per_protocol.get(p)] + by_url

    async def start(self) -> None:
        """Redis first (it is up in a moment), then every process at once: the gateways and
        the worker wait for Temporal (`temporal.connect_wait_s`) while it starts, the SDK
        agents join when a gateway is up; then the registrations by URL."""
        began = time.monotonic()
        self.ledgers.mkdir(parents=True, exist_ok=True)
        self.gateway_ports = [free_port(), free_port()]
        self.mqtt_port = free_port()
        port = free_port()
        redis_args = ["--port", str(port), "--bind", "127.0.0.1", "--save", ""]
        redis_args += ["--appendonly", "yes", "--appendfsync", "always"]
        self.redis = RedisProcess(port, self.tmp / "redis", redis_args)
        await asyncio.to_thread(self.redis.start)
        self.temporal = DevServer(
            str(self.tmp / "temporal.db"), free_port(), None, log_file=self.tmp / "temporal.log"
        )
        engine = asyncio.create_task(self.temporal.start_async())
        conf = self.tmp / "mosquitto.conf"
        conf.write_text(f"listener {self.mqtt_port} 127.0.0.1\nallow_anonymous true\n")
        exe = shutil.which("mosquitto") or "/usr/sbin/mosquitto"
        self.mosquitto = self._mosquitto([exe, "-c", str(conf)])
        self.stack = Stack(
            temporal=self.temporal.address,
            tmp=self.tmp,
            task_queue=f"rel-{uuid.uuid4().hex[:8]}",
            registry="redis",
            key_prefix=f"rel-{uuid.uuid4().hex[:8]}",
            heartbeat_interval=HEARTBEAT_S,
            heartbeat_timeout=HEARTBEAT_TIMEOUT_S,
            extra={
                "REACH_REGISTRY__REDIS_URL": f"redis://127.0.0.1:{port}/0",
                "REACH_CALLBACK__MAX_BACKOFF_S": "1",
                # Signed callbacks: each carries its webhook-id, the same on every delivery.
                "REACH_SECURITY__WEBHOOK_KEY": uuid.uuid4().hex,
                "REACH_TEMPORAL__CONNECT_WAIT_S": "60",
            },
        )
        self.gateways = [
            GatewayProcess(self.stack, f"gw{i}", port=p) for i, p in enumerate(self.gateway_ports)
        ]
        self.worker_procs = [Worker(self.stack) for _ in range(self.workers)]
        together: list[tuple[str, str]] = []
        for protocol in PROTOCOLS:
            for i in range(self.per_protocol.get(protocol, 0)):
                instance = (protocol, f"rel-{protocol}-{i:02d}")
                if instance[1] in self.alone:
                    self.agents.append(LedgerAgent(self, [instance]))
                else:
                    together.append(instance)
        self.agents.append(LedgerAgent(self, together))
        for agent in self.agents:
            agent.start()
        by_url: list[McpLedgerServer | A2ALedgerAgent] = []
        if self.with_mcp:
            self.mcp = McpLedgerServer(self.tmp, self.ledgers)
            by_url.append(self.mcp.start())
        if self.with_a2a:
            self.a2a = A2ALedgerAgent(self.tmp, self.ledgers)
            by_url.append(self.a2a.start())
        await asyncio.gather(engine, self.receiver.up())
        self.phases["engine"] = time.monotonic() - began
        await asyncio.gather(
            *(g.ready(90) for g in self.gateways),
            *(w.ready(90) for w in self.worker_procs),
            *(s.ready() for s in by_url),
        )
        self.phases["gateways"] = time.monotonic() - began
        await asyncio.gather(*(a.ready() for a in self.agents), self._register_by_url())
        self.phases["agents"] = time.monotonic() - began

    async def _register_by_url(self) -> None:
        """POST /reach/agents for the MCP server and the A2A agent; `read` is declared
        idempotent for the A2A agent (its card cannot say so; the MCP tool's hint does)."""
        bodies: list[dict[str, object]] = []
        if self.mcp is not None:
            bodies.append({"protocol": "mcp", "service_address": self.mcp.url})
            bodies[-1].update(capability="rel-mcp", instance_id=self.mcp.instance)
        if self.a2a is not None:
            bodies.append({"protocol": "a2a", "service_address": self.a2a.url})
            bodies[-1].update(capability="rel-a2a", instance_id=self.a2a.instance)
            bodies[-1]["operations"] = [{"name": "read", "idempotent": True}]
        async with httpx.AsyncClient(trust_env=False, timeout=30) as http:
            for body in bodies:
                r = await http.post(f"{self.gateways[0].url}/reach/agents", json=body)
                if r.status_code not in (200, 201):
                    raise RuntimeError(f"registering {body}: {r.status_code} {r.text}")

    def _mosquitto(self, args: list[str]) -> subprocess.Popen[bytes]:
        with (self.tmp / "mosquitto.log").open("ab") as log:
            return subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT)

    def cpu(self) -> dict[str, float]:
        """CPU seconds (user + system) the processes now running have used, by kind: where a
        run's time goes on a busy box (restarted processes count from their restart)."""
        kinds: dict[str, list[subprocess.Popen[bytes] | None]] = {
            "gateways": [g.proc.popen for g in self.gateways],
            "worker": [w.proc.popen for w in self.worker_procs],
            "agents": [a.proc.popen for a in self.agents if a.proc is not None],
            "by URL": [s.proc.popen for s in (self.mcp, self.a2a) if s and s.proc],
            "temporal": [self.temporal.process if self.temporal else None],
            "redis": [self.redis.proc if self.redis else None],
        }
        tick = os.sysconf("SC_CLK_TCK")
        used: dict[str, float] = {}
        for kind, popens in kinds.items():
            for popen in popens:
                with contextlib.suppress(OSError, IndexError, ValueError):
                    assert popen is not None
                    fields = Path(f"/proc/{popen.pid}/stat").read_text().rsplit(")", 1)[1]
                    utime, stime = fields.split()[11:13]
                    used[kind] = used.get(kind, 0.0) + (int(utime) + int(stime)) / tick
        return used

    async def stop(self) -> None:
        """SIGKILL everything at once (the verdicts are taken: nothing is left to finish)."""
        await self.receiver.down()
        procs = [a.proc for a in self.agents if a.proc is not None]
        procs += [w.proc for w in self.worker_procs] + [g.proc for g in self.gateways]
        procs += [s.proc for s in (self.mcp, self.a2a) if s is not None and s.proc is not None]
        for proc in procs:
            proc.kill()
        if self.mosquitto is not None:
            self.mosquitto.kill()
        if self.redis is not None:
            self.redis.kill()
        if self.temporal is not None and self.temporal.process is not None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.temporal.process.pid, signal.SIGKILL)
        for popen in [p.popen for p in procs] + [self.mosquitto]:
            if popen is not None:
                await asyncio.to_thread(popen.wait)
        if self.temporal is not None:
            self.temporal.stop()

    # -- faults: each returns once the fault is done and what it broke is back --------------

    async def kill_gateway(self, index: int) -> None:
        assert self.stack is not None
        self.gateways[index].proc.kill()
        self.gateways[index].proc.popen.wait()
        gw = GatewayProcess(self.stack, f"gw{index}", port=self.gateway_ports[index])
        self.gateways[index] = gw
        await gw.ready(90)

    async def kill_worker(self) -> None:
        assert self.stack is not None
        self.worker_procs[0].proc.kill()
        self.worker_procs[0].proc.popen.wait()
        self.worker_procs[0] = await Worker(self.stack).ready(90)

    async def kill_temporal(self, down_s: float) -> None:
        assert self.temporal is not None
        assert self.temporal.process is not None
        os.killpg(self.temporal.process.pid, signal.SIGKILL)
        self.temporal.process.wait()
        await asyncio.sleep(down_s)
        await self.temporal.start_async()  # the same db file and port

    async def kill_redis(self, down_s: float) -> None:
        assert self.redis is not None
        self.redis.kill()
        await asyncio.sleep(down_s)
        await asyncio.to_thread(self.redis.start)  # its AOF: what it acknowledged is back

    def agent(self, instance_id: str) -> LedgerAgent:
        """The process of an instance that runs alone (what a fault may kill)."""
        return next(a for a in self.agents if [i for _, i in a.instances] == [instance_id])

    async def kill_agent(self, instance_id: str) -> None:
        agent = self.agent(instance_id)
        assert agent.proc is not None
        agent.proc.kill()
        agent.proc.popen.wait()
        agent.start()
        await agent.ready()

    async def stop_agent(self, instance_id: str, stopped_s: float) -> None:
        proc = self.agent(instance_id).proc
        assert proc is not None
        proc.kill(signal.SIGSTOP)
        await asyncio.sleep(stopped_s)
        proc.kill(signal.SIGCONT)

    async def kill_mcp(self) -> None:
        assert self.mcp is not None
        await self.mcp.restart()

    async def kill_a2a(self) -> None:
        assert self.a2a is not None
        await self.a2a.restart()

    async def receiver_down(self, down_s: float) -> None:
        await self.receiver.down()
        await asyncio.sleep(down_s)
        await self.receiver.up()


def ledger_rows(cluster: Cluster) -> list[dict[str, object]]:
    """Every execution in every ledger: the SDK agents', the MCP server's, the A2A agent's."""
    rows: list[dict[str, object]] = []
    for path in sorted(cluster.ledgers.glob("*.jsonl")):
        for line in path.read_text().splitlines():
            if line.strip():
                rows.append(json.loads(line))
    return rows


__all__ = ["ROOT", "Cluster", "LedgerAgent", "Receiver", "ledger_rows"]
