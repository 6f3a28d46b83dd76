"""The WebSocket connector's and server's pure decisions: addresses, frames, the status table,
exception mapping and backoff."""

from __future__ import annotations

import inspect
import json
from typing import Any

import pytest
import websockets.exceptions as wse
from websockets.datastructures import Headers
from websockets.http11 import Response

from agent_reach_sdk.servers import server_class
from agent_reach_sdk.servers.websocket import WebSocketAgentServer, parse_request, reply_frame
from agent_reach_sdk.wire import Answer, Inbound, error_answer
from connectors import load
from connectors.websocket import (
    BACKOFF_FIRST_S,
    BACKOFF_MAX_S,
    WebSocketConnector,
    backoff_s,
    frame_limit,
    map_websocket_exceptions,
    read_reply,
    request_frame,
    request_id_in,
    ws_url,
)
from reach.errors import AgentError, DeadlineExceeded, InvalidRequest, ReachError, TransportError
from reach.invocation import Endpoint
from reach.messages import Header, Message, dumps

EP = Endpoint(instance_id="a1", capability="cap", protocol="websocket", address="127.0.0.1:9")


def test_the_websocket_protocol_is_found_through_its_entry_point() -> None:
    assert load("websocket") is WebSocketConnector
    assert server_class("websocket") is WebSocketAgentServer


# -- addresses ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("address", "normalized", "url"),
    [
        ("127.0.0.1:9001", "127.0.0.1:9001", "ws://127.0.0.1:9001/reach"),
        ("Agent.Internal:9001", "agent.internal:9001", "ws://agent.internal:9001/reach"),
        ("[::1]:9001", "[::1]:9001", "ws://[::1]:9001/reach"),
        ("WS://10.0.0.8:80", "ws://10.0.0.8:80", "ws://10.0.0.8:80/reach"),
        ("ws://10.0.0.8:80/", "ws://10.0.0.8:80", "ws://10.0.0.8:80/reach"),
        ("ws://h:1/agents/a1", "ws://h:1/agents/a1", "ws://h:1/agents/a1"),
        ("wss://agents.example.com", "wss://agents.example.com", "wss://agents.example.com/reach"),
    ],
)
def test_addresses_it_can_call(address: str, normalized: str, url: str) -> None:
    assert WebSocketConnector.check_address(address) == normalized
    assert ws_url(normalized) == url


@pytest.mark.parametrize(
    ("address", "why"),
    [
        ("", "empty"),
        ("http://h:1", "not ws or wss"),
        ("ftp://h:1", "not ws or wss"),
        ("h:1/reach", "needs the URL form: ws://"),
        ("agent.internal", "no port"),
        ("ws://user@h:1", "userinfo"),
        ("ws://h:1/?q=1", "query"),
        ("ws://h:99999", "port"),
        ("ws://h:1/a b", "spaces"),
    ],
)
def test_addresses_it_refuses_at_the_door(address: str, why: str) -> None:
    with pytest.raises(InvalidRequest, match=why):
        WebSocketConnector.check_address(address)


@pytest.mark.parametrize(
    ("advertise", "expected"),
    [
        ("127.0.0.1:0", "127.0.0.1:4321"),
        ("0.0.0.0:7000", "0.0.0.0:7000"),
        ("[::1]:0", "[::1]:4321"),
        ("ws://agent.internal:0", "ws://agent.internal:4321/reach"),
        ("ws://agent.internal/agents/a1/", "ws://agent.internal:4321/agents/a1"),
    ],
)
def test_the_server_advertises_what_the_connector_accepts(advertise: str, expected: str) -> None:
    server = WebSocketAgentServer(
        _never, listen="127.0.0.1:0", advertise=advertise, instance_id="a1", max_body_bytes=1024
    )
    server.port = 4321
    assert server.service_address == expected
    assert WebSocketConnector.check_address(expected) == expected


async def _never(request: Inbound) -> Answer:
    raise AssertionError("not called")


