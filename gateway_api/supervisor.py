"""What `reach up` keeps running: the Temporal dev server, the demo agents and their token.

Each child is restarted when it exits, after 1 s, 2 s, 4 s ... up to 30 s (afresh once it has run
30 s), and the console says so: `Temporal dev server exited (signal 9); restarting in 1 s
(attempt 1)`, then `... back`. The dev server comes back on the same database, so the requests
in it resume; the gateway's Temporal client reconnects by itself (`/readyz` is 503 meanwhile),
and so does its worker.

The demo agents' token. With tokens required when `reach up` starts, the agents get an agent
token of their own. In `auth.mode: auto` with no token yet they join without one, and the first
`reach tokens issue` closes the door: their heartbeats would get 401 until
`registry.heartbeat_timeout` evicted them. So the token store is watched, and once it holds a
token the demo agents are issued one and each is replaced by a process that holds it (a running
agent cannot be handed a token, and an instance joined without one is nobody's, so heartbeats
under a token would be refused). The new process joins under the same instance id before the
old one stops, so the capability stays served. The token lasts a day and is renewed the same
way half a day before it expires; the one it replaces is then revoked.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Coroutine, Mapping
from pathlib import Path
from typing import Any

import httpx

from gateway_api.devserver import DevServer, dies_with_parent, port_open_async
from reach.config import ReachSettings
from reach.errors import ReachError
from reach.security.guard import token_store
from reach.security.tokens import TokenStore, issue
from reach.store import Store, create_store

log = logging.getLogger("reach.up")

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
FIRST_BACKOFF_S = 1.0
MAX_BACKOFF_S = 30.0
STABLE_S = 30.0  # a child that ran this long before it exited starts its backoff afresh
POLL_S = 0.2
TOKEN_POLL_S = 0.5  # the gateway sees a new token within 0.2 s (file) or at once (Redis)
TOKEN_TTL_S = 86_400.0
RENEW_BEFORE_S = TOKEN_TTL_S / 2
JOIN_WAIT_S = 30.0
STOP_GRACE_S = 5.0
DEMO_PRINCIPAL = "demo-agents"
DEMO_CAPABILITY = "knowledge-retriever"

Announce = Callable[[Callable[[], dict[str, str]]], Coroutine[Any, Any, None]]


def backoff_s(attempt: int) -> float:
    """The wait before restart `attempt` (1, 2, 3 ...): 1 s, 2 s, 4 s ..., at most 30 s."""
    doublings = min(max(attempt, 1) - 1, 16)
    return min(MAX_BACKOFF_S, FIRST_BACKOFF_S * float(1 << doublings))


def how_it_ended(code: int) -> str:
    return f"signal {-code}" if code < 0 else f"code {code}"


def kill_group(proc: subprocess.Popen[bytes], sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, sig)


async def stop_process(proc: subprocess.Popen[bytes], grace_s: float = STOP_GRACE_S) -> None:
    """SIGTERM its process group, then SIGKILL after `grace_s`, without blocking the loop."""
    if proc.poll() is not None:
        return
    kill_group(proc, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while proc.poll() is None:
        if time.monotonic() > deadline:
            kill_group(proc, signal.SIGKILL)
            await asyncio.to_thread(proc.wait)
            return
        await asyncio.sleep(0.05)


class Child:
    """One supervised process. `launch` starts it (and waits until it serves, where it can
    tell); it is called on the event loop's thread, the one `dies_with_parent` ties it to."""

    name = "child"
    started_at = 0.0
    restarting = False  # between an exit and the restart that follows it

    @property
    def process(self) -> subprocess.Popen[bytes] | None:
        raise NotImplementedError

    async def launch(self) -> None:
        raise NotImplementedError

    def kill(self) -> None:
        """After a failed start: nothing it began may stay (a port held, a half-started server),
        and the next attempt starts from no process."""
        proc = self.process
        if proc is not None and proc.poll() is None:
            kill_group(proc, signal.SIGKILL)
            proc.wait()
        self.forget()

    def forget(self) -> None:
        raise NotImplementedError

    def where(self) -> str:
        proc = self.process
        return f"as pid {proc.pid}" if proc is not None else "(not running)"


class DevServerChild(Child):
    name = "Temporal dev server"

    def __init__(self, server: DevServer) -> None:
        self.server = server
        self.started_at = time.monotonic()  # started (and waited for) before supervision

    @property
    def process(self) -> subprocess.Popen[bytes] | None:
        return self.server.process

    async def launch(self) -> None:
        await self.server.start_async()

    def forget(self) -> None:
        self.server.process = None

    def where(self) -> str:
        return f"on {self.server.address}, {self.server.db_filename}"


