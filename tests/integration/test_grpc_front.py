"""The gateway's gRPC front (`reach.v1.Reach`, health, reflection) from a plain grpcio client,
against real gateway, agent and Temporal processes. Every refusal is compared with what the
HTTP API answers to the same request: the two doors must say the same thing."""

from __future__ import annotations

import asyncio
import base64
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import httpx
import pytest
from google.protobuf.descriptor_pool import DescriptorPool
from grpc_health.v1 import health_pb2
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import (
    ProtoReflectionDescriptorDatabase,
)

from agent_reach_proto import gateway_pb2 as pb
from gateway_api.devserver import command, free_port, wait_port
from gateway_api.grpc_wire import TRAILERS_MAX_BYTES, Refusal, fit_envelope
from tests.helpers import ROOT, CallbackReceiver, GatewayProcess, Stack, start_agents, wait_until

pytestmark = pytest.mark.integration

LISTENING = re.compile(r"gRPC front listening on 127\.0\.0\.1:(\d+)")
ERROR_KEY = "x-reach-error-bin"
HEALTH_SERVING = health_pb2.HealthCheckResponse.SERVING
HEALTH_NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


def grpc_stack(temporal: str, tmp: Path, **extra: str) -> Stack:
    """A test stack whose gateways bind their gRPC front on any free port (0)."""
    return Stack(
        temporal=temporal,
        tmp=tmp,
        task_queue=f"tq-{uuid.uuid4().hex[:12]}",
        extra={"REACH_TRANSPORT__PORTS__GRPC": "0", **extra},
    )


def front_address(gateway: GatewayProcess) -> str:
    """The bound port, as the gateway logs it (port 0 means any free port)."""
    found = LISTENING.search(gateway.proc.output())
    assert found, gateway.proc.output()
    return f"127.0.0.1:{found[1]}"


@dataclass
class Front:
    gateway: GatewayProcess
    address: str