# -- request frames -------------------------------------------------------------------------------


def _message(**header: Any) -> Message:
    fields: dict[str, Any] = {
        "request_id": "req-1",
        "caller": "alice",
        "target": "cap",
        "operation": "query",
        **header,
    }
    return Message(header=Header(**fields), payload={"text": "é 🙂", "n": [1.5]})


def test_a_request_frame_carries_the_metadata_under_the_shared_names() -> None:
    frame = json.loads(
        request_frame(
            _message(
                attempt=3, deadline_ms=1767225600000, idempotency_key="k 1", traceparent="00-x"
            )
        )
    )
    assert frame == {
        "type": "request",
        "request_id": "req-1",
        "operation": "query",
        "headers": {
            "x-reach-request-id": "req-1",
            "x-reach-caller": "alice",
            "x-reach-attempt": "3",
            "x-reach-deadline-ms": "1767225600000",
            "idempotency-key": "k 1",
            "traceparent": "00-x",
        },
        "payload": {"text": "é 🙂", "n": [1.5]},
    }


def test_a_request_frame_holds_the_payload_as_reach_measured_it() -> None:
    message = _message()
    raw = request_frame(message)
    assert dumps(message.payload) in raw  # compact UTF-8, not escaped
    assert set(json.loads(raw)["headers"]) == {
        "x-reach-request-id",
        "x-reach-caller",
        "x-reach-attempt",
    }


def test_a_payload_no_hop_can_encode_is_not_retried() -> None:
    message = Message(
        header=Header(request_id="r", caller="c", target="t", operation="o"),
        payload={"bad": "\ud800"},
    )
    with pytest.raises(TransportError) as err:
        request_frame(message)
    assert not err.value.retryable


# -- reply frames ---------------------------------------------------------------------------------


def _reply(status: Any, body: Any = None) -> dict[str, Any]:
    return {"type": "reply", "request_id": "req-1", "status": status, "body": body}


@pytest.mark.parametrize(
    ("body", "result"),
    [({"a": 1}, {"a": 1}), ([1, 2], {"value": [1, 2]}), (None, {}), ("text", {"value": "text"})],
)
def test_a_200_body_is_the_result(body: Any, result: dict[str, Any]) -> None:
    reply = read_reply(EP, _reply(200, body), 1024)
    assert (reply.status, reply.result) == ("ok", result)


def test_202_is_accepted_and_504_is_reachs_timeout() -> None:
    assert read_reply(EP, _reply(202, {"status": "accepted"}), 1024).status == "accepted"
    with pytest.raises(DeadlineExceeded, match="passed"):
        read_reply(EP, _reply(504, {"error": {"type": "timeout", "message": "passed"}}), 1024)


@pytest.mark.parametrize(
    ("status", "body", "retryable"),
    [
        (404, None, False),
        (413, None, False),
        (422, {"error": {"type": "bad_input", "message": "no"}}, False),
        (429, None, True),
        (503, {"error": {"type": "busy", "message": "later"}}, True),
        (500, {"error": {"type": "result_too_large", "retryable": False}}, False),
        (400, {"error": {"type": "bad", "retryable": True}}, False),  # never asks for a retry
    ],
)
def test_error_statuses_follow_the_shared_table(status: int, body: Any, retryable: bool) -> None:
    with pytest.raises(AgentError) as err:
        read_reply(EP, _reply(status, body), 1024)
    assert err.value.retryable is retryable
    assert err.value.fault is not None
    assert err.value.fault.status == status
    assert f"answered {status}" in err.value.message


@pytest.mark.parametrize("status", ["200", True, 99, 600, None, 200.0, [200]])
def test_a_status_that_is_not_an_http_style_integer_is_not_retried(status: Any) -> None:
    with pytest.raises(AgentError, match="not an HTTP-style integer") as err:
        read_reply(EP, _reply(status, {}), 1024)
    assert not err.value.retryable


