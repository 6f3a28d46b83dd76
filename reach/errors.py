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
    ├── UnknownRequest              unknown_request     404  (status/result of an unknown id)
    ├── RequestClosed               request_closed      409  (a late answer after the end)
    ├── Unavailable                 unavailable         503  (Temporal or the store is down)
    └── InternalError               internal            500

`retryable` says whether the same request may succeed if tried again (possibly elsewhere); the
policy engine decides whether it actually is.
"""

from __future__ import annotations

from typing import ClassVar, Literal

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
    "unknown_request",
    "request_closed",
    "unavailable",
    "internal",
]


class ReachError(Exception):
    type: ClassVar[ErrorType]
    http_status: ClassVar[int]
    default_retryable: ClassVar[bool] = False

    def __init__(self, message: str, *, retryable: bool | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.retryable = self.default_retryable if retryable is None else retryable


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
    type = "agent_error"
    http_status = 502


class TransportError(ReachError):
    type = "transport_error"
    http_status = 502
    default_retryable = True


class UnknownInstance(ReachError):
    type = "unknown_instance"
    http_status = 404


class UnknownRequest(ReachError):
    type = "unknown_request"
    http_status = 404


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
        UnknownRequest,
        RequestClosed,
        Unavailable,
        InternalError,
    )
}


def http_status_for(error_type: str) -> int:
    cls = ERRORS_BY_TYPE.get(error_type)
    return cls.http_status if cls else 500
