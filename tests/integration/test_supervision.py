"""Self-healing: `reach up` restarts what it started, keeps its demo agents in once the first
token closes the door, and `reach gateway` exits loudly when its Temporal is gone for good."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import httpx
import pytest

from gateway_api.devserver import DevServer, free_port
from tests.helpers import ROOT, GatewayProcess, Stack, wait_until
from tests.integration.test_up import Up, processes_mentioning, up_env

pytestmark = pytest.mark.integration

CAPABILITY = "knowledge-retriever"
FIRST_TOKEN = "this is the first token"


def gateway_of(env: dict[str, str]) -> str:
    return f"http://127.0.0.1:{env['REACH_LISTEN_PORT']}"


async def query(
    http: httpx.AsyncClient, gateway: str, token: str | None = None, **body: Any
) -> httpx.Response:
    return await http.post(
        f"{gateway}/reach/invoke",
        json={"target": CAPABILITY, "operation": "query", "payload": {"text": "x"}, **body},
        headers={"Authorization": f"Bearer {token}"} if token else {},
    )


async def instances(
    http: httpx.AsyncClient, gateway: str, token: str | None = None
) -> dict[str, dict[str, Any]]:
    r = await http.get(
        f"{gateway}/reach/capabilities/{CAPABILITY}",
        headers={"Authorization": f"Bearer {token}"} if token else {},
    )
    assert r.status_code == 200, r.text
    return {i["instance_id"]: i for i in r.json()["instances"]}


def issue_token(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "gateway_api", "tokens", "issue", *args],
        env=env,
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=60,
    )


async def said(up: Up, text: str, *, count: int = 1, timeout_s: float = 60) -> None:
    """Until `reach up`'s console holds `text` `count` times (and `reach up` still runs)."""

    def enough() -> bool:
        assert up.proc.poll() is None, up.output()
        return up.output().count(text) >= count

    await wait_until(enough, timeout_s, every_s=0.1)


def secret_of(done: subprocess.CompletedProcess[str]) -> str:
    assert done.returncode == 0, done.stderr
    return done.stdout.splitlines()[1].strip()


async def test_up_restarts_a_killed_dev_server_on_its_database_and_a_killed_agent(
    tmp_path: Path,
) -> None:
    env = up_env(tmp_path)
    gateway = gateway_of(env)
    db = str(tmp_path / "state" / "temporal.db")
    up = Up(tmp_path, env)
    try:
        await up.ready()
        assert "supervised   the dev server and agents restart when they exit" in up.output()
        async with httpx.AsyncClient(trust_env=False, timeout=30) as http:
            before = await query(http, gateway, request_id="req-before-the-kill")
            assert before.status_code == 200, before.text

            # The dev server, SIGKILLed twice: restarted after 1 s, then 2 s (the backoff).
            for attempt, delay in ((1, 1), (2, 2)):
                (server,) = processes_mentioning(db)
                os.kill(server, signal.SIGKILL)
                await said(
                    up,
                    "Temporal dev server exited (signal 9); "
                    f"restarting in {delay} s (attempt {attempt})",
                )
                await said(up, "Temporal dev server back on 127.0.0.1:", count=attempt)
                assert processes_mentioning(db) not in ([], [server])

                async def answers() -> bool:
                    assert up.proc.poll() is None, up.output()
                    r = await query(http, gateway, timeout_ms=3000)
                    return r.status_code == 200

                # Before: the gateway answered 503 for ever, nothing restarted the server.
                await wait_until(answers, 60, every_s=0.5)
            ready = await http.get(f"{gateway}/readyz")
            assert ready.status_code == 200, ready.text
            kept = await http.get(f"{gateway}/reach/requests/req-before-the-kill")
            assert kept.status_code == 200, kept.text  # the same database: the request is kept
            assert kept.json()["status"] == "success"

            # A demo agent, SIGKILLed: restarted, and it joins again (a new address).
            first = (await instances(http, gateway))["retriever-01"]
            (agent,) = processes_mentioning(f"--reach {gateway} --instance-id retriever-01")
            os.kill(agent, signal.SIGKILL)
            await said(
                up, "demo agent retriever-01 exited (signal 9); restarting in 1 s (attempt 1)"
            )
            await said(up, "demo agent retriever-01 back as pid")

            async def rejoined() -> bool:
                now = (await instances(http, gateway)).get("retriever-01")
                return now is not None and now["joined_at"] > first["joined_at"]

            await wait_until(rejoined, 60, every_s=0.2)
            assert processes_mentioning(f"--reach {gateway} --instance-id retriever-01") not in (
                [],
                [agent],
            )
            again = await instances(http, gateway)
            assert again["retriever-01"]["address"] != first["address"]
            assert {"retriever-01", "retriever-02"} <= again.keys()
            assert all(i["status"] == "ok" for i in again.values())
    finally:
        code = await up.interrupt()
    assert code == 0, up.output()
    assert processes_mentioning(db) == []
    assert processes_mentioning(f"--reach {gateway}") == []