@pytest.fixture(scope="module")
async def front(
    temporal_server: str, tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[Front]:
    gateway = GatewayProcess(grpc_stack(temporal_server, tmp_path_factory.mktemp("grpc-front")))
    try:
        await gateway.ready()
        yield Front(gateway, front_address(gateway))
    finally:
        gateway.proc.stop()


class Reach:
    """`reach.v1.Reach` as any grpcio client calls it: method paths and message classes."""

    def __init__(self, channel: grpc.aio.Channel) -> None:
        self.invoke = channel.unary_unary(
            "/reach.v1.Reach/Invoke",
            request_serializer=pb.InvokeRequest.SerializeToString,
            response_deserializer=pb.InvokeResponse.FromString,
        )
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
        self.check = channel.unary_unary(
            "/grpc.health.v1.Health/Check",
            request_serializer=health_pb2.HealthCheckRequest.SerializeToString,
            response_deserializer=health_pb2.HealthCheckResponse.FromString,
        )
        self.watch = channel.unary_stream(
            "/grpc.health.v1.Health/Watch",
            request_serializer=health_pb2.HealthCheckRequest.SerializeToString,
            response_deserializer=health_pb2.HealthCheckResponse.FromString,
        )


@pytest.fixture
async def reach(front: Front) -> AsyncIterator[Reach]:
    async with grpc.aio.insecure_channel(front.address) as channel:
        yield Reach(channel)


@dataclass
class Refused:
    code: grpc.StatusCode
    details: str
    envelope: dict[str, Any]
    trailing: dict[str, str | bytes]


async def refused(call: Any) -> Refused:
    """The status a call ended with, and the HTTP envelope from its trailing metadata."""
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await call
    return refusal(info.value)


def refusal(err: grpc.aio.AioRpcError) -> Refused:
    trailing = dict(err.trailing_metadata() or ())
    raw = trailing.get(ERROR_KEY)
    assert isinstance(raw, bytes), (err.code(), err.details(), trailing)
    return Refused(err.code(), err.details() or "", json.loads(raw), trailing)


def query(capability: str, **fields: Any) -> pb.InvokeRequest:
    defaults: dict[str, Any] = {
        "operation": "query",
        "payload_json": json.dumps({"text": "durable retries", "top_k": 2}),
        "timeout_ms": 5000,
    }
    return pb.InvokeRequest(target=capability, **{**defaults, **fields})


# -- Invoke -----------------------------------------------------------------------------------


async def test_invoke_reaches_a_real_agent_with_the_callers_metadata(
    front: Front, reach: Reach, http: httpx.AsyncClient, capability: str
) -> None:
    agents = await start_agents(front.gateway, capability, 1)
    rid = f"req-{uuid.uuid4().hex}"
    answer: pb.InvokeResponse = await reach.invoke(
        query(capability, request_id=rid), metadata=(("x-reach-caller", "grpc-caller"),)
    )
    assert answer.request_id == rid
    assert answer.status == "success"
    assert answer.instance_id == agents[0].instance_id
    assert answer.HasField("duration_ms")
    result = json.loads(answer.result_json)
    assert result["request_id"] == rid
    assert len(result["passages"]) == 2
    # The same request, read back over HTTP: one request, whichever door it came through.
    status = await http.get(f"{front.gateway.url}/reach/requests/{rid}")
    assert status.json()["result"] == result
    assert "query from grpc-caller" in agents[0].proc.output()

    # The Idempotency-Key metadata reaches the agent like the HTTP header does.
    created: pb.InvokeResponse = await reach.invoke(
        pb.InvokeRequest(target=capability, operation="create"),
        metadata=(("idempotency-key", "note-key-1"),),
    )
    assert created.status == "success"
    await wait_until(lambda: _true("key note-key-1" in agents[0].proc.output()), 5)


async def _true(value: bool) -> bool:
    return value


async def test_invoke_with_a_callback_is_accepted_and_delivered(
    front: Front, reach: Reach, capability: str
) -> None:
    await start_agents(front.gateway, capability, 1)
    async with CallbackReceiver() as receiver:
        rid = f"req-{uuid.uuid4().hex}"
        answer: pb.InvokeResponse = await reach.invoke(
            query(capability, request_id=rid, callback=receiver.url)
        )
        assert (answer.request_id, answer.status, answer.result_json) == (rid, "accepted", "")
        await receiver.wait(1)
        assert len(receiver.received) == 1
        envelope = receiver.received[0][1]
        assert (envelope["request_id"], envelope["status"]) == (rid, "success")


@pytest.mark.parametrize(
    ("fields", "metadata", "headers"),
    [
        ({"target": "Not A Name", "operation": "query"}, {}, {}),
        ({"target": "some-cap"}, {}, {}),  # operation: Field required
        ({"target": "some-cap", "operation": "query", "timeout_ms": 0}, {}, {}),
        ({"target": "some-cap", "operation": "q", "callback": "ftp://x"}, {}, {}),
        ({"target": "some-cap", "operation": "q"}, {"x-reach-caller": "two words"}, None),
        ({"target": "some-cap", "operation": "q"}, {"traceparent": "00-zz"}, None),
        (
            {"target": "some-cap", "operation": "q", "idempotency_key": "a"},
            {"idempotency-key": "b"},
            None,
        ),
        ({"target": "some-cap", "operation": "q", "payload_json": "[1, 2]"}, {}, {}),
        # A lone surrogate has no UTF-8: refused with the HTTP API's words for it.
        ({"target": "some-cap", "operation": "q", "payload_json": '{"t": "\\ud800"}'}, {}, {}),
    ],
)
async def test_invalid_invoke_is_invalid_argument_with_the_http_envelope(
    front: Front,
    reach: Reach,
    http: httpx.AsyncClient,
    fields: dict[str, Any],
    metadata: dict[str, str],
    headers: dict[str, str] | None,
) -> None:
    """Same rules, same words: the gRPC envelope is byte for byte what HTTP answers."""
    got = await refused(reach.invoke(pb.InvokeRequest(**fields), metadata=tuple(metadata.items())))
    # The same request as an HTTP body, the payload spliced in as written (escapes kept).
    http_body = {k: v for k, v in fields.items() if k != "payload_json"}
    raw = json.dumps(http_body)
    if "payload_json" in fields:
        raw = raw[:-1] + f', "payload": {fields["payload_json"]}}}'
    r = await http.post(
        f"{front.gateway.url}/reach/invoke",
        content=raw.encode(),
        headers={
            "Content-Type": "application/json",
            **(metadata if headers is None else headers),
        },
    )
    assert r.status_code == 422, r.text
    assert got.code == grpc.StatusCode.INVALID_ARGUMENT
    assert got.envelope == r.json()
    assert got.details == got.envelope["error"]["message"]


async def test_a_bad_json_field_is_refused_by_name(reach: Reach) -> None:
    for payload_json, words in (
        ("{not json", "payload_json is not valid JSON"),
        ('{"a": ' + "[" * 300 + "]" * 300 + "}", "payload is nested more than 64 levels deep"),
        ("[" * 100_000 + "]" * 100_000, "payload_json is nested more than 64 levels deep"),
        ('{"x": NaN}', "NaN is not a JSON number"),
    ):
        got = await refused(
            reach.invoke(pb.InvokeRequest(target="a", operation="q", payload_json=payload_json))
        )
        assert got.code == grpc.StatusCode.INVALID_ARGUMENT
        assert words in got.details, got.details
        assert got.envelope["error"]["type"] == "invalid_request"


async def test_a_payload_over_the_limit_is_resource_exhausted_as_413(
    front: Front, reach: Reach, http: httpx.AsyncClient
) -> None:
    big = {"blob": "x" * (1024 * 1024)}
    got = await refused(
        reach.invoke(pb.InvokeRequest(target="a", operation="q", payload_json=json.dumps(big)))
    )
    r = await http.post(
        f"{front.gateway.url}/reach/invoke", json={"target": "a", "operation": "q", "payload": big}
    )
    assert r.status_code == 413
    assert got.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert got.envelope == r.json()


async def test_unknown_capability_is_not_found(
    front: Front, reach: Reach, http: httpx.AsyncClient
) -> None:
    rid = f"req-{uuid.uuid4().hex}"
    target = f"nobody-{uuid.uuid4().hex[:6]}"
    got = await refused(
        reach.invoke(pb.InvokeRequest(request_id=rid, target=target, operation="q"))
    )
    r = await http.post(
        f"{front.gateway.url}/reach/invoke",
        json={"request_id": rid, "target": target, "operation": "q"},
    )
    assert r.status_code == 404
    assert got.code == grpc.StatusCode.NOT_FOUND
    assert got.envelope == r.json()
    assert got.envelope["error"]["type"] == "unknown_capability"
    assert got.trailing["x-reach-request-id"] == rid


async def test_an_agents_error_is_unknown_with_its_own_words_inside(
    front: Front, reach: Reach, capability: str
) -> None:
    await start_agents(front.gateway, capability, 1)
    rid = f"req-{uuid.uuid4().hex}"
    got = await refused(
        reach.invoke(
            pb.InvokeRequest(
                request_id=rid,
                target=capability,
                operation="fail",
                payload_json=json.dumps({"message": "the index is gone", "status": 422}),
            )
        )
    )
    assert got.code == grpc.StatusCode.UNKNOWN  # 502 agent_error
    assert got.envelope["request_id"] == rid
    assert got.envelope["status"] == "error"
    error = got.envelope["error"]
    assert error["type"] == "agent_error"
    assert (error["agent"]["type"], error["agent"]["message"]) == (
        "index_unavailable",
        "the index is gone",
    )
    assert got.details == error["message"]


def wire_size(err: grpc.aio.AioRpcError) -> int:
    """The trailers as a gRPC client counts them against its 8 KiB default: name, value and 32
    bytes an entry, grpc-message percent-encoded, -bin values base64 (the worst case)."""
    details = (err.details() or "").encode()
    size = (
        len("grpc-message") + 32 + sum(1 if 0x20 <= b <= 0x7E and b != 0x25 else 3 for b in details)
    )
    for key, value in err.trailing_metadata() or ():
        length = len(base64.b64encode(value)) if isinstance(value, bytes) else len(value)
        size += len(key) + length + 32
    return size


@pytest.mark.parametrize("char", ["中", "😀"])
async def test_an_agents_long_non_ascii_error_still_arrives_with_its_envelope(
    front: Front, reach: Reach, http: httpx.AsyncClient, capability: str, char: str
) -> None:
    """Percent-encoded details plus the envelope would pass gRPC's trailer limits (8 KiB soft,
    16 KiB hard): RESOURCE_EXHAUSTED "received metadata size exceeds", no verdict at all."""
    await start_agents(front.gateway, capability, 1)
    words = char * 1000
    payload_json = json.dumps({"message": words, "status": 422})

    async def one() -> tuple[str, Refused, int]:
        rid = f"req-{uuid.uuid4().hex}"
        request = pb.InvokeRequest(
            request_id=rid, target=capability, operation="fail", payload_json=payload_json
        )
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await reach.invoke(request)
        return rid, refusal(info.value), wire_size(info.value)

    for rid, got, size in await asyncio.gather(*(one() for _ in range(20))):
        assert got.code == grpc.StatusCode.UNKNOWN, got.details  # 502 agent_error
        assert size < 6 * 1024
        assert len(got.details.encode()) <= 1024
        assert got.details.endswith("…")
        error = got.envelope["error"]
        assert (got.envelope["request_id"], got.envelope["status"]) == (rid, "error")
        assert (error["type"], error["retryable"]) == ("agent_error", False)
        assert error["agent"]["type"] == "index_unavailable"
        assert error["agent"]["message"].startswith(char * 50)
    # The whole envelope is still there to read over HTTP.
    full = (await http.get(f"{front.gateway.url}/reach/requests/{rid}")).json()
    assert full["error"]["agent"]["message"] == words
    assert full["error"]["message"].startswith(got.details.removesuffix("…"))


def test_a_refusals_trailers_stay_within_what_grpc_clients_take() -> None:
    """Every string long, in 4-byte characters: the envelope is cut to fit, fields kept."""
    long = "😀" * 2000
    envelope = {
        "request_id": "req-1",
        "status": "error",
        "error": {
            "type": "agent_error",
            "message": long,
            "retryable": False,
            "agent": {"type": "x", "message": long, "status": 500},
        },
        "delivery": {"url": "http://h/" + "p" * 2000, "status": "failed", "attempts": 3},
    }
    details, trailing = Refusal(503, long, envelope).trailers()
    entries = dict(trailing)
    raw = entries["x-reach-error-bin"]
    assert isinstance(raw, bytes)
    size = len("grpc-message") + 32 + 3 * len(details.encode())
    size += sum(
        len(k) + len(base64.b64encode(v) if isinstance(v, bytes) else v) + 32 for k, v in trailing
    )
    assert size + 256 <= TRAILERS_MAX_BYTES
    assert entries["x-reach-request-id"] == "req-1"
    assert entries["grpc-retry-pushback-ms"] == "1000"
    cut = json.loads(raw)
    assert cut["error"]["message"].startswith("😀" * 10)
    assert cut["error"]["message"].endswith("…")
    assert cut["error"]["agent"]["status"] == 500
    assert cut["delivery"]["attempts"] == 3
    # An envelope that fits is sent untouched, and so are its details.
    small = {"request_id": None, "status": "error", "error": {"type": "t", "message": "m"}}
    details, trailing = Refusal(422, "m", small).trailers()
    assert (details, json.loads(dict(trailing)["x-reach-error-bin"])) == ("m", small)
    assert json.loads(fit_envelope({"s": "\ud800x"}, 100)) == {"s": "?x"}
    # Many short strings: only what says what happened is kept.
    crowded = {**small, "request_id": "req-2", "result": {"k": ["v" * 8] * 2000}}
    kept = json.loads(fit_envelope(crowded, 2000))
    assert kept == {k: v for k, v in crowded.items() if k != "result"}


async def test_the_requests_own_timeout_is_deadline_exceeded_with_the_envelope(
    front: Front, reach: Reach, capability: str
) -> None:
    await start_agents(front.gateway, capability, 1, "--delay-ms", "3000")
    got = await refused(reach.invoke(query(capability, timeout_ms=300)))
    assert got.code == grpc.StatusCode.DEADLINE_EXCEEDED  # 504: Reach's verdict, with envelope
    assert got.envelope["status"] == "timeout"
    assert got.envelope["error"]["type"] == "timeout"


async def test_a_shorter_grpc_deadline_leaves_the_request_running(
    front: Front, reach: Reach, http: httpx.AsyncClient, capability: str
) -> None:
    """The caller's own deadline passes first: it hears DEADLINE_EXCEEDED from its library (no
    envelope), learns the request id from the initial metadata, and the request carries on."""
    await start_agents(front.gateway, capability, 1, "--delay-ms", "1500")
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await reach.invoke(query(capability), timeout=0.5)
    err = info.value
    assert err.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert ERROR_KEY not in dict(err.trailing_metadata() or ())
    rid = dict(err.initial_metadata() or ())["x-reach-request-id"]
    assert isinstance(rid, str)
    assert rid.startswith("req-")

    async def succeeded() -> bool:
        r = await http.get(f"{front.gateway.url}/reach/requests/{rid}")
        return r.json()["status"] == "success"

    await wait_until(succeeded, 10)
    # Asking again with the same id attaches to the finished request.
    again: pb.InvokeResponse = await reach.invoke(query(capability, request_id=rid))
    assert (again.request_id, again.status) == (rid, "success")


# -- Join and Heartbeat ----------------------------------------------------------------------


async def test_join_then_a_heartbeat_stream(
    front: Front, reach: Reach, http: httpx.AsyncClient, capability: str
) -> None:
    instance = f"{capability}-grpc-01"
    ack: pb.JoinAck = await reach.join(
        pb.JoinRequest(
            capability=capability,
            instance_id=instance,
            protocol="http",
            service_address="127.0.0.1:9",
            heartbeat_interval=60,
            operations=["query"],
            max_message_bytes=1 << 30,
            labels={"zone": "a"},
        )
    )
    assert (ack.instance_id, ack.capability) == (instance, capability)
    assert ack.heartbeat_timeout == 3.0  # the test stack's setting
    assert ack.heartbeat_interval == 1.5  # clamped: two heartbeats fit in one timeout
    assert ack.max_message_bytes == 1024 * 1024  # the smaller of the two
    listed = (await http.get(f"{front.gateway.url}/reach/capabilities/{capability}")).json()
    assert [(i["instance_id"], i["labels"]) for i in listed["instances"]] == [
        (instance, {"zone": "a"})
    ]

    async def routable() -> int:
        r = await http.get(f"{front.gateway.url}/reach/capabilities")
        return {c["name"]: c["routable"] for c in r.json()["capabilities"]}[capability]

    stream = reach.heartbeat()

    async def report(**fields: Any) -> pb.HeartbeatAck:
        await stream.write(pb.HeartbeatRequest(**fields))
        ack: pb.HeartbeatAck = await stream.read()
        return ack

    ok = await report(instance_id=instance, checks_json='{"index": "loaded"}', inflight=2)
    assert (ok.instance_id, ok.error_type, ok.message) == (instance, "", "")
    assert ok.status == "ok"
    assert ok.heartbeat_interval > 0
    assert await routable() == 1
    unknown = await report(instance_id="nobody-here")
    assert (unknown.instance_id, unknown.error_type) == ("nobody-here", "unknown_instance")
    invalid = await report(instance_id=instance, status="sleepy")
    assert invalid.error_type == "invalid_request"
    assert "status" in invalid.message
    garbage = await report(instance_id=instance, checks_json="{nope")
    assert garbage.error_type == "invalid_request"
    assert "checks_json is not valid JSON" in garbage.message
    bad_id = await report(instance_id="no spaces allowed")
    assert bad_id.error_type == "invalid_request"
    assert "instance_id" in bad_id.message
    # The stream carried on after every refusal, and each report is recorded.
    sick = await report(instance_id=instance, status="unhealthy")
    assert (sick.error_type, sick.status) == ("", "unhealthy")
    assert await routable() == 0
    well = await report(instance_id=instance)  # empty status: ok
    assert well.error_type == ""
    assert await routable() == 1
    await stream.done_writing()
    assert await stream.read() == grpc.aio.EOF
    assert await stream.code() == grpc.StatusCode.OK


async def test_join_declares_operations_as_the_http_api_does(
    front: Front, reach: Reach, http: httpx.AsyncClient, capability: str
) -> None:
    """`declared_operations` are the HTTP body's object entries, after the plain names."""
    instance = f"{capability}-grpc-02"
    await reach.join(
        pb.JoinRequest(
            capability=capability,
            instance_id=instance,
            service_address="127.0.0.1:9",
            operations=["stats"],
            declared_operations=[
                pb.OperationDeclaration(name="query", idempotent=True, timeout_ms=3000),
                pb.OperationDeclaration(name="index", idempotent=False),
                pb.OperationDeclaration(name="warm"),
            ],
        )
    )
    listed = (await http.get(f"{front.gateway.url}/reach/capabilities/{capability}")).json()
    assert [(i["operations"], i["declared"]) for i in listed["instances"]] == [
        (
            ["stats", "query", "index", "warm"],
            {
                "query": {"name": "query", "idempotent": True, "timeout_ms": 3000},
                "index": {"name": "index", "idempotent": False},
            },
        )
    ]
    # A name in both lists is refused as HTTP refuses it, with the same envelope.
    twice = pb.JoinRequest(
        capability=capability,
        instance_id=instance,
        service_address="127.0.0.1:9",
        operations=["query"],
        declared_operations=[pb.OperationDeclaration(name="query", timeout_ms=3000)],
    )
    got = await refused(reach.join(twice))
    r = await http.post(
        f"{front.gateway.url}/reach/agents",
        json={
            "capability": capability,
            "instance_id": instance,
            "service_address": "127.0.0.1:9",
            "operations": ["query", {"name": "query", "timeout_ms": 3000}],
        },
    )
    assert r.status_code == 422, r.text
    assert got.code == grpc.StatusCode.INVALID_ARGUMENT
    assert got.details == "operations: Value error, operation 'query' is listed more than once"
    assert got.envelope == r.json()
    unnamed = pb.JoinRequest(
        capability=capability,
        instance_id=instance,
        service_address="127.0.0.1:9",
        operations=["query"],
        declared_operations=[pb.OperationDeclaration(timeout_ms=5)],
    )
    got = await refused(reach.join(unnamed))
    assert got.code == grpc.StatusCode.INVALID_ARGUMENT
    assert got.details == "operations.1.name: Field required"


async def test_join_carries_weight_and_max_inflight(
    front: Front, reach: Reach, http: httpx.AsyncClient, capability: str
) -> None:
    """Stored as HTTP stores them; set but out of range (0 is not unset) is refused by name."""
    await reach.join(
        pb.JoinRequest(
            capability=capability,
            instance_id=f"{capability}-w3",
            service_address="127.0.0.1:9",
            weight=3,
            max_inflight=5,
        )
    )
    await reach.join(
        pb.JoinRequest(
            capability=capability, instance_id=f"{capability}-w1", service_address="127.0.0.1:9"
        )
    )
    listed = (await http.get(f"{front.gateway.url}/reach/capabilities/{capability}")).json()
    assert sorted(
        (i["instance_id"], i["weight"], i["max_inflight"]) for i in listed["instances"]
    ) == [
        (f"{capability}-w1", 1, None),
        (f"{capability}-w3", 3, 5),
    ]
    for name in ("weight", "max_inflight"):
        body: dict[str, Any] = {
            "capability": capability,
            "instance_id": f"{capability}-w0",
            "service_address": "127.0.0.1:9",
            name: 0,
        }
        got = await refused(reach.join(pb.JoinRequest(**body)))
        r = await http.post(f"{front.gateway.url}/reach/agents", json=body)
        assert r.status_code == 422, r.text
        assert got.code == grpc.StatusCode.INVALID_ARGUMENT
        assert got.details.startswith(f"{name}: "), got.details
        assert got.envelope == r.json()


@pytest.mark.parametrize(
    "fields",
    [
        {
            "capability": "x",
            "instance_id": "x-1",
            "protocol": "carrier-pigeon",
            "service_address": "127.0.0.1:1",
        },
        {"instance_id": "x-1", "service_address": "127.0.0.1:1"},  # capability: Field required
        {"capability": "x", "instance_id": "x-1", "service_address": "not an address"},
        {
            "capability": "x",
            "instance_id": "x-1",
            "service_address": "h:1",
            "heartbeat_interval": 0,
        },
    ],
)
async def test_invalid_join_is_invalid_argument_with_the_http_envelope(
    front: Front, reach: Reach, http: httpx.AsyncClient, fields: dict[str, Any]
) -> None:
    got = await refused(reach.join(pb.JoinRequest(**fields)))
    r = await http.post(f"{front.gateway.url}/reach/agents", json=fields)
    assert r.status_code == 422, r.text
    assert got.code == grpc.StatusCode.INVALID_ARGUMENT
    assert got.envelope == r.json()
    if fields.get("protocol") == "carrier-pigeon":
        assert "known: " in got.details
        assert "http" in got.details


@pytest.mark.parametrize(
    ("method", "data", "words"),
    [
        ("Invoke", b"\xff\xff\xff\xff", "not a valid reach.v1.InvokeRequest"),
        ("Invoke", b"\x12\x03\xff\xfe\xfd\x1a\x05query", "UTF-8"),  # target: bad UTF-8
        ("Join", b"\x0a\x02\xff\xfe", "UTF-8"),
        ("Join", b"\x0a", "not a valid reach.v1.JoinRequest"),  # truncated
    ],
)
async def test_bytes_that_are_not_the_message_are_invalid_argument_with_the_envelope(
    front: Front, http: httpx.AsyncClient, method: str, data: bytes, words: str
) -> None:
    """As HTTP answers a body that is not JSON: 422 invalid_request, no request id."""
    async with grpc.aio.insecure_channel(front.address) as channel:
        call: grpc.aio.UnaryUnaryMultiCallable[bytes, bytes] = channel.unary_unary(
            f"/reach.v1.Reach/{method}"
        )
        got = await refused(call(data))
    assert got.code == grpc.StatusCode.INVALID_ARGUMENT
    assert words in got.details
    route = "/reach/invoke" if method == "Invoke" else "/reach/agents"
    r = await http.post(f"{front.gateway.url}{route}", content=b"\xff{")
    assert r.status_code == 422
    assert set(got.envelope) == set(r.json())
    assert got.envelope == {**r.json(), "error": {**r.json()["error"], "message": got.details}}


@pytest.mark.parametrize("interval", [float("nan"), float("inf"), float("-inf")])
async def test_a_join_with_a_non_finite_interval_is_refused_by_name(
    reach: Reach, interval: float
) -> None:
    request = pb.JoinRequest(
        capability="x",
        instance_id="x-1",
        service_address="127.0.0.1:1",
        heartbeat_interval=interval,
    )
    got = await refused(reach.join(request))
    assert got.code == grpc.StatusCode.INVALID_ARGUMENT
    assert got.details == "heartbeat_interval is not a finite number"
    assert got.envelope["error"]["type"] == "invalid_request"


async def test_a_malformed_heartbeat_report_is_acked_and_the_stream_goes_on(
    front: Front, reach: Reach, capability: str
) -> None:
    instance = f"{capability}-hb-01"
    await reach.join(
        pb.JoinRequest(capability=capability, instance_id=instance, service_address="127.0.0.1:9")
    )
    async with grpc.aio.insecure_channel(front.address) as channel:
        beats: grpc.aio.StreamStreamMultiCallable[bytes, bytes] = channel.stream_stream(
            "/reach.v1.Reach/Heartbeat"
        )
        stream = beats()

        async def report(raw: bytes) -> pb.HeartbeatAck:
            await stream.write(raw)
            answer = await stream.read()
            assert isinstance(answer, bytes)
            return pb.HeartbeatAck.FromString(answer)

        good = pb.HeartbeatRequest(instance_id=instance).SerializeToString()
        assert (await report(good)).status == "ok"
        for bad in (b"\x0a\x02\xff\xfe", b"\xff\xff\xff\xff"):
            refused_ack = await report(bad)
            assert (refused_ack.instance_id, refused_ack.error_type) == ("", "invalid_request")
            assert "reach.v1.HeartbeatRequest" in refused_ack.message
        again = await report(good)
        assert (again.instance_id, again.error_type, again.status) == (instance, "", "ok")
        await stream.done_writing()
        assert await stream.read() == grpc.aio.EOF
        assert await stream.code() == grpc.StatusCode.OK


# -- health and reflection -------------------------------------------------------------------


async def test_health_serves_the_gateway_and_reflection_lists_the_services(
    front: Front, reach: Reach
) -> None:
    for service in ("", "reach.v1.Reach"):
        answer = await reach.check(health_pb2.HealthCheckRequest(service=service))
        assert answer.status == HEALTH_SERVING, service
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await reach.check(health_pb2.HealthCheckRequest(service="no.such.Service"))
    assert info.value.code() == grpc.StatusCode.NOT_FOUND

    def reflect() -> tuple[list[str], list[str]]:
        with grpc.insecure_channel(front.address) as channel:
            database = ProtoReflectionDescriptorDatabase(channel)
            services = list(database.get_services())
            pool = DescriptorPool(database)
            methods = [m.name for m in pool.FindServiceByName("reach.v1.Reach").methods]
            return services, methods

    services, methods = await asyncio.to_thread(reflect)
    assert set(services) == {
        "reach.v1.Reach",
        "grpc.health.v1.Health",
        "grpc.reflection.v1alpha.ServerReflection",
    }
    assert methods == ["Invoke", "Join", "Heartbeat"]


class OwnTemporal:
    """A dev server this test stops and starts, spawned without `DevServer`'s preexec_fn: once
    grpc's threads run in this process, Python code between fork and exec can hang the child."""

    def __init__(self, tmp: Path) -> None:
        self.port = free_port()
        self.address = f"127.0.0.1:{self.port}"
        self.cmd = command(str(tmp / "t.db"), self.port, None)
        self.log = tmp / "temporal.log"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        with self.log.open("ab") as out:
            self.proc = subprocess.Popen(
                self.cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
            )
        wait_port(self.port, 30)

    def signal(self, sig: int) -> None:
        assert self.proc is not None
        os.killpg(self.proc.pid, sig)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.signal(signal.SIGCONT)
            self.signal(signal.SIGTERM)
            self.proc.wait(30)


async def test_health_follows_temporal_down_and_back(tmp_path: Path) -> None:
    """Its own Temporal server, under a running gateway: stopped and started again, then stuck
    (SIGSTOP: connections accepted, never answered) and resumed."""
    temporal = OwnTemporal(tmp_path)
    temporal.start()
    try:
        stack = grpc_stack(temporal.address, tmp_path, REACH_TEMPORAL__RPC_TIMEOUT_S="1")
        gateway = await GatewayProcess(stack).ready()
        async with grpc.aio.insecure_channel(front_address(gateway)) as channel:
            reach = Reach(channel)
            watch = reach.watch(health_pb2.HealthCheckRequest(service=""))
            assert (await watch.read()).status == HEALTH_SERVING

            temporal.stop()
            assert (await asyncio.wait_for(watch.read(), 10)).status == HEALTH_NOT_SERVING
            named = await reach.check(health_pb2.HealthCheckRequest(service="reach.v1.Reach"))
            assert named.status == HEALTH_NOT_SERVING
            temporal.start()
            assert (await asyncio.wait_for(watch.read(), 30)).status == HEALTH_SERVING

            temporal.signal(signal.SIGSTOP)
            assert (await asyncio.wait_for(watch.read(), 10)).status == HEALTH_NOT_SERVING
            # A call that needs Temporal now: 503 unavailable within the RPC timeout, and a hint
            # to retry in a second.
            started = time.monotonic()
            got = await refused(reach.invoke(pb.InvokeRequest(target="anyone", operation="q")))
            assert time.monotonic() - started < 4
            assert got.code == grpc.StatusCode.UNAVAILABLE
            assert got.envelope["error"]["type"] == "unavailable"
            assert got.envelope["error"]["retryable"] is True
            assert got.trailing["grpc-retry-pushback-ms"] == "1000"
            temporal.signal(signal.SIGCONT)
            assert (await asyncio.wait_for(watch.read(), 30)).status == HEALTH_SERVING
            named = await reach.check(health_pb2.HealthCheckRequest(service="reach.v1.Reach"))
            assert named.status == HEALTH_SERVING
            watch.cancel()
        gateway.proc.stop()
        log = gateway.proc.output()
        assert log.count("gRPC health: NOT_SERVING (temporal not answering)") == 2
        assert log.count("gRPC health: SERVING") == 2
        assert "gRPC front stopped" in log
        assert "Traceback" not in log
    finally:
        temporal.stop()


# -- port and start-up -----------------------------------------------------------------------


def _clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("REACH_", "TEMPORAL_"))}
    return {**env, "REACH_CONFIG": str(ROOT / "reach.yaml"), **extra}


def test_a_busy_grpc_port_names_the_port_and_the_setting() -> None:
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        done = subprocess.run(
            [sys.executable, "-m", "gateway_api", "gateway"],
            env=_clean_env(
                REACH_LISTEN_PORT=str(free_port()), REACH_TRANSPORT__PORTS__GRPC=str(port)
            ),
            capture_output=True,
            text=True,
            timeout=60,
            cwd=ROOT,
        )
    assert done.returncode != 0
    assert f"port {port} (gateway gRPC front)" in done.stderr
    assert "REACH_TRANSPORT__PORTS__GRPC (-1: off)" in done.stderr  # as docs/configuration.md


async def test_a_negative_port_turns_the_front_off(temporal_server: str, tmp_path: Path) -> None:
    gateway = await GatewayProcess(
        grpc_stack(temporal_server, tmp_path, REACH_TRANSPORT__PORTS__GRPC="-1")
    ).ready()
    gateway.proc.stop()
    log = gateway.proc.output()
    assert "gRPC front off" in log
    assert "gRPC front listening" not in log
