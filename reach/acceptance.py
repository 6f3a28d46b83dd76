"""What Reach accepts at its doors, decided in one place from the limits of what carries it.

Every invoke, Join, heartbeat and late answer passes through here before anything else sees it,
so nothing is accepted that a later hop cannot carry. The numbers are in `reach.limits`:

- **Size, as sent.** A request's payload travels in its workflow input and activity inputs, an
  agent's result in a marker, the workflow result and the callback. Temporal refuses any one
  payload blob over `temporal.payload_limit_bytes` (2 MiB by default), so
  `transport.max_message_bytes` (1 MiB by default) leaves 64 KiB for the fields around it; the
  settings refuse to load otherwise. Sizes are measured with `reach.messages.dumps`, the
  encoding connectors send. A request's history then holds at most about seven such copies
  (input, queue-mode calls, result, callback), far inside Temporal's 50 MiB history limit.
- **The raw body** is refused before it is parsed once it passes `Limits.max_body_bytes`.
- **Nesting.** Payloads, results and health checks nest at most `MAX_DEPTH` levels (the SDK's
  JSON decoder stops at 200, and Reach's own messages add levels around a payload).
- **Standard JSON only.** No NaN or Infinity, no float that overflows to infinity, no integer
  past Python's 4300-digit conversion limit, no unpaired UTF-16 surrogate (it has no UTF-8
  encoding, so no hop could carry it).
- **Header values and identifiers** are visible ASCII; the field types in `reach.messages` say
  exactly which characters.

Every refusal is a `PayloadTooLarge` (413) or an `InvalidRequest` (422) naming what was wrong.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from typing import Any, TypeVar

from pydantic import BaseModel, ConfigDict, TypeAdapter, ValidationError
from pydantic.json_schema import SkipJsonSchema

from reach.errors import InvalidRequest, PayloadTooLarge
from reach.invocation import LateAnswer
from reach.limits import MAX_CHECKS_BYTES, MAX_DEPTH, Limits
from reach.messages import (
    CallerName,
    ErrorText,
    ErrorTypeName,
    IdempotencyKey,
    InstanceId,
    InvokeRequest,
    Traceparent,
    dumps,
)
from reach.registry import HealthReport, JoinRequest
from reach.registry.by_url import UrlRegistration

M = TypeVar("M", bound=BaseModel)

__all__ = [
    "LateAnswerBody",
    "Limits",
    "caller_header",
    "check_json",
    "health_report",
    "health_report_values",
    "idempotency_key_header",
    "invoke_request",
    "join_request",
    "late_answer",
    "one_idempotency_key",
    "parse_json",
    "parse_model",
    "traceparent_header",
]


class LateAnswerBody(LateAnswer):
    """What an agent may POST as its late answer: the workflow's model, narrowed."""

    model_config = ConfigDict(
        extra="forbid",
        json_schema_extra={"examples": [{"status": "success", "result": {"answer": 42}}]},
    )

    instance_id: InstanceId | None = None
    error_type: ErrorTypeName | None = None
    error_message: ErrorText | None = None
    # Who answers comes from the token, never from the body.
    principal: SkipJsonSchema[None] = None


# -- JSON ---------------------------------------------------------------------------------------


def _refuse_constant(name: str) -> Any:
    raise InvalidRequest(f"{name} is not a JSON number; standard JSON has no NaN or Infinity")


def _finite_float(text: str) -> float:
    value = float(text)
    if math.isinf(value):
        raise InvalidRequest(f"number {text[:40]} is too large for a 64-bit float")
    return value


