"""Operations declared at Join: the object form of `operations`, what a record keeps of it,
what the instances of a capability declare together, and how the SDK and the gRPC front send
it."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest

from agent_reach_proto import gateway_pb2 as pb
from agent_reach_sdk import AgentRuntime
from gateway_api.grpc_wire import join_fields as _join_fields
from reach import acceptance
from reach.config import RegistrySettings
from reach.errors import InvalidRequest
from reach.limits import Limits
from reach.messages import MAX_TIMEOUT_MS
from reach.registry import (
    InstanceRecord,
    JoinRequest,
    OperationDeclaration,
    Registry,
    declared_policy,
)
from reach.store.memory import MemoryStore

LIMITS = Limits()


def join(operations: list[Any]) -> JoinRequest:
    body = {
        "capability": "retriever",
        "instance_id": "r-1",
        "service_address": "127.0.0.1:9",
        "operations": operations,
    }
    return acceptance.join_request(json.dumps(body).encode(), LIMITS)


def refusal(operations: list[Any]) -> str:
    with pytest.raises(InvalidRequest) as info:
        join(operations)
    return info.value.message


def record(
    instance_id: str, declared: dict[str, dict[str, Any]], status: str = "ok"
) -> InstanceRecord:
    return InstanceRecord.model_validate(
        {
            "instance_id": instance_id,
            "capability": "retriever",
            "protocol": "http",
            "address": "127.0.0.1:9",
            "operations": ["query", "index"],
            "declared": {name: {"name": name, **d} for name, d in declared.items()},
            "max_message_bytes": 1024,
            "async_callback": False,
            "heartbeat_interval": 5.0,
            "status": status,
            "joined_at": 1.0,
            "last_seen": 1.0,
        }
    )


# -- JoinRequest ----------------------------------------------------------------------------


def test_names_and_objects_share_one_list() -> None:
    got = join(
        [
            "stats",
            {"name": "query", "idempotent": True, "timeout_ms": 3000},
            {"name": "index", "idempotent": False},
            {"name": "warm"},  # declares nothing
            {"name": "scan", "timeout_ms": 60000.0},  # an integer, as JSON counts them
        ]
    )
    assert got.operations == [
        "stats",
        OperationDeclaration(name="query", idempotent=True, timeout_ms=3000),
        OperationDeclaration(name="index", idempotent=False, timeout_ms=None),
        OperationDeclaration(name="warm", idempotent=None, timeout_ms=None),
        OperationDeclaration(name="scan", idempotent=None, timeout_ms=60000),
    ]
    assert got.operation_names == ["stats", "query", "index", "warm", "scan"]
    assert got.declarations == {
        "query": OperationDeclaration(name="query", idempotent=True, timeout_ms=3000),
        "index": OperationDeclaration(name="index", idempotent=False, timeout_ms=None),
        "scan": OperationDeclaration(name="scan", idempotent=None, timeout_ms=60000),
    }
    assert join(["query"]).operations == ["query"]
    assert join([]).declarations == {}


@pytest.mark.parametrize(
    ("operations", "message"),
    [
        (
            ["query", {"name": "index", "idempotnt": True}],
            "operations.1.idempotnt: Extra inputs are not permitted",
        ),
        ([{"idempotent": True}], "operations.0.name: Field required"),
        (
            [{"name": "not ok!"}],
            "operations.0.name: String should match pattern '^[A-Za-z0-9_][A-Za-z0-9_.-]{0,63}$'",
        ),
        (
            ["not ok!"],
            "operations.0: String should match pattern '^[A-Za-z0-9_][A-Za-z0-9_.-]{0,63}$'",
        ),
        (
            [{"name": "q", "idempotent": 1}],
            "operations.0.idempotent: Input should be a valid boolean",
        ),
        (
            [{"name": "q", "idempotent": "true"}],
            "operations.0.idempotent: Input should be a valid boolean",
        ),
        (
            [{"name": "q", "timeout_ms": 0}],
            "operations.0.timeout_ms: Input should be greater than or equal to 1",
        ),
        (
            [{"name": "q", "timeout_ms": MAX_TIMEOUT_MS + 1}],
            "operations.0.timeout_ms: Input should be less than or equal to 86400000",
        ),
        (
            [{"name": "q", "timeout_ms": 1.5}],
            "operations.0.timeout_ms: Input should be a valid integer",
        ),
        (
            [{"name": "q", "timeout_ms": "3000"}],
            "operations.0.timeout_ms: Input should be a valid integer",
        ),
        (
            [{"name": "q", "timeout_ms": True}],
            "operations.0.timeout_ms: Input should be a valid integer",
        ),
        (
            [5],
            "operations.0: Input should be an operation name or an object with its name and policy",
        ),
        (
            ["query", {"name": "query", "idempotent": True}],
            "operations: Value error, operation 'query' is listed more than once",
        ),
        (
            ["index", "index"],
            "operations: Value error, operation 'index' is listed more than once",
        ),
    ],
)
def test_a_wrong_entry_is_refused_by_name(operations: list[Any], message: str) -> None:
    assert refusal(operations) == message


def test_the_timeout_bounds_are_accepted() -> None:
    got = join([{"name": "a", "timeout_ms": 1}, {"name": "b", "timeout_ms": MAX_TIMEOUT_MS}])
    assert [d.timeout_ms for d in got.declarations.values()] == [1, 86_400_000]


# -- InstanceRecord ---------------------------------------------------------------------------


async def test_a_join_records_the_names_and_what_was_declared() -> None:
    registry = Registry(MemoryStore(), RegistrySettings())
    await registry.join(
        join(["stats", {"name": "query", "idempotent": True, "timeout_ms": 3000}, {"name": "x"}])
    )
    got = await registry.get("r-1")
    assert got is not None
    assert got.operations == ["stats", "query", "x"]
    assert got.declared == {
        "query": OperationDeclaration(name="query", idempotent=True, timeout_ms=3000)
    }
    assert json.loads(got.model_dump_json())["declared"] == {
        "query": {"name": "query", "idempotent": True, "timeout_ms": 3000}
    }


def test_records_from_older_and_newer_gateways_load() -> None:
    older = record("r-1", {}).model_dump()
    del older["declared"]
    assert InstanceRecord.model_validate(older).declared == {}
    newer = record("r-1", {}).model_dump()
    newer["declared"] = {"query": {"name": "query", "idempotent": True, "max_attempts": 9}}
    assert InstanceRecord.model_validate(newer).declared == {
        "query": OperationDeclaration(name="query", idempotent=True, timeout_ms=None)
    }


# -- declared_policy ------------------------------------------------------------------------


def test_nothing_declared_is_none() -> None:
    assert declared_policy([], "query") is None
    assert (
        declared_policy([record("a", {}), record("b", {"index": {"idempotent": True}})], "query")
        is None
    )


def test_one_declaration_is_the_policy() -> None:
    got = declared_policy(
        [record("a", {"query": {"idempotent": True, "timeout_ms": 3000}})], "query"
    )
    assert got == OperationDeclaration(name="query", idempotent=True, timeout_ms=3000)


def test_an_instance_that_declares_nothing_does_not_veto() -> None:
    instances = [record("a", {"query": {"idempotent": True}}), record("b", {})]
    assert declared_policy(instances, "query") == OperationDeclaration(
        name="query", idempotent=True, timeout_ms=None
    )


def test_one_false_makes_it_not_idempotent() -> None:
    instances = [
        record("a", {"query": {"idempotent": True, "timeout_ms": 3000}}),
        record("b", {"query": {"idempotent": False}}),
        record("c", {"query": {"idempotent": True}}),
    ]
    assert declared_policy(instances, "query") == OperationDeclaration(
        name="query", idempotent=False, timeout_ms=3000
    )


def test_the_smallest_timeout_wins_and_idempotence_may_stay_open() -> None:
    instances = [
        record("a", {"query": {"timeout_ms": 5000}}),
        record("b", {"query": {"timeout_ms": 1200}}),
        record("c", {"query": {"timeout_ms": 9000}}),
    ]
    assert declared_policy(instances, "query") == OperationDeclaration(
        name="query", idempotent=None, timeout_ms=1200
    )


def test_unhealthy_instances_have_no_say() -> None:
    instances = [
        record("a", {"query": {"idempotent": True, "timeout_ms": 5000}}),
        record("b", {"query": {"idempotent": False, "timeout_ms": 10}}, status="unhealthy"),
        record("c", {"query": {"timeout_ms": 4000}}, status="degraded"),
    ]
    assert declared_policy(instances, "query") == OperationDeclaration(
        name="query", idempotent=True, timeout_ms=4000
    )
    assert declared_policy(instances[1:2], "query") is None


# -- the SDK ----------------------------------------------------------------------------------


async def test_the_sdk_sends_a_name_or_an_object() -> None:
    runtime = AgentRuntime("retriever", instance_id="r-1", reach_address="127.0.0.1:1")

    @runtime.operation("query", idempotent=True, timeout_ms=3000)
    def query(payload: dict[str, Any]) -> dict[str, Any]:
        return payload

    @runtime.operation("index", idempotent=False)
    def index(payload: dict[str, Any]) -> dict[str, Any]:
        return payload

    @runtime.operation("stats")
    def stats(payload: dict[str, Any]) -> dict[str, Any]:
        return payload

    sent: list[dict[str, Any]] = []

    def gateway(request: httpx.Request) -> httpx.Response:
        sent.append(json.loads(request.content))
        ack = {
            "instance_id": "r-1",
            "capability": "retriever",
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
    assert runtime.operations == ["index", "query", "stats"]
    assert [body["operations"] for body in sent] == [
        [
            {"name": "index", "idempotent": False},
            {"name": "query", "idempotent": True, "timeout_ms": 3000},
            "stats",
        ]
    ]
    # What the SDK sends, the gateway accepts.
    assert join(sent[0]["operations"]).declarations == {
        "index": OperationDeclaration(name="index", idempotent=False),
        "query": OperationDeclaration(name="query", idempotent=True, timeout_ms=3000),
    }


@pytest.mark.parametrize(
    ("kwargs", "error"),
    [
        ({"timeout_ms": 0}, ValueError),
        ({"timeout_ms": MAX_TIMEOUT_MS + 1}, ValueError),
        ({"timeout_ms": 1.5}, ValueError),
        ({"timeout_ms": True}, ValueError),
        ({"idempotent": "yes"}, TypeError),
    ],
)
def test_the_sdk_refuses_a_declaration_reach_would_refuse(
    kwargs: dict[str, Any], error: type[Exception]
) -> None:
    runtime = AgentRuntime("retriever", reach_address="127.0.0.1:1")
    with pytest.raises(error):
        runtime.operation("query", **kwargs)


# -- the gRPC front ---------------------------------------------------------------------------


def test_the_grpc_declarations_follow_the_plain_names() -> None:
    request = pb.JoinRequest(
        capability="retriever",
        instance_id="r-1",
        service_address="127.0.0.1:9",
        operations=["stats"],
        declared_operations=[
            pb.OperationDeclaration(name="query", idempotent=True, timeout_ms=3000),
            pb.OperationDeclaration(name="index", idempotent=False),
            pb.OperationDeclaration(name="warm"),
            pb.OperationDeclaration(timeout_ms=5),
        ],
    )
    assert _join_fields(request)["operations"] == [
        "stats",
        {"name": "query", "idempotent": True, "timeout_ms": 3000},
        {"name": "index", "idempotent": False},
        {"name": "warm"},
        {"timeout_ms": 5},  # an empty name reads as absent: "Field required"
    ]
    assert "operations" not in _join_fields(pb.JoinRequest(capability="retriever"))
