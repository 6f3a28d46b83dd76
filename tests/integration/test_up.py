"""`reach up` (what `make up` runs): the whole stack, a clean Ctrl-C, history kept across runs."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from gateway_api.devserver import free_port
from tests.helpers import ROOT, wait_until

pytestmark = pytest.mark.integration


def processes_mentioning(needle: str) -> list[int]:
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        if needle in cmdline:
            pids.append(int(entry.name))
    return pids


def up_env(tmp: Path, **extra: str) -> dict[str, str]:
    """`reach up`'s environment: every port free, the state, tokens and audit trail in `tmp`
    (never the checkout's .reach/), and `extra` on top."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("REACH_", "TEMPORAL_"))}
    return {
        **clean,
        "REACH_CONFIG": str(ROOT / "reach.yaml"),
        "REACH_LISTEN_PORT": str(free_port()),
        "REACH_TRANSPORT__PORTS__GRPC": str(free_port()),
        "REACH_TEMPORAL__DEV_SERVER__PORT": str(free_port()),
        "REACH_TEMPORAL__DEV_SERVER__UI_PORT": str(free_port()),
        "REACH_TEMPORAL__DEV_SERVER__DB_FILENAME": str(tmp / "state" / "temporal.db"),
        "REACH_AUTH__TOKENS_FILE": str(tmp / "tokens.json"),
        "REACH_AUDIT__FILE": str(tmp / "audit.jsonl"),
        "TEMPORAL_ADDRESS": "127.0.0.1:1",  # ignored: `up` talks to its own dev server
        **extra,
    }


class Up:
    """`reach up` (and `flags`) in its own process, its output in a file of `tmp` named after
    `name`."""

    def __init__(self, tmp: Path, env: dict[str, str], *flags: str, name: str = "up") -> None:
        self.env = env
        self.log = tmp / f"{name}-{len(list(tmp.glob(f'{name}-*.log')))}.log"
        with self.log.open("wb") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "gateway_api", "up", *flags],
                env=env,
                stdout=out,
                stderr=subprocess.STDOUT,
                cwd=ROOT,
            )

    def output(self) -> str:
        return self.log.read_text()

    async def ready(self) -> None:
        async def up() -> bool:
            assert self.proc.poll() is None, self.output()
            return "Agent-Reach is up." in self.output()

        await wait_until(up, 90, every_s=0.2)

    async def ended(self, sig: signal.Signals) -> int:
        """Its exit code once `sig` ended it (30 s at most)."""
        self.proc.send_signal(sig)
        return await asyncio.to_thread(self.proc.wait, 30)

    async def interrupt(self) -> int:
        return await self.ended(signal.SIGINT)


async def test_up_runs_the_stack_stops_cleanly_and_keeps_history(tmp_path: Path) -> None:
    env = up_env(tmp_path)
    gw_port = env["REACH_LISTEN_PORT"]
    ui_port = env["REACH_TEMPORAL__DEV_SERVER__UI_PORT"]
    grpc_port = env["REACH_TRANSPORT__PORTS__GRPC"]
    db = tmp_path / "state" / "temporal.db"
    gateway = f"http://127.0.0.1:{gw_port}"
    first = Up(tmp_path, env)
    try:
        await first.ready()
        banner = first.output()
        assert gateway in banner
        assert f"http://127.0.0.1:{ui_port}" in banner
        assert f"127.0.0.1:{grpc_port}" in banner  # the gRPC front, beside HTTP
        assert "curl -s -X POST" in banner
        assert "worker       in the gateway process, task queue reach-invoke" in banner
        assert len(processes_mentioning(f"--reach {gateway}")) == 2  # the demo agents
        # Launched once the gateway listens, each joined at its first try: launched before,
        # an agent was refused and tried again a heartbeat interval (5 s) later.
        for log in sorted((tmp_path / "state" / "logs").glob("retriever-0*.log")):
            assert "cannot join Reach" not in log.read_text(), log.read_text()
        async with httpx.AsyncClient(trust_env=False, timeout=30) as http:
            r = await http.post(
                f"{gateway}/reach/invoke",
                json={
                    "request_id": "req-kept-1",
                    "target": "knowledge-retriever",
                    "operation": "query",
                    "payload": {"text": "durable"},
                },
            )
            assert r.status_code == 200, r.text
            ui = await http.get(f"http://127.0.0.1:{ui_port}/")
            assert ui.status_code == 200
    finally:
        code = await first.interrupt()
    assert code == 0, first.output()
    assert "stopped." in first.output()
    assert processes_mentioning(str(db)) == []  # the dev server
    assert processes_mentioning(f"--reach {gateway}") == []  # the agents

    second = Up(tmp_path, env)
    try:
        await second.ready()
        async with httpx.AsyncClient(trust_env=False, timeout=30) as http:
            r = await http.get(f"{gateway}/reach/requests/req-kept-1")
        assert r.status_code == 200
        assert r.json()["status"] == "success"
    finally:
        await second.interrupt()


@pytest.mark.slow  # 15 s of waiting before it says so
async def test_up_says_it_is_still_waiting_for_demo_agents_that_cannot_join(
    tmp_path: Path,
) -> None:
    """With loopback refused (`allow_networks: []`), the demo agents never join: `reach up`
    waited 60 s for them and then said nothing more, its banner never shown."""
    up = Up(tmp_path, up_env(tmp_path, REACH_SECURITY__ALLOW_NETWORKS="[]"))
    try:

        async def said() -> bool:
            assert up.proc.poll() is None, up.output()
            return "still waiting for the 2 demo agents to join" in up.output()

        await wait_until(said, 60, every_s=0.2)
        output = up.output()
        assert "127.0.0.1 is a loopback address; allow it in security.allow_networks" in output
        assert "Agent-Reach is up." not in output
    finally:
        code = await up.interrupt()
    assert code == 0, up.output()
    assert "stopped." in up.output()
