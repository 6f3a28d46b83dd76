"""Payload encryption end to end: real dev server, real gateway processes, a real agent, and
the real `temporal` CLI reading history through the gateway's codec server.

What Temporal stores (read with a plain client, no codec) must not contain what was sent;
the gateway, the codec server and the CLI with `--codec-endpoint` must read it all back.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from google.protobuf import json_format
from google.protobuf.message import Message
from temporalio.api.common.v1 import Payload, Payloads
from temporalio.api.history.v1 import History
from temporalio.client import Client

from activities.codec import ENCODING, KEY_ID
from gateway_api.devserver import temporal_binary
from reach.security.crypto import new_key
from reach.security.tokens import FileTokenStore, issue
from tests.conftest import new_stack
from tests.helpers import GatewayProcess, start_agents, wait_until
from workflows.invoke import SA_CALLER, SA_CAPABILITY, SA_OPERATION, SA_STATUS

pytestmark = pytest.mark.integration

UI_ORIGIN = "http://localhost:8233"


def admin_token(tmp: Path) -> tuple[str, dict[str, str]]:
    """An admin token in a token file of this test's own, and the settings that use it. Invokes
    and agents stay open (auth.mode open); the codec endpoints always need an admin."""
    token, record = issue("codec-admin", "admin")
    FileTokenStore(tmp / "tokens.json").write(record)
    return token, {
        "REACH_AUTH__MODE": "open",
        "REACH_AUTH__TOKENS_FILE": str(tmp / "tokens.json"),
    }


def encryption_env(active: str, keys: dict[str, str]) -> dict[str, str]:
    return {
        "REACH_SECURITY__ENCRYPTION__ENABLED": "true",
        "REACH_SECURITY__ENCRYPTION__ACTIVE_KEY": active,
        "REACH_SECURITY__ENCRYPTION__KEYS": json.dumps(keys),
    }


@pytest.fixture(scope="module")
def admin(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, dict[str, str]]:
    return admin_token(tmp_path_factory.mktemp("auth"))


@pytest.fixture(scope="module")
async def enc_gateway(
    temporal_server: str,
    tmp_path_factory: pytest.TempPathFactory,
    admin: tuple[str, dict[str, str]],
) -> AsyncIterator[GatewayProcess]:
    """One gateway with encryption on (key k1) for the module."""
    stack = new_stack(
        temporal_server,
        tmp_path_factory.mktemp("enc"),
        extra={**encryption_env("k1", {"k1": new_key()}), **admin[1]},
    )
    async with GatewayProcess(stack) as gw:
        yield gw


def marker() -> str:
    return f"MARKER-{uuid.uuid4().hex}"


def query(capability: str, text: str, **extra: object) -> dict[str, object]:
    return {
        "target": capability,
        "operation": "query",
        "payload": {"text": text, "top_k": 1},
        "timeout_ms": 5000,
        **extra,
    }


async def raw_history(temporal: str, rid: str) -> History:
    """The history as Temporal stores it: a client without any codec."""
    client = await Client.connect(temporal)
    history = await client.get_workflow_handle(rid).fetch_history()
    return History(events=history.events)


def payloads_in(msg: Message, path: str = "") -> Iterator[tuple[str, Payload]]:
    """Every Payload anywhere inside `msg`, with the field path that holds it."""
    if isinstance(msg, Payload):
        yield path, msg
        return
    for field, value in msg.ListFields():
        if field.message_type is None:
            continue
        where = f"{path}.{field.name}"
        if field.message_type.GetOptions().map_entry:
            for key, item in value.items():
                if isinstance(item, Message):
                    yield from payloads_in(item, f"{where}[{key}]")
        elif field.is_repeated:
            for index, item in enumerate(value):
                yield from payloads_in(item, f"{where}[{index}]")
        else:
            yield from payloads_in(value, where)


def is_search_attribute(path: str) -> bool:
    return ".search_attributes." in path


def is_sdk_bookkeeping(path: str, payload: Payload) -> bool:
    """The SDK core's own record of a local activity (sequence number, type, attempt, times)
    beside its result, or of a patch (`workflow.patched`: its id); the result itself is a
    payload of ours, and sealed."""
    if ".marker_recorded_event_attributes.details[patch-data]." in path:
        return set(json.loads(payload.data)) <= {"id", "deprecated"}
    if ".marker_recorded_event_attributes.details[data]." not in path:
        return False
    return set(json.loads(payload.data)) <= {
        "seq",
        "attempt",
        "activity_id",
        "activity_type",
        "complete_time",
        "backoff",
        "original_schedule_time",
        "activation_index",
    }


def assert_sealed(history: History, *secrets: str) -> list[Payload]:
    """No secret anywhere in the stored history (its bytes and its JSON); every payload but
    the search attributes encrypted. Returns the encrypted payloads."""
    raw = history.SerializeToString()
    text = json_format.MessageToJson(history)
    for secret in secrets:
        assert secret.encode() not in raw, f"{secret} stored in the clear"
        assert secret not in text, f"{secret} stored in the clear"
    sealed = []
    for path, payload in payloads_in(history):
        if is_search_attribute(path) or is_sdk_bookkeeping(path, payload):
            assert payload.metadata["encoding"] == b"json/plain", path
            continue
        assert payload.metadata["encoding"] == ENCODING, f"{path} is not encrypted: {payload}"
        sealed.append(payload)
    assert sealed, "the history holds no payload at all"
    return sealed


async def codec_decode(
    http: httpx.AsyncClient, gateway: GatewayProcess, token: str, payloads: list[Payload]
) -> list[Payload]:
    r = await http.post(
        f"{gateway.url}/codec/decode",
        content=json_format.MessageToJson(Payloads(payloads=payloads)),
        headers={
            "Content-Type": "application/json",
            "X-Namespace": "default",
            "Authorization": f"Bearer {token}",
        },
    )
    assert r.status_code == 200, r.text
    return list(json_format.Parse(r.text, Payloads()).payloads)


async def listed(temporal: str, capability: str) -> list[str]:
    client = await Client.connect(temporal)
    return [wf.id async for wf in client.list_workflows(f'ReachCapability="{capability}"')]


async def test_history_holds_no_plaintext_and_the_codec_server_reads_it(
    enc_gateway: GatewayProcess,
    http: httpx.AsyncClient,
    capability: str,
    temporal_server: str,
    admin: tuple[str, dict[str, str]],
) -> None:
    token = admin[0]
    await start_agents(enc_gateway, capability, 1)
    secret = marker()
    rid = f"req-{uuid.uuid4().hex}"
    r = await http.post(
        f"{enc_gateway.url}/reach/invoke",
        headers={"X-Reach-Caller": "orchestrator"},
        json=query(capability, f"durable retries {secret}", request_id=rid),
    )
    # (e) The caller still gets the plaintext result.
    assert r.status_code == 200, r.text
    assert r.json()["status"] == "success"
    assert r.json()["result"]["request_id"] == rid
    assert r.json()["result"]["passages"]

    # (a) Temporal's copy has neither the payload nor anything else readable.
    history = await raw_history(temporal_server, rid)
    sealed = assert_sealed(history, secret)
    key_ids = {p.metadata[KEY_ID] for p in sealed}
    assert key_ids == {b"k1"}

    # (b) The codec server opens every one of them; the request's input is among them.
    decoded = await codec_decode(http, enc_gateway, token, sealed)
    assert len(decoded) == len(sealed)
    assert all(p.metadata["encoding"] != ENCODING for p in decoded)
    assert any(secret.encode() in p.data for p in decoded)

    # (e) The search attributes stay the index: a plain client finds the request by them.
    client = await Client.connect(temporal_server)
    sa = (await client.get_workflow_handle(rid).describe()).typed_search_attributes
    assert sa.get(SA_CAPABILITY) == capability
    assert sa.get(SA_CALLER) == "orchestrator"
    assert sa.get(SA_OPERATION) == "query"
    assert sa.get(SA_STATUS) == "success"

    async def found() -> bool:
        return rid in await listed(temporal_server, capability)

    await wait_until(found, 10)

    # The gateway itself reads the request back (its input and result through the codec).
    r = await http.get(f"{enc_gateway.url}/reach/requests/{rid}")
    assert r.status_code == 200, r.text
    assert r.json()["status"] == "success"
    assert r.json()["result"]["request_id"] == rid
    # ...and a repeat of the same request_id is compared with the (encrypted) original.
    again = await http.post(
        f"{enc_gateway.url}/reach/invoke",
        headers={"X-Reach-Caller": "orchestrator"},
        json=query(capability, f"durable retries {secret}", request_id=rid),
    )
    assert again.status_code == 200, again.text
    assert again.json()["result"] == r.json()["result"]
    other = await http.post(
        f"{enc_gateway.url}/reach/invoke",
        headers={"X-Reach-Caller": "orchestrator"},
        json=query(capability, "another body", request_id=rid),
    )
    assert other.status_code == 409, other.text

    # (c) The real CLI shows it through the codec endpoint, and not without it.
    shown = await cli_show(temporal_server, rid, f"{enc_gateway.url}/codec", token)
    assert secret in shown
    assert secret not in await cli_show(temporal_server, rid, None, None)


async def test_an_agent_error_message_is_sealed_too(
    enc_gateway: GatewayProcess,
    http: httpx.AsyncClient,
    capability: str,
    temporal_server: str,
    admin: tuple[str, dict[str, str]],
) -> None:
    """An agent's error can quote what it was sent: failure messages are encrypted as well."""
    await start_agents(enc_gateway, capability, 1)
    secret = marker()
    rid = f"req-{uuid.uuid4().hex}"
    r = await http.post(
        f"{enc_gateway.url}/reach/invoke",
        json={
            "request_id": rid,
            "target": capability,
            "operation": "fail",
            "payload": {"message": f"cannot index {secret}", "status": 422},
            "timeout_ms": 5000,
        },
    )
    assert r.status_code == 502, r.text
    assert r.json()["error"]["type"] == "agent_error"
    assert secret in r.text  # the caller reads the agent's own words
    history = await raw_history(temporal_server, rid)
    sealed = assert_sealed(history, secret)
    decoded = await codec_decode(http, enc_gateway, admin[0], sealed)
    assert any(secret.encode() in p.data for p in decoded)
    # The gateway reads the failure back whole (message and stack trace were sealed too).
    r = await http.get(f"{enc_gateway.url}/reach/requests/{rid}")
    assert r.status_code == 502, r.text
    assert r.json()["error"]["agent"]["message"] == f"cannot index {secret}"


