"""The standard message (Header + Payload + Metadata) and the invoke envelope (R1, R4, R9, R10).

Every connector converts to and from `Message`/`Reply`; callers always send `InvokeRequest` and
receive `InvokeResponse`, whatever protocol the agent speaks.

Field types here are the shapes every hop can carry: identifiers and header values are visible
ASCII (HTTP, gRPC metadata and MQTT properties all take them), free text has no control
characters. What is acceptable beyond shape (sizes, nesting) is decided in `reach.acceptance`.
"""

from __future__ import annotations

import json
import uuid
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    AnyHttpUrl,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    StringConstraints,
    UrlConstraints,
    model_validator,
)

from reach.errors import AGENT_TEXT_MAX, ERROR_TYPES, AgentFault, ErrorType, clipped

REQUEST_ID_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._:-]{0,127}$"
RequestId = Annotated[str, StringConstraints(pattern=REQUEST_ID_PATTERN)]
InstanceId = RequestId
CapabilityName = Annotated[str, StringConstraints(pattern=r"^[a-z0-9][a-z0-9._-]{0,63}$")]
OperationName = Annotated[str, StringConstraints(pattern=r"^[A-Za-z0-9_][A-Za-z0-9_.-]{0,63}$")]
# A caller's name travels as a header to every agent: visible ASCII, no spaces.
CallerName = Annotated[str, StringConstraints(pattern=r"^[\x21-\x7e]{1,128}$")]
# The IETF Idempotency-Key draft's sf-string: printable ASCII, not starting or ending in a space.
IdempotencyKey = Annotated[
    str, StringConstraints(pattern=r"^[\x21-\x7e](?:[\x20-\x7e]{0,254}[\x21-\x7e])?$")
]
# Hashed, never sent as a header: any text without control characters.
RoutingKey = Annotated[str, StringConstraints(pattern=r"^[^\x00-\x1f\x7f]{1,256}$")]


def _valid_trace_ids(value: str) -> str:
    version, trace_id, parent_id = value.split("-")[:3]
    if version == "ff" or not trace_id.strip("0") or not parent_id.strip("0"):
        raise ValueError("version ff and all-zero trace or parent ids are invalid")
    return value


# W3C Trace Context `traceparent`: version-traceid-parentid-flags, lower-case hex.
Traceparent = Annotated[
    str,
    StringConstraints(
        pattern=r"^[0-9a-f]{2}-[0-9a-f]{32}-[0-9a-f]{16}-[0-9a-f]{2}(?:-[\x21-\x7e]{1,64})?$"
    ),
    AfterValidator(_valid_trace_ids),
]
CallbackUrl = Annotated[AnyHttpUrl, UrlConstraints(max_length=2048)]
ErrorTypeName = Annotated[str, StringConstraints(pattern=r"^[A-Za-z0-9_.:-]{1,64}$")]
ErrorText = Annotated[str, StringConstraints(max_length=AGENT_TEXT_MAX)]


def _integral(value: Any) -> Any:
    # JSON has one number type: 5.0 is an integer in JSON Schema's sense. Booleans stay refused.
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value


# An integer field as JSON Schema means it (5 and 5.0), under strict validation otherwise.
JsonInt = Annotated[int, BeforeValidator(_integral)]

# input_required: an A2A agent's task waits for the caller (input-required, auth-required);
# canceled: the agent canceled it. Both final, HTTP 200, `result` says which task
# (docs/protocols/a2a.md).
RequestStatus = Literal[
    "accepted", "running", "success", "error", "timeout", "input_required", "canceled"
]
DeliveryStatus = Literal["pending", "delivered", "given_up"]

MAX_TIMEOUT_MS = 24 * 3600 * 1000


def new_request_id() -> str:
    return f"req-{uuid.uuid4().hex}"


def dumps(value: Any) -> bytes:
    """The one JSON encoding Reach sends and measures: compact, UTF-8, standard JSON only.

    Sizes are measured with it and connectors send it, so a payload within a limit stays
    within it on the wire (escaping non-ASCII would grow it up to six times).
    """
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False, allow_nan=False).encode()


def json_size(value: Any) -> int:
    return len(dumps(value))


class Header(BaseModel):
    """What every hop needs to know about a request, whatever the protocol."""

    request_id: str
    caller: str
    target: str
    operation: str
    attempt: int = 1
    deadline_ms: int | None = None  # absolute, Unix epoch milliseconds
    idempotency_key: str | None = None
    traceparent: str | None = None
    context_id: str | None = None  # the conversation it belongs to (InvokeRequest.context_id)


class Metadata(BaseModel):
    content_type: str = "application/json"
    size_bytes: int = 0
    labels: dict[str, str] = Field(default_factory=dict)


class Message(BaseModel):
    header: Header
    payload: dict[str, Any] = Field(default_factory=dict)
    metadata: Metadata = Field(default_factory=Metadata)


