"""The gRPC connector's pure decisions: the status table, replies, addresses, metadata."""

from __future__ import annotations

from typing import Any

import grpc
import grpc.aio
import pytest
from grpc._cython import cygrpc  # type: ignore[attr-defined]  # what grpc core raises

from agent_reach_proto.agent_pb2 import InvokeReply
from agent_reach_sdk import wire
from agent_reach_sdk.servers import server_class
from agent_reach_sdk.servers.grpc import GrpcAgentServer, clip_utf8, status_for
from agent_reach_sdk.wire import error_answer
from connectors import ConnectorSet, load, reply_for_status
from connectors.grpc import (
    METHOD,
    STATUS_TABLE,
    GrpcConnector,
    error_for_status,
    map_grpc_exceptions,
    reply_of,
    wire_metadata,
)
from reach.errors import AgentError, AgentFault, InvalidRequest, ReachError
from reach.invocation import Endpoint
from reach.messages import Header, Message, dumps

ENDPOINT = Endpoint(instance_id="g1", capability="cap", protocol="grpc", address="127.0.0.1:9")
C = grpc.StatusCode

# Written out again here, on purpose: a change to the connector's table must change this too.
EXPECTED: dict[grpc.StatusCode, tuple[str, bool]] = {
    C.DEADLINE_EXCEEDED: ("timeout", False),
    C.UNAVAILABLE: ("transport_error", True),
    C.CANCELLED: ("transport_error", True),
    C.RESOURCE_EXHAUSTED: ("agent_error", True),
    C.ABORTED: ("agent_error", True),
    C.INTERNAL: ("agent_error", True),
    C.UNKNOWN: ("agent_error", True),
    C.DATA_LOSS: ("agent_error", True),
    C.INVALID_ARGUMENT: ("agent_error", False),
    C.NOT_FOUND: ("agent_error", False),
    C.ALREADY_EXISTS: ("agent_error", False),
    C.PERMISSION_DENIED: ("agent_error", False),
    C.FAILED_PRECONDITION: ("agent_error", False),
    C.OUT_OF_RANGE: ("agent_error", False),
    C.UNIMPLEMENTED: ("agent_error", False),
    C.UNAUTHENTICATED: ("agent_error", False),
}
FAILURES = [code for code in grpc.StatusCode if code is not C.OK]


def test_the_table_covers_every_status_code() -> None:
    assert set(STATUS_TABLE) == set(grpc.StatusCode)
    assert set(EXPECTED) | {C.OK} == set(grpc.StatusCode)
    assert STATUS_TABLE[C.OK][0] == "ok"


@pytest.mark.parametrize("code", FAILURES, ids=lambda c: c.name)
def test_every_failure_status_is_mapped_deliberately(code: grpc.StatusCode) -> None:
    err = error_for_status(ENDPOINT, code, "what the agent said", {})
    assert (err.type, err.retryable) == EXPECTED[code]
    assert code.name in err.message


@pytest.mark.parametrize("code", FAILURES, ids=lambda c: c.name)
def test_the_agents_words_travel_only_inside_the_fault(code: grpc.StatusCode) -> None:
    said = {"x-reach-error-type": "timeout", "x-reach-retryable": "true"}
    err = error_for_status(ENDPOINT, code, "my database timed out", said)
    # The agent's type never chooses Reach's; asking for a retry never makes one.
    assert err.retryable == EXPECTED[code][1]
    if code is C.DEADLINE_EXCEEDED:
        assert err.type == "timeout"
        return
    assert isinstance(err, AgentError)  # a transport code with the agent's type was its own
    assert err.fault is not None
    assert (err.fault.type, err.fault.message) == ("timeout", "my database timed out")
    assert err.fault.status == code.value[0]


@pytest.mark.parametrize("code", FAILURES, ids=lambda c: c.name)
def test_an_agent_can_withhold_a_retry(code: grpc.StatusCode) -> None:
    err = error_for_status(ENDPOINT, code, "", {"x-reach-retryable": "false"})
    assert not err.retryable


@pytest.mark.parametrize("code", FAILURES, ids=lambda c: c.name)
def test_a_failed_call_is_mapped_by_its_status(code: grpc.StatusCode) -> None:
    trailing = grpc.aio.Metadata(("x-reach-error-type", "oops"), ("x-reach-retryable", "false"))
    exc = grpc.aio.AioRpcError(code, grpc.aio.Metadata(), trailing, "its words")
    with pytest.raises(ReachError) as err, map_grpc_exceptions(ENDPOINT, 1088, 1024):
        raise exc
    # With the agent's own type, even a transport code is the agent's answer.
    expected = "timeout" if code is C.DEADLINE_EXCEEDED else "agent_error"
    assert err.value.type == expected
    assert not err.value.retryable
    assert err.value.__cause__ is exc


