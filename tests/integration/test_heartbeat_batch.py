"""Batched heartbeats (issue 29): many instances' reports in one message, on the gRPC Heartbeat
stream (HeartbeatRequest.batch) and over HTTP (POST /reach/heartbeats), each entry checked as a
single heartbeat is; and the gRPC Join's operation schemas (issue 28), as the HTTP Join's.
Real gateway processes (memory registry without tokens; Redis registry with tokens), real
grpcio clients, a real Redis under the module's own key prefix."""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import grpc
import httpx
import pytest

from agent_reach_proto import gateway_pb2 as pb
from tests.conftest import new_stack
from tests.helpers import GatewayProcess, wait_until
from tests.integration.test_auth import audit_lines, issue_cli

pytestmark = pytest.mark.integration

LISTENING = re.compile(r"gRPC front listening on 127\.0\.0\.1:(\d+)")


@dataclass
class Gateways:
    plain: GatewayProcess  # memory registry, tokens off
    secured: GatewayProcess  # Redis registry, tokens on
    tokens: dict[str, str]


def grpc_of(gateway: GatewayProcess) -> str:
    found = LISTENING.search(gateway.proc.output())
    assert found, gateway.proc.output()
    return f"127.0.0.1:{found[1]}"


@pytest.fixture(scope="module")
async def gateways(
    temporal_server: str, tmp_path_factory: pytest.TempPathFactory, module_redis_prefix: str
) -> AsyncIterator[Gateways]:
    plain_tmp, secured_tmp = tmp_path_factory.mktemp("beats"), tmp_path_factory.mktemp("beats-s")
    plain = GatewayProcess(new_stack(temporal_server, plain_tmp, heartbeat_timeout=30.0))
    secured_stack = new_stack(
        temporal_server,
        secured_tmp,
        registry="redis",
        key_prefix=module_redis_prefix,
        heartbeat_timeout=30.0,
        extra={"REACH_AUTH__MODE": "tokens"},
    )
    # Issued where this deployment keeps its tokens (with a Redis registry: in Redis).
    tokens = {
        name: issue_cli(secured_stack, "--principal", name, "--agent", "--capability", "*")[0]
        for name in ("owner", "intruder")
    }
    secured = GatewayProcess(secured_stack, "secured")
    try:
        await plain.ready()
        await secured.ready()
        yield Gateways(plain, secured, tokens)
    finally:
        plain.proc.stop()
        secured.proc.stop()


@pytest.fixture
def capability() -> str:
    return f"beat-{uuid.uuid4().hex[:8]}"


class Reach:
    def __init__(self, channel: grpc.aio.Channel) -> None:
        self.join = channel.unary_unary(
            "/reach.v1.Reach/Join",
            request_serializer=pb.JoinRequest.SerializeToString,
            response_deserializer=pb.JoinAck.FromString,
        )
        self.heartbeat = channel.stream_stream(
            "/reach.v1.Reach/Heartbeat",
            request_serializer=pb.HeartbeatRequest.SerializeToString,
            response_deserializer=pb.HeartbeatAck.FromString,
        )


def auth(token: str | None) -> tuple[tuple[str, str], ...] | None:
    return (("authorization", f"Bearer {token}"),) if token else None


async def statuses(
    http: httpx.AsyncClient, gateway: GatewayProcess, cap: str, token: str | None = None
) -> dict[str, Any]:
    headers = {"Authorization": f"Bearer {token}"} if token else None
    r = await http.get(f"{gateway.url}/reach/capabilities/{cap}", headers=headers)
    assert r.status_code == 200, r.text
    return {i["instance_id"]: i["status"] for i in r.json()["instances"]}


async def join_three(reach: Reach, cap: str, token: str | None = None) -> list[pb.JoinAck]:
    acks = []
    for n in range(3):
        request = pb.JoinRequest(
            capability=cap, instance_id=f"{cap}-{n}", service_address="127.0.0.1:9"
        )
        acks.append(await reach.join(request, metadata=auth(token)))
    return acks


