"""What every protocol server hands the runtime, and what it gets back.

One request shape for every protocol: the operation, the request's metadata under the HTTP
header names in lower case (gRPC metadata, MQTT user properties and WebSocket frames use the
same names), and the payload as the bytes that arrived. One answer shape: an HTTP-style status
and a JSON body. Each server translates the status into its protocol's own terms (a gRPC status
code, a frame field, an MQTT user property) with the same meaning everywhere:

    200 result   202 accepted (answer later)   4xx/5xx error body {"error": {...}}

The names are the wire contract's (`agent_reach_proto.wire`, docs/protocols/).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

# The metadata names, lower case, the same on every protocol: the contract's, re-exported.
from agent_reach_proto.wire import ATTEMPT as ATTEMPT
from agent_reach_proto.wire import CALLER as CALLER
from agent_reach_proto.wire import CONTEXT_ID as CONTEXT_ID
from agent_reach_proto.wire import DEADLINE_MS as DEADLINE_MS
from agent_reach_proto.wire import IDEMPOTENCY_KEY as IDEMPOTENCY_KEY
from agent_reach_proto.wire import METADATA_NAMES as METADATA_NAMES
from agent_reach_proto.wire import REQUEST_ID as REQUEST_ID
from agent_reach_proto.wire import TRACEPARENT as TRACEPARENT
from reach.messages import dumps


@dataclass(frozen=True)
class Inbound:
    operation: str
    headers: Mapping[str, str]  # lower-case names
    body: bytes


@dataclass
class Answer:
    status: int
    body: dict[str, Any] | None = None
    _content: bytes | None = field(default=None, init=False, repr=False, compare=False)

    def content(self) -> bytes:
        """The body as sent, encoded once (a remembered answer is sent again as it was).

        Raises what `reach.messages.dumps` raises for a body that is not standard JSON.
        """
        if self._content is None:
            self._content = dumps(self.body) if self.body is not None else b""
        return self._content

    @property
    def error(self) -> dict[str, Any]:
        """The error object of a failed answer (empty for a success)."""
        err = (self.body or {}).get("error") if self.status >= 300 else None
        return err if isinstance(err, dict) else {}


def error_answer(
    status: int, error_type: str, message: str, *, retryable: bool | None = None
) -> Answer:
    error: dict[str, Any] = {"type": error_type, "message": message}
    if retryable is not None:
        error["retryable"] = retryable
    return Answer(status, {"error": error})


INTERNAL_ERROR = error_answer(500, "agent_error", "internal error")

Dispatch = Callable[[Inbound], Awaitable[Answer]]