@pytest.mark.parametrize(
    ("exc", "expected"),
    [
        (TimeoutError(), ("timeout", False)),
        (cygrpc.ExecuteBatchError("bad metadata"), ("transport_error", False)),
        (grpc.aio.InternalError("core said no"), ("transport_error", False)),
        (grpc.aio.UsageError("channel closed"), ("internal", False)),
        (grpc.aio.AbortError("abort"), ("internal", False)),
        (grpc.RpcError(), ("internal", False)),
    ],
    ids=lambda v: type(v).__name__,
)
def test_every_other_grpcio_exception_is_mapped(exc: Exception, expected: tuple[str, bool]) -> None:
    with pytest.raises(ReachError) as err, map_grpc_exceptions(ENDPOINT, 1088, 1024):
        raise exc
    assert (err.value.type, err.value.retryable) == expected
    assert err.value.__cause__ is exc


def test_reach_errors_pass_through_unchanged() -> None:
    original = AgentError("mine", retryable=False)
    with pytest.raises(AgentError) as err, map_grpc_exceptions(ENDPOINT, 1088, 1024):
        raise original
    assert err.value is original


def test_a_transport_code_without_the_agents_type_is_a_transport_error() -> None:
    err = error_for_status(ENDPOINT, C.UNAVAILABLE, "failed to connect to all addresses", {})
    assert err.type == "transport_error"
    assert "127.0.0.1:9" in err.message


@pytest.mark.parametrize(
    "details",
    [
        "failed to connect to all addresses; last error: UNKNOWN: ipv4:127.0.0.1:9: "
        "Failed to connect to remote host: Connection refused",
        "DNS resolution failed for nowhere.invalid:443",
    ],
)
def test_a_call_that_never_left_is_a_plain_retryable_transport_error(details: str) -> None:
    err = error_for_status(ENDPOINT, C.UNAVAILABLE, details, {})
    assert (err.type, err.retryable, err.outcome_unknown) == ("transport_error", True, None)


@pytest.mark.parametrize(
    ("code", "details"),
    [
        (C.UNAVAILABLE, "Socket closed"),
        (C.UNAVAILABLE, "recvmsg:Connection reset by peer"),
        (C.CANCELLED, "Received RST_STREAM with error code 8"),
    ],
)
def test_a_break_after_the_call_was_written_is_an_unknown_outcome(
    code: grpc.StatusCode, details: str
) -> None:
    err = error_for_status(ENDPOINT, code, details, {})
    assert (err.type, err.retryable, err.outcome_unknown) == ("transport_error", True, True)
    assert "broke mid-call" in err.message


def test_grpcs_size_refusal_of_the_reply_is_final_and_names_the_limit() -> None:
    details = "Stream removed (CLIENT: Received message larger than max (5003 vs. 1088))"
    err = error_for_status(ENDPOINT, C.RESOURCE_EXHAUSTED, details, {}, 1088, 1024)
    assert isinstance(err, AgentError)
    assert not err.retryable
    assert "5003 bytes" in err.message
    assert "max_message_bytes is 1024" in err.message


def test_the_agents_size_refusal_of_the_payload_is_final() -> None:
    details = "SERVER: Received message larger than max (3006 vs. 2000)"
    err = error_for_status(ENDPOINT, C.RESOURCE_EXHAUSTED, details, {}, 1088, 1024)
    assert not err.retryable
    assert "refused the payload as too large" in err.message
    plain = error_for_status(ENDPOINT, C.RESOURCE_EXHAUSTED, "queue full", {}, 1088, 1024)
    assert plain.retryable  # overload, not size


# -- the SDK server's statuses read back as the HTTP table reads the same answer ------------------


def _reading(err: ReachError) -> tuple[str, bool, str, AgentFault | None]:
    """All a caller is told: type, retry flag, message and the agent's own account."""
    return err.type, err.retryable, err.message, getattr(err, "fault", None)