@pytest.mark.parametrize("which", ["plain", "secured"])
async def test_a_grpc_batch_records_each_entry_and_refuses_bad_ones_alone(
    gateways: Gateways, http: httpx.AsyncClient, capability: str, which: str
) -> None:
    gateway = gateways.plain if which == "plain" else gateways.secured
    token = gateways.tokens["owner"] if which == "secured" else None
    async with grpc.aio.insecure_channel(grpc_of(gateway)) as channel:
        reach = Reach(channel)
        acks = await join_three(reach, capability, token)
        assert all(ack.session for ack in acks)  # the JoinAck carries the session now
        stream = reach.heartbeat(metadata=auth(token))
        first, second, third = (ack.instance_id for ack in acks)
        batch = pb.HeartbeatRequest(
            batch=[
                pb.HeartbeatRequest(instance_id=first, session=acks[0].session, inflight=3),
                pb.HeartbeatRequest(instance_id=second, status="unhealthy"),
                pb.HeartbeatRequest(instance_id="nobody-here"),
                pb.HeartbeatRequest(instance_id=third, session="not-its-session"),
                pb.HeartbeatRequest(instance_id=first, checks_json="{nope"),
                pb.HeartbeatRequest(instance_id=third, batch=[pb.HeartbeatRequest()]),
                pb.HeartbeatRequest(instance_id="no spaces allowed"),
            ]
        )
        await stream.write(batch)
        ack: pb.HeartbeatAck = await stream.read()
        assert ack.error_type == "", (ack.message, gateway.proc.output()[-3000:])
        got = [(a.instance_id, a.error_type, a.status) for a in ack.batch]
        assert got == [
            (first, "", "ok"),
            (second, "", "unhealthy"),
            ("nobody-here", "unknown_instance", ""),
            (third, "instance_replaced", ""),
            (first, "invalid_request", ""),
            (third, "invalid_request", ""),
            ("no spaces allowed", "invalid_request", ""),
        ]
        assert "checks_json is not valid JSON" in ack.batch[4].message
        assert ack.batch[0].heartbeat_interval > 0
        # Recorded: the unhealthy one is no longer routable, the others are.
        await wait_until(
            lambda: _is(statuses(http, gateway, capability, token), {second: "unhealthy"}), 10
        )
        # A single report still works on the same stream, session and all.
        await stream.write(pb.HeartbeatRequest(instance_id=second, session=acks[1].session))
        single: pb.HeartbeatAck = await stream.read()
        assert (single.instance_id, single.error_type, single.status) == (second, "", "ok")
        assert len(single.batch) == 0
        # Refused whole: too many entries, or a batch that also names an instance.
        many = [pb.HeartbeatRequest(instance_id=first)] * 1001
        await stream.write(pb.HeartbeatRequest(batch=many))
        too_many: pb.HeartbeatAck = await stream.read()
        assert (too_many.error_type, len(too_many.batch)) == ("payload_too_large", 0)
        assert "1001 entries" in too_many.message
        await stream.write(pb.HeartbeatRequest(instance_id=first, batch=many[:2]))
        mixed: pb.HeartbeatAck = await stream.read()
        assert mixed.error_type == "invalid_request"
        await stream.done_writing()
        assert await stream.code() == grpc.StatusCode.OK


async def _is(found: Any, wanted: dict[str, str]) -> bool:
    held = await found
    return all(held.get(k) == v for k, v in wanted.items())


async def test_an_agent_token_beats_only_its_own_instances_in_a_batch(
    gateways: Gateways, http: httpx.AsyncClient, capability: str
) -> None:
    """Over HTTP and gRPC alike: the intruder's entry for the owner's instance is refused
    (403, audited), its own entry in the same batch is recorded."""
    gateway, tokens = gateways.secured, gateways.tokens
    async with grpc.aio.insecure_channel(grpc_of(gateway)) as channel:
        reach = Reach(channel)
        owned = await join_three(reach, capability, tokens["owner"])
        own = pb.JoinRequest(
            capability=capability, instance_id=f"{capability}-x", service_address="127.0.0.1:9"
        )
        mine = await reach.join(own, metadata=auth(tokens["intruder"]))
        stream = reach.heartbeat(metadata=auth(tokens["intruder"]))
        entries = [
            pb.HeartbeatRequest(instance_id=owned[0].instance_id, status="unhealthy"),
            pb.HeartbeatRequest(instance_id=mine.instance_id, status="degraded"),
        ]
        await stream.write(pb.HeartbeatRequest(batch=entries))
        ack: pb.HeartbeatAck = await stream.read()
        await stream.done_writing()
    assert [(a.error_type, a.status) for a in ack.batch] == [("forbidden", ""), ("", "degraded")]

    headers = {"Authorization": f"Bearer {tokens['intruder']}"}
    body = [
        {"instance_id": owned[1].instance_id, "status": "unhealthy"},
        {"instance_id": mine.instance_id, "status": "ok", "checks": {"index": "loaded"}},
        {"instance_id": mine.instance_id, "status": "sleepy"},
        {"instance_id": mine.instance_id, "session": "someone-elses"},
        {"instance_id": mine.instance_id, "session": mine.session, "inflight": 2},
        "not an object",
        {"status": "ok"},
    ]
    r = await http.post(f"{gateway.url}/reach/heartbeats", json=body, headers=headers)
    assert r.status_code == 200, r.text
    answer = r.json()
    results = answer["results"]
    assert [
        (x["instance_id"], (x.get("error") or {}).get("type"), x["status"]) for x in results
    ] == [
        (owned[1].instance_id, "forbidden", None),
        (mine.instance_id, None, "ok"),
        (mine.instance_id, "invalid_request", None),
        (mine.instance_id, "instance_replaced", None),
        (mine.instance_id, None, "ok"),
        (None, "invalid_request", None),
        (None, "invalid_request", None),
    ]
    assert "body.2.status" in results[2]["error"]["message"]
    assert "body.6.instance_id" in results[6]["error"]["message"]
    assert (answer["recorded"], answer["refused"]) == (2, 5)
    # The owner's instances were never touched by the intruder's entries.
    held = await statuses(http, gateway, capability, tokens["owner"])
    assert held[owned[0].instance_id] == held[owned[1].instance_id] == "ok"
    theirs = {o.instance_id for o in owned}

    def refused() -> list[dict[str, Any]]:
        lines = audit_lines(gateway.stack)
        return [a for a in lines if a["event"] == "heartbeat_refused" and a["instance"] in theirs]

    await wait_until(lambda: len(refused()) == 2, 10)  # one over gRPC, one over HTTP
    assert {a["principal"] for a in refused()} == {"intruder"}

    # The body as a whole: not an array (422), too many entries (413), no token (401).
    r = await http.post(f"{gateway.url}/reach/heartbeats", json={"a": 1}, headers=headers)
    assert r.status_code == 422, r.text
    assert "JSON array" in r.json()["error"]["message"]
    many = [{"instance_id": mine.instance_id}] * 1001
    r = await http.post(f"{gateway.url}/reach/heartbeats", json=many, headers=headers)
    assert r.status_code == 413, r.text
    r = await http.post(f"{gateway.url}/reach/heartbeats", json=body[1:2])
    assert r.status_code == 401, r.text