def parse_json(raw: bytes, *, what: str = "body") -> Any:
    """Parse standard JSON, refusing what a later hop could not carry."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise InvalidRequest(f"{what} is not UTF-8 (byte {exc.start})") from None
    try:
        return json.loads(text, parse_constant=_refuse_constant, parse_float=_finite_float)
    except json.JSONDecodeError as exc:
        raise InvalidRequest(
            f"{what} is not valid JSON (at character {exc.pos}): {exc.msg}"
        ) from None
    except RecursionError:
        raise InvalidRequest(f"{what} is nested more than {MAX_DEPTH} levels deep") from None
    except ValueError as exc:  # an int past Python's digit limit
        raise InvalidRequest(f"{what} has a number Reach cannot carry: {exc}") from None


def _depth(value: Any, stop_after: int) -> int:
    """Nesting depth of containers (a scalar is 0, `{}` is 1), counted up to `stop_after` + 1."""
    deepest = 0
    level = [value] if isinstance(value, dict | list) else []
    while level and deepest <= stop_after:
        deepest += 1
        level = [
            child
            for c in level
            for child in (c.values() if isinstance(c, dict) else c)
            if isinstance(child, dict | list)
        ]
    return deepest


def check_json(value: Any, *, what: str, limit: int, max_depth: int = MAX_DEPTH) -> bytes:
    """Check the nesting and encodability of a JSON value; return it encoded as sent."""
    if _depth(value, max_depth) > max_depth:
        raise InvalidRequest(f"{what} is nested more than {max_depth} levels deep")
    try:
        encoded = dumps(value)
    except UnicodeEncodeError as exc:
        bad = exc.object[exc.start : exc.end].encode("unicode_escape").decode()
        raise InvalidRequest(
            f"{what} contains an unpaired UTF-16 surrogate ({bad}), which no hop can carry"
        ) from None
    except ValueError as exc:  # NaN or Infinity that did not come from parsing
        raise InvalidRequest(f"{what} is not standard JSON: {exc}") from None
    if len(encoded) > limit:
        raise PayloadTooLarge(f"{what} is {len(encoded)} bytes as sent; the limit is {limit} bytes")
    return encoded


# -- models -------------------------------------------------------------------------------------


def describe_validation_error(exc: ValidationError, *, root: str = "body") -> str:
    """One line naming every field that was wrong."""
    parts = []
    for err in exc.errors(include_url=False):
        where = ".".join(str(p) for p in err["loc"]) or root
        parts.append(f"{where}: {err['msg']}")
    return "; ".join(parts)


def parse_model(model: type[M], raw: bytes, limits: Limits, *, what: str = "body") -> M:
    """A request body: size first, then the JSON rules, then the model's own fields."""
    if len(raw) > limits.max_body_bytes:
        raise PayloadTooLarge(
            f"{what} is {len(raw)} bytes; the limit is {limits.max_body_bytes} bytes"
        )
    data = parse_json(raw, what=what)
    if not isinstance(data, dict):
        raise InvalidRequest(f"{what} must be a JSON object (Content-Type: application/json)")
    try:
        # Strict: JSON's types as written (no "5" for 5, no 0 for false).
        return model.model_validate(data, strict=True)
    except ValidationError as exc:
        raise InvalidRequest(describe_validation_error(exc, root=what)) from None


def invoke_request(raw: bytes, limits: Limits) -> tuple[InvokeRequest, bytes]:
    """`POST /reach/invoke`: the request, and its payload encoded as it will be sent."""
    req = parse_model(InvokeRequest, raw, limits)
    payload = check_json(
        req.payload, what="payload", limit=limits.max_message_bytes, max_depth=limits.max_depth
    )
    return req, payload


def join_request(raw: bytes, limits: Limits) -> JoinRequest:
    """`POST /reach/agents`. The service address's form is the connector's to check."""
    return parse_model(JoinRequest, raw, limits)


