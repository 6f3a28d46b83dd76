"""The standard message (Header + Payload + Metadata) and the invoke envelope (R1, R4, R9, R10).

Every connector converts to and from `Message`/`Reply`; callers always send `InvokeRequest` and
receive `InvokeResponse`, whatever protocol the agent speaks.
"""

from __future__ import annotations

import json
import uuid
from typing import Annotated, Any, Literal

from pydantic import AnyHttpUrl, BaseModel, ConfigDict, Field, StringConstraints

RequestId = Annotated[str, StringConstraints(pattern=r"^[A-Za-z0-9][A-Za-z0-9._:-]{0,127}$")]
CapabilityName = Annotated[str, StringConstraints(pattern=r"^[a-z0-9][a-z0-9._-]{0,63}$")]
OperationName = Annotated[str, StringConstraints(pattern=r"^[A-Za-z0-9_][A-Za-z0-9_.-]{0,63}$")]

RequestStatus = Literal["accepted", "running", "success", "error", "timeout"]

MAX_TIMEOUT_MS = 24 * 3600 * 1000


def new_request_id() -> str:
    return f"req-{uuid.uuid4().hex}"


def json_size(value: Any) -> int:
    return len(json.dumps(value, separators=(",", ":"), ensure_ascii=False).encode())


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
    `POST /reach/requests/{request_id}/result` (R3).
    """

    status: Literal["ok", "accepted"]
    result: dict[str, Any] | None = None


class ErrorInfo(BaseModel):
    type: str
    message: str
    retryable: bool = False


class InvokeRequest(BaseModel):
    """The body of `POST /reach/invoke` (R9)."""

    model_config = ConfigDict(extra="forbid")

    request_id: RequestId | None = Field(
        default=None, description="Globally unique; generated when absent. A repeat attaches."
    )
    target: CapabilityName = Field(description="A capability name, never an address.")
    operation: OperationName
    payload: dict[str, Any] = Field(default_factory=dict)
    timeout_ms: int | None = Field(
        default=None, ge=1, le=MAX_TIMEOUT_MS, description="The request's deadline."
    )
    callback: AnyHttpUrl | None = Field(
        default=None, description="When set, answer 202 at once and POST the result here."
    )
    idempotency_key: str | None = Field(default=None, max_length=256)
    routing_key: str | None = Field(default=None, max_length=256)


class InvokeResponse(BaseModel):
    """The one envelope for results, errors, callbacks and status look-ups (R10)."""

    request_id: str
    status: RequestStatus
    duration_ms: int | None = None
    result: dict[str, Any] | None = None
    error: ErrorInfo | None = None
    instance_id: str | None = None