@pytest.mark.parametrize(
    "status", [400, 401, 403, 404, 405, 409, 410, 413, 418, 422, 429, 500, 502, 503, 504]
)
@pytest.mark.parametrize("retryable", [None, False, True])
def test_the_caller_cannot_tell_grpc_from_http(status: int, retryable: bool | None) -> None:
    answer = error_answer(status, "its_own_type", "its own words", retryable=retryable)
    with pytest.raises(ReachError) as http:
        reply_for_status(ENDPOINT, status, answer.content(), 1024)
    code, details, trailing = status_for(answer)
    via_grpc = error_for_status(ENDPOINT, code, details, dict(trailing))
    assert _reading(via_grpc) == _reading(http.value)


@pytest.mark.parametrize("char", ["é", "中", "😀", "x"])
def test_the_servers_error_metadata_is_always_sendable(char: str) -> None:
    """gRPC clients refuse trailers past 8 KiB at random (16 KiB always), and grpc-message is
    percent-encoded: the details are cut in UTF-8 bytes, between characters, never by count."""
    answer = error_answer(500, "ünïcode\r\ntype" + "x" * 100, char * 5000)
    code, details, trailing = status_for(answer)
    assert code is C.INTERNAL
    encoded = details.encode()
    assert len(encoded) <= 1024
    assert details == char * (len(details) - 1) + "…"  # whole characters, the cut marked
    assert len(encoded) > 1024 - len(char.encode()) - len("…".encode())
    metadata = dict(trailing)
    assert metadata["x-reach-status"] == "500"
    value = metadata["x-reach-error-type"]
    assert value.isascii()
    assert value.isprintable()
    assert len(value) <= 64


def test_short_details_are_sent_whole() -> None:
    text = "日本語 " * 50
    assert status_for(error_answer(422, "t", text))[1] == text
    assert clip_utf8("a😀", 4) == "a…"
    assert clip_utf8("😀😀", 4) == "…"  # not even one emoji and the mark fit: only the mark
    assert clip_utf8("😀😀", 2) == ""
    assert clip_utf8("\ud800ok", 10) == "?ok"  # a lone surrogate cannot travel


@pytest.mark.parametrize("budget", range(0, 20))
def test_a_cut_never_splits_a_character(budget: int) -> None:
    text = "aé中😀" * 5
    cut = clip_utf8(text, budget)
    assert len(cut.encode()) <= budget
    assert text.startswith(cut.removesuffix("…"))


@pytest.mark.parametrize(
    "status", [400, 401, 403, 404, 409, 413, 422, 429, 500, 502, 503, 504, 418, 204, 301]
)
def test_the_agents_http_status_decides_through_the_shared_table(status: int) -> None:
    """With `x-reach-status`, gRPC's code no longer decides: a non-SDK agent that sends it is
    read as an HTTP agent with the same answer, whatever code it picked."""
    body = {"error": {"type": "own", "message": "its words"}}
    with pytest.raises(ReachError) as http:
        reply_for_status(ENDPOINT, status, dumps(body), 1024)
    said = {"x-reach-status": f" {status} ", "x-reach-error-type": "own"}
    via_grpc = error_for_status(ENDPOINT, C.UNKNOWN, "its words", said)
    assert _reading(via_grpc) == _reading(http.value)
    if isinstance(via_grpc, AgentError):
        assert via_grpc.fault is not None
        assert via_grpc.fault.status == status


@pytest.mark.parametrize("said", ["200", "202", "600", "099", "5xx", "", "1e2", "٥٠٣"])
def test_a_status_that_is_no_failure_is_ignored(said: str) -> None:
    err = error_for_status(ENDPOINT, C.INVALID_ARGUMENT, "no", {"x-reach-status": said})
    assert (err.type, err.retryable) == ("agent_error", False)
    assert "INVALID_ARGUMENT" in err.message
    assert isinstance(err, AgentError)
    assert err.fault is not None
    assert err.fault.status == C.INVALID_ARGUMENT.value[0]


def test_the_status_trailer_cannot_ask_for_a_retry_that_was_withheld() -> None:
    said = {"x-reach-status": "503", "x-reach-retryable": "false"}
    err = error_for_status(ENDPOINT, C.UNAVAILABLE, "down for good", said)
    assert (err.type, err.retryable) == ("agent_error", False)
    assert err.message == "agent g1 answered 503: down for good"


def test_result_too_large_from_the_runtime_is_not_retryable() -> None:
    answer = error_answer(500, "result_too_large", "4 KiB > negotiated 2 KiB", retryable=False)
    code, details, trailing = status_for(answer)
    err = error_for_status(ENDPOINT, code, details, dict(trailing))
    assert (err.type, err.retryable) == ("agent_error", False)