async def cli_show(temporal: str, rid: str, codec_endpoint: str | None, token: str | None) -> str:
    codec = ["--codec-endpoint", codec_endpoint] if codec_endpoint else []
    if token:
        codec += ["--codec-auth", f"Bearer {token}"]
    proc = await asyncio.create_subprocess_exec(
        temporal_binary(),
        "workflow",
        "show",
        "--workflow-id",
        rid,
        "--address",
        temporal,
        *codec,
        "--output",
        "json",
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await asyncio.wait_for(proc.communicate(), 30)
    assert proc.returncode == 0, err.decode(errors="replace")
    return readable(out.decode())


def readable(cli_json: str) -> str:
    """The CLI's JSON with every base64 `data` field decoded alongside (the CLI prints a
    payload's data as JSON when it can, and as base64 otherwise)."""
    decoded: list[str] = []

    def visit(node: Any) -> None:
        if isinstance(node, dict):
            for key, value in node.items():
                if key == "data" and isinstance(value, str):
                    with contextlib.suppress(ValueError):
                        decoded.append(base64.b64decode(value).decode(errors="replace"))
                visit(value)
        elif isinstance(node, list):
            for item in node:
                visit(item)

    visit(json.loads(cli_json))
    return cli_json + "\n" + "\n".join(decoded)


async def test_ui_preflight_and_cors(
    enc_gateway: GatewayProcess, http: httpx.AsyncClient, admin: tuple[str, dict[str, str]]
) -> None:
    """(f) The Temporal UI (port 8233) may call the codec server from the browser, with an
    admin token; the preflight needs none."""
    r = await http.options(
        f"{enc_gateway.url}/codec/decode",
        headers={
            "Origin": UI_ORIGIN,
            "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "authorization,content-type,x-namespace",
        },
    )
    assert r.status_code == 204, r.text
    assert r.headers["access-control-allow-origin"] == UI_ORIGIN
    allowed = {h.strip().lower() for h in r.headers["access-control-allow-headers"].split(",")}
    assert {"authorization", "content-type", "x-namespace"} <= allowed
    assert "POST" in r.headers["access-control-allow-methods"]
    ui = {"Origin": UI_ORIGIN, "X-Namespace": "default"}
    bearer = {"Authorization": f"Bearer {admin[0]}"}
    r = await http.post(f"{enc_gateway.url}/codec/decode", json={"payloads": []}, headers=ui)
    assert r.status_code == 401, r.text
    assert r.headers["access-control-allow-origin"] == UI_ORIGIN  # the UI can say why
    r = await http.post(
        f"{enc_gateway.url}/codec/decode", json={"payloads": []}, headers=ui | bearer
    )
    assert r.status_code == 200, r.text
    assert r.json() == {}  # protobuf JSON leaves an empty list out
    assert r.headers["access-control-allow-origin"] == UI_ORIGIN
    r = await http.post(f"{enc_gateway.url}/codec/decode", content=b"{not json", headers=bearer)
    assert r.status_code == 422
    assert r.json()["error"]["type"] == "invalid_request"


async def test_rotation_keeps_old_requests_readable(
    temporal_server: str, tmp_path: Path, http: httpx.AsyncClient, capability: str
) -> None:
    """(d) Plain first, then k1, then k2 active with k1 kept: every request still reads."""
    k1, k2 = new_key(), new_key()
    token, auth = admin_token(tmp_path)
    stack = new_stack(temporal_server, tmp_path)
    secrets: dict[str, str] = {}

    async def run_phase(extra: dict[str, str], port: int | None) -> tuple[GatewayProcess, str]:
        stack.extra = {**extra, **auth}
        gateway = await GatewayProcess(stack, port=port).ready()
        # A capability (and so an agent log file) per phase: a fresh agent's readiness is read
        # from its own log.
        phase_capability = f"{capability}-{len(secrets)}"
        agents = await start_agents(gateway, phase_capability, 1)
        secret = marker()
        r = await http.post(f"{gateway.url}/reach/invoke", json=query(phase_capability, secret))
        assert r.status_code == 200, r.text
        for agent in agents:
            agent.proc.stop()
        rid: str = r.json()["request_id"]
        secrets[rid] = secret
        return gateway, rid

    def stop(gateway: GatewayProcess) -> None:
        gateway.proc.stop()

    plain_gw, rid_plain = await run_phase({}, None)
    history = await raw_history(temporal_server, rid_plain)
    # The control: without encryption the marker is right there in the stored bytes.
    assert secrets[rid_plain].encode() in history.SerializeToString()
    stop(plain_gw)

    gw1, rid_k1 = await run_phase(encryption_env("k1", {"k1": k1}), plain_gw.port)
    assert_sealed(await raw_history(temporal_server, rid_k1), secrets[rid_k1])
    stop(gw1)

    gw2, rid_k2 = await run_phase(encryption_env("k2", {"k1": k1, "k2": k2}), plain_gw.port)
    sealed = assert_sealed(await raw_history(temporal_server, rid_k2), secrets[rid_k2])
    assert {p.metadata[KEY_ID] for p in sealed} == {b"k2"}
    for rid in (rid_plain, rid_k1, rid_k2):
        r = await http.get(f"{gw2.url}/reach/requests/{rid}")
        assert r.status_code == 200, (rid, r.text)
        assert r.json()["status"] == "success"
        assert r.json()["result"]["request_id"] == rid
    # The codec server opens both generations.
    old = assert_sealed(await raw_history(temporal_server, rid_k1), secrets[rid_k1])
    decoded = await codec_decode(http, gw2, token, old + sealed)
    assert any(secrets[rid_k1].encode() in p.data for p in decoded)
    assert any(secrets[rid_k2].encode() in p.data for p in decoded)
    stop(gw2)
