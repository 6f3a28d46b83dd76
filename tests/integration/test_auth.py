"""The door with tokens, rules and audit (R18-R20, R26): real gateway and agent processes, the
real token file / Redis, real HTTP and gRPC fronts."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import grpc
import httpx
import pytest

from agent_reach_proto import gateway_pb2 as pb
from reach.security.tokens import FileTokenStore, issue
from tests.conftest import new_stack
from tests.helpers import ROOT, Agent, GatewayProcess, Stack, wait_until
from tests.integration.test_grpc_front import Reach

pytestmark = pytest.mark.integration


def body(capability: str, operation: str = "query", **extra: object) -> dict[str, object]:
    return {
        "target": capability,
        "operation": operation,
        "payload": {"text": "who may call", "top_k": 1},
        "timeout_ms": 5000,
        **extra,
    }


def cli(stack: Stack, *args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("REACH_", "TEMPORAL_"))}
    env.update(stack.env())
    return subprocess.run(
        [sys.executable, "-m", "gateway_api", *args],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )


def issue_cli(stack: Stack, *args: str) -> tuple[str, str]:
    """(token, id) issued through `reach tokens issue --json`."""
    done = cli(stack, "tokens", "issue", "--json", *args)
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout)
    return out["token"], out["record"]["id"]


def bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


def audit_lines(stack: Stack) -> list[dict[str, Any]]:
    path = stack.tmp / "audit.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


@pytest.fixture(scope="module")
async def secured(temporal_server: str, tmp_path_factory: pytest.TempPathFactory) -> Any:
    """A gateway whose token file already holds tokens (so tokens are required), with rules."""
    tmp = tmp_path_factory.mktemp("auth")
    config = tmp / "reach.yaml"
    config.write_text((ROOT / "reach.yaml").read_text())
    stack = new_stack(temporal_server, tmp, extra={"REACH_CONFIG": str(config)})
    store = FileTokenStore(tmp / "tokens.json")
    tokens: dict[str, str] = {}
    for name, kind, caps in [
        ("orchestrator", "caller", []),
        ("intruder", "caller", []),
        ("ops", "admin", []),
    ]:
        token, record = issue(name, kind, caps)  # type: ignore[arg-type]
        store.write(record)
        tokens[name] = token
    gw = await GatewayProcess(stack).ready()
    try:
        yield stack, gw, tokens, config
    finally:
        gw.proc.stop()


async def start_agent(
    gw: GatewayProcess, capability: str, token: str, name: str = "a", *flags: str
) -> Agent:
    ledger = gw.stack.tmp / f"ledger-{capability}"
    agent = Agent(
        gw,
        f"{capability}-{name}",
        capability,
        "--ledger",
        str(ledger),
        *flags,
        env={"REACH_AGENT_TOKEN": token},
    )
    return await agent.ready()


async def _in_ledger(gw: GatewayProcess, capability: str, request_id: str) -> bool:
    ledger = gw.stack.tmp / f"ledger-{capability}"
    return ledger.exists() and request_id in ledger.read_text()


def calls(gw: GatewayProcess, capability: str) -> int:
    ledger = gw.stack.tmp / f"ledger-{capability}"
    return len(ledger.read_text().splitlines()) if ledger.exists() else 0


# -- tokens ---------------------------------------------------------------------------------


async def test_missing_garbage_expired_and_revoked_tokens_are_401(
    secured: Any, http: httpx.AsyncClient, capability: str
) -> None:
    stack, gw, tokens, _ = secured
    agent_token, _ = issue_cli(stack, "--principal", "kr", "--agent", "--capability", capability)
    await start_agent(gw, capability, agent_token)
    expired, expired_record = issue("late", "caller", ttl_s=0.5)
    FileTokenStore(stack.tmp / "tokens.json").write(expired_record)
    revoked, revoked_id = issue_cli(stack, "--principal", "former")
    done = cli(stack, "tokens", "revoke", revoked_id)
    assert done.returncode == 0, done.stderr
    url = f"{gw.url}/reach/invoke"

    async def refused(token: str, says: str) -> bool:
        r = await http.get(f"{gw.url}/reach/capabilities", headers=bearer(token))
        return r.status_code == 401 and says in r.json()["error"]["message"]

    # Until the expiry has passed and the gateway has read the file with both records.
    await wait_until(lambda: refused(expired, "expired"), 10, every_s=0.05)
    await wait_until(lambda: refused(revoked, "revoked"), 10, every_s=0.05)
    for headers, says in [
        ({}, "missing credentials"),
        ({"Authorization": "Basic abc"}, "Bearer"),
        (bearer("reach_000000000000_" + "x" * 43), "invalid token"),
        (bearer("garbage"), "invalid token"),
        (bearer(expired), "expired"),
        (bearer(revoked), "revoked"),
    ]:
        r = await http.post(url, json=body(capability), headers=headers)
        assert r.status_code == 401, (headers, r.text)
        assert r.json()["error"]["type"] == "unauthorized"
        assert says in r.json()["error"]["message"]
    # Agent routes too: Join, heartbeat, leave and late answers.
    join = {"instance_id": "x-1", "capability": capability, "service_address": "127.0.0.1:9"}
    assert (await http.post(f"{gw.url}/reach/agents", json=join)).status_code == 401
    r = await http.put(f"{gw.url}/reach/agents/x-1/heartbeat", headers=bearer("nope"))
    assert r.status_code == 401
    assert (await http.delete(f"{gw.url}/reach/agents/x-1")).status_code == 401
    r = await http.post(f"{gw.url}/reach/requests/r-1/result", json={"status": "success"})
    assert r.status_code == 401
    # Reads need a token as well.
    assert (await http.get(f"{gw.url}/reach/capabilities")).status_code == 401
    # A valid token passes, and the caller is the token's principal.
    r = await http.post(url, json=body(capability), headers=bearer(tokens["orchestrator"]))
    assert r.status_code == 200, r.text
    assert calls(gw, capability) == 1


async def test_grpc_front_refuses_without_a_valid_token(secured: Any, capability: str) -> None:
    _stack, gw, tokens, _ = secured
    port = _grpc_port(gw)
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = Reach(channel)
        request = pb.InvokeRequest(target=capability, operation="query", payload_json="{}")
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await stub.invoke(request)
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await stub.invoke(request, metadata=(("authorization", "Bearer wrong"),))
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
        join = pb.JoinRequest(
            instance_id="g-1", capability=capability, service_address="127.0.0.1:9"
        )
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await stub.join(join, metadata=(("authorization", f"Bearer {tokens['orchestrator']}"),))
        assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED  # a caller token


def _grpc_port(gw: GatewayProcess) -> int:
    for line in gw.proc.output().splitlines():
        if "gRPC front listening on" in line:
            return int(line.rsplit(":", 1)[1].split()[0])
    raise AssertionError("no gRPC port in the gateway's log")


async def test_x_reach_caller_must_match_the_token(
    secured: Any, http: httpx.AsyncClient, capability: str
) -> None:
    stack, gw, tokens, _ = secured
    agent_token, _ = issue_cli(stack, "--principal", "kr2", "--agent", "--capability", capability)
    await start_agent(gw, capability, agent_token)
    headers = bearer(tokens["orchestrator"]) | {"X-Reach-Caller": "someone-else"}
    r = await http.post(f"{gw.url}/reach/invoke", json=body(capability), headers=headers)
    assert r.status_code == 403
    assert "does not match" in r.json()["error"]["message"]
    rid = f"req-{uuid.uuid4().hex}"
    headers = bearer(tokens["orchestrator"]) | {"X-Reach-Caller": "orchestrator"}
    r = await http.post(
        f"{gw.url}/reach/invoke", json=body(capability, request_id=rid), headers=headers
    )
    assert r.status_code == 200, r.text
    # Only its caller reads a request; to anyone else it does not exist.
    mine = await http.get(f"{gw.url}/reach/requests/{rid}", headers=bearer(tokens["orchestrator"]))
    assert mine.status_code == 200
    theirs = await http.get(f"{gw.url}/reach/requests/{rid}", headers=bearer(tokens["intruder"]))
    assert theirs.status_code == 404
    # The audit record names the token's principal.
    await wait_until(lambda: _found(stack, rid), 5)
    record = next(r for r in audit_lines(stack) if r.get("request_id") == rid)
    assert record["caller"] == "orchestrator"
    assert record["status"] == 200
    assert record["instance"] == f"{capability}-a"
    assert record["outcome"] == "success"


async def _found(stack: Stack, rid: str) -> bool:
    return any(r.get("request_id") == rid for r in audit_lines(stack))


# -- capability hijack ----------------------------------------------------------------------


async def test_an_agent_token_cannot_hijack(
    secured: Any, http: httpx.AsyncClient, capability: str
) -> None:
    stack, gw, tokens, _ = secured
    mine, _ = issue_cli(stack, "--principal", "owner", "--agent", "--capability", capability)
    other, _ = issue_cli(stack, "--principal", "thief", "--agent", "--capability", capability)
    agent = await start_agent(gw, capability, mine, "deferring", "--defer", "--delay-ms", "3000")
    # A Join for a capability the token does not name.
    join = {
        "instance_id": "thief-1",
        "capability": f"{capability}-other",
        "service_address": "127.0.0.1:9",
    }
    r = await http.post(f"{gw.url}/reach/agents", json=join, headers=bearer(other))
    assert r.status_code == 403
    assert "may serve" in r.json()["error"]["message"]
    # Taking over another principal's instance_id (and so its traffic).
    join = {
        "instance_id": agent.instance_id,
        "capability": capability,
        "service_address": "127.0.0.1:9",
    }
    r = await http.post(f"{gw.url}/reach/agents", json=join, headers=bearer(other))
    assert r.status_code == 403
    assert "held by another principal" in r.json()["error"]["message"]
    hb = await http.put(
        f"{gw.url}/reach/agents/{agent.instance_id}/heartbeat", headers=bearer(other)
    )
    assert hb.status_code == 403
    gone = await http.delete(f"{gw.url}/reach/agents/{agent.instance_id}", headers=bearer(other))
    assert gone.status_code == 403
    # Still registered at its own address, still called.
    r = await http.post(
        f"{gw.url}/reach/invoke", json=body(capability), headers=bearer(tokens["orchestrator"])
    )
    assert r.status_code == 200
    assert r.json()["instance_id"] == agent.instance_id
    # A late answer to a request it was not sent: the thief's own instance, then the owner's.
    rid = f"req-{uuid.uuid4().hex}"
    r = await http.post(
        f"{gw.url}/reach/invoke",
        json=body(capability, request_id=rid, callback="http://127.0.0.1:9/cb"),
        headers=bearer(tokens["orchestrator"]),
    )
    assert r.status_code == 202, r.text
    # Sent (the agent deferred it) before the thief's own instance exists to be routed to.
    await wait_until(lambda: _in_ledger(gw, capability, rid), 10)
    join = {"instance_id": "thief-2", "capability": capability, "service_address": "127.0.0.1:9"}
    r = await http.post(f"{gw.url}/reach/agents", json=join, headers=bearer(other))
    assert r.status_code == 200, r.text
    answer = {"instance_id": "thief-2", "status": "success", "result": {"forged": True}}
    r = await http.post(f"{gw.url}/reach/requests/{rid}/result", json=answer, headers=bearer(other))
    assert r.status_code == 403, r.text
    answer["instance_id"] = agent.instance_id
    r = await http.post(f"{gw.url}/reach/requests/{rid}/result", json=answer, headers=bearer(other))
    assert r.status_code == 403, r.text
    await http.delete(f"{gw.url}/reach/agents/thief-2", headers=bearer(other))
    # The owner's instance goes away; another principal takes its name and answers as it:
    # the request was sent to the owner's instance, so only the owner's token answers.
    agent.proc.kill()
    r = await http.delete(f"{gw.url}/reach/agents/{agent.instance_id}", headers=bearer(mine))
    assert r.status_code == 204
    r = await http.post(f"{gw.url}/reach/requests/{rid}/result", json=answer, headers=bearer(other))
    assert r.status_code == 403, r.text  # not registered: join first
    join = {
        "instance_id": agent.instance_id,
        "capability": capability,
        "service_address": "127.0.0.1:9",
    }
    r = await http.post(f"{gw.url}/reach/agents", json=join, headers=bearer(other))
    assert r.status_code == 200, r.text
    r = await http.post(f"{gw.url}/reach/requests/{rid}/result", json=answer, headers=bearer(other))
    assert r.status_code == 403, r.text
    assert "not sent to an instance of 'thief'" in r.json()["error"]["message"]
    await http.delete(f"{gw.url}/reach/agents/{agent.instance_id}", headers=bearer(other))


# -- rules ----------------------------------------------------------------------------------


def write_rules(config: Path, rules: str) -> None:
    text = (ROOT / "reach.yaml").read_text().replace("  rules: []", f"  rules:\n{rules}")
    tmp = config.with_suffix(".tmp")
    tmp.write_text(text)
    tmp.replace(config)


async def test_rules_decide_and_change_without_restart(
    secured: Any, http: httpx.AsyncClient, capability: str
) -> None:
    stack, gw, tokens, config = secured
    agent_token, _ = issue_cli(stack, "--principal", "kr3", "--agent", "--capability", capability)
    await start_agent(gw, capability, agent_token)
    write_rules(
        config,
        f"""    - name: orchestrator-reads
      caller: orchestrator
      target_capability: {capability}
      allowed_operations: [query]
      denied_operations: [delete_index]
