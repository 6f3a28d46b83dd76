"""A newcomer's first hour (issue 26): the traps found trying Reach as a new user would.

The seed's own configuration (SPEC R7), used as written, must give a stack that a local agent
joins and a caller invokes.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import subprocess
import sys
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


def _reach_cli(*args: str, cwd: Path, **env: str) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("REACH_", "TEMPORAL_"))}
    return subprocess.run(
        [sys.executable, "-m", "gateway_api", *args],
        env={**clean, **env},
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_a_relative_tokens_file_is_the_configs_wherever_the_cli_runs(tmp_path: Path) -> None:
    home = tmp_path / "deploy"
    home.mkdir()
    config = home / "reach.yaml"
    config.write_text("reach:\n  auth:\n    tokens_file: state/tokens.json\n")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    kept = home / "state" / "tokens.json"
    # Run from another directory: the tokens go beside the config (where the gateway started
    # with it reads them), and the CLI says which file it used.
    done = _reach_cli(
        "tokens", "issue", "--principal", "orchestrator", cwd=elsewhere, REACH_CONFIG=str(config)
    )
    assert done.returncode == 0, done.stderr
    assert kept.is_file()
    assert not (elsewhere / "state").exists()
    assert f"kept in {kept} (auth.tokens_file)" in done.stdout
    done = _reach_cli("tokens", "list", cwd=ROOT, REACH_CONFIG=str(config))
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[0] == f"tokens in {kept} (auth.tokens_file)"
    assert "orchestrator" in done.stdout
    done = _reach_cli("config", "check", cwd=elsewhere, REACH_CONFIG=str(config))
    assert f"tokens in {kept} (auth.tokens_file)" in done.stdout, done.stderr
    # The default is the working directory's, and an empty store says where it looked.
    done = _reach_cli("tokens", "list", cwd=elsewhere)
    assert done.stdout.startswith(f"no tokens in {elsewhere / '.reach' / 'tokens.json'} ")


def test_config_check_refuses_a_ports_http_that_is_not_listen_port(tmp_path: Path) -> None:
    config = tmp_path / "reach.yaml"
    config.write_text(SEED_YAML.replace("ports: { http: 7600", "ports: { http: 7700"))
    done = _reach_cli("config", "check", "--config", str(config), cwd=tmp_path)
    assert done.returncode == 1
    assert "transport.ports.http in" in done.stderr
    assert "says the HTTP port is 7700, but listen_port: 7600 in" in done.stderr
    assert "Traceback" not in done.stderr
    done = _reach_cli(
        "config", "check", "--config", str(config), cwd=tmp_path, **{"REACH_LISTEN_PORT": "7700"}
    )  # the environment moves the port: the file's two keys are both overridden
    assert done.returncode == 0, done.stderr


async def test_trace_of_a_request_refused_at_the_door_says_so(
    gateway: GatewayProcess, http: httpx.AsyncClient, capability: str
) -> None:
    # Refused once it had its RequestID (nobody serves the capability): no workflow, no
    # history; the trace says it was refused and why, not that there is no such request.
    request_id = f"req-refused-{capability}"
    r = await invoke(http, gateway, capability, request_id=request_id)
    assert r.status_code == 404, r.text
    done = await asyncio.to_thread(
        _reach_cli, "trace", request_id, "--gateway", gateway.url, cwd=ROOT
    )
    assert done.returncode == 1
    assert f"request {request_id!r} was refused at the door at " in done.stderr
    assert "never started, so it has no timeline: 404 unknown_capability: no agent has " in (
        done.stderr
    )
    assert "lists recent ones" not in done.stderr
    # An id the door never saw (or refused before it had one): the hint says that can be why.
    done = await asyncio.to_thread(
        _reach_cli, "trace", f"req-never-{capability}", "--gateway", gateway.url, cwd=ROOT
    )
    assert done.returncode == 1
    assert "a request the door refused never started and has no timeline" in done.stderr
    assert "another caller's request reads as unknown too" in done.stderr


def _first_python_block(page: str) -> str:
    found = re.search(r"```python\n(.*?)```\n", (ROOT / "docs" / page).read_text(), re.S)
    assert found is not None, page
    return found.group(1)


async def test_the_front_pages_client_programs_run_as_copied(
    gateway: GatewayProcess, capability: str, tmp_path: Path
) -> None:
    """The MCP and A2A front pages open with a client program; a newcomer copies it into a file
    and runs it beside `make up`. It used top-level `await` and an undefined `token`, so it
    ran nowhere as written."""
    await start_agents(gateway, capability, 1)
    no_proxy = {k: v for k, v in os.environ.items() if "proxy" not in k.lower()}
    expected = {
        "mcp-front.md": [f"'{capability}.query'", "'passages'", "req-"],  # tools, result, id
        "a2a-front.md": ["TASK_STATE_SUBMITTED", "TASK_STATE_COMPLETED", "passages"],
    }
    for page, said in expected.items():
        program = tmp_path / f"{page}.py"
        code = _first_python_block(page)  # only the address and the capability are this test's
        code = code.replace("http://127.0.0.1:7600", gateway.url)
        program.write_text(code.replace("knowledge-retriever", capability))
        done = await asyncio.to_thread(
            subprocess.run,
            [sys.executable, str(program)],
            env=no_proxy,
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert done.returncode == 0, f"{page}: {done.stderr}"
        assert all(word in done.stdout for word in said), f"{page}: {done.stdout}"
