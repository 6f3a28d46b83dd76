"""The stack under test and the faults done to it, all real processes on free ports.

One Temporal dev server (its own db file, restarted on it after a SIGKILL), one redis-server of
the suite's own (AOF with fsync always: a SIGKILLed Redis comes back with what it acknowledged,
as a durable production Redis does; never the machine's 6379), one Mosquitto for the MQTT
agents, two gateways (API + invoke worker), extra `worker.py` processes, ledger agents on every
SDK protocol, and a callback receiver that can be taken down and brought back on its port.
"""

from __future__ import annotations

import asyncio
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
from tests.mcp_servers import McpServerProcess
from tests.redis_servers import RedisProcess

PROTOCOLS = ("http", "grpc", "websocket", "mqtt")


class LedgerAgent:
    """One tests/reliability/agent.py process; restartable under the same instance id."""

    def __init__(self, cluster: Cluster, protocol: str, index: int) -> None:
        self.cluster = cluster
        self.protocol = protocol
        self.capability = f"rel-{protocol}"
        self.instance_id = f"rel-{protocol}-{index:02d}"
        self.proc: Proc | None = None
        self.stopped = False

    def start(self) -> None:
        c = self.cluster
        args = [sys.executable, "-m", "tests.reliability.agent", "--reach", c.gateway_urls]
        args += ["--capability", self.capability, "--instance-id", self.instance_id]
        args += ["--ledger", str(c.ledgers / f"{self.instance_id}.jsonl")]
        args += ["--protocol", self.protocol, "--broker", f"127.0.0.1:{c.mqtt_port}"]
        self.proc = spawn(args, {}, c.tmp / f"agent-{self.instance_id}.log")

    async def ready(self, timeout_s: float = 60.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            assert self.proc is not None
            out = self.proc.own_output()
            if "serving at" in out and "joined Reach" in out:
                return
            if self.proc.popen.poll() is not None:
                raise RuntimeError(f"agent {self.instance_id} exited:\n{out}")
            await asyncio.sleep(0.1)
        raise TimeoutError(f"agent {self.instance_id} not ready")


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
    with_mcp: bool = True
    agents_per_protocol: int = 2
    gateways: list[GatewayProcess] = field(default_factory=list)
    worker_procs: list[Worker] = field(default_factory=list)
    agents: list[LedgerAgent] = field(default_factory=list)
    receiver: Receiver = field(default_factory=Receiver)
    temporal: DevServer | None = None
    redis: RedisProcess | None = None
    mosquitto: subprocess.Popen[bytes] | None = None
    mcp: McpServerProcess | None = None  # an MCP server registered by URL (capability rel-mcp)
    stack: Stack | None = None
    gateway_ports: list[int] = field(default_factory=list)
    mqtt_port: int = 0

    @property
    def ledgers(self) -> Path:
        return self.tmp / "ledgers"

    @property
    def gateway_urls(self) -> str:
        return ",".join(f"http://127.0.0.1:{p}" for p in self.gateway_ports)

    async def start(self) -> None:
        self.ledgers.mkdir(parents=True, exist_ok=True)
        self.temporal = DevServer(
            str(self.tmp / "temporal.db"), free_port(), None, log_file=self.tmp / "temporal.log"
        )
        await self.temporal.start_async()
        port = free_port()
        redis_args = ["--port", str(port), "--bind", "127.0.0.1", "--save", ""]
        redis_args += ["--appendonly", "yes", "--appendfsync", "always"]
        self.redis = RedisProcess(port, self.tmp / "redis", redis_args)
        await asyncio.to_thread(self.redis.start)
        self.mqtt_port = free_port()
        conf = self.tmp / "mosquitto.conf"
        conf.write_text(f"listener {self.mqtt_port} 127.0.0.1\nallow_anonymous true\n")
        exe = shutil.which("mosquitto") or "/usr/sbin/mosquitto"
        self.mosquitto = await asyncio.to_thread(self._mosquitto, [exe, "-c", str(conf)])
        self.stack = Stack(
            temporal=self.temporal.address,
            tmp=self.tmp,
            task_queue=f"rel-{uuid.uuid4().hex[:8]}",
            registry="redis",
            key_prefix=f"rel-{uuid.uuid4().hex[:8]}",
            extra={
                "REACH_REGISTRY__REDIS_URL": f"redis://127.0.0.1:{port}/0",
                "REACH_CALLBACK__MAX_BACKOFF_S": "1",
                # Signed callbacks: each carries its webhook-id, the same on every delivery.
                "REACH_SECURITY__WEBHOOK_KEY": uuid.uuid4().hex,
            },
        )
        self.gateway_ports = [free_port(), free_port()]
        self.gateways = [
            GatewayProcess(self.stack, f"gw{i}", port=p) for i, p in enumerate(self.gateway_ports)
        ]
        self.worker_procs = [Worker(self.stack) for _ in range(self.workers)]
        await asyncio.gather(
            *(g.ready() for g in self.gateways), *(w.ready(60) for w in self.worker_procs)
        )
        for protocol in PROTOCOLS:
            for i in range(self.agents_per_protocol):
                self.agents.append(LedgerAgent(self, protocol, i))
        for agent in self.agents:
            agent.start()
        await asyncio.gather(*(a.ready() for a in self.agents))
        if self.with_mcp:
            await self._register_mcp()
        await self.receiver.up()

    async def _register_mcp(self) -> None:
        """tests/mcp_servers.py: its `count` tool (not idempotent) appends its `tag`, the
        request id, to its calls file: the MCP server's ledger."""
        self.mcp = await McpServerProcess(self.tmp, "both").start().ready()
        body = {"protocol": "mcp", "service_address": self.mcp.url, "capability": "rel-mcp"}
        async with httpx.AsyncClient(trust_env=False, timeout=30) as http:
            r = await http.post(f"{self.gateways[0].url}/reach/agents", json=body)
        if r.status_code not in (200, 201):
            raise RuntimeError(f"registering the MCP server: {r.status_code} {r.text}")

    async def kill_mcp(self) -> None:
        assert self.mcp is not None
        await self.mcp.restart()  # SIGKILL, then the same port: the probe finds it again

    def _mosquitto(self, args: list[str]) -> subprocess.Popen[bytes]:
        with (self.tmp / "mosquitto.log").open("ab") as log:
            return subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT)

    async def stop(self) -> None:
        await self.receiver.down()
        for agent in self.agents:
            if agent.proc is not None:
                agent.proc.kill(signal.SIGCONT)
                agent.proc.stop()
        for worker in self.worker_procs:
            worker.proc.stop()
        for gateway in self.gateways:
            gateway.proc.stop()
        if self.mcp is not None:
            self.mcp.stop()
        if self.mosquitto is not None:
            self.mosquitto.terminate()
            self.mosquitto.wait(10)
        if self.redis is not None:
            self.redis.stop()
        if self.temporal is not None:
            self.temporal.stop()

    # -- faults: each returns once the fault is done and what it broke is back --------------

    async def kill_gateway(self, index: int) -> None:
        assert self.stack is not None
        self.gateways[index].proc.kill()
        self.gateways[index].proc.popen.wait()
        gw = GatewayProcess(self.stack, f"gw{index}", port=self.gateway_ports[index])
        self.gateways[index] = gw
        await gw.ready()

    async def kill_worker(self) -> None:
        assert self.stack is not None
        self.worker_procs[0].proc.kill()
        self.worker_procs[0].proc.popen.wait()
        self.worker_procs[0] = await Worker(self.stack).ready(60)

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

    async def kill_agent(self, index: int) -> None:
        agent = self.agents[index]
        assert agent.proc is not None
        agent.proc.kill()
        agent.proc.popen.wait()
        agent.start()
        await agent.ready()

    async def stop_agent(self, index: int, stopped_s: float) -> None:
        proc = self.agents[index].proc
        assert proc is not None
        proc.kill(signal.SIGSTOP)
        await asyncio.sleep(stopped_s)
        proc.kill(signal.SIGCONT)

    async def receiver_down(self, down_s: float) -> None:
        await self.receiver.down()
        await asyncio.sleep(down_s)
        await self.receiver.up()


def ledger_rows(cluster: Cluster) -> list[dict[str, object]]:
    """Every execution: the SDK agents' ledgers, then the MCP server's calls (request ids)."""
    rows: list[dict[str, object]] = []
    for path in sorted(cluster.ledgers.glob("*.jsonl")):
        for line in path.read_text().splitlines():
            if line.strip():
                rows.append(json.loads(line))
    if cluster.mcp is not None:
        for line in cluster.mcp.calls.read_text().splitlines():
            if line.strip():
                rows.append({"request_id": line.strip(), "instance": "mcp", "op": "count"})
    return rows


__all__ = ["ROOT", "Cluster", "LedgerAgent", "Receiver", "ledger_rows"]
