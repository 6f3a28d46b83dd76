"""A newcomer's first hour (issue 26): the traps found trying Reach as a new user would.

The seed's own configuration (SPEC R7), used as written, must give a stack that a local agent
joins and a caller invokes.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from tests.conftest import new_stack
from tests.helpers import (
    ROOT,
    CallbackReceiver,
    GatewayProcess,
    Stack,
    invoke,
    start_agents,
    wait_until,
)

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


def _audit(stack: Stack, event: str) -> list[dict[str, Any]]:
    path = stack.tmp / "audit.jsonl"
    if not path.exists():
        return []
    lines = (json.loads(line) for line in path.read_text().splitlines())
    return [line for line in lines if line["event"] == event]


async def test_a_reloaded_routing_strategy_and_redaction_are_in_force_at_once(
    temporal_server: str, tmp_path: Path, http: httpx.AsyncClient, capability: str
) -> None:
    """Issue 26: the strategy was shown as reloaded while traffic kept the old one, and the
    audit trail's max_string needed a restart."""
    config = tmp_path / "reach.yaml"
    settings = yaml.safe_load((ROOT / "reach.yaml").read_text())
    config.write_text(yaml.safe_dump(settings))
    stack = new_stack(temporal_server, tmp_path, extra={"REACH_CONFIG": str(config)})
    async with GatewayProcess(stack, "reload") as gateway:
        await start_agents(gateway, capability, 3)

        async def instances(caller: str = "me") -> set[str]:
            seen = set()
            for _ in range(6):
                r = await invoke(http, gateway, capability, caller=caller, routing_key="user-1")
                assert r.status_code == 200, r.text
                seen.add(r.json()["instance_id"])
            return seen

        assert len(await instances()) > 1  # round robin spreads one key
        reach = settings["reach"]
        reach.setdefault("capabilities", {})[capability] = {
            "routing": {"strategy": "consistent_hash"}
        }
        reach.setdefault("audit", {})["max_string"] = 16
        config.write_text(yaml.safe_dump(settings))

        async def reloaded() -> bool:
            r = await http.get(f"{gateway.url}/reach/capabilities/{capability}")
            return bool(r.json()["routing"]["strategy"] == "consistent_hash")

        await wait_until(reloaded, 15)
        long_caller = "a-caller-with-a-rather-long-name"
        assert len(await instances(long_caller)) == 1  # the key now picks one instance
        [changed] = _audit(stack, "config_changed")
        assert changed["restart"] == []  # routing and redaction are both live
        assert "only after a restart" not in gateway.proc.output()

        async def flushed() -> bool:
            return any(isinstance(r["caller"], dict) for r in _audit(stack, "invoke"))

        await wait_until(flushed, 10)
        redacted = [r["caller"] for r in _audit(stack, "invoke") if isinstance(r["caller"], dict)]
        assert redacted[-1]["len"] == len(long_caller)


async def test_a_callback_requests_audit_record_carries_its_outcome(
    gateway: GatewayProcess, http: httpx.AsyncClient, capability: str
) -> None:
    """Issue 26 (R20): a request with a callback was audited only as `202 accepted`, with no
    instance, final status, duration or error type."""
    await start_agents(gateway, capability, 1)
    async with CallbackReceiver() as receiver:
        r = await invoke(http, gateway, capability, callback=receiver.url)
        assert r.status_code == 202, r.text
        request_id = r.json()["request_id"]
        await receiver.wait(1)

    def records(event: str) -> list[dict[str, Any]]:
        return [a for a in _audit(gateway.stack, event) if a.get("request_id") == request_id]

    await wait_until(lambda: bool(records("invoke")), 15)
    [outcome] = records("invoke")  # one record per invoke, and it means the outcome
    assert outcome["outcome"] == "success"
    assert outcome["status"] == 200
    assert outcome["instance"] == f"{capability}-00"
    assert (outcome["capability"], outcome["operation"]) == (capability, "query")
    assert isinstance(outcome["duration_ms"], int)
    [accepted] = records("invoke_accepted")
    assert accepted["status"] == 202
