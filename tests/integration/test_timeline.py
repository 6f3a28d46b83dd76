"""`reach trace` and `reach requests` end to end: real dev server, gateway, agents and callback
receiver; the timeline read back from the request's workflow history (R16), the list from
Temporal's visibility, and the CLI as a subprocess."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from temporalio.client import Client

from reach.security.tokens import FileTokenStore, issue
from tests.conftest import new_stack
from tests.helpers import (
    ROOT,
    Agent,
    CallbackReceiver,
    GatewayProcess,
    rid,
    start_agents,
    wait_until,
)

pytestmark = pytest.mark.integration

BACKOFF_MS = 300


def body(capability: str, **extra: Any) -> dict[str, Any]:
    return {
        "target": capability,
        "operation": "query",  # idempotent: retried (R13)
        "payload": {"text": "where did it go", "top_k": 1},
        "timeout_ms": 5000,
        **extra,
    }


@pytest.fixture(scope="module")
async def gw(
    temporal_server: str, tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[GatewayProcess]:
    extra = {"REACH_POLICY__RETRY__BACKOFF_BASE_MS": str(BACKOFF_MS)}
    stack = new_stack(temporal_server, tmp_path_factory.mktemp("timeline"), extra=extra)
    async with GatewayProcess(stack) as gateway:
        yield gateway


async def timeline(
    http: httpx.AsyncClient, gateway: GatewayProcess, request_id: str
) -> dict[str, Any]:
    r = await http.get(f"{gateway.url}/reach/requests/{request_id}/timeline")
    assert r.status_code == 200, r.text
    data: dict[str, Any] = r.json()
    return data


def kinds(data: dict[str, Any]) -> list[str]:
    return [e["kind"] for e in data["events"]]


def event(data: dict[str, Any], kind: str, nth: int = 0) -> dict[str, Any]:
    found = [e for e in data["events"] if e["kind"] == kind]
    assert len(found) > nth, (kind, kinds(data))
    result: dict[str, Any] = found[nth]
    return result


def reach_cli(url: str, *args: str, token: str | None = None) -> Any:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("REACH_", "TEMPORAL_"))}
    env["REACH_CONFIG"] = str(ROOT / "reach.yaml")
    if token:
        env["REACH_TOKEN"] = token
    return subprocess.run(
        [sys.executable, "-m", "gateway_api", *args, "--gateway", url],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )


async def test_a_retry_reads_in_order_with_growing_offsets(
    gw: GatewayProcess, http: httpx.AsyncClient, capability: str, tmp_path: Path
) -> None:
    ledger = tmp_path / "ledger.txt"
    # Only the very first call of the two instances fails: attempt 2 goes to the other one.
    await start_agents(
        gw, capability, 2, "--ledger", str(ledger), "--fail-first", "1", "--fail-shared"
    )
    request_id = rid()
    r = await http.post(f"{gw.url}/reach/invoke", json=body(capability, request_id=request_id))
    assert r.status_code == 200, r.text
    data = await timeline(http, gw, request_id)
    assert data["request_id"] == request_id
    assert data["status"] == "success"
    assert kinds(data) == [
        "accepted",
        "instance_chosen",
        "sent",
        "attempt_failed",
        "backoff",
        "instance_chosen",
        "sent",
        "attempt_succeeded",
        "result",
    ]
    offsets = [e["at_ms"] for e in data["events"]]
    assert offsets == sorted(offsets)
    assert offsets[0] == 0
    accepted = event(data, "accepted")["detail"]
    assert accepted["caller"] == "anonymous"
    assert accepted["capability"] == capability
    # Configuration leaves it open; the agent declares `query` idempotent (R13: 2 retries).
    assert "idempotent" not in accepted  # open until the agents declare it
    assert accepted["retries_if_idempotent"] == 2
    assert accepted["deadline_ms"] == 5000
    first, second = event(data, "sent", 0)["detail"], event(data, "sent", 1)["detail"]
    assert (first["attempt"], second["attempt"]) == (1, 2)
    assert first["protocol"] == "http"
    assert first["instance"] != second["instance"]  # attempt 2 avoids the instance that failed
    failed = event(data, "attempt_failed")["detail"]
    assert failed["error"]["type"] == "agent_error"
    assert failed["instance"] == first["instance"]
    backoff = event(data, "backoff")
    assert backoff["detail"]["delay_ms"] == BACKOFF_MS
    # The durable timer really held attempt 2 back.
    assert event(data, "sent", 1)["at_ms"] - backoff["at_ms"] >= BACKOFF_MS - 5
    assert event(data, "instance_chosen", 0)["detail"]["declared"]["idempotent"] is True
    chosen = event(data, "instance_chosen", 1)["detail"]
    assert chosen["instance"] == second["instance"]
    assert chosen["strategy"]
    assert event(data, "result")["detail"]["instance"] == second["instance"]
    # The Temporal UI's one line: fixed at the start, the outcome added by the workflow.
    client = await Client.connect(gw.stack.temporal)
    handle = client.get_workflow_handle(request_id)
    line = f"{capability}.query from anonymous"
    assert await (await handle.describe()).static_summary() == line
    metadata = await handle.query("__temporal_workflow_metadata")
    assert metadata.current_details.startswith(f"{line} → success on {second['instance']} in ")


async def test_a_callback_request_shows_its_delivery_attempts(
    gw: GatewayProcess, http: httpx.AsyncClient, capability: str
) -> None:
    await start_agents(gw, capability, 1)
    async with CallbackReceiver(fail_first=1) as receiver:
        request_id = rid()
        r = await http.post(
            f"{gw.url}/reach/invoke",
            json=body(capability, request_id=request_id, callback=receiver.url),
        )
        assert r.status_code == 202, r.text
        await receiver.wait(1)
        assert len(receiver.received) == 1

        async def delivered() -> bool:
            return "callback_delivered" in kinds(await timeline(http, gw, request_id))

        await wait_until(delivered, 10)
    data = await timeline(http, gw, request_id)
    assert kinds(data) == [
        "accepted",
        "instance_chosen",
        "sent",
        "attempt_succeeded",
        "result",
        "callback",
        "callback_retrying",
        "callback_delivered",
    ]
    assert event(data, "accepted")["detail"]["callback"] == receiver.url
    assert event(data, "callback_retrying")["detail"]["last_error"].endswith("HTTP 500")
    assert event(data, "callback_delivered")["detail"]["attempts"] == 2
    offsets = [e["at_ms"] for e in data["events"]]
    assert offsets == sorted(offsets)


async def test_an_unreachable_callback_says_why_without_its_credentials(
    gw: GatewayProcess, http: httpx.AsyncClient, capability: str
) -> None:
    await start_agents(gw, capability, 1)
    request_id = rid()
    url = "http://user:CBSECRET@127.0.0.1:9/cb?token=QSECRET"  # port 9: nothing listens
    r = await http.post(
        f"{gw.url}/reach/invoke", json=body(capability, request_id=request_id, callback=url)
    )
    assert r.status_code == 202, r.text

    async def retried() -> bool:
        r = await http.get(f"{gw.url}/reach/requests/{request_id}")
        delivery = r.json().get("delivery") or {}
        return "unreachable" in (delivery.get("last_error") or "")

    await wait_until(retried, 15)
    data = await timeline(http, gw, request_id)
    text = json.dumps(data)
    assert "SECRET" not in text
    assert "127.0.0.1:9/cb" in text


async def test_a_late_answer_and_a_timeout(
    gw: GatewayProcess, http: httpx.AsyncClient, capability: str
) -> None:
    await start_agents(gw, capability, 1, "--defer", "--delay-ms", "200")
    late = rid()
    r = await http.post(f"{gw.url}/reach/invoke", json=body(capability, request_id=late))
    assert r.status_code == 200, r.text
    data = await timeline(http, gw, late)
    assert kinds(data) == [
        "accepted",
        "instance_chosen",
        "sent",
        "attempt_accepted",
        "late_answer",
        "result",
    ]
    assert event(data, "late_answer")["at_ms"] >= 150

    slow = f"{capability}-slow"
    await start_agents(gw, slow, 1, "--delay-ms", "3000")
    timed_out = rid()
    r = await http.post(
        f"{gw.url}/reach/invoke", json=body(slow, request_id=timed_out, timeout_ms=500)
    )
    assert r.status_code == 504, r.text
    data = await timeline(http, gw, timed_out)
    assert data["status"] == "timeout"
    assert kinds(data)[:2] == ["accepted", "instance_chosen"]
    assert kinds(data)[-1] == "timeout"
    assert event(data, "timeout")["at_ms"] >= 450


async def test_requests_list_filters_and_the_cli(
    gw: GatewayProcess, http: httpx.AsyncClient, capability: str
) -> None:
    await start_agents(gw, capability, 1)
    ids = [rid() for _ in range(3)]
    for request_id in ids:
        r = await http.post(f"{gw.url}/reach/invoke", json=body(capability, request_id=request_id))
        assert r.status_code == 200, r.text

    async def listed() -> bool:  # visibility lags the workflows a moment
        r = await http.get(f"{gw.url}/reach/requests", params={"capability": capability})
        rows = r.json()["requests"] if r.status_code == 200 else []
        return {(x["request_id"], x["status"]) for x in rows} == {(i, "success") for i in ids}

    await wait_until(listed, 10)
    r = await http.get(
        f"{gw.url}/reach/requests",
        params={"capability": capability, "status": "success", "since": "10m", "limit": 2},
    )
    assert r.status_code == 200, r.text
    rows = r.json()["requests"]
    assert [x["request_id"] for x in rows] == ids[::-1][:2]  # newest first
    row = rows[0]
    assert set(row) == {
        "request_id",
        "capability",
        "operation",
        "caller",
        "status",
        "instance",
        "started_at",
        "closed_at",
        "duration_ms",
        "context_id",  # the conversation it belongs to (None: it started none)
    }
    assert (row["capability"], row["operation"], row["caller"]) == (
        capability,
        "query",
        "anonymous",
    )
    assert row["status"] == "success"
    assert row["instance"] == f"{capability}-00"
    assert isinstance(row["duration_ms"], int)
    none = await http.get(
        f"{gw.url}/reach/requests", params={"capability": capability, "status": "timeout"}
    )
    assert none.json() == {"requests": []}

    # Bad filters are refused by name; nothing a caller types reaches the query raw.
    for params, name in [
        ({"since": "ten minutes"}, "since"),
        ({"caller": "x' OR '1'='1"}, "caller"),
        ({"status": "done"}, "status"),
        ({"limit": "501"}, "limit"),
        ({"capability": "Bad Name"}, "capability"),
    ]:
        bad = await http.get(f"{gw.url}/reach/requests", params=params)
        assert bad.status_code == 422, (params, bad.text)
        assert name in bad.json()["error"]["message"]

    done = reach_cli(gw.url, "trace", ids[0], "--json")
    assert done.returncode == 0, done.stderr
    traced = json.loads(done.stdout)
    assert traced["request_id"] == ids[0]
    assert [e["kind"] for e in traced["events"]][-1] == "result"
    done = reach_cli(gw.url, "trace", ids[0])
    assert done.returncode == 0, done.stderr
    for words in ("OFFSET", "accepted", "+0 ms", "result"):
        assert words in done.stdout
    done = reach_cli(gw.url, "requests", "--json", "--capability", capability, "--since", "10m")
    assert done.returncode == 0, done.stderr
    assert {x["request_id"] for x in json.loads(done.stdout)["requests"]} == set(ids)
    done = reach_cli(gw.url, "requests", "--capability", capability)
    assert done.returncode == 0, done.stderr
    assert "REQUEST ID" in done.stdout
    assert ids[0] in done.stdout
    done = reach_cli(gw.url, "trace", "req-nobody-made-this")
    assert done.returncode == 1
    assert "no request with id" in done.stderr


def test_the_cli_names_the_fix_when_the_gateway_is_away() -> None:
    done = reach_cli("http://127.0.0.1:9", "requests")
    assert done.returncode == 3
    assert "cannot reach the gateway at http://127.0.0.1:9" in done.stderr
    assert "reach up" in done.stderr


async def test_with_tokens_only_the_caller_or_an_admin_reads_a_request(
    temporal_server: str, tmp_path: Path, http: httpx.AsyncClient, capability: str
) -> None:
    store = FileTokenStore(tmp_path / "tokens.json")
    tokens: dict[str, str] = {}
    for name, kind in [("alice", "caller"), ("bob", "caller"), ("ops", "admin")]:
        tokens[name], record = issue(name, kind)
        store.write(record)
    agent_token, record = issue("agents", "agent", [capability])
    store.write(record)
    stack = new_stack(temporal_server, tmp_path)
    gateway = await GatewayProcess(stack).ready()
    await Agent(gateway, "a-01", capability, env={"REACH_AGENT_TOKEN": agent_token}).ready()

    def auth(name: str) -> dict[str, str]:
        return {"Authorization": f"Bearer {tokens[name]}"}

    request_id = rid()
    r = await http.post(
        f"{gateway.url}/reach/invoke",
        json=body(capability, request_id=request_id),
        headers=auth("alice"),
    )
    assert r.status_code == 200, r.text
    path = f"{gateway.url}/reach/requests/{request_id}/timeline"
    assert (await http.get(path)).status_code == 401
    assert (await http.get(path, headers=auth("bob"))).status_code == 404
    mine = await http.get(path, headers=auth("alice"))
    assert mine.status_code == 200, mine.text
    assert mine.json()["events"][0]["detail"]["caller"] == "alice"
    assert (await http.get(path, headers=auth("ops"))).status_code == 200

    async def listed_for(name: str, **params: str) -> set[str]:
        r = await http.get(f"{gateway.url}/reach/requests", params=params, headers=auth(name))
        assert r.status_code == 200, r.text
        return {x["request_id"] for x in r.json()["requests"]}

    async def alice_sees_it() -> bool:
        return request_id in await listed_for("alice")

    await wait_until(alice_sees_it, 10)
    assert request_id in await listed_for("ops", caller="alice")
    assert request_id not in await listed_for("bob")
    assert request_id not in await listed_for("bob", caller="alice")  # never another's

    done = reach_cli(gateway.url, "requests")
    assert done.returncode == 1
    assert "REACH_TOKEN" in done.stderr
    done = reach_cli(gateway.url, "trace", request_id, "--json", token=tokens["alice"])
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["status"] == "success"
    gateway.proc.stop()
