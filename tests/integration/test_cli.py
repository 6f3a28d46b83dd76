"""Start-up errors name the problem: a busy port and its setting, a bad config field and file."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from gateway_api.devserver import free_port
from tests.helpers import ROOT

pytestmark = pytest.mark.integration


def run_reach(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("REACH_", "TEMPORAL_"))}
    return subprocess.run(
        [sys.executable, "-m", "gateway_api", *args],
        env={**clean, "REACH_TRANSPORT__PORTS__GRPC": "0", **(env or {})},
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
    )


def test_busy_port_names_the_port_and_the_setting() -> None:
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        done = run_reach("gateway", env={"REACH_LISTEN_PORT": str(port)})
    assert done.returncode != 0
    assert f"port {port}" in done.stderr
    assert "REACH_LISTEN_PORT" in done.stderr


def test_up_refuses_a_busy_temporal_port(tmp_path: Path) -> None:
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        done = run_reach(
            "up",
            env={
                "REACH_TEMPORAL__DEV_SERVER__PORT": str(port),
                "REACH_LISTEN_PORT": str(free_port()),
            },
        )
    assert done.returncode != 0
    assert f"port {port}" in done.stderr
    assert "REACH_TEMPORAL__DEV_SERVER__PORT" in done.stderr


def test_bad_config_names_file_and_field(tmp_path: Path) -> None:
    bad = tmp_path / "reach.yaml"
    bad.write_text("reach:\n  policy:\n    default_retyr: 2\n")
    done = run_reach("--config", str(bad), "gateway")
    assert done.returncode != 0
    assert str(bad) in done.stderr
    assert "reach.policy.default_retyr" in done.stderr


@pytest.mark.parametrize("command", [["gateway"], ["worker"]])
def test_unreachable_temporal_is_one_clear_line(command: list[str]) -> None:
    port = free_port()  # nothing listens there
    done = run_reach(
        *command,
        env={
            "TEMPORAL_ADDRESS": f"127.0.0.1:{port}",
            "REACH_TEMPORAL__CONNECT_WAIT_S": "1",
            "REACH_LISTEN_PORT": str(free_port()),
        },
    )
    assert done.returncode == 1
    assert f"cannot connect to Temporal at 127.0.0.1:{port}" in done.stderr
    assert "TEMPORAL_ADDRESS" in done.stderr
    assert "Traceback" not in done.stderr