class Reply(BaseModel):
    """An agent's answer as a connector reports it.

    `accepted` means the agent took the request and will answer later through
    `POST /reach/requests/{request_id}/result` (R3) — or, with `follow`, that the connector can
    follow the work itself: the handle (an A2A task's id, context id and URL) is kept in the
    request's history and handed to `Connector.follow` until the work ends.
    `input_required` and `canceled` are final answers of an agent's task (A2A): `result` holds
    the task and context ids, its state and the agent's words (docs/protocols/a2a.md).
    """

    status: Literal["ok", "accepted", "input_required", "canceled"]
    result: dict[str, Any] | None = None
    follow: dict[str, Any] | None = None
    named: dict[str, str] | None = Field(
        default=None,
        description="The agent's own task and context ids a final answer names (an A2A "
        "completed task's, a message's): kept as the caller's (a follow-up naming them is "
        "only its own), not part of the result.",
    )


class ErrorInfo(BaseModel):
    """`type` is one of Reach's own error types and alone decides the HTTP status."""

    type: ErrorType
    message: Annotated[str, clipped(2 * AGENT_TEXT_MAX)]
    retryable: bool = False
    agent: AgentFault | None = Field(
        default=None, description="For agent_error: the agent's own error type and message."
    )
    retry_after_s: int | None = Field(
        default=None, description="For circuit_open and rate_limited: when to try again."
    )
    outcome_unknown: bool | None = Field(
        default=None,
        description="The request reached an agent (or may have) and its answer never came: "
        "the agent may have run it. Find out whether it ran before sending it again: sent again "
        "with the same idempotency_key it runs nothing and gets this answer back, while a "
        "keyless repeat, or one with a new key, may run it a second time.",
    )

    @model_validator(mode="before")
    @classmethod
    def _agent_words_stay_inside(cls, data: Any) -> Any:
        # Histories recorded before the vocabulary was closed can hold an agent's own type here.
        if isinstance(data, dict) and data.get("type") not in ERROR_TYPES:
            fault = {"type": str(data.get("type") or "agent_error"), "message": data.get("message")}
            data = {**data, "type": "agent_error", "agent": data.get("agent") or fault}
        return data


class DeliveryState(BaseModel):
    """Callback delivery, a fact of its own beside the request's (final) result."""

    url: str
    status: DeliveryStatus
    attempts: int = 0
    last_error: str | None = None


EXAMPLE_REQUEST_ID = "req-20250516-001"


class InvokeRequest(BaseModel):
    """The body of `POST /reach/invoke` (R9)."""

    model_config = ConfigDict(
        extra="forbid",
        json_schema_extra={
            "examples": [
                {
                    "request_id": EXAMPLE_REQUEST_ID,
                    "target": "knowledge-retriever",
                    "operation": "query",
                    "payload": {"text": "durable retries", "top_k": 2},
                    "timeout_ms": 3000,
                }
            ]
        },
    )

    request_id: RequestId | None = Field(
        default=None, description="Globally unique; generated when absent. A repeat attaches."
    )
    target: CapabilityName = Field(description="A capability name, never an address.")
    operation: OperationName
    payload: dict[str, Any] = Field(default_factory=dict)
    timeout_ms: JsonInt | None = Field(
        default=None, ge=1, le=MAX_TIMEOUT_MS, description="The request's deadline."
    )
    callback: CallbackUrl | None = Field(
        default=None, description="When set, answer 202 at once and POST the result here."
    )
    idempotency_key: IdempotencyKey | None = None
    routing_key: RoutingKey | None = None
    context_id: RequestId | None = Field(
        default=None,
        description="The conversation this request belongs to: the RequestID of its first "
        "request (or of any request of it), of the same target and caller; the request's own "
        "id starts one. Sent to the agent (x-reach-context-id; an A2A agent's contextId).",
    )


class AttemptInfo(BaseModel):
    """One attempt as policy saw it: where it went, how it ended, what came after."""

    attempt: int
    instance_id: str | None = None
    outcome: str  # "success", "accepted", or the error type
    duration_ms: int = 0
    breaker: str | None = Field(
        default=None, description="The capability's circuit breaker when it was admitted."
    )
    backoff_ms: int | None = Field(default=None, description="The wait before the next one.")


class InvokeResponse(BaseModel):
    """The one envelope for results, errors, callbacks and status look-ups (R10)."""

    request_id: str
    status: RequestStatus
    duration_ms: int | None = None
    result: dict[str, Any] | None = None
    error: ErrorInfo | None = None
    instance_id: str | None = None
    delivery: DeliveryState | None = None
    attempts: list[AttemptInfo] | None = Field(
        default=None, description="Every attempt, with its backoff (policy decisions)."
    )
    waited_ms: int | None = Field(
        default=None, description="Time spent waiting for a rate-limit token (on_limit: queue)."
    )
    replayed_from: str | None = Field(
        default=None,
        description="With an idempotency_key used before: the request whose result this is "
        "(no agent was called for this one).",
    )


class ErrorResponse(InvokeResponse):
    """The same envelope when something failed. `request_id` is null only when the request was
    refused before one was read (a body that is not JSON, say)."""

    request_id: str | None  # type: ignore[assignment]
    status: Literal["error", "timeout", "running"]
    error: ErrorInfo
