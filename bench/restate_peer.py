"""The bench's peer: a Restate server and the service of bench/restate_service.py, started for
bench/invoke.py's "Restate, one ctx.run step" row (`make bench-peers` installs them).

The server is @restatedev/restate-server from npm, installed under .reach/peers by `make
bench-peers` (a 225 MB binary, hence not part of `make bench`'s install; `make bench` shows the
row whenever it is there). It runs with its defaults (its WAL fsync'd, 24 partitions) but for
loopback ports of the bench's own, its telemetry and update check off, and a data directory
under the bench's temporary one. The service is registered with the server's admin API and
called through its ingress: POST /bench/invoke, answered once the step's journal entry is
durable and the handler returned.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
SERVER = ROOT / ".reach/peers/node_modules/@restatedev/restate-server-linux-x64/bin/restate-server"
ROW = "Restate, one ctx.run step"


def installed() -> bool:
    return SERVER.exists()


def start_server(
    tmp: Path, ingress: int, admin: int, fabric: int, env: dict[str, str], log: Path
) -> subprocess.Popen[bytes]:
    config = tmp / "restate.toml"
    config.write_text(
        "\n".join(
            (
                'node-name = "bench"',
                f'base-dir = "{tmp / "restate-data"}"',
                "disable-telemetry = true",
                f'bind-address = "127.0.0.1:{fabric}"',
                f'advertised-address = "http://127.0.0.1:{fabric}"',
                'log-filter = "warn"',
                "[admin]",
                f'bind-address = "127.0.0.1:{admin}"',
                "disable-web-ui = true",
                "[ingress]",
                f'bind-address = "127.0.0.1:{ingress}"',
                "",
            )
        )
    )
    with log.open("ab") as out:
        return subprocess.Popen(
            [str(SERVER), "--config-file", str(config), "--no-logo", "--listen-mode", "tcp"],
            env=dict(env, RESTATE_DISABLE_TELEMETRY="true"),
            stdout=out,
            stderr=subprocess.STDOUT,
            cwd=tmp,
        )


def start_service(
    port: int, agent_url: str, env: dict[str, str], log: Path
) -> subprocess.Popen[bytes]:
    with log.open("ab") as out:
        return subprocess.Popen(
            [
                sys.executable,
                str(ROOT / "bench/restate_service.py"),
                "--port",
                str(port),
                "--agent",
                agent_url,
            ],
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            cwd=ROOT,
        )


async def register(admin: int, service_port: int, timeout_s: float = 300) -> None:
    """Register the service's deployment once the admin API and the service both answer."""
    deadline = time.monotonic() + timeout_s
    last: object = None
    async with httpx.AsyncClient(trust_env=False) as c:
        while time.monotonic() < deadline:
            try:
                r = await c.post(
                    f"http://127.0.0.1:{admin}/deployments",
                    json={"uri": f"http://127.0.0.1:{service_port}", "force": True},
                    timeout=10,
                )
                if r.status_code in (200, 201):
                    return
                last = f"{r.status_code} {r.text[:300]}"
            except httpx.HTTPError as exc:
                last = exc
            await asyncio.sleep(0.5)
    raise TimeoutError(f"Restate deployment not registered: {last}")


async def ready(ingress: int, payload: object, timeout_s: float = 120) -> None:
    """Wait for the ingress to answer a call (the partitions come up after registration)."""
    deadline = time.monotonic() + timeout_s
    last: object = None
    async with httpx.AsyncClient(trust_env=False) as c:
        while time.monotonic() < deadline:
            try:
                r = await c.post(
                    f"http://127.0.0.1:{ingress}/bench/invoke", json=payload, timeout=10
                )
                if r.status_code == 200:
                    return
                last = f"{r.status_code} {r.text[:300]}"
            except httpx.HTTPError as exc:
                last = exc
            await asyncio.sleep(0.5)
    raise TimeoutError(f"Restate ingress not answering: {last}")


def environment() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith("RESTATE_")}
