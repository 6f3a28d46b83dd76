"""The A2A front's pure parts: the error table covers Reach's whole vocabulary (and the docs
say so), the JSON-RPC envelope checks, the payload rule, the task a response reads as, and
cards the SDK's schema accepts."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
from a2a.types import (
    GetTaskRequest,
    ListTasksRequest,
    Message,
    Part,
    Role,
    SendMessageRequest,
    Task,
    TaskPushNotificationConfig,
    TaskState,
)
from a2a.utils.errors import JSON_RPC_ERROR_CODE_MAP, InvalidParamsError
from a2a.utils.proto_utils import validate_proto_required_fields
from google.protobuf import json_format
from temporalio.exceptions import CancelledError

from gateway_api.a2a_front import (
    HANDLERS,
    PARAMS,
    SERVER_ERROR,
    STATES,
    STREAMERS,
    RpcError,
    capability_card,
    gateway_card,
    is_a2a_call,
    missing,
    operations_of,
    parse_call,
    payload_of,
    rpc_error_of,
    state_of,
    task_json,
    task_of,
)
from gateway_api.engine import ended_without_result
from reach.errors import ERRORS_BY_TYPE, RateLimited, Unauthorized
from reach.messages import ErrorInfo, InvokeResponse
from reach.registry.models import InstanceRecord, OperationDeclaration

DOC = (Path(__file__).resolve().parents[2] / "docs" / "a2a-front.md").read_text()
A2A_CODES = set(JSON_RPC_ERROR_CODE_MAP.values())


@pytest.mark.parametrize("error_type", sorted(ERRORS_BY_TYPE))
def test_every_reach_error_has_a_json_rpc_error_and_a_row_in_the_docs(error_type: str) -> None:
    error = rpc_error_of(ERRORS_BY_TYPE[error_type]("words"), "req-1")
    assert error.code in A2A_CODES | {SERVER_ERROR}
    body = error.body(3)
    assert body["id"] == 3
    assert body["error"]["message"] == "words"
    assert body["error"]["data"][0]["metadata"]["reachError"] == error_type
    assert f"`{error_type}`" in DOC


def test_auth_is_http_and_the_retryable_say_when() -> None:
    unauthorized = rpc_error_of(Unauthorized("no token"))
    assert unauthorized.http_status == 401
    assert unauthorized.headers["WWW-Authenticate"].startswith("Bearer")
    limited = rpc_error_of(RateLimited("slow down", retry_after_s=3))
    assert limited.http_status == 200
    assert limited.headers["Retry-After"] == "3"
    assert limited.metadata["retryAfterS"] == "3"


def test_every_method_has_one_handler() -> None:
    assert set(PARAMS) == set(HANDLERS) | set(STREAMERS)
    aliases = {"CreateTaskPushNotificationConfig", "ListTaskPushNotificationConfigs"}
    for method in set(PARAMS) - aliases:
        assert f"`{method}" in DOC, method


@pytest.mark.parametrize(
    ("raw", "code", "words"),
    [
        (b"", -32700, "Invalid JSON"),
        (b"\xff", -32700, "Invalid JSON"),
        (b"[]", -32600, "batch"),
        (b'"x"', -32600, "object"),
        (b'{"jsonrpc": "2.0", "id": true, "method": "GetTask"}', -32600, "id"),
        (b'{"jsonrpc": "2.0", "id": 1}', -32600, "method"),
        (b'{"jsonrpc": "2.0", "id": 1, "method": "message/send"}', -32601, "message/send"),
        (b'{"jsonrpc": "2.0", "id": 1, "method": "GetTask", "params": []}', -32602, "object"),
        (b'{"jsonrpc": "2.0", "id": 1, "method": "GetTask", "params": {}}', -32602, "id"),
    ],
)
def test_a_malformed_request_is_a_clear_error(raw: bytes, code: int, words: str) -> None:
    with pytest.raises(RpcError) as caught:
        parse_call(raw)
    assert caught.value.code == code
    assert words in caught.value.message


def test_a_well_formed_request_parses_into_the_sdks_type() -> None:
    rpc_id, method, params, _ = parse_call(
        b'{"jsonrpc": "2.0", "id": "a", "method": "GetTask", "params": {"id": "req-1"}}'
    )
    assert (rpc_id, method, json_format.MessageToDict(params)) == ("a", "GetTask", {"id": "req-1"})


def _message(*parts: Part) -> Message:
    return Message(message_id="m", role=Role.ROLE_USER, parts=list(parts))


def test_the_payload_is_the_first_data_part_else_the_text() -> None:
    def sent(*parts: dict[str, Any]) -> dict[str, Any]:
        return {"messageId": "m", "role": "ROLE_USER", "parts": list(parts)}

    assert payload_of(sent({"text": "a"}, {"data": {"q": 1}})) == {"q": 1}
    assert payload_of(sent({"text": "a"}, {"text": "b"})) == {"text": "a\nb"}
    assert payload_of(sent()) == {}
    with pytest.raises(RpcError, match="file"):
        payload_of(sent({"url": "https://example.com/x.pdf"}))
    with pytest.raises(RpcError, match="JSON object"):
        payload_of(sent({"data": [1, 2]}))


@pytest.mark.parametrize(
    "params",
    [
        (SendMessageRequest, {}),
        (SendMessageRequest, {"message": {"messageId": "m"}}),
        (SendMessageRequest, {"message": {"messageId": "m", "role": "ROLE_USER", "parts": [{}]}}),
        (
            SendMessageRequest,
            {
                "message": {"messageId": "m", "role": "ROLE_USER", "parts": [{"text": "x"}]},
                "configuration": {"taskPushNotificationConfig": {"url": "https://x"}},
                "metadata": {"deep": {"deeper": [1, {"a": None}]}},
            },
        ),
        (GetTaskRequest, {}),
        (GetTaskRequest, {"id": "req-1"}),
        (TaskPushNotificationConfig, {"taskId": "t"}),
        (ListTasksRequest, {}),
    ],
)
def test_required_fields_are_the_sdks(params: tuple[type[Any], dict[str, Any]]) -> None:
    kind, fields = params
    parsed = json_format.ParseDict(fields, kind())
    try:
        validate_proto_required_fields(parsed)
        expected: list[str] = []
    except InvalidParamsError as exc:
        expected = [e["field"] for e in (exc.data or {})["errors"]]
    assert [p.split(":")[0] for p in missing(parsed)] == expected


def test_the_answers_json_is_the_tasks_protojson() -> None:
    responses = [
        InvokeResponse(request_id="req-1", status="success", result={"n": 2, "x": [1.5]}),
        InvokeResponse(
            request_id="req-2",
            status="error",
            error=ErrorInfo(type="agent_error", message="it broke", outcome_unknown=True),
            instance_id="i-1",
        ),
        InvokeResponse(request_id="req-3", status="running"),
        InvokeResponse(
            request_id="req-4",
            status="input_required",
            result={"task_id": "t", "context_id": "c", "state": "input-required"},
        ),
    ]
    for response in responses:
        written = json_format.ParseDict(task_json(response), Task())
        built = task_of(response)
        for task in (written, built):
            task.status.ClearField("timestamp")
        assert written == built, response


def test_a_response_reads_as_its_task() -> None:
    done = task_of(InvokeResponse(request_id="req-1", status="success", result={"a": 1}))
    assert done.status.state == TaskState.TASK_STATE_COMPLETED
    assert json_format.MessageToDict(done.artifacts[0].parts[0].data) == {"a": 1}
    failed = task_of(
        InvokeResponse(
            request_id="req-2",
            status="error",
            error=ErrorInfo(type="agent_error", message="it broke"),
        )
    )
    assert failed.status.state == TaskState.TASK_STATE_FAILED
    assert failed.status.message.parts[0].text == "it broke"
    assert not failed.artifacts
    cancelled = ended_without_result("req-3", CancelledError("from a test"))
    assert state_of(cancelled) == TaskState.TASK_STATE_CANCELED
    for status in ("accepted", "running", "success", "error", "timeout"):
        assert status in STATES
    for status in STATES:
        assert f"`{status}`" in DOC, status
    asked = InvokeResponse(
        request_id="req-4",
        status="input_required",
        result={"task_id": "t", "context_id": "c", "state": "auth-required", "message": "who?"},
    )
    needs = task_of(asked)
    assert needs.status.state == TaskState.TASK_STATE_AUTH_REQUIRED
    assert needs.status.message.parts[0].text == "who?"
    assert json_format.MessageToDict(needs.status.message.parts[1].data)["task_id"] == "t"
    validate_proto_required_fields(SendMessageRequest(message=_message(Part(text="x"))))


def _instance(name: str, ops: list[str], described: dict[str, str]) -> InstanceRecord:
    now = time.time()
    return InstanceRecord(
        instance_id=name,
        capability="cap",
        protocol="http",
        address="127.0.0.1:1",
        operations=ops,
        declared={op: OperationDeclaration(name=op, description=d) for op, d in described.items()},
        max_message_bytes=1 << 20,
        async_callback=False,
        heartbeat_interval=5,
        joined_at=now,
        last_seen=now,
    )


def test_cards_have_a_skill_per_operation_and_pass_the_sdks_schema() -> None:
    instances = [
        _instance("a", ["query", "create"], {"query": "Rank passages"}),
        _instance("b", ["query"], {}),
    ]
    assert operations_of(instances) == {"create": "", "query": "Rank passages"}
    card = capability_card("http://gw:7600", "cap", instances, tokens_required=True)
    validate_proto_required_fields(card)
    assert [s.id for s in card.skills] == ["create", "query"]
    assert card.skills[1].description == "Rank passages"
    assert card.supported_interfaces[0].url == "http://gw:7600/a2a/cap"
    assert len(card.security_requirements) == 1
    open_card = gateway_card("http://gw:7600", ["cap"], tokens_required=False)
    validate_proto_required_fields(open_card)
    assert not open_card.security_requirements
    assert "bearer" in open_card.security_schemes


def test_only_a_capabilitys_json_rpc_calls_take_the_fast_path() -> None:
    def scope(method: str, path: str, kind: str = "http") -> dict[str, Any]:
        return {"type": kind, "method": method, "path": path}

    assert is_a2a_call(scope("POST", "/a2a/cap"))
    assert not is_a2a_call(scope("GET", "/a2a/cap"))
    assert not is_a2a_call(scope("POST", "/a2a/cap/.well-known/agent-card.json"))
    assert not is_a2a_call(scope("POST", "/reach/invoke"))
    assert not is_a2a_call({"type": "lifespan"})