async def test_the_first_token_does_not_evict_the_demo_agents_of_up(tmp_path: Path) -> None:
    # The agents propose 5 s (reach.yaml); the gateway gives them half the timeout, 4 s: the
    # replacement holding a token must join within 4 to 8 s of the door closing, not evicted.
    timeout_s = 8.0
    env = up_env(tmp_path, REACH_REGISTRY__HEARTBEAT_TIMEOUT=str(timeout_s))
    gateway = gateway_of(env)
    up = Up(tmp_path, env)
    try:
        await up.ready()
        async with httpx.AsyncClient(trust_env=False, timeout=30) as http:
            assert (await query(http, gateway)).status_code == 200  # the door is open
            done = issue_token(env, "--principal", "tester")
            token = secret_of(done)
            assert FIRST_TOKEN in done.stderr

            async def closed() -> bool:
                return (await query(http, gateway)).status_code == 401

            await wait_until(closed, 5)  # the gateway re-reads the tokens file every 0.2 s

            # Every invoke is answered until both agents were replaced by ones holding a token
            # (their records are then fresh: nothing left to evict), and the old ones stopped.
            # Before, that never happened: the agents had no token and were evicted
            # ~heartbeat_timeout after the door closed (the deadline below is past it).
            start = time.monotonic()
            failed = []

            async def replaced() -> bool:
                r = await query(http, gateway, token, timeout_ms=3000)
                if r.status_code != 200:
                    failed.append((round(time.monotonic() - start, 1), r.status_code, r.text))
                held = await instances(http, gateway, token)
                return (
                    {"retriever-01", "retriever-02"} <= held.keys()
                    and {held[i]["principal"] for i in ("retriever-01", "retriever-02")}
                    == {"demo-agents"}
                    and len(processes_mentioning(f"--reach {gateway}")) == 2
                )

            await wait_until(replaced, timeout_s * 3, every_s=0.3)
            assert failed == [], failed
            r = await query(http, gateway, token, timeout_ms=3000)
            assert r.status_code == 200, r.text
            held = await instances(http, gateway, token)
            assert {"retriever-01", "retriever-02"} <= held.keys()
            # Before: the agents had no token, and were evicted ~heartbeat_timeout later.
            assert {held[i]["principal"] for i in ("retriever-01", "retriever-02")} == {
                "demo-agents"
            }
            out = up.output()
            assert "the demo agents get an agent token of their own" in out
            assert "demo agent retriever-01 holds an agent token now" in out
            assert "demo agent retriever-02 holds an agent token now" in out
            assert "evicted capability=knowledge-retriever" not in out
            assert len(processes_mentioning(f"--reach {gateway}")) == 2  # the old ones stopped
    finally:
        code = await up.interrupt()
    assert code == 0, up.output()


def test_the_first_token_says_what_it_does_to_agents_without_one(tmp_path: Path) -> None:
    env = {
        **up_env(tmp_path),
        "REACH_REGISTRY__HEARTBEAT_TIMEOUT": "45",
        "REACH_REGISTRY__HEARTBEAT_INTERVAL": "5",
    }
    first = issue_token(env, "--principal", "ops", "--admin")
    secret_of(first)
    warning = first.stderr
    assert FIRST_TOKEN in warning
    assert "tokens are now required" in warning
    assert "401 on their next heartbeat" in warning
    assert "45 s later (registry.heartbeat_timeout)" in warning
    assert "reach tokens issue --principal NAME --agent --capability CAPABILITY" in warning
    assert "REACH_AGENT_TOKEN=<token>" in warning
    # Machine-readable output stays so: the warning is on standard error only.
    second = issue_token(env, "--principal", "orchestrator", "--json")
    assert second.returncode == 0, second.stderr
    assert FIRST_TOKEN not in second.stderr  # the door was already closed
    other = tmp_path / "other"
    other.mkdir()
    # With auth.mode tokens the door was never open: nothing changes, nothing to warn about.
    strict = {**up_env(other), "REACH_AUTH__MODE": "tokens"}
    assert FIRST_TOKEN not in issue_token(strict, "--principal", "ops", "--admin").stderr


async def test_a_gateway_whose_temporal_is_gone_for_good_exits_loudly(
    tmp_path: Path, http: httpx.AsyncClient
) -> None:
    server = DevServer(str(tmp_path / "t.db"), free_port(), None, log_file=tmp_path / "t.log")
    server.start()
    try:
        stack = Stack(
            temporal=server.address,
            tmp=tmp_path,
            task_queue=f"tq-{uuid.uuid4().hex[:8]}",
            extra={"REACH_TEMPORAL__CONNECT_WAIT_S": "2"},
        )
        gateway = await GatewayProcess(stack).ready()
        assert server.process is not None
        os.killpg(server.process.pid, signal.SIGKILL)
        server.process.wait()
        # While it waits for Temporal, it is not ready (and says why).
        r = await http.get(f"{gateway.url}/readyz")
        assert r.status_code == 503, r.text
        assert r.json()["checks"]["temporal"] is False
        # Before: it answered 503 for as long as it ran.
        code = await asyncio.to_thread(gateway.proc.popen.wait, 60)
        out = gateway.proc.output()
        assert code == 1, out
        said = f"Temporal at {server.address} has not answered for 2 s (temporal.connect_wait_s)"
        assert f"error: {said}" in out  # the last line, on standard error
        assert "Traceback" not in out
    finally:
        server.stop()