# -- replies ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("result", "expected"),
    [(b'{"a":1}', {"a": 1}), (b"[1,2]", {"value": [1, 2]}), (b"", {}), (b"null", {"value": None})],
)
def test_a_result_is_a_json_object(result: bytes, expected: dict[str, Any]) -> None:
    reply = reply_of(ENDPOINT, InvokeReply(result=result).SerializeToString(), 1024)
    assert (reply.status, reply.result) == ("ok", expected)


def test_accepted_is_a_late_answer() -> None:
    reply = reply_of(ENDPOINT, InvokeReply(accepted=True).SerializeToString(), 1024)
    assert (reply.status, reply.result) == ("accepted", None)


@pytest.mark.parametrize(
    ("raw", "why"),
    [
        (b"\xff\xff\xff\xff", "not an InvokeReply"),
        (InvokeReply(result=b"\xff\xfe").SerializeToString(), "not UTF-8"),
        (InvokeReply(result=b'{"x": NaN}').SerializeToString(), "NaN"),
        (InvokeReply(result=b'{"truncated": ').SerializeToString(), "not valid JSON"),
        (InvokeReply(result=b'{"n":"' + b"x" * 2000 + b'"}').SerializeToString(), "limit is 1024"),
    ],
)
def test_a_malformed_reply_is_a_final_agent_error(raw: bytes, why: str) -> None:
    with pytest.raises(AgentError, match=why) as err:
        reply_of(ENDPOINT, raw, 1024)
    assert not err.value.retryable


# -- addresses and metadata ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("address", "normalized"),
    [
        ("127.0.0.1:9001", "127.0.0.1:9001"),
        ("grpc://Retriever.Internal:9001", "retriever.internal:9001"),
        ("GRPC://agent_1:80", "agent_1:80"),
        ("[FD00::0008]:9001", "[fd00::8]:9001"),
        ("grpc://[::1]:50051", "[::1]:50051"),
        ("localhost:65535", "localhost:65535"),
    ],
)
def test_addresses_the_grpc_connector_accepts(address: str, normalized: str) -> None:
    assert GrpcConnector.check_address(address) == normalized


@pytest.mark.parametrize(
    ("address", "why"),
    [
        ("", "empty"),
        ("127.0.0.1", "no port"),
        ("grpc://host", "no port"),
        ("[::1]", "no port"),
        ("127.0.0.1:0", "port '0'"),
        ("127.0.0.1:65536", "port '65536'"),
        ("host:", "port ''"),
        ("::1:80", "brackets"),
        ("[::1:80", "closing"),
        ("[fe80::1%eth0]:80", "zone"),
        ("999.1.1.1:80", "not an IPv4"),
        ("bad host:80", "spaces"),
        ("ágent:80", "ASCII"),
        ("-agent:80", "not a hostname"),
        ("user@host:80", "userinfo"),
        ("http://host:80", "scheme 'http' is not grpc"),
        ("dns:///host:80", "scheme 'dns' is not grpc"),
        ("grpc://host:80/path", "no path"),
        ("host:80?x", "no path, query"),
        ("grpc://" + "a" * 2050 + ":80", "longer"),
    ],
)
def test_addresses_the_grpc_connector_refuses(address: str, why: str) -> None:
    with pytest.raises(InvalidRequest, match=why):
        GrpcConnector.check_address(address)


def _message(**header: Any) -> Message:
    fields = {"request_id": "r1", "caller": "c", "target": "cap", "operation": "op", **header}
    return Message(header=Header(**fields))


def test_metadata_names_are_the_sdks_and_only_those_present_are_sent() -> None:
    full = wire_metadata(
        _message(
            attempt=3,
            deadline_ms=17,
            idempotency_key="k",
            traceparent="00-ab-cd-01",
            context_id="req-1",
        )
    )
    assert {name for name, _ in full} == set(wire.METADATA_NAMES)
    assert dict(full)["x-reach-attempt"] == "3"
    bare = dict(wire_metadata(_message()))
    assert set(bare) == {wire.REQUEST_ID, wire.CALLER, wire.ATTEMPT}


def test_the_connector_and_server_are_found_by_protocol_name() -> None:
    assert load("grpc") is GrpcConnector
    assert isinstance(ConnectorSet().get("grpc"), GrpcConnector)
    assert server_class("grpc") is GrpcAgentServer
    assert METHOD == "/reach.agent.v1.Agent/Invoke"
