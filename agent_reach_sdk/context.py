"""The RequestID being served: a context variable, and on every log record (R24)."""

from __future__ import annotations

import contextvars
import logging
from dataclasses import dataclass, field
from typing import Any

current_request_id: contextvars.ContextVar[str | None] = contextvars.ContextVar(
    "reach_request_id", default=None
)

_installed = False


@dataclass(frozen=True)
class RequestContext:
    request_id: str
    operation: str
    caller: str = "anonymous"
    attempt: int = 1
    deadline_ms: int | None = None
    idempotency_key: str | None = None
    headers: dict[str, str] = field(default_factory=dict)
    context_id: str | None = None  # the conversation it belongs to (x-reach-context-id)

    def defer(self) -> Deferred:
        """Answer 202 now; send the result later with `AgentRuntime.send_result`."""
        return DEFERRED


class Deferred:
    """Returned by a handler that will answer later (asynchronously)."""


DEFERRED = Deferred()


def install_request_id_logging() -> None:
    """Give every log record a `request_id` attribute ('-' outside a request).

    Done with a record factory, not a filter, so records of every logger and handler carry it,
    including third-party libraries the agent calls while serving a request.
    """
    global _installed
    if _installed:
        return
    previous = logging.getLogRecordFactory()

    def factory(*args: Any, **kwargs: Any) -> logging.LogRecord:
        record = previous(*args, **kwargs)
        record.request_id = current_request_id.get() or "-"
        return record

    logging.setLogRecordFactory(factory)
    _installed = True