async def test_a_grpc_join_declares_descriptions_and_input_schemas(
    gateways: Gateways, http: httpx.AsyncClient, capability: str
) -> None:
    """Stored as the HTTP Join stores them, shown by GET /reach/capabilities/{name} and the MCP
    front's tools/list; a schema that is not JSON, or past the bounds, is refused by name."""
    gateway = gateways.plain
    schema = {
        "type": "object",
        "properties": {"text": {"type": "string", "description": "what to look up"}},
        "required": ["text"],
    }
    async with grpc.aio.insecure_channel(grpc_of(gateway)) as channel:
        reach = Reach(channel)
        declared = pb.OperationDeclaration(
            name="lookup",
            idempotent=True,
            description="Look a text up in the index.",
            input_schema_json=json.dumps(schema),
        )
        await reach.join(
            pb.JoinRequest(
                capability=capability,
                instance_id=f"{capability}-0",
                service_address="127.0.0.1:9",
                declared_operations=[declared],
            )
        )
        refusals = []
        deep: Any = 1
        for _ in range(40):
            deep = [deep]
        bad_schemas = ["{nope", json.dumps({"a": deep}), json.dumps({"x": "y" * 70_000}), "[1]"]
        for bad in bad_schemas:
            wrong = pb.OperationDeclaration(name="lookup", input_schema_json=bad)
            join = pb.JoinRequest(
                capability=capability,
                instance_id=f"{capability}-1",
                service_address="127.0.0.1:9",
                declared_operations=[wrong],
            )
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await reach.join(join)
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            refusals.append(info.value.details() or "")
    assert "operations.0.input_schema_json is not valid JSON" in refusals[0]
    assert "input_schema nests deeper than 32 levels" in refusals[1]
    assert "input_schema is larger than 65536 bytes" in refusals[2]
    assert "operations.0.input_schema" in refusals[3]

    r = await http.get(f"{gateway.url}/reach/capabilities/{capability}")
    assert r.status_code == 200, r.text
    [instance] = r.json()["instances"]
    assert instance["declared"]["lookup"] == {
        "name": "lookup",
        "idempotent": True,
        "description": "Look a text up in the index.",
        "input_schema": schema,
    }
    rpc = {"jsonrpc": "2.0", "id": 1, "method": "tools/list", "params": {}}
    accept = {"Accept": "application/json, text/event-stream"}
    r = await http.post(f"{gateway.url}/mcp", json=rpc, headers=accept)
    assert r.status_code == 200, r.text
    tools = {t["name"]: t for t in r.json()["result"]["tools"]}
    tool = tools[f"{capability}.lookup"]
    assert tool["description"] == "Look a text up in the index."
    assert tool["inputSchema"] == schema


