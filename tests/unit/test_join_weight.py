"""`weight` and `max_inflight` at Join: what the gateway accepts and records, and how the SDK
and the gRPC front send them."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest

from agent_reach_proto import gateway_pb2 as pb
from agent_reach_sdk import AgentRuntime
from gateway_api.grpc_wire import as_body as _body
from gateway_api.grpc_wire import join_fields as _join_fields
from reach import acceptance
from reach.config import RegistrySettings
from reach.errors import InvalidRequest
from reach.limits import Limits
from reach.registry import InstanceRecord, JoinRequest, Registry
from reach.store.memory import MemoryStore

LIMITS = Limits()
BASE: dict[str, Any] = {
    "capability": "retriever",
    "instance_id": "r-1",
    "service_address": "127.0.0.1:9",
}


def join(**fields: Any) -> JoinRequest:
    return acceptance.join_request(json.dumps({**BASE, **fields}).encode(), LIMITS)


# -- the gateway ------------------------------------------------------------------------------


def test_the_defaults_are_weight_one_and_no_limit() -> None:
    got = join()
    assert (got.weight, got.max_inflight) == (1, None)


def test_the_bounds_are_accepted() -> None:
    top = join(weight=1000, max_inflight=1_000_000)
    assert (top.weight, top.max_inflight) == (1000, 1_000_000)
    assert join(max_inflight=1).max_inflight == 1
    assert join(weight=3.0).weight == 3  # an integer, as JSON counts them


@pytest.mark.parametrize(
    ("fields", "name"),
    [
        ({"weight": 0}, "weight"),
        ({"weight": 1001}, "weight"),
        ({"weight": 1.5}, "weight"),
        ({"weight": None}, "weight"),
        ({"max_inflight": 0}, "max_inflight"),
        ({"max_inflight": 1_000_001}, "max_inflight"),
        ({"max_inflight": "5"}, "max_inflight"),
    ],
)
def test_a_value_out_of_range_is_refused_by_name(fields: dict[str, Any], name: str) -> None:
    with pytest.raises(InvalidRequest) as info:
        join(**fields)
    assert info.value.message.startswith(f"{name}:"), info.value.message


async def test_a_join_records_them() -> None:
    registry = Registry(MemoryStore(), RegistrySettings())
    await registry.join(join(weight=3, max_inflight=5))
    got = await registry.get("r-1")
    assert got is not None
    assert (got.weight, got.max_inflight) == (3, 5)
    dumped = json.loads(got.model_dump_json())
    assert (dumped["weight"], dumped["max_inflight"]) == (3, 5)


def test_records_from_older_gateways_load_with_the_defaults() -> None:
    older = {
        "instance_id": "r-1",
        "capability": "retriever",
        "protocol": "http",
        "address": "127.0.0.1:9",
        "max_message_bytes": 1024,
        "async_callback": False,
        "heartbeat_interval": 5.0,
        "joined_at": 1.0,
        "last_seen": 1.0,
    }
    got = InstanceRecord.model_validate(older)
    assert (got.weight, got.max_inflight) == (1, None)


# -- the SDK ----------------------------------------------------------------------------------


async def sent_join(runtime: AgentRuntime) -> dict[str, Any]:
    """The body `runtime` sends at Join, to a gateway that acks it."""
    sent: list[dict[str, Any]] = []

    def gateway(request: httpx.Request) -> httpx.Response:
        sent.append(json.loads(request.content))
        ack = {
            "instance_id": runtime.instance_id,
            "capability": runtime.capability,
            "heartbeat_interval": 5.0,
            "heartbeat_timeout": 30.0,
            "max_message_bytes": 1024,
            "async_callback": True,
        }
        return httpx.Response(200, json=ack)

    runtime._client = httpx.AsyncClient(
        base_url="http://reach", transport=httpx.MockTransport(gateway)
    )
    try:
        await runtime._join()
    finally:
        await runtime._client.aclose()
    [body] = sent
    return body


async def test_the_sdk_sends_them_when_set() -> None:
    runtime = AgentRuntime(
        "retriever", instance_id="r-1", reach_address="127.0.0.1:1", weight=3, max_inflight=5
    )
    body = await sent_join(runtime)
    assert (body["weight"], body["max_inflight"]) == (3, 5)
    # What the SDK sends, the gateway accepts.
    got = acceptance.join_request(json.dumps(body).encode(), LIMITS)
    assert (got.weight, got.max_inflight) == (3, 5)


async def test_the_sdk_leaves_the_defaults_out_for_older_gateways() -> None:
    """A gateway that predates the fields refuses unknown ones (extra=forbid)."""
    runtime = AgentRuntime("retriever", instance_id="r-1", reach_address="127.0.0.1:1")
    assert (runtime.weight, runtime.max_inflight) == (1, None)
    body = await sent_join(runtime)
    assert "weight" not in body
    assert "max_inflight" not in body
    only_inflight = AgentRuntime(
        "retriever", instance_id="r-2", reach_address="127.0.0.1:1", max_inflight=7
    )
    body = await sent_join(only_inflight)
    assert "weight" not in body
    assert body["max_inflight"] == 7


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        ({"weight": 0}, "weight"),
        ({"weight": -1}, "weight"),
        ({"weight": 1001}, "weight"),
        ({"weight": 2.0}, "weight"),
        ({"weight": True}, "weight"),
        ({"weight": "3"}, "weight"),
        ({"max_inflight": 0}, "max_inflight"),
        ({"max_inflight": 1_000_001}, "max_inflight"),
        ({"max_inflight": 5.0}, "max_inflight"),
        ({"max_inflight": False}, "max_inflight"),
    ],
)
def test_the_sdk_refuses_what_reach_would_refuse(kwargs: dict[str, Any], name: str) -> None:
    with pytest.raises(ValueError, match=rf"^{name} must be an integer from 1 to "):
        AgentRuntime("retriever", reach_address="127.0.0.1:1", **kwargs)


def test_the_sdk_accepts_the_bounds() -> None:
    runtime = AgentRuntime(
        "retriever", reach_address="127.0.0.1:1", weight=1000, max_inflight=1_000_000
    )
    assert (runtime.weight, runtime.max_inflight) == (1000, 1_000_000)
    assert AgentRuntime("retriever", reach_address="127.0.0.1:1", max_inflight=1).max_inflight == 1


# -- the gRPC front ---------------------------------------------------------------------------


def test_the_grpc_front_maps_them_only_when_present() -> None:
    unset = _join_fields(pb.JoinRequest(**BASE))
    assert "weight" not in unset
    assert "max_inflight" not in unset
    fields = _join_fields(pb.JoinRequest(**BASE, weight=3, max_inflight=5))
    assert (fields["weight"], fields["max_inflight"]) == (3, 5)
    got = acceptance.join_request(_body(fields), LIMITS)
    assert (got.weight, got.max_inflight) == (3, 5)


@pytest.mark.parametrize(
    ("fields", "name"),
    [({"weight": 0}, "weight"), ({"max_inflight": 0}, "max_inflight")],
)
def test_a_zero_sent_over_grpc_is_refused_by_name(fields: dict[str, Any], name: str) -> None:
    """Set to 0 is not unset: the gateway refuses it as HTTP refuses the same body."""
    request = pb.JoinRequest(**BASE, **fields)
    with pytest.raises(InvalidRequest) as info:
        acceptance.join_request(_body(_join_fields(request)), LIMITS)
    with pytest.raises(InvalidRequest) as http:
        join(**fields)
    assert info.value.message == http.value.message
    assert info.value.message.startswith(f"{name}:")
