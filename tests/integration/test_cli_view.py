"""`reach invoke | agents | capabilities | config check` as a person runs them: `python -m
gateway_api …` subprocesses against a real gateway and real agents, outputs and exit codes."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import pytest

from gateway_api.devserver import free_port
from reach.security.tokens import FileTokenStore, issue
from tests.conftest import new_stack
from tests.helpers import ROOT, Agent, CallbackReceiver, GatewayProcess, start_agents

pytestmark = pytest.mark.integration


def reach(
    *args: str, env: dict[str, str] | None = None, stdin: str | None = None
) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("REACH_", "TEMPORAL_"))}
    return subprocess.run(
        [sys.executable, "-m", "gateway_api", *args],
        env={**clean, "REACH_CONFIG": str(ROOT / "reach.yaml"), **(env or {})},
        input=stdin,
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
    )


def rows(stdout: str) -> list[list[str]]:
    """The plain table (stdout is not a terminal here): header first, cells split on 2+ spaces."""
    return [re.split(r"\s{2,}", line.strip()) for line in stdout.splitlines() if line.strip()]


@pytest.fixture(scope="module")
async def agents(gateway: GatewayProcess) -> tuple[str, list[Agent]]:
    capability = f"cli-{uuid.uuid4().hex[:8]}"
    return capability, await start_agents(gateway, capability, 2)


# -- capabilities and agents -------------------------------------------------------------------


def test_capabilities_table_and_json(
    gateway: GatewayProcess, agents: tuple[str, list[Agent]]
) -> None:
    capability, _ = agents
    done = reach("capabilities", "--gateway", gateway.url)
    assert done.returncode == 0, done.stderr
    table = rows(done.stdout)
    assert table[0] == ["CAPABILITY", "INSTANCES", "ROUTABLE", "STATE"]
    assert [capability, "2", "2", "ok"] in table

    done = reach("capabilities", "--gateway", gateway.url, "--json")
    assert done.returncode == 0, done.stderr
    caps = {c["name"]: c for c in json.loads(done.stdout)["capabilities"]}
    assert caps[capability] == {"name": capability, "instances": 2, "routable": 2}


def test_agents_shows_protocol_health_checks_inflight_and_heartbeat_age(
    gateway: GatewayProcess, agents: tuple[str, list[Agent]]
) -> None:
    capability, started = agents
    # The self-check comes with each agent's first heartbeat, after its Join: a CLI that
    # starts in a tenth of a second can be there first.
    deadline = time.monotonic() + 15
    while True:
        done = reach("agents", capability, "--gateway", gateway.url)
        assert done.returncode == 0, done.stderr
        table = rows(done.stdout)
        if all(row[5] != "-" for row in table[1:]) or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert table[0] == [
        "CAPABILITY",
        "INSTANCE",
        "PROTOCOL",
        "ADDRESS",
        "HEALTH",
        "CHECKS",
        "IN-FLIGHT",
        "LAST HEARTBEAT",
        "UP",
    ]
    by_id = {row[1]: row for row in table[1:]}
    assert set(by_id) == {a.instance_id for a in started}
    for row in by_id.values():
        assert row[0] == capability
        assert row[2] == "http"
        assert row[3].startswith("127.0.0.1:")
        assert row[4] == "ok"
        assert row[5] == "corpus=6"  # the demo agent's self-check
        assert row[6] == "0"
        assert row[7].endswith("s ago")

    # Without a capability: every capability's instances, these among them.
    done = reach("agents", "--gateway", gateway.url)
    assert done.returncode == 0, done.stderr
    assert {a.instance_id for a in started} <= {row[1] for row in rows(done.stdout)[1:]}

    done = reach("agents", capability, "--gateway", gateway.url, "--json")
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout)
    instances = {i["instance_id"]: i for i in out["instances"]}
    assert set(instances) == {a.instance_id for a in started}
    for record in instances.values():
        assert record["protocol"] == "http"
        assert record["status"] == "ok"
        assert record["checks"] == {"corpus": 6}
        assert record["reach_inflight"] == 0
        # The stack heartbeats every 0.5 s.
        assert 0 <= record["last_heartbeat_age_s"] < 3
    assert out["capabilities"][0]["routing"]["strategy"]


def test_agents_of_an_unknown_capability_names_the_fix(gateway: GatewayProcess) -> None:
    done = reach("agents", "no-such-capability", "--gateway", gateway.url)
    assert done.returncode == 1
    assert "unknown_capability" in done.stderr
    assert "reach capabilities" in done.stderr
    assert "Traceback" not in done.stderr


# -- invoke ------------------------------------------------------------------------------------


def test_invoke_prints_the_result_and_exits_0(
    gateway: GatewayProcess, agents: tuple[str, list[Agent]]
) -> None:
    capability, started = agents
    done = reach(
        "invoke",
        capability,
        "query",
        "--payload",
        '{"text": "durable retries", "top_k": 2}',
        "--timeout-ms",
        "5000",
        "--request-id",
        "cli-req-0001",
        "--gateway",
        gateway.url,
    )
    assert done.returncode == 0, done.stderr
    first, _, rest = done.stdout.partition("\n")
    assert first.split()[:3] == ["success", "cli-req-0001", f"{capability}.query"]
    assert "instance" in first
    assert first.rstrip().endswith("ms")
    result = json.loads(rest)
    assert len(result["passages"]) == 2
    assert result["instance_id"] in {a.instance_id for a in started}
    assert done.stderr == ""  # no spinner: stderr is not a terminal


def test_invoke_json_and_payload_file(
    gateway: GatewayProcess, agents: tuple[str, list[Agent]], tmp_path: Path
) -> None:
    capability, _ = agents
    payload = tmp_path / "payload.json"
    payload.write_text('{"text": "heartbeats", "top_k": 1}')
    done = reach(
        "invoke", capability, "query", "--payload-file", str(payload), "--json",
        "--gateway", gateway.url,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    envelope = json.loads(done.stdout)
    assert envelope["status"] == "success"
    assert envelope["request_id"].startswith("req-")
    assert len(envelope["result"]["passages"]) == 1

    # `-` reads the payload from stdin.
    done = reach(
        "invoke", capability, "query", "--payload-file", "-", "--json", "--gateway", gateway.url,
        stdin='{"text": "routing", "top_k": 3}',
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert len(json.loads(done.stdout)["result"]["passages"]) == 3


def test_invoke_errors_exit_1_with_the_error(
    gateway: GatewayProcess, agents: tuple[str, list[Agent]]
) -> None:
    capability, _ = agents
    done = reach(
        "invoke", capability, "fail", "--payload", '{"status": 400}', "--gateway", gateway.url
    )
    assert done.returncode == 1
    assert done.stdout == ""
    assert done.stderr.startswith("error ")
    assert "agent_error" in done.stderr
    assert "index_unavailable" in done.stderr  # the agent's own error type
    assert "(HTTP 502)" in done.stderr

    done = reach("invoke", capability, "fail", "--json", "--gateway", gateway.url)
    assert done.returncode == 1
    envelope = json.loads(done.stdout)
    assert envelope["status"] == "error"
    assert envelope["error"]["type"] == "agent_error"

    done = reach("invoke", "no-such-capability", "query", "--gateway", gateway.url)
    assert done.returncode == 1
    assert "unknown_capability" in done.stderr
    assert "(HTTP 404)" in done.stderr


def test_invoke_bad_payload_is_a_usage_error(gateway: GatewayProcess) -> None:
    for flag, says in [("{not json", "not valid JSON"), ("[1, 2]", "must be a JSON object")]:
        done = reach("invoke", "x", "query", "--payload", flag, "--gateway", gateway.url)
        assert done.returncode == 2
        assert says in done.stderr
        assert "Traceback" not in done.stderr
    done = reach("invoke", "x", "query", "--payload-file", "/nonexistent", "--gateway", gateway.url)
    assert done.returncode == 2
    assert "cannot read /nonexistent" in done.stderr


def test_invoke_context_id_goes_on_with_a_conversation(
    gateway: GatewayProcess, agents: tuple[str, list[Agent]]
) -> None:
    capability, _ = agents
    call = ("invoke", capability, "query", "--payload", '{"text": "x"}', "--gateway", gateway.url)
    first = reach(*call, "--request-id", f"cli-ctx-{uuid.uuid4().hex[:8]}")
    assert first.returncode == 0, first.stderr
    context = first.stdout.split()[1]
    follow_up = reach(*call, "--context-id", context)
    assert follow_up.returncode == 0, follow_up.stderr
    # The flag reaches the door: a conversation Reach never handed out is refused.
    unknown = reach(*call, "--context-id", "cli-no-such-conversation")
    assert unknown.returncode == 1
    assert "unknown_request" in unknown.stderr
    assert "cli-no-such-conversation" in unknown.stderr


async def test_invoke_timeout_says_how_to_wait_longer(gateway: GatewayProcess) -> None:
    capability = f"cli-slow-{uuid.uuid4().hex[:8]}"
    slow = await start_agents(gateway, capability, 1, "--delay-ms", "3000")
    try:
        done = reach(
            "invoke", capability, "query", "--payload", '{"text": "x"}', "--timeout-ms", "300",
            "--gateway", gateway.url,
        )  # fmt: skip
    finally:
        for agent in slow:
            agent.proc.stop()
    assert done.returncode == 1
    assert done.stderr.startswith("timeout ")
    assert "--timeout-ms MS" in done.stderr
    # It was sent: no invitation to send it again without looking (it said only how to wait).
    assert "it may have run: look (reach trace " in done.stderr
    assert "safe" not in done.stderr


async def test_invoke_with_a_callback_is_accepted(
    gateway: GatewayProcess, agents: tuple[str, list[Agent]]
) -> None:
    capability, _ = agents
    async with CallbackReceiver() as receiver:
        done = reach(
            "invoke", capability, "query", "--payload", '{"text": "x", "top_k": 1}',
            "--callback", receiver.url, "--gateway", gateway.url,
        )  # fmt: skip
        assert done.returncode == 0, done.stderr
        assert done.stdout.split()[0] == "accepted"
        assert f"POSTed to {receiver.url}" in done.stdout
        request_id = done.stdout.split()[1]
        await receiver.wait(1)
    assert receiver.received[0][1]["request_id"] == request_id
    assert receiver.received[0][1]["status"] == "success"


# -- the gateway cannot be reached, or wants a token -------------------------------------------


def test_unreachable_gateway_names_the_url_and_the_fix() -> None:
    port = free_port()  # nothing listens there
    for command in (["capabilities"], ["agents"], ["invoke", "cap", "op"]):
        done = reach(*command, "--gateway", f"http://127.0.0.1:{port}")
        assert done.returncode == 3, command
        assert (
            f"error: cannot reach the gateway at http://127.0.0.1:{port}: connection refused"
            in done.stderr
        )
        assert "reach up" in done.stderr
        assert "--gateway" in done.stderr
        assert "Traceback" not in done.stderr
    # Without --gateway: the configured one (reach.listen_port here).
    done = reach("agents", env={"REACH_LISTEN_PORT": str(port)})
    assert done.returncode == 3
    assert f"cannot reach the gateway at http://127.0.0.1:{port}" in done.stderr


def test_something_else_at_the_url_is_named() -> None:
    import http.server
    import threading

    server = http.server.HTTPServer(("127.0.0.1", 0), http.server.SimpleHTTPRequestHandler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        done = reach("capabilities", "--gateway", f"http://127.0.0.1:{server.server_port}")
    finally:
        server.shutdown()
        server.server_close()
    assert done.returncode == 1
    assert "did not answer as a Reach gateway (HTTP 404" in done.stderr


@pytest.fixture(scope="module")
async def secured(temporal_server: str, tmp_path_factory: pytest.TempPathFactory) -> Any:
    """A gateway that requires tokens (its token file holds some), and one agent on it."""
    tmp = tmp_path_factory.mktemp("cli-auth")
    stack = new_stack(temporal_server, tmp)
    store = FileTokenStore(tmp / "tokens.json")
    capability = f"cli-{uuid.uuid4().hex[:8]}"
    caller, record = issue("cli-user", "caller", [])
    store.write(record)
    agent_token, record = issue("cli-agent", "agent", [capability])
    store.write(record)
    gw = await GatewayProcess(stack).ready()
    agent = Agent(gw, f"{capability}-01", capability, env={"REACH_AGENT_TOKEN": agent_token})
    try:
        await agent.ready()
        yield gw, capability, caller
    finally:
        agent.proc.stop()
        gw.proc.stop()


def test_401_names_reach_token(secured: Any) -> None:
    gw, capability, caller = secured
    for command in (["capabilities"], ["agents", capability], ["invoke", capability, "query"]):
        done = reach(*command, "--gateway", gw.url)
        assert done.returncode == 1, done.stdout
        assert "the gateway requires a token" in done.stderr
        assert "set REACH_TOKEN" in done.stderr
        assert "reach tokens issue" in done.stderr

    done = reach("capabilities", "--gateway", gw.url, "--token", "reach_000000000000_" + "x" * 43)
    assert done.returncode == 1
    assert "the gateway refused the token" in done.stderr

    # With the token, from REACH_TOKEN or --token.
    done = reach("agents", capability, "--gateway", gw.url, env={"REACH_TOKEN": caller})
    assert done.returncode == 0, done.stderr
    assert f"{capability}-01" in done.stdout
    done = reach(
        "invoke", capability, "query", "--payload", '{"text": "x"}', "--gateway", gw.url,
        "--token", caller,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("success ")


# -- config check ------------------------------------------------------------------------------


def test_config_check_ok_prints_a_summary(tmp_path: Path) -> None:
    done = reach("config", "check", "--config", str(ROOT / "reach.yaml"))
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0] == f"OK: {ROOT / 'reach.yaml'} is valid"
    summary = {line.split()[0]: line for line in lines[1:]}
    assert {"gateway", "registry", "temporal", "policy", "auth", "security"} <= set(summary)
    assert "http://127.0.0.1:7600" in summary["gateway"]

    # The top-level --config works too, and $REACH_CONFIG is the default (as for the gateway).
    done = reach("--config", str(ROOT / "reach.yaml"), "config", "check")
    assert done.returncode == 0, done.stderr
    done = reach("config", "check", "--json")
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout)
    assert out["ok"] is True
    assert out["file"] == str(ROOT / "reach.yaml")
    assert out["settings"]["registry"]["type"] == "memory"
    assert "REACH_CONFIG" in out["env"]


def test_config_check_names_the_field_and_exits_1(tmp_path: Path) -> None:
    bad = tmp_path / "reach.yaml"
    bad.write_text("reach:\n  registry:\n    heartbeat_timeout: -1\n  policy:\n    retyr: 2\n")
    done = reach("config", "check", "--config", str(bad))
    assert done.returncode == 1
    assert done.stdout == ""
    assert str(bad) in done.stderr
    assert "reach.registry.heartbeat_timeout" in done.stderr
    assert "reach.policy.retyr" in done.stderr
    assert "Traceback" not in done.stderr

    # A bad REACH_* variable is named as well; and the file must exist.
    done = reach(
        "config", "check", "--config", str(ROOT / "reach.yaml"),
        env={"REACH_LISTEN_PORT": "http"},
    )  # fmt: skip
    assert done.returncode == 1
    assert "reach.listen_port" in done.stderr
    done = reach("config", "check", "--config", str(tmp_path / "missing.yaml"))
    assert done.returncode == 1
    assert "does not exist" in done.stderr

    done = reach("config", "check", "--config", str(bad), "--json")
    assert done.returncode == 1
    out = json.loads(done.stdout)
    assert out["ok"] is False
    assert "reach.policy.retyr" in out["error"]
