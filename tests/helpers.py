"""Real processes for integration tests (gateways, workers, demo agents, a callback receiver) and
the calls and waits the tests share."""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import json
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Protocol

import httpx

from agent_reach_sdk.servers.http import HttpAgentServer
from agent_reach_sdk.wire import Answer, Dispatch, Inbound
from gateway_api.devserver import free_port
from reach.messages import Header, Message

ROOT = Path(__file__).resolve().parent.parent
AGENT_SCRIPT = ROOT / "examples" / "knowledge_retriever.py"
# The W3C Trace Context example: a valid traceparent for messages to carry.
TRACEPARENT = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"


def _env(extra: Mapping[str, str]) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("REACH_", "TEMPORAL_"))}
    env.update(extra)
    return env


@dataclass
class Proc:
    popen: subprocess.Popen[bytes]
    log: Path
    # Where this process's output starts: a log may hold an earlier process's (an agent
    # restarted under its instance_id appends to the same file).
    start: int = 0

    def output(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""

    def own_output(self) -> str:
        """What this process wrote, not what was in its log before it started."""
        if not self.log.exists():
            return ""
        with self.log.open("rb") as f:
            f.seek(self.start)
            return f.read().decode(errors="replace")

    def kill(self, sig: int = signal.SIGKILL) -> None:
        if self.popen.poll() is None:
            os.killpg(self.popen.pid, sig)

    def stop(self) -> None:
        if self.popen.poll() is None:
            os.killpg(self.popen.pid, signal.SIGTERM)
            try:
                self.popen.wait(10)
            except subprocess.TimeoutExpired:
                os.killpg(self.popen.pid, signal.SIGKILL)
                self.popen.wait()


SPAWNED: list[Proc] = []


def spawn(args: list[str], env: Mapping[str, str], log: Path) -> Proc:
    with log.open("ab") as out:
        start = out.tell()
        popen = subprocess.Popen(
            args,
            env=_env(env),
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            cwd=ROOT,
        )
    proc = Proc(popen, log, start)
    SPAWNED.append(proc)
    return proc


def stop_spawned(since: int = 0) -> None:
    """Stop every process spawned after index `since` (SIGCONT first: some tests SIGSTOP), all
    at once: each is sent SIGTERM before any is waited for, SIGKILL after 10 s."""
    procs = SPAWNED[since:]
    del SPAWNED[since:]
    for sig in (signal.SIGCONT, signal.SIGTERM):
        for proc in procs:
            if proc.popen.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.popen.pid, sig)
    deadline = time.monotonic() + 10
    for proc in procs:
        try:
            proc.popen.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.popen.wait()


@dataclass
class Stack:
    """Settings shared by the gateways and workers of one test."""

    temporal: str
    tmp: Path
    task_queue: str
    registry: str = "memory"
    key_prefix: str = "reach"
    heartbeat_timeout: float = 3.0
    heartbeat_interval: float = 0.5
    extra: dict[str, str] = field(default_factory=dict)

    def env(self, port: int | None = None) -> dict[str, str]:
        env = {
            "TEMPORAL_ADDRESS": self.temporal,
            "REACH_TEMPORAL__TASK_QUEUE": self.task_queue,
            "REACH_REGISTRY__TYPE": self.registry,
            "REACH_REGISTRY__KEY_PREFIX": self.key_prefix,
            "REACH_REGISTRY__HEARTBEAT_TIMEOUT": str(self.heartbeat_timeout),
            "REACH_REGISTRY__HEARTBEAT_INTERVAL": str(self.heartbeat_interval),
            "REACH_CALLBACK__INITIAL_BACKOFF_S": "0.2",
            # Determinism guard: tests run the workflow in the SDK sandbox (production doesn't).
            "REACH_TEMPORAL__WORKFLOW_SANDBOX": "true",
            "REACH_CONFIG": str(ROOT / "reach.yaml"),
            # Many gateways per session: each gRPC front on a free port of its own.
            "REACH_TRANSPORT__PORTS__GRPC": "0",
            # Each stack its own tokens and audit trail (never the checkout's .reach/).
            "REACH_AUTH__TOKENS_FILE": str(self.tmp / "tokens.json"),
            "REACH_AUDIT__FILE": str(self.tmp / "audit.jsonl"),
            **self.extra,
        }
        if port is not None:
            env["REACH_LISTEN_PORT"] = str(port)
        return env