@pytest.mark.parametrize("body", [{"x": float("nan")}, {"x": float("inf")}, {"x": "\udc00"}])
def test_a_body_that_is_not_standard_json_is_not_retried(body: Any) -> None:
    with pytest.raises(AgentError, match="not standard JSON") as err:
        read_reply(EP, _reply(200, body), 1024)
    assert not err.value.retryable


def test_a_result_over_the_limit_is_not_retried() -> None:
    with pytest.raises(AgentError, match="the limit is 64") as err:
        read_reply(EP, _reply(200, {"pad": "x" * 64}), 64)
    assert not err.value.retryable
    assert frame_limit(4096) == 6 * 4096 + 64 * 1024


@pytest.mark.parametrize(
    ("data", "found"),
    [
        (b'{"type":"reply","request_id":"req-9","status":200,"body":{"x":', "req-9"),
        (b'{"request_id" : "a.b:c-1"} trailing', "a.b:c-1"),
        (b'{"request_id":"a","body":{"request_id":"a"}', "a"),
        (b'{"request_id":"a","body":{"request_id":"b"}', None),  # which one? nobody
        (b'{"request_id":"has space"}', None),
        (b"\xff\xfe garbage", None),
    ],
)
def test_a_request_id_is_read_from_a_broken_frame_only_when_unambiguous(
    data: bytes, found: str | None
) -> None:
    assert request_id_in(data) == found


def test_backoff_doubles_from_a_tenth_of_a_second_to_five() -> None:
    for failures, base in [(1, 0.1), (2, 0.2), (3, 0.4), (6, 3.2), (7, 5.0), (50, 5.0)]:
        wait = backoff_s(failures)
        assert 0.8 * base <= wait <= base, (failures, wait)
    assert (BACKOFF_FIRST_S, BACKOFF_MAX_S) == (0.1, 5.0)


# -- exception mapping ----------------------------------------------------------------------------


def _websockets_exceptions() -> list[type[Exception]]:
    found = [getattr(wse, name) for name in wse.__all__]
    return sorted(
        (c for c in found if isinstance(c, type) and issubclass(c, Exception)),
        key=lambda c: c.__name__,
    )


def _instance(exc_type: type[Exception], status: int = 503) -> Exception:
    if issubclass(exc_type, wse.ConnectionClosed):
        return exc_type(None, None)
    if exc_type in (wse.InvalidStatus, wse.InvalidProxyStatus):
        return exc_type(Response(status, "reason", Headers()))
    if exc_type is wse.PayloadTooBig:
        return exc_type(10, 5)
    required = [
        p
        for p in inspect.signature(exc_type.__init__).parameters.values()
        if p.name != "self"
        and p.default is p.empty
        and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
    ]
    return exc_type(*(1 if "int" in str(p.annotation) else "x" for p in required))


def _expected(exc_type: type[Exception]) -> tuple[str, bool]:
    if issubclass(exc_type, wse.ConnectionClosed):
        return "transport_error", True
    if issubclass(exc_type, wse.InvalidURI):
        return "transport_error", False
    if issubclass(exc_type, wse.InvalidHandshake):
        return "transport_error", True  # a 503 handshake and malformed ones: it may come up
    return "internal", False


def test_the_list_covers_the_websockets_exception_tree() -> None:
    names = {c.__name__ for c in _websockets_exceptions()}
    assert {"ConnectionClosedError", "InvalidStatus", "InvalidURI", "ProtocolError"} <= names
    assert {"ConcurrencyError", "InvalidProxy", "PayloadTooBig", "InvalidUpgrade"} <= names


@pytest.mark.parametrize("exc_type", _websockets_exceptions(), ids=lambda c: c.__name__)
def test_every_websockets_exception_is_mapped_deliberately(exc_type: type[Exception]) -> None:
    exc = _instance(exc_type)
    with pytest.raises(ReachError) as err, map_websocket_exceptions("127.0.0.1:1"):
        raise exc
    assert (err.value.type, err.value.retryable) == _expected(exc_type)
    assert err.value.__cause__ is exc