class DemoAgent(Child):
    """A demo knowledge-retriever (examples/knowledge_retriever.py) with the token `env` gives."""

    def __init__(
        self,
        instance_id: str,
        gateway_url: str,
        log_dir: Path,
        env: Callable[[], Mapping[str, str]],
    ) -> None:
        self.instance_id = instance_id
        self.name = f"demo agent {instance_id}"
        self.gateway_url = gateway_url
        self.log_file = log_dir / f"{instance_id}.log"
        self.env = env
        self.current: subprocess.Popen[bytes] | None = None
        self.retiring: set[subprocess.Popen[bytes]] = set()  # replaced, not yet stopped

    @property
    def process(self) -> subprocess.Popen[bytes] | None:
        return self.current

    def spawn(self) -> subprocess.Popen[bytes]:
        cmd = [
            sys.executable,
            str(EXAMPLES / "knowledge_retriever.py"),
            "--reach",
            self.gateway_url,
            "--instance-id",
            self.instance_id,
        ]
        with open(self.log_file, "ab") as out:
            return subprocess.Popen(
                dies_with_parent(cmd),
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                env={**os.environ, **self.env()},
            )

    async def launch(self) -> None:
        self.current = self.spawn()

    def forget(self) -> None:
        self.current = None

    def log_size(self) -> int:
        try:
            return self.log_file.stat().st_size
        except FileNotFoundError:
            return 0

    def said_joined(self, offset: int) -> bool:
        """Whether the agent's log says it joined, past `offset`."""
        with contextlib.suppress(OSError), open(self.log_file, "rb") as f:
            f.seek(offset)
            return b"joined Reach" in f.read()
        return False

    async def joined_since(self, offset: int, timeout_s: float) -> bool:
        """Whether the agent joined (its log says so past `offset`) within `timeout_s`."""
        deadline = time.monotonic() + timeout_s
        while not self.said_joined(offset):
            if time.monotonic() > deadline:
                return False
            await asyncio.sleep(0.1)
        return True

    def stop_all(self) -> None:
        """At shutdown: SIGTERM to every process of this agent (`wait_all` then reaps them)."""
        for proc in (self.current, *self.retiring):
            if proc is not None and proc.poll() is None:
                kill_group(proc, signal.SIGTERM)

    def wait_all(self) -> None:
        for proc in (self.current, *self.retiring):
            if proc is None:
                continue
            try:
                proc.wait(STOP_GRACE_S)
            except subprocess.TimeoutExpired:
                kill_group(proc, signal.SIGKILL)
                proc.wait()


async def keep_running(child: Child) -> None:
    """Restart `child` whenever it exits (or fails to start), with a backoff, until cancelled."""
    attempt = 0
    failure: str | None = None
    while True:
        proc = child.process
        # Polled: the child is a plain Popen (no asyncio child watcher), and 0.2 s is soon enough.
        while proc is not None and child.process is proc and proc.poll() is None:  # noqa: ASYNC110
            await asyncio.sleep(POLL_S)
        if proc is not None and child.process is not proc:
            continue  # replaced on purpose (a new token): watch the new process
        if time.monotonic() - child.started_at >= STABLE_S:
            attempt = 0
        attempt += 1
        delay = backoff_s(attempt)
        ended = f"exited ({how_it_ended(proc.returncode)})" if proc is not None else failure
        log.warning("%s %s; restarting in %g s (attempt %d)", child.name, ended, delay, attempt)
        child.restarting = True
        try:
            await asyncio.sleep(delay)
            child.started_at = time.monotonic()
            await child.launch()
        except Exception as exc:  # a start that failed is one more attempt
            failure = f"did not start ({exc or type(exc).__name__})"
            child.kill()
            continue
        finally:
            child.restarting = False
        log.warning("%s back %s (attempt %d)", child.name, child.where(), attempt)


class DemoToken:
    """The demo agents' agent token, in the store the gateway reads (`token_store`)."""

    def __init__(self, settings: ReachSettings) -> None:
        self.settings = settings
        self.store: Store | None = None
        self.tokens: TokenStore | None = None
        self.token: str | None = None
        self.token_id: str | None = None
        self.expires_at = 0.0

    def open(self) -> TokenStore:
        if self.tokens is None:
            redis = self.settings.registry.type == "redis"
            self.store = create_store(self.settings.registry) if redis else None
            self.tokens = token_store(self.settings, self.store)
        return self.tokens

    async def aclose(self) -> None:
        if self.store is not None:
            await self.store.aclose()

    async def required(self) -> bool:
        """Whether the gateway requires tokens: `auth.mode` tokens, or auto with any token."""
        mode = self.settings.auth.mode
        if mode == "open":
            return False
        return mode == "tokens" or bool(await self.open().load())

    def due(self) -> bool:
        return self.token is not None and self.expires_at - time.time() < RENEW_BEFORE_S

    async def renew(self) -> str | None:
        """Issue a new token (and save it); return the id of the one it replaces."""
        token, record = issue(
            DEMO_PRINCIPAL,
            "agent",
            [DEMO_CAPABILITY],
            ttl_s=TOKEN_TTL_S,
            note="reach up demo agents",
        )
        await self.open().save(record)
        previous = self.token_id
        self.token, self.token_id = token, record.id
        self.expires_at = record.expires_at or 0.0
        return previous

    def env(self) -> dict[str, str]:
        return {"REACH_AGENT_TOKEN": self.token} if self.token else {}

    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.token}"} if self.token else {}