class GatewayProcess:
    def __init__(
        self, stack: Stack, name: str = "gateway", *, worker: bool = True, port: int | None = None
    ) -> None:
        self.stack = stack
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc = spawn(
            [sys.executable, "-m", "gateway_api", "gateway", *([] if worker else ["--no-worker"])],
            stack.env(self.port),
            stack.tmp / f"{name}-{self.port}.log",
        )

    async def ready(self, timeout_s: float = 60.0) -> GatewayProcess:
        deadline = time.monotonic() + timeout_s
        async with httpx.AsyncClient(trust_env=False) as client:
            while time.monotonic() < deadline:
                if self.proc.popen.poll() is not None:
                    raise RuntimeError(f"gateway exited:\n{self.proc.output()}")
                try:
                    r = await client.get(f"{self.url}/readyz", timeout=1)
                    if r.status_code == 200:
                        return self
                except httpx.HTTPError:
                    pass
                await asyncio.sleep(0.1)
        raise TimeoutError(f"gateway not ready:\n{self.proc.output()}")

    async def __aenter__(self) -> GatewayProcess:
        """Ready to serve; stopped when the block ends, even if it never got ready."""
        try:
            return await self.ready()
        except BaseException:
            self.proc.stop()
            raise

    async def __aexit__(self, *exc: object) -> None:
        self.proc.stop()


class Worker:
    def __init__(self, stack: Stack, *args: str) -> None:
        self.proc = spawn(
            [sys.executable, str(ROOT / "worker.py"), *args],
            stack.env(),
            stack.tmp / f"worker-{time.monotonic_ns()}.log",
        )

    async def ready(self, timeout_s: float = 30.0) -> Worker:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if "reach worker: serving" in self.proc.output():
                return self
            if self.proc.popen.poll() is not None:
                raise RuntimeError(f"worker exited:\n{self.proc.output()}")
            await asyncio.sleep(0.1)
        raise TimeoutError(f"worker not ready:\n{self.proc.output()}")


class Agent:
    def __init__(
        self,
        gateway: GatewayProcess,
        instance_id: str,
        capability: str,
        *flags: str,
        heartbeat_interval: float = 0.5,
        env: Mapping[str, str] | None = None,
    ) -> None:
        self.instance_id = instance_id
        self.proc = spawn(
            [
                sys.executable,
                str(AGENT_SCRIPT),
                "--reach",
                gateway.url,
                "--capability",
                capability,
                "--instance-id",
                instance_id,
                "--heartbeat-interval",
                str(heartbeat_interval),
                *flags,
            ],
            dict(env or {}),
            gateway.stack.tmp / f"agent-{instance_id}.log",
        )

    async def ready(self, timeout_s: float = 20.0) -> Agent:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            out = self.proc.own_output()  # not the lines of an earlier agent of this id
            if "serving at" in out and "joined Reach" in out:
                return self
            if self.proc.popen.poll() is not None:
                raise RuntimeError(f"agent exited:\n{out}")
            await asyncio.sleep(0.05)
        raise TimeoutError(f"agent not ready:\n{self.proc.output()}")


def spawn_agents(gateway: GatewayProcess, capability: str, count: int, *flags: str) -> list[Agent]:
    """`count` agents of `capability` started now, not waited for (`ready_together`)."""
    return [Agent(gateway, f"{capability}-{i:02d}", capability, *flags) for i in range(count)]


async def start_agents(
    gateway: GatewayProcess, capability: str, count: int, *flags: str
) -> list[Agent]:
    agents = spawn_agents(gateway, capability, count, *flags)
    await asyncio.gather(*(a.ready() for a in agents))
    return agents


async def ready_together(gateway: GatewayProcess, *others: Agent | Worker) -> GatewayProcess:
    """A gateway and the agents (and workers) started beside it while it starts: an agent
    joins once the gateway answers (the SDK tries its Join again every heartbeat interval), so
    its process starts during the gateway's rather than after it. The others' deadlines count
    from the gateway's readiness."""
    await gateway.ready()
    await asyncio.gather(*(o.ready() for o in others))
    return gateway