def join_or_registration(
    raw: bytes, limits: Limits, by_url: Callable[[str], bool]
) -> JoinRequest | UrlRegistration:
    """`POST /reach/agents`: a Join, or a registration by URL when the body's `protocol` is
    one whose instances are registered by URL (`by_url(protocol)`: A2A, MCP)."""
    if len(raw) > limits.max_body_bytes:
        raise PayloadTooLarge(
            f"body is {len(raw)} bytes; the limit is {limits.max_body_bytes} bytes"
        )
    data = parse_json(raw)
    if not isinstance(data, dict):
        raise InvalidRequest("body must be a JSON object (Content-Type: application/json)")
    protocol = data.get("protocol")
    model: type[JoinRequest | UrlRegistration] = JoinRequest
    if isinstance(protocol, str) and by_url(protocol):
        model = UrlRegistration
    try:
        return model.model_validate(data, strict=True)
    except ValidationError as exc:
        said = describe_validation_error(exc, root="body")
        if model is JoinRequest and "instance_id" not in data and isinstance(protocol, str):
            # `reach agents add grpc URL` said only "instance_id: Field required".
            said += (
                f" (a {protocol} instance joins by itself, naming its instance_id, as the SDK"
                " does; only protocols such as a2a and mcp are registered by URL:"
                " docs/instances-by-url.md)"
            )
        raise InvalidRequest(said) from None


def health_report(raw: bytes, limits: Limits) -> HealthReport:
    """`PUT /reach/agents/{id}/heartbeat`; an empty body is an 'ok' report."""
    report = parse_model(HealthReport, raw or b"{}", limits)
    check_json(report.checks, what="checks", limit=MAX_CHECKS_BYTES, max_depth=limits.max_depth)
    return report


def health_report_values(values: dict[str, Any], body: bytes, limits: Limits) -> HealthReport:
    """`health_report` of a report already read as JSON values (a gRPC front's fields, each
    parsed under the JSON rules), `body` the JSON they make: what the HTTP route checks of
    that body, without parsing it again."""
    if len(body) > limits.max_body_bytes:
        raise PayloadTooLarge(
            f"body is {len(body)} bytes; the limit is {limits.max_body_bytes} bytes"
        )
    try:
        report = HealthReport.model_validate(values, strict=True)
    except ValidationError as exc:
        raise InvalidRequest(describe_validation_error(exc, root="body")) from None
    check_json(report.checks, what="checks", limit=MAX_CHECKS_BYTES, max_depth=limits.max_depth)
    return report


def late_answer(raw: bytes, limits: Limits) -> LateAnswer:
    """`POST /reach/requests/{id}/result`, as the workflow will receive it."""
    body = parse_model(LateAnswerBody, raw, limits)
    if body.result is not None:
        check_json(
            body.result, what="result", limit=limits.max_message_bytes, max_depth=limits.max_depth
        )
    return LateAnswer.model_validate(body.model_dump())


# -- headers ------------------------------------------------------------------------------------

_CALLER: TypeAdapter[str] = TypeAdapter(CallerName)
_TRACEPARENT: TypeAdapter[str] = TypeAdapter(Traceparent)
_IDEMPOTENCY_KEY: TypeAdapter[str] = TypeAdapter(IdempotencyKey)


def _header(adapter: TypeAdapter[str], name: str, value: str | None, rule: str) -> str | None:
    if value is None or not value.strip():
        return None  # an empty header is no header
    try:
        return adapter.validate_python(value)
    except ValidationError:
        shown = value[:40].encode("unicode_escape").decode()
        raise InvalidRequest(f"header {name}: {shown!r} is not {rule}") from None


def caller_header(value: str | None) -> str | None:
    return _header(_CALLER, "X-Reach-Caller", value, "1-128 visible ASCII characters")


def traceparent_header(value: str | None) -> str | None:
    return _header(
        _TRACEPARENT,
        "traceparent",
        value,
        "a W3C traceparent (version-traceid-parentid-flags, lower-case hex)",
    )


def one_idempotency_key(in_body: str | None, in_header: str | None) -> str | None:
    """The body's `idempotency_key` or the `Idempotency-Key` header; both must then agree."""
    if in_body and in_header and in_body != in_header:
        raise InvalidRequest("idempotency_key in the body and the Idempotency-Key header differ")
    return in_body or in_header


def idempotency_key_header(value: str | None) -> str | None:
    return _header(_IDEMPOTENCY_KEY, "Idempotency-Key", value, "1-256 printable ASCII characters")