class Up:
    """The children of `reach up` once its dev server has started: supervised until cancelled."""

    def __init__(
        self, settings: ReachSettings, server: DevServer, log_dir: Path, *, agents: int
    ) -> None:
        self.settings = settings
        self.server = DevServerChild(server)
        self.token = DemoToken(settings)
        self.agents = [
            DemoAgent(f"retriever-0{i}", settings.gateway_url, log_dir, self.token.env)
            for i in range(1, agents + 1)
        ]

    async def gateway_listening(self) -> None:
        """Until the gateway, starting beside this, accepts connections. A demo agent launched
        before it did was refused its Join and tried again a heartbeat interval later (5 s):
        the banner came ~5 s after the gateway was up (an agent starts in under a second)."""
        host = self.settings.listen_host
        host = "127.0.0.1" if host in ("0.0.0.0", "::") else host
        while self.agents:
            if await port_open_async(self.settings.listen_port, host):
                return
            await asyncio.sleep(0.05)

    async def run(self, announce: Announce) -> None:
        """Start the demo agents, announce, then keep every child running."""
        try:
            try:
                if self.agents and await self.token.required():
                    await self.token.renew()
            except (ReachError, OSError, ValueError) as exc:  # keep_token tries again
                log.warning("could not read or write the token store: %s", exc)
            await self.gateway_listening()
            for agent in self.agents:
                await agent.launch()
                agent.started_at = time.monotonic()
            async with asyncio.TaskGroup() as tasks:
                tasks.create_task(announce(self.token.headers))
                for child in (self.server, *self.agents):
                    tasks.create_task(keep_running(child))
                if self.agents and self.settings.auth.mode != "open":
                    tasks.create_task(self.keep_token())
        finally:
            await self.token.aclose()

    async def keep_token(self) -> None:
        """Give the demo agents a token once one is required, and a fresh one before it ends."""
        while True:
            await asyncio.sleep(TOKEN_POLL_S)
            try:
                if self.token.token is None:
                    if not await self.token.required():
                        continue
                    log.warning(
                        "a token was issued, so the gateway now requires tokens (auth.mode "
                        "auto): the demo agents get an agent token of their own (principal %s) "
                        "and are restarted with it, one new process each before the old stops",
                        DEMO_PRINCIPAL,
                    )
                elif not self.token.due():
                    continue
                previous = await self.token.renew()
            except (ReachError, OSError, ValueError) as exc:
                log.warning("could not read or write the token store: %s", exc)
                continue
            await self.door_closed()
            await asyncio.gather(*(self.replace(agent) for agent in self.agents))
            if previous is not None:
                with contextlib.suppress(ReachError, OSError, LookupError):
                    await self.token.open().revoke(previous)

    async def door_closed(self, timeout_s: float = 10.0) -> None:
        """Until the gateway refuses a request without a token: a new agent that joined before
        it did would be nobody's, and its heartbeats under the token refused."""
        deadline = time.monotonic() + timeout_s
        async with httpx.AsyncClient(base_url=self.settings.gateway_url, trust_env=False) as http:
            while time.monotonic() < deadline:
                with contextlib.suppress(httpx.HTTPError):
                    if (await http.get("/reach/capabilities", timeout=2)).status_code == 401:
                        return
                await asyncio.sleep(0.1)

    async def replace(self, agent: DemoAgent) -> None:
        """A new process with the current token under the same instance id; the old one stops
        once the new one has joined (its Leave, without a token, is refused)."""
        old = agent.current
        if agent.restarting or old is None or old.poll() is not None:
            return  # its restart takes the new token
        mark = agent.log_size()
        agent.retiring.add(old)
        agent.current = agent.spawn()
        agent.started_at = time.monotonic()
        if not await agent.joined_since(mark, JOIN_WAIT_S):
            log.warning(
                "%s has not joined with its token within %g s; stopping the old process anyway",
                agent.name,
                JOIN_WAIT_S,
            )
        await stop_process(old)
        agent.retiring.discard(old)
        log.info("%s holds an agent token now, %s", agent.name, agent.where())

    def stop(self) -> None:
        """Stop every child: the agents first (they leave), then the dev server."""
        for agent in self.agents:
            agent.stop_all()
        for agent in self.agents:
            agent.wait_all()
        self.server.server.stop()