def message(
    operation: str, payload: dict[str, Any] | None = None, *, deadline_s: float = 5.0, **header: Any
) -> Message:
    """A message as a connector is handed one: a second attempt with an idempotency key and a
    traceparent, so every header it carries has a value; `header` replaces any field."""
    fields: dict[str, Any] = {
        "request_id": f"req-{uuid.uuid4().hex[:12]}",
        "caller": "tester",
        "target": "cap",
        "operation": operation,
        "attempt": 2,
        "deadline_ms": int((time.time() + deadline_s) * 1000),
        "idempotency_key": "key-1",
        "traceparent": TRACEPARENT,
        **header,
    }
    return Message(header=Header(**fields), payload={"q": "x"} if payload is None else payload)


class PathServer(HttpAgentServer):
    """The SDK's HTTP server answering every method and path; `Inbound.operation` is the path."""

    def route(self, method: str, path: str) -> str | None:
        return path


def path_server(handler: Dispatch, max_body_bytes: int = 1 << 20) -> PathServer:
    return PathServer(
        handler,
        listen="127.0.0.1:0",
        advertise="127.0.0.1:0",
        instance_id="test-server",
        max_body_bytes=max_body_bytes,
    )


def agent_server(handler: Dispatch, max_body_bytes: int = 1 << 20) -> HttpAgentServer:
    """The SDK's HTTP agent server (`POST /reach/{operation}`) around a raw handler."""
    return HttpAgentServer(
        handler,
        listen="127.0.0.1:0",
        advertise="127.0.0.1:0",
        instance_id="test-agent",
        max_body_bytes=max_body_bytes,
    )


class CallbackReceiver:
    """A real HTTP endpoint that records every callback POST."""

    def __init__(self, *, fail_first: int = 0, fail_status: int = 500) -> None:
        self.received: list[tuple[dict[str, str], dict[str, Any]]] = []
        self.refused = 0
        self.arrived = asyncio.Event()
        self._fail_first = fail_first
        self._fail_status = fail_status
        self._server = path_server(self._handle)

    async def _handle(self, request: Inbound) -> Answer:
        if self.refused < self._fail_first:
            self.refused += 1
            return Answer(self._fail_status, {"error": "not now"})
        self.received.append((dict(request.headers), json.loads(request.body)))
        self.arrived.set()
        return Answer(200, {"ok": True})

    async def __aenter__(self) -> CallbackReceiver:
        await self._server.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self._server.close()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._server.port}/callback"

    async def wait(self, count: int = 1, timeout_s: float = 15.0) -> None:
        """Until `count` callbacks arrived or the time is up (the caller asserts the count)."""

        async def enough() -> None:
            while True:
                self.arrived.clear()
                if len(self.received) >= count:
                    return
                await self.arrived.wait()

        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(enough(), timeout_s)


def rid() -> str:
    """A request id no other request uses."""
    return f"req-{uuid.uuid4().hex}"


async def invoke(
    http: httpx.AsyncClient,
    gateway: GatewayProcess,
    capability: str,
    operation: str = "query",
    *,
    caller: str | None = None,
    **body: Any,
) -> httpx.Response:
    """`POST /reach/invoke` of `operation` with an empty payload; `body` adds or replaces fields,
    `caller` is sent as X-Reach-Caller."""
    return await http.post(
        f"{gateway.url}/reach/invoke",
        json={"target": capability, "operation": operation, "payload": {}, **body},
        headers={"X-Reach-Caller": caller} if caller is not None else {},
    )


async def wait_until(
    predicate: Callable[[], bool | Awaitable[bool]], timeout_s: float, every_s: float = 0.1
) -> float:
    """Until `predicate` (plain or async) holds; return the seconds it took, raise if it never
    held within `timeout_s`."""
    start = time.monotonic()
    while True:
        held = predicate()
        if inspect.isawaitable(held):
            held = await held
        if held:
            return time.monotonic() - start
        if time.monotonic() - start > timeout_s:
            raise TimeoutError(f"condition not met within {timeout_s}s")
        await asyncio.sleep(every_s)