@pytest.mark.parametrize("which", ["plain", "secured"])
async def test_the_same_report_sent_again_is_answered_by_what_the_registry_holds_then(
    gateways: Gateways, http: httpx.AsyncClient, capability: str, which: str
) -> None:
    """A gateway keeps a single report as checked, by its bytes (an agent sends the same ones
    every interval): each repeat is still recorded on its own and checked against the
    registry and the token of its stream, so the same bytes are answered ok, then
    unknown_instance once the instance left, instance_replaced once another process joined
    it, and forbidden on another principal's stream every time."""
    gateway = gateways.plain if which == "plain" else gateways.secured
    token = gateways.tokens["owner"] if which == "secured" else None
    headers = {"Authorization": f"Bearer {token}"} if token else None
    async with grpc.aio.insecure_channel(grpc_of(gateway)) as channel:
        reach = Reach(channel)
        joined = (await join_three(reach, capability, token))[0]
        same = pb.HeartbeatRequest(
            instance_id=joined.instance_id, session=joined.session, checks_json='{"disk":1}'
        )
        stream = reach.heartbeat(metadata=auth(token))

        async def answer(on: Any = stream) -> tuple[str, str]:
            await on.write(same)
            ack: pb.HeartbeatAck = await on.read()
            return ack.error_type, ack.status

        assert await answer() == ("", "ok")
        assert await answer() == ("", "ok")
        if which == "secured":
            other = reach.heartbeat(metadata=auth(gateways.tokens["intruder"]))
            assert (await answer(other))[0] == "forbidden"
            assert (await answer(other))[0] == "forbidden"
            await other.done_writing()
        left = await http.delete(
            f"{gateway.url}/reach/agents/{joined.instance_id}", headers=headers
        )
        assert left.status_code == 204, left.text
        assert (await answer())[0] == "unknown_instance"
        again = await reach.join(
            pb.JoinRequest(
                capability=capability,
                instance_id=joined.instance_id,
                service_address="127.0.0.1:9",
            ),
            metadata=auth(token),
        )
        assert again.session != joined.session
        assert (await answer())[0] == "instance_replaced"
        await stream.done_writing()
        assert await stream.code() == grpc.StatusCode.OK


@pytest.mark.parametrize("which", ["plain", "secured"])
async def test_a_single_http_heartbeat_answers_as_its_route_did(
    gateways: Gateways, http: httpx.AsyncClient, capability: str, which: str
) -> None:
    """PUT /reach/agents/{id}/heartbeat is answered ahead of the framework (as POST
    /reach/invoke is): the same answer and envelopes, the token checked before the body, the
    same bytes checked against the registry each time, an id that is not one left to the
    route's own 422."""
    gateway = gateways.plain if which == "plain" else gateways.secured
    token = gateways.tokens["owner"] if which == "secured" else None
    owner = {"Authorization": f"Bearer {token}"} if token else {}
    async with grpc.aio.insecure_channel(grpc_of(gateway)) as channel:
        joined = (await join_three(Reach(channel), capability, token))[0]
    url = f"{gateway.url}/reach/agents/{joined.instance_id}/heartbeat"
    with_session = owner | {"X-Reach-Session": joined.session}
    for _ in range(2):  # the second: the same bytes again
        r = await http.put(url, content=b'{"status":"degraded"}', headers=with_session)
        assert r.status_code == 200, r.text
        assert r.json() == {
            "instance_id": joined.instance_id,
            "status": "degraded",
            "heartbeat_interval": joined.heartbeat_interval,
        }
    await wait_until(
        lambda: _is(statuses(http, gateway, capability, token), {joined.instance_id: "degraded"}),
        10,
    )
    r = await http.put(url, headers=owner | {"X-Reach-Session": "another"})
    assert (r.status_code, r.json()["error"]["type"]) == (409, "instance_replaced")
    r = await http.put(url, content=b"{nope", headers=owner)
    assert (r.status_code, r.json()["error"]["type"]) == (422, "invalid_request")
    r = await http.put(f"{gateway.url}/reach/agents/nobody-{capability}/heartbeat", headers=owner)
    assert (r.status_code, r.json()["error"]["type"]) == (404, "unknown_instance")
    r = await http.put(f"{gateway.url}/reach/agents/not%20an%20id/heartbeat", headers=owner)
    assert (r.status_code, r.json()["error"]["type"]) == (422, "invalid_request")
    if which == "secured":
        r = await http.put(url, content=b"{nope")  # no token: refused before the body is read
        assert (r.status_code, r.json()["error"]["type"]) == (401, "unauthorized")
        intruder = {"Authorization": f"Bearer {gateways.tokens['intruder']}"}
        for _ in range(2):
            r = await http.put(url, content=b'{"status":"degraded"}', headers=intruder)
            assert (r.status_code, r.json()["error"]["type"]) == (403, "forbidden")
