"""One exception tree and one error vocabulary for every protocol, the audit log and metrics.

    ReachError                      type                status
    ├── InvalidRequest              invalid_request     422
    ├── PayloadTooLarge             payload_too_large   413
    ├── Unauthorized                unauthorized        401
    ├── Forbidden                   forbidden           403
    ├── UnknownCapability           unknown_capability  404
    ├── RateLimited                 rate_limited        429
    ├── NoInstance                  no_instance         503
    ├── CircuitOpen                 circuit_open        503
    ├── DeadlineExceeded            timeout             504
    ├── AgentError                  agent_error         502
    ├── TransportError              transport_error     502
    ├── UnknownInstance             unknown_instance    404  (heartbeat: join again)
    ├── InstanceReplaced            instance_replaced   409  (heartbeat: another process joined)
    ├── UnknownRequest              unknown_request     404  (status/result of an unknown id)
    ├── NotFound                    not_found           404  (no such route)
    ├── MethodNotAllowed            method_not_allowed  405  (the route exists, not the method)
    ├── RequestConflict             request_conflict    409  (a repeated request_id, other body)
    ├── IdempotencyConflict         idempotency_conflict 409 (a reused key, other payload)
    ├── RequestClosed               request_closed      409  (a late answer after the end)
    ├── Unavailable                 unavailable         503  (Temporal or the store is down)
    └── InternalError               internal            500  (a bug in Reach, never an agent's)

Only these types decide an HTTP status. Whatever an agent reports (an HTTP error body, a late
answer's `error_type`) is an `agent_error` carrying the agent's own type and message as an
`AgentFault`; it never chooses the caller's status.

`retryable` says whether the same request may succeed if tried again (possibly elsewhere); the
policy engine decides whether it actually is.
"""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal, get_args

from pydantic import BaseModel, BeforeValidator, Field

ErrorType = Literal[
    "invalid_request",
    "payload_too_large",
    "unauthorized",
    "forbidden",
    "unknown_capability",
    "rate_limited",
    "no_instance",
    "circuit_open",
    "timeout",
    "agent_error",
    "transport_error",
    "unknown_instance",
    "instance_replaced",
    "unknown_request",
    "not_found",
    "method_not_allowed",
    "request_conflict",
    "idempotency_conflict",
    "request_closed",
    "unavailable",
    "internal",
]
ERROR_TYPES: frozenset[str] = frozenset(get_args(ErrorType))

AGENT_TEXT_MAX = 1000


def clipped(limit: int) -> BeforeValidator:
    """Keep at most `limit` characters: an agent's words are evidence, not a channel."""

    def clip(value: Any) -> Any:
        if isinstance(value, str) and len(value) > limit:
            return value[: limit - 1] + "…"
        return value

    return BeforeValidator(clip)


class AgentFault(BaseModel):
    """What an agent said about its own failure, kept inside an `agent_error`."""

    type: Annotated[str, clipped(64)] = "agent_error"
    message: Annotated[str, clipped(AGENT_TEXT_MAX)] = ""
    status: int | None = Field(default=None, description="the agent's protocol status, e.g. HTTP")


class ReachError(Exception):
    type: ClassVar[ErrorType]
    http_status: ClassVar[int]
    default_retryable: ClassVar[bool] = False

    def __init__(
        self,
        message: str,
        *,
        retryable: bool | None = None,
        retry_after_s: int | None = None,
        outcome_unknown: bool | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.retryable = self.default_retryable if retryable is None else retryable
        self.retry_after_s = retry_after_s  # 429/503: Retry-After, when Reach knows better than 1
        self.outcome_unknown = outcome_unknown  # sent, never answered: the agent may have run it


class InvalidRequest(ReachError):
    type = "invalid_request"
    http_status = 422


class PayloadTooLarge(ReachError):
    type = "payload_too_large"
    http_status = 413


class Unauthorized(ReachError):
    type = "unauthorized"
    http_status = 401


class Forbidden(ReachError):
    type = "forbidden"
    http_status = 403


class UnknownCapability(ReachError):
    type = "unknown_capability"
    http_status = 404


class RateLimited(ReachError):
    type = "rate_limited"
    http_status = 429
    default_retryable = True


class NoInstance(ReachError):
    type = "no_instance"
    http_status = 503
    default_retryable = True


class CircuitOpen(ReachError):
    type = "circuit_open"
    http_status = 503
    default_retryable = True


class DeadlineExceeded(ReachError):
    type = "timeout"
    http_status = 504


class AgentError(ReachError):
    """The agent answered with a failure; `fault` keeps what it said, in its own words."""

    type = "agent_error"
    http_status = 502

    def __init__(
        self, message: str, *, retryable: bool | None = None, fault: AgentFault | None = None
    ) -> None:
        super().__init__(message, retryable=retryable)
        self.fault = fault


class TransportError(ReachError):
    type = "transport_error"
    http_status = 502
    default_retryable = True


class UnknownInstance(ReachError):
    type = "unknown_instance"
    http_status = 404


class InstanceReplaced(ReachError):
    """A heartbeat from a process whose instance_id another process has joined since."""

    type = "instance_replaced"
    http_status = 409


class UnknownRequest(ReachError):
    type = "unknown_request"
    http_status = 404


class NotFound(ReachError):
    type = "not_found"
    http_status = 404


class MethodNotAllowed(ReachError):
    type = "method_not_allowed"
    http_status = 405


class RequestConflict(ReachError):
    type = "request_conflict"
    http_status = 409


class IdempotencyConflict(ReachError):
    type = "idempotency_conflict"
    http_status = 409


class RequestClosed(ReachError):
    type = "request_closed"
    http_status = 409


class Unavailable(ReachError):
    type = "unavailable"
    http_status = 503
    default_retryable = True


class InternalError(ReachError):
    type = "internal"
    http_status = 500


ERRORS_BY_TYPE: dict[str, type[ReachError]] = {
    cls.type: cls
    for cls in (
        InvalidRequest,
        PayloadTooLarge,
        Unauthorized,
        Forbidden,
        UnknownCapability,
        RateLimited,
        NoInstance,
        CircuitOpen,
        DeadlineExceeded,
        AgentError,
        TransportError,
        UnknownInstance,
        InstanceReplaced,
        UnknownRequest,
        NotFound,
        MethodNotAllowed,
        RequestConflict,
        IdempotencyConflict,
        RequestClosed,
        Unavailable,
        InternalError,
    )
}
assert set(ERRORS_BY_TYPE) == ERROR_TYPES, "every error type has exactly one class"


def http_status_for(error_type: ErrorType) -> int:
    """The HTTP status of one of Reach's own error types (KeyError for anything else)."""
    return ERRORS_BY_TYPE[error_type].http_status