class OutageReceiver:
    """A callback receiver on a port of its own with nothing listening until `up` (a receiver
    that is down a while); `arrived` holds each envelope with the moment it came."""

    def __init__(self) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}/callback"
        self.arrived: list[tuple[float, dict[str, Any]]] = []
        self._server: PathServer | None = None

    async def _handle(self, request: Inbound) -> Answer:
        self.arrived.append((time.monotonic(), json.loads(request.body)))
        return Answer(200, {"ok": True})

    async def up(self) -> float:
        self._server = PathServer(
            self._handle,
            listen=f"127.0.0.1:{self.port}",
            advertise=f"127.0.0.1:{self.port}",
            instance_id="receiver",
            max_body_bytes=1 << 20,
        )
        await self._server.start()
        return time.monotonic()

    async def close(self) -> None:
        if self._server is not None:
            await self._server.close()


def count_ca_bundles(monkeypatch: Any) -> list[int]:
    """Count the CA bundles read from now on (one per TLS context built: ~15 ms of CPU each),
    with the shared public context forgotten so that the first use builds it again."""
    import ssl

    from connectors import public_context

    built: list[int] = []
    real = ssl.SSLContext.load_verify_locations

    def counted(self: ssl.SSLContext, *args: Any, **kwargs: Any) -> None:
        built.append(1)
        real(self, *args, **kwargs)

    monkeypatch.setattr(ssl.SSLContext, "load_verify_locations", counted)
    public_context.cache_clear()
    return built


def executions(ledger: Path, request_id: str) -> list[str]:
    """The instances that ran `request_id`, from an agent's ledger (`knowledge_retriever.py
    --ledger`: a line per execution)."""
    if not ledger.exists():
        return []
    rows = [line.split() for line in ledger.read_text().splitlines() if line.strip()]
    return [instance for request, instance in rows if request == request_id]


def redis_stack(
    temporal: str, tmp: Path, redis_url: str, *, heartbeat_timeout: float = 90.0, **extra: str
) -> Stack:
    """A stack (its own task queue, as `tests.conftest.new_stack`) whose registry is the Redis
    at `redis_url`: a test's private redis-server, or a proxy of the test's in front of one;
    `extra` settings on top."""
    return Stack(
        temporal=temporal,
        tmp=tmp,
        task_queue=f"tq-{uuid.uuid4().hex[:12]}",
        registry="redis",
        heartbeat_timeout=heartbeat_timeout,
        extra={"REACH_REGISTRY__REDIS_URL": redis_url, **extra},
    )


class Ledgered(Protocol):
    """A test server (`tests.mcp_servers.McpServerProcess`) whose ledger `calls` has a line per
    run of its `count` tool: the tag it was called with."""

    calls: Path


def runs(server: Ledgered, tag: str) -> int:
    """How many times `server` ran `count` for `tag`."""
    return server.calls.read_text().splitlines().count(tag)


def tokened_http_agent(
    tmp: Path, capability: str, *callers: tuple[str, Literal["caller", "admin"]]
) -> TokenedAgent:
    """A tokens file in `tmp` holding an agent token for `capability` and one token per
    (name, kind) in `callers`; an HTTP agent (on a free port) that heartbeats with the agent's
    token every 0.5 s, its operations still to add, its `reach_url` still to set."""
    from agent_reach_sdk.runtime import AgentRuntime
    from reach.security.tokens import FileTokenStore, issue

    store = FileTokenStore(tmp / "tokens.json")
    tokens, ids = [], []
    for name, kind in callers:
        token, record = issue(name, kind)
        store.write(record)
        tokens.append(token)
        ids.append(record.id)
    agent, record = issue("agent", "agent", [capability])
    store.write(record)
    runtime = AgentRuntime(
        capability,
        protocol="http",
        service_address="127.0.0.1:0",
        heartbeat_interval=0.5,
        token=agent,
    )
    return TokenedAgent(runtime, tokens, ids)


@dataclass
class TokenedAgent:
    runtime: Any  # an AgentRuntime
    tokens: list[str]  # the callers' tokens, in the order asked
    ids: list[str]  # their ids (`reach tokens revoke <id>`)