""",
    )
    orch = bearer(tokens["orchestrator"])
    url = f"{gw.url}/reach/invoke"

    async def denied(op: str) -> bool:
        r = await http.post(url, json=body(capability, op), headers=orch)
        return r.status_code == 403

    await wait_until(lambda: denied("delete_index"), 10)
    r = await http.post(url, json=body(capability, "delete_index"), headers=orch)
    assert r.status_code == 403
    assert "orchestrator-reads" in r.json()["error"]["message"]
    denied_id = r.json()["request_id"]  # a denial names its request, in the audit trail too
    r = await http.post(url, json=body(capability, "rebuild"), headers=orch)
    assert r.status_code == 403
    assert "no rule allows" in r.json()["error"]["message"]
    r = await http.post(url, json=body(capability), headers=bearer(tokens["intruder"]))
    assert r.status_code == 403
    before = calls(gw, capability)
    r = await http.post(url, json=body(capability), headers=orch)
    assert r.status_code == 200, r.text
    assert calls(gw, capability) == before + 1  # denied calls never reached the agent

    async def denial_audited() -> bool:
        denials = [a for a in audit_lines(stack) if a["event"] == "denied"]
        return any(
            a.get("rule") == "orchestrator-reads" and a.get("request_id") == denied_id
            for a in denials
        )

    await wait_until(denial_audited, 5)
    # An invalid change is refused; the rule in force stays.
    config.write_text(
        config.read_text().replace("allowed_operations: [query]", "allowed_operations: 7")
    )
    await wait_until(lambda: _event(stack, "config_rejected"), 10)
    r = await http.post(url, json=body(capability, "delete_index"), headers=orch)
    assert r.status_code == 403
    assert (await http.post(url, json=body(capability), headers=orch)).status_code == 200
    # An empty (or half-written) file is refused too: a gateway never resets to defaults.
    for text in ("", "# nothing yet\n"):
        rejected = _count(stack, "config_rejected")
        config.write_text(text)
        await wait_until(lambda: _count(stack, "config_rejected") > rejected, 10)  # noqa: B023
    r = await http.post(url, json=body(capability, "delete_index"), headers=orch)
    assert r.status_code == 403
    # Back to no rules: everything is allowed again.
    write_rules(config, "      []\n")
    await wait_until(lambda: _not_denied(http, url, capability, orch), 10)


async def _event(stack: Stack, name: str) -> bool:
    return any(a["event"] == name for a in audit_lines(stack))


def _count(stack: Stack, name: str) -> int:
    """The audit records of event `name` so far."""
    return sum(a["event"] == name for a in audit_lines(stack))


async def _not_denied(
    http: httpx.AsyncClient, url: str, capability: str, headers: dict[str, str]
) -> bool:
    r = await http.post(url, json=body(capability, "rebuild"), headers=headers)
    return r.status_code != 403


# -- admin API ------------------------------------------------------------------------------


async def test_admin_api_issues_and_revokes(
    secured: Any, http: httpx.AsyncClient, capability: str
) -> None:
    stack, gw, tokens, _ = secured
    admin = bearer(tokens["ops"])
    r = await http.post(
        f"{gw.url}/reach/admin/tokens",
        json={"principal": "api-made"},
        headers=bearer(tokens["orchestrator"]),
    )
    assert r.status_code == 403
    r = await http.post(
        f"{gw.url}/reach/admin/tokens", json={"principal": "api-made"}, headers=admin
    )
    assert r.status_code == 201, r.text
    made = r.json()
    assert "sha256" not in made["record"]
    listed = (await http.get(f"{gw.url}/reach/admin/tokens", headers=admin)).json()["tokens"]
    assert any(t["id"] == made["record"]["id"] for t in listed)
    assert not any("sha256" in t for t in listed)
    r = await http.get(f"{gw.url}/reach/capabilities", headers=bearer(made["token"]))
    assert r.status_code == 200
    r = await http.delete(f"{gw.url}/reach/admin/tokens/{made['record']['id']}", headers=admin)
    assert r.status_code == 200
    assert r.json()["state"] == "revoked"
    r = await http.get(f"{gw.url}/reach/capabilities", headers=bearer(made["token"]))
    assert r.status_code == 401
    await wait_until(lambda: _event(stack, "token_revoked"), 5)
    assert await _event(stack, "token_issued")
    # The secret never reaches the audit trail.
    assert made["token"] not in (stack.tmp / "audit.jsonl").read_text()


async def test_an_emptied_token_store_does_not_open_the_door(
    secured: Any, http: httpx.AsyncClient
) -> None:
    stack, gw, tokens, _ = secured
    store = stack.tmp / "tokens.json"
    kept = store.with_suffix(".kept")
    store.replace(kept)
    try:
        await asyncio.sleep(1.0)  # the gateway has looked at the (missing) file by now
        assert (await http.get(f"{gw.url}/reach/capabilities")).status_code == 401
        r = await http.get(f"{gw.url}/reach/capabilities", headers=bearer(tokens["intruder"]))
        assert r.status_code == 200  # the last good copy is kept
    finally:
        kept.replace(store)


# -- revocation across gateways (Redis) -----------------------------------------------------


async def test_revoked_on_one_gateway_is_refused_on_another_within_a_second(
    temporal_server: str,
    tmp_path: Path,
    redis_prefix: str,
    http: httpx.AsyncClient,
) -> None:
    stack = new_stack(temporal_server, tmp_path, registry="redis", key_prefix=redis_prefix)
    admin_token, _ = issue_cli(stack, "--principal", "ops", "--admin")
    caller_token, caller_id = issue_cli(stack, "--principal", "orchestrator")
    a, b = GatewayProcess(stack, "a"), GatewayProcess(stack, "b")
    await asyncio.gather(a.ready(), b.ready())
    try:
        url = f"{b.url}/reach/capabilities"
        assert (await http.get(url, headers=bearer(caller_token))).status_code == 200
        r = await http.delete(
            f"{a.url}/reach/admin/tokens/{caller_id}", headers=bearer(admin_token)
        )
        assert r.status_code == 200
        revoked_at = time.monotonic()

        async def refused() -> bool:
            return (await http.get(url, headers=bearer(caller_token))).status_code == 401

        await wait_until(refused, 5, every_s=0.02)
        assert time.monotonic() - revoked_at < 1.0
    finally:
        a.proc.stop()
        b.proc.stop()


# -- safe by default ------------------------------------------------------------------------


async def test_a_reload_cannot_open_a_public_gateway(temporal_server: str, tmp_path: Path) -> None:
    config = tmp_path / "reach.yaml"
    text = (ROOT / "reach.yaml").read_text()
    config.write_text(text.replace("    mode: auto ", "    mode: tokens "))
    stack = new_stack(
        temporal_server,
        tmp_path,
        extra={"REACH_LISTEN_HOST": "0.0.0.0", "REACH_CONFIG": str(config)},
    )
    gw = await GatewayProcess(stack).ready()
    try:
        async with httpx.AsyncClient(trust_env=False, timeout=10) as http:
            assert (await http.get(f"{gw.url}/reach/capabilities")).status_code == 401
            config.write_text(text)  # mode: auto, and no token exists
            await wait_until(lambda: _event(stack, "config_rejected"), 10)
            assert (await http.get(f"{gw.url}/reach/capabilities")).status_code == 401
        assert "refusing to keep serving" in gw.proc.output()
    finally:
        gw.proc.stop()


async def test_no_tokens_means_loopback_only(temporal_server: str, tmp_path: Path) -> None:
    stack = new_stack(temporal_server, tmp_path, extra={"REACH_LISTEN_HOST": "0.0.0.0"})
    gw = GatewayProcess(stack)
    code = await asyncio.to_thread(gw.proc.popen.wait, 60)
    assert code != 0
    assert "auth.mode: open" in gw.proc.output()
    open_stack = new_stack(
        temporal_server,
        tmp_path / "open",
        extra={"REACH_LISTEN_HOST": "0.0.0.0", "REACH_AUTH__MODE": "open"},
    )
    (tmp_path / "open").mkdir()
    served = GatewayProcess(open_stack)
    try:
        await served.ready()
    finally:
        served.proc.stop()
    (tmp_path / "local").mkdir()
    local = await GatewayProcess(new_stack(temporal_server, tmp_path / "local")).ready()
    try:
        assert "no tokens" in local.proc.output()
    finally:
        local.proc.stop()


async def test_a_reload_cannot_open_a_door_that_holds_tokens(
    temporal_server: str, tmp_path: Path, http: httpx.AsyncClient
) -> None:
    """Issue 25: a live reload accepted auth.mode: open on a gateway holding tokens."""
    config = tmp_path / "reach.yaml"
    text = (ROOT / "reach.yaml").read_text()
    assert "    mode: auto " in text
    config.write_text(text)
    stack = new_stack(temporal_server, tmp_path, extra={"REACH_CONFIG": str(config)})
    issue_cli(stack, "--principal", "orchestrator")  # the door is closed: tokens required
    async with GatewayProcess(stack, "closed") as gw:
        assert (await http.get(f"{gw.url}/reach/capabilities")).status_code == 401
        config.write_text(text.replace("    mode: auto ", "    mode: open "))
        await wait_until(lambda: _event(stack, "config_rejected"), 10)
        assert (await http.get(f"{gw.url}/reach/capabilities")).status_code == 401
        [rejected] = [a for a in audit_lines(stack) if a["event"] == "config_rejected"]
        assert "does not open its door" in rejected["reason"]