@pytest.mark.parametrize(("status", "retryable"), [(404, False), (403, False), (429, True)])
def test_a_refused_handshake_is_retried_only_when_the_agent_may_accept_later(
    status: int, retryable: bool
) -> None:
    with pytest.raises(TransportError) as err, map_websocket_exceptions("127.0.0.1:1"):
        raise _instance(wse.InvalidStatus, status)
    assert err.value.retryable is retryable
    assert f"HTTP {status}" in err.value.message


def test_os_errors_are_retryable_transport_errors_and_the_deadline_a_timeout() -> None:
    with pytest.raises(TransportError) as refused, map_websocket_exceptions("127.0.0.1:1"):
        raise ConnectionRefusedError(111, "refused")
    assert refused.value.retryable
    with pytest.raises(DeadlineExceeded), map_websocket_exceptions("127.0.0.1:1"):
        raise TimeoutError
    original = InvalidRequest("mine")
    with pytest.raises(InvalidRequest) as err, map_websocket_exceptions("127.0.0.1:1"):
        raise original
    assert err.value is original


# -- the server's frames --------------------------------------------------------------------------


def _frame(**fields: Any) -> bytes:
    base: dict[str, Any] = {"type": "request", "request_id": "r1", "operation": "op"}
    base.update(fields)
    return json.dumps(base).encode()


def test_a_request_frame_becomes_the_runtimes_inbound() -> None:
    headers = {"X-Reach-Caller": "alice", "x-reach-attempt": "2"}
    rid, parsed = parse_request(_frame(headers=headers, payload={"q": "é"}), 1024)
    assert rid == "r1"
    assert parsed == Inbound(
        "op",
        {"x-reach-caller": "alice", "x-reach-attempt": "2", "x-reach-request-id": "r1"},
        dumps({"q": "é"}),
    )
    _, bare = parse_request(_frame(), 1024)
    assert isinstance(bare, Inbound)
    assert (bare.body, dict(bare.headers)) == (b"{}", {"x-reach-request-id": "r1"})


@pytest.mark.parametrize(
    ("data", "rid", "status"),
    [
        (b"not json", None, 400),
        (b'{"type":"request","request_id":"r7","operation":', "r7", 400),
        (b"[1]", None, None),
        (b'{"type":"request","operation":"op"}', None, None),
        (_frame(type="cancel"), "r1", None),
        (_frame(type=None), "r1", 400),
        (_frame(operation=""), "r1", 400),
        (_frame(headers=["x"]), "r1", 400),
        (_frame(headers={"x-reach-attempt": 2}), "r1", 400),
        (_frame(payload=[1]), "r1", 400),
        (_frame(payload={"pad": "x" * 2000}), "r1", 413),
        (b'{"type":"request","request_id":"r1","operation":"o","payload":{"x":NaN}}', "r1", 400),
    ],
)
def test_frames_the_server_cannot_run(data: bytes, rid: str | None, status: int | None) -> None:
    got_rid, parsed = parse_request(data, 1024)
    assert got_rid == rid
    if status is None:
        assert parsed is None or rid is None
    else:
        assert isinstance(parsed, Answer)
        assert parsed.status == status


def test_a_reply_frame_splices_the_answer_as_encoded() -> None:
    answer = Answer(200, {"text": "é", "n": 1.5})
    frame = reply_frame('odd"id', answer)
    assert answer.content() in frame
    assert json.loads(frame) == {
        "type": "reply",
        "request_id": 'odd"id',
        "status": 200,
        "body": {"text": "é", "n": 1.5},
    }
    assert json.loads(reply_frame("r", Answer(202)))["body"] is None
    error = json.loads(reply_frame("r", error_answer(503, "busy", "later", retryable=True)))
    assert error["body"] == {"error": {"type": "busy", "message": "later", "retryable": True}}
