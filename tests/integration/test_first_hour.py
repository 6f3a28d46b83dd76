"""A newcomer's first hour (issue 26): the traps found trying Reach as a new user would.

The seed's own configuration (SPEC R7), used as written, must give a stack that a local agent
joins and a caller invokes.
"""

from __future__ import annotations

import re
from pathlib import Path

import httpx
import pytest

from tests.conftest import new_stack
from tests.helpers import GatewayProcess, invoke, start_agents

pytestmark = pytest.mark.integration

# The block under R7 in ../shared/SPEC.md, as the source article gives it.
SEED_YAML = """\
reach:
  listen_port: 7600
  registry:
    type: memory          # single machine; production: redis (or etcd)
    heartbeat_timeout: 30 # seconds
    heartbeat_interval: 5
  transport:
    default_protocol: http
    ports: { http: 7600, grpc: 7601 }
  policy:
    default_retry: 2
    default_timeout_ms: 5000
    circuit_breaker:
      error_threshold: 3
      open_duration_ms: 10000
"""
SPEC = Path(__file__).resolve().parents[3] / "shared" / "SPEC.md"


def test_the_seed_yaml_here_is_the_specs() -> None:
    if not SPEC.exists():
        pytest.skip(f"{SPEC} is not beside this checkout")
    block = re.search(r"R7 .*?```yaml\n(.*?)```", SPEC.read_text(), re.S)
    assert block is not None
    assert block.group(1).split() == SEED_YAML.split()


async def test_the_seeds_own_config_serves_an_agent_on_this_machine(
    temporal_server: str, tmp_path: Path, http: httpx.AsyncClient, capability: str
) -> None:
    config = tmp_path / "reach.yaml"
    config.write_text(SEED_YAML)
    # Only what two stacks on one box need apart: ports, the task queue (new_stack) and
    # heartbeats short enough for a test; the allowlist and everything else is the seed's.
    stack = new_stack(temporal_server, tmp_path, extra={"REACH_CONFIG": str(config)})
    async with GatewayProcess(stack, "seed") as gateway:
        await start_agents(gateway, capability, 1)  # it joins from 127.0.0.1
        r = await invoke(http, gateway, capability, payload={"text": "hello"})
        assert r.status_code == 200, r.text
        assert r.json()["status"] == "success"
        assert "is a loopback address" not in gateway.proc.output()
