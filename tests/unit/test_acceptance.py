"""Property tests for the acceptance rules: what the door accepts, every later hop can carry;
what it refuses, it refuses with Reach's own two errors and nothing else."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from temporalio.contrib.pydantic import pydantic_data_converter

from reach import acceptance
from reach.errors import InvalidRequest, PayloadTooLarge
from reach.invocation import CallInput, CallPlan, Endpoint, InvokeInput
from reach.limits import MAX_DEPTH, TEMPORAL_PAYLOAD_LIMIT_BYTES, Limits
from reach.messages import Header, InvokeResponse, Message, dumps

LIMITS = Limits(max_message_bytes=64 * 1024)
CONVERTER = pydantic_data_converter.payload_converter

# Any text, unpaired surrogates and control characters included: what a JSON body can spell.
any_text = st.text(st.characters(codec=None), max_size=40)
scalars = st.none() | st.booleans() | st.integers() | st.floats() | any_text
json_values = st.recursive(
    scalars,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(any_text, inner, max_size=4),
    max_leaves=30,
)


def _body(payload: Any) -> bytes:
    # json.dumps writes NaN/Infinity and "\ud800" escapes: exactly the input the door must judge.
    return json.dumps({"target": "cap", "operation": "query", "payload": payload}).encode()


def _round_trip(value: Any, kind: type[Any]) -> Any:
    [payload] = CONVERTER.to_payloads([value])
    assert payload.ByteSize() < TEMPORAL_PAYLOAD_LIMIT_BYTES
    return CONVERTER.from_payloads([payload], [kind])[0]


@settings(max_examples=300, suppress_health_check=[HealthCheck.too_slow])
@given(st.dictionaries(any_text, json_values, max_size=5))
def test_what_the_door_accepts_the_workflow_can_decode(payload: dict[str, Any]) -> None:
    """The poison-input property: accepted input never becomes a workflow that cannot run."""
    try:
        req, encoded = acceptance.invoke_request(_body(payload), LIMITS)
    except (InvalidRequest, PayloadTooLarge):
        return
    assert encoded == dumps(req.payload)  # measured as it will be sent
    inp = InvokeInput(
        request_id="r",
        caller="c",
        target=req.target,
        operation=req.operation,
        payload=req.payload,
        accepted_at_ms=0,
        deadline_ms=1,
        plan=CallPlan(timeout_ms=1, idempotent=True, max_retries=0),
    )
    assert _round_trip(inp, InvokeInput) == inp
    call = CallInput(
        endpoint=Endpoint(instance_id="i", capability="cap", protocol="http", address="a:1"),
        message=Message(
            header=Header(request_id="r", caller="c", target="cap", operation="query"),
            payload=req.payload,
        ),
        timeout_ms=1,
    )
    assert _round_trip(call, CallInput) == call
    # ... and as an agent's result, back through the workflow's result.
    response = InvokeResponse(request_id="r", status="success", result=req.payload)
    assert _round_trip(response, InvokeResponse) == response


@given(st.binary(max_size=200) | json_values.map(lambda v: json.dumps(v).encode()))
def test_any_bytes_are_parsed_or_refused_as_invalid_request(raw: bytes) -> None:
    try:
        value = acceptance.parse_json(raw)
    except InvalidRequest:
        return
    assert value == json.loads(raw)  # what it accepts, it reads as JSON does


@given(
    st.dictionaries(
        st.sampled_from(
            [
                "capability",
                "instance_id",
                "service_address",
                "heartbeat_interval",
                "operations",
                "labels",
                "max_message_bytes",
                "protocol",
                "async_callback",
                "surprise",
            ]
        ),
        json_values,
        max_size=8,
    )
)
def test_any_join_body_is_a_join_or_a_typed_refusal(body: dict[str, Any]) -> None:
    try:
        join = acceptance.join_request(json.dumps(body).encode(), LIMITS)
    except (InvalidRequest, PayloadTooLarge):
        return
    assert join.service_address.isascii()
    assert join.service_address.isprintable()
    assert len(join.labels) <= 32


@given(st.dictionaries(st.sampled_from(["status", "checks", "inflight", "x"]), json_values))
def test_any_heartbeat_is_a_report_or_a_typed_refusal(body: dict[str, Any]) -> None:
    try:
        report = acceptance.health_report(json.dumps(body).encode(), LIMITS)
    except (InvalidRequest, PayloadTooLarge):
        return
    assert len(dumps(report.checks)) <= 16 * 1024


@given(st.dictionaries(st.sampled_from(["status", "checks", "inflight", "x"]), json_values))
def test_a_heartbeat_read_as_values_is_judged_as_its_body_is(body: dict[str, Any]) -> None:
    # The gRPC front's reports: the same report, or the same refusal, as the HTTP body. The
    # body is written as the front writes it (a lone surrogate escaped; NaN it refuses first).
    try:
        try:
            raw = dumps(body)
        except UnicodeEncodeError:
            raw = json.dumps(body, separators=(",", ":")).encode()
    except ValueError:
        assume(False)
    outcomes = []
    for check in (
        lambda: acceptance.health_report(raw, LIMITS),
        lambda: acceptance.health_report_values(body, raw, LIMITS),
    ):
        try:
            outcomes.append(check())
        except (InvalidRequest, PayloadTooLarge) as exc:
            outcomes.append((type(exc), exc.message))
    assert outcomes[0] == outcomes[1]


@given(
    st.dictionaries(
        st.sampled_from(["status", "result", "error_type", "error_message", "instance_id"]),
        json_values,
    )
)
def test_any_late_answer_is_an_answer_or_a_typed_refusal(body: dict[str, Any]) -> None:
    try:
        answer = acceptance.late_answer(json.dumps(body).encode(), LIMITS)
    except (InvalidRequest, PayloadTooLarge):
        return
    if answer.result is not None:
        assert len(dumps(answer.result)) <= LIMITS.max_message_bytes


@pytest.mark.parametrize(
    "check",
    [
        acceptance.caller_header,
        acceptance.traceparent_header,
        acceptance.idempotency_key_header,
    ],
)
@given(value=st.text(st.characters(codec=None), max_size=80))
def test_a_header_value_is_accepted_only_if_http_can_carry_it(check: Any, value: str) -> None:
    try:
        accepted = check(value)
    except InvalidRequest:
        return
    if accepted is None:
        assert not value.strip()  # empty means absent
        return
    # httpx (h11) refuses non-ASCII and control characters: an accepted value always passes.
    httpx.Request("POST", "http://agent/reach/op", headers={"x-test": accepted})
    assert accepted.isascii()
    assert accepted.isprintable()


@given(st.integers(min_value=0, max_value=MAX_DEPTH + 40))
def test_nesting_is_accepted_exactly_up_to_the_limit(depth: int) -> None:
    value: Any = 0
    for _ in range(depth):
        value = [value]
    if depth <= MAX_DEPTH:
        acceptance.check_json(value, what="payload", limit=1 << 20)
    else:
        with pytest.raises(InvalidRequest, match="nested more than"):
            acceptance.check_json(value, what="payload", limit=1 << 20)


@given(json_values)
def test_the_size_limit_is_exact_as_sent(value: Any) -> None:
    try:
        size = len(dumps(value))
    except (UnicodeEncodeError, ValueError):
        return  # not encodable: refused for that, tested above
    acceptance.check_json(value, what="v", limit=size)
    with pytest.raises(PayloadTooLarge, match=f"is {size} bytes as sent"):
        acceptance.check_json(value, what="v", limit=size - 1)
