"""The gRPC front's wire: its messages into the door's metadata and JSON body, and a refusal
into a gRPC status with the HTTP API's envelope (the rules are `gateway_api.grpc_front`'s
docstring: errors, trailer size).
"""

from __future__ import annotations

import base64
import json
import logging
import math
from typing import Any, Never, TypeVar

import grpc
from google.protobuf.message import DecodeError, Message
from temporalio.service import RPCError

from agent_reach_proto import gateway_pb2 as pb
from agent_reach_proto import wire
from gateway_api.errors import error_body, reach_error_of_rpc
from reach import acceptance
from reach.errors import (
    ERRORS_BY_TYPE,
    InternalError,
    InvalidRequest,
    ReachError,
    RequestClosed,
    UnknownRequest,
)
from reach.limits import MAX_DEPTH
from reach.messages import dumps

log = logging.getLogger("reach.gateway")
M = TypeVar("M", bound=Message)

# Metadata keys: the wire contract's (agent_reach_proto.wire, docs/protocols/grpc.md).
ERROR_KEY = wire.GRPC_ERROR_BIN
REQUEST_ID_KEY = wire.REQUEST_ID
CALLER_KEY = wire.CALLER
AUTHORIZATION_KEY = wire.GRPC_AUTHORIZATION
TRACEPARENT_KEY = wire.TRACEPARENT
IDEMPOTENCY_KEY = wire.IDEMPOTENCY_KEY
PUSHBACK_KEY = wire.GRPC_RETRY_PUSHBACK_MS

# The error's message in `grpc-message`, in UTF-8 bytes (at most three times that on the wire).
DETAILS_MAX_BYTES = 1024
# The whole trailing metadata of a refusal, as a gRPC client counts it (each entry's name and
# value plus 32 bytes; `-bin` values as base64, the worst case), well under the 8 KiB default.
TRAILERS_MAX_BYTES = 6 * 1024
ENTRY_OVERHEAD_BYTES = 32
# What the transport adds to a trailers-only answer (:status, content-type, grpc-status).
TRANSPORT_TRAILER_BYTES = 256

# HTTP status (decided by Reach's error type) -> gRPC code; gateway.proto's table.
GRPC_CODES: dict[int, grpc.StatusCode] = {
    401: grpc.StatusCode.UNAUTHENTICATED,
    403: grpc.StatusCode.PERMISSION_DENIED,
    404: grpc.StatusCode.NOT_FOUND,
    405: grpc.StatusCode.UNIMPLEMENTED,
    409: grpc.StatusCode.ALREADY_EXISTS,
    413: grpc.StatusCode.RESOURCE_EXHAUSTED,
    422: grpc.StatusCode.INVALID_ARGUMENT,
    429: grpc.StatusCode.RESOURCE_EXHAUSTED,
    500: grpc.StatusCode.INTERNAL,
    502: grpc.StatusCode.UNKNOWN,
    503: grpc.StatusCode.UNAVAILABLE,
    504: grpc.StatusCode.DEADLINE_EXCEEDED,
}
assert {e.http_status for e in ERRORS_BY_TYPE.values()} <= set(GRPC_CODES), "a code for each"


def clip_utf8(text: str, max_bytes: int) -> str:
    """`text` in at most `max_bytes` of UTF-8, never half a character; a cut ends in "…".

    A lone surrogate (no UTF-8 of its own) becomes "?", as no hop could carry it."""
    raw = text.encode("utf-8", "replace")
    if len(raw) <= max_bytes:
        return raw.decode("utf-8")
    mark = "…" if max_bytes >= 3 else ""  # the mark is 3 bytes of UTF-8
    # Cut bytes, then drop the partial character the cut may have left at the end.
    return raw[: max_bytes - len(mark.encode())].decode("utf-8", "ignore") + mark


def _percent_encoded_size(text: str) -> int:
    """`grpc-message` on the wire: visible ASCII but '%' as is, every other byte as %XX."""
    return sum(1 if 0x20 <= b <= 0x7E and b != 0x25 else 3 for b in text.encode())


def _clip_strings(value: Any, max_bytes: int | None) -> Any:
    """A JSON value with every string within `max_bytes` of UTF-8 (None: any length)."""
    if isinstance(value, str):
        return clip_utf8(value, max_bytes if max_bytes is not None else len(value) * 4)
    if isinstance(value, dict):
        return {key: _clip_strings(item, max_bytes) for key, item in value.items()}
    if isinstance(value, list):
        return [_clip_strings(item, max_bytes) for item in value]
    return value


# What an envelope keeps when cutting its strings is not enough: what happened to the request.
_ESSENTIALS = ("request_id", "status", "duration_ms", "error", "instance_id")


def fit_envelope(envelope: dict[str, Any], max_bytes: int) -> bytes:
    """The envelope as compact UTF-8 JSON in at most `max_bytes`: its long strings cut, each
    field kept, so that it stays the envelope a client parses; when even that is too much (a
    great many short strings), only the fields that say what happened, cut short."""
    raw = dumps(_clip_strings(envelope, None))
    cut = 1024
    while len(raw) > max_bytes and cut >= 16:
        raw = dumps(_clip_strings(envelope, cut))
        cut //= 2
    if len(raw) > max_bytes:
        essentials = {key: envelope[key] for key in _ESSENTIALS if key in envelope}
        raw = dumps(_clip_strings(essentials, 64))
    return raw


class Refusal:
    """How one call ends when it does not succeed: a gRPC code, details and the envelope."""

    def __init__(self, status: int, message: str, envelope: dict[str, Any]) -> None:
        self.status = status
        self.code = GRPC_CODES.get(status, grpc.StatusCode.UNKNOWN)
        self.message = message
        self.envelope = envelope

    @classmethod
    def of_error(cls, err: ReachError, request_id: str | None) -> Refusal:
        body = error_body(request_id, err.type, err.message, err.retryable)
        if err.retry_after_s:
            body["error"]["retry_after_s"] = err.retry_after_s
        if err.outcome_unknown:
            body["error"]["outcome_unknown"] = True
        return cls(err.http_status, err.message, body)

    def retry_after_s(self) -> int:
        """What HTTP's Retry-After says for this refusal: the error's own, else 1 s."""
        error = self.envelope.get("error")
        found = error.get("retry_after_s") if isinstance(error, dict) else None
        return max(1, found) if isinstance(found, int) else 1

    def trailers(self) -> tuple[str, tuple[tuple[str, str | bytes], ...]]:
        """The details and trailing metadata, within what every gRPC client accepts."""
        details = clip_utf8(self.message, DETAILS_MAX_BYTES)
        trailing: list[tuple[str, str | bytes]] = []
        request_id = self.envelope.get("request_id")
        if isinstance(request_id, str):
            trailing.append((REQUEST_ID_KEY, request_id))
        if self.status in (429, 503):
            # HTTP's Retry-After, in the words gRPC's own retry policies read (gRFC A6).
            trailing.append((PUSHBACK_KEY, str(1000 * self.retry_after_s())))
        used = trailer_size(details, ((ERROR_KEY, b""), *trailing))
        # What is left for the envelope, as base64 (4 characters for each 3 bytes).
        envelope = fit_envelope(self.envelope, (TRAILERS_MAX_BYTES - used) * 3 // 4)
        return details, ((ERROR_KEY, envelope), *trailing)

    async def end(self, context: grpc.aio.ServicerContext[Any, Any]) -> Never:
        details, trailing = self.trailers()
        await context.abort(self.code, details, trailing_metadata=trailing)


def trailer_size(details: str, trailing: tuple[tuple[str, str | bytes], ...]) -> int:
    """A refusal's trailers as a gRPC client counts them: name, value and 32 bytes an entry,
    `grpc-message` percent-encoded, `-bin` values as base64 (the worst case), and the
    transport's own entries."""
    size = TRANSPORT_TRAILER_BYTES + len("grpc-message") + _percent_encoded_size(details)
    for key, value in trailing:
        length = len(base64.b64encode(value)) if isinstance(value, bytes) else len(value)
        size += len(key) + length + ENTRY_OVERHEAD_BYTES
    return size + ENTRY_OVERHEAD_BYTES


def refusal_of(exc: Exception, where: str, request_id: str | None) -> Refusal:
    """The one place an exception becomes a refusal, logged as the HTTP handlers log it."""
    if isinstance(exc, ReachError):
        if not isinstance(exc, UnknownRequest | RequestClosed):
            log.info("gRPC %s -> %s: %s", where, exc.type, exc.message)
        return Refusal.of_error(exc, request_id)
    if isinstance(exc, RPCError):
        log.error("Temporal call failed on gRPC %s: %s", where, exc)
        return Refusal.of_error(reach_error_of_rpc(exc), request_id)
    log.error("gRPC %s failed inside Reach", where, exc_info=exc)
    bug = InternalError(f"Reach failed on this request ({type(exc).__name__}); see the gateway log")
    return Refusal.of_error(bug, request_id)


def metadata_of(context: grpc.aio.ServicerContext[Any, Any]) -> dict[str, str]:
    """The call's text metadata, first value of each key (keys arrive lower-case)."""
    found: dict[str, str] = {}
    for key, value in context.invocation_metadata() or ():
        if isinstance(value, str):
            found.setdefault(key, value)
    return found


def json_text(text: str, what: str) -> Any:
    """A JSON-as-text field, under the rules of a JSON body."""
    return acceptance.parse_json(text.encode(), what=what)


def as_body(fields: dict[str, Any], what: str = "body") -> bytes:
    """The JSON body the HTTP route would have read.

    Compact UTF-8 like every body Reach measures; a lone surrogate (from a `\\ud800` escape in a
    JSON field) has no UTF-8, so that body is written escaped and acceptance refuses it by name.
    """
    try:
        try:
            return dumps(fields)
        except UnicodeEncodeError:
            return json.dumps(fields, separators=(",", ":")).encode()
    except RecursionError:
        raise InvalidRequest(f"{what} is nested more than {MAX_DEPTH} levels deep") from None
    except ValueError:  # NaN or Infinity in a number field the checks above did not know
        raise InvalidRequest(f"{what} has a number that is not finite") from None


def parse(cls: type[M], raw: bytes) -> M:
    """One request message from the call's bytes; bytes that are not one (or a string field
    that is not UTF-8) are the caller's `InvalidRequest`, as a body that is not JSON is."""
    try:
        return cls.FromString(raw)
    except DecodeError as exc:
        reason = str(exc).rpartition(": ")[2] or "cannot be parsed"
        raise InvalidRequest(
            f"the request is not a valid {cls.DESCRIPTOR.full_name}: {reason}"
        ) from None


def invoke_fields(request: pb.InvokeRequest) -> dict[str, Any]:
    fields: dict[str, Any] = {}
    if request.HasField("request_id"):
        fields["request_id"] = request.request_id
    if request.target:
        fields["target"] = request.target
    if request.operation:
        fields["operation"] = request.operation
    if request.payload_json:
        fields["payload"] = json_text(request.payload_json, "payload_json")
    for name in ("timeout_ms", "callback", "idempotency_key", "routing_key"):
        if request.HasField(name):
            fields[name] = getattr(request, name)
    return fields


def join_fields(request: pb.JoinRequest) -> dict[str, Any]:
    fields: dict[str, Any] = {"async_callback": request.async_callback}
    for name in ("capability", "instance_id", "protocol", "service_address"):
        if getattr(request, name):
            fields[name] = getattr(request, name)
    for name in ("heartbeat_interval", "max_message_bytes", "weight", "max_inflight"):
        if request.HasField(name):
            fields[name] = getattr(request, name)
    interval = fields.get("heartbeat_interval")
    if interval is not None and not math.isfinite(interval):
        # JSON has no NaN or Infinity: HTTP could not even be sent one.
        raise InvalidRequest("heartbeat_interval is not a finite number")
    operations: list[str | dict[str, Any]] = list(request.operations)
    for declared in request.declared_operations:
        entry: dict[str, Any] = {"name": declared.name} if declared.name else {}
        for name in ("idempotent", "timeout_ms", "description"):
            if declared.HasField(name):
                entry[name] = getattr(declared, name)
        if declared.HasField("input_schema_json"):
            # Named as the HTTP body's field: its bounds (64 KiB, 32 levels) are checked there.
            where = f"operations.{len(operations)}.input_schema_json"
            entry["input_schema"] = json_text(declared.input_schema_json, where)
        operations.append(entry)
    if operations:
        fields["operations"] = operations
    if request.labels:
        fields["labels"] = dict(request.labels)
    return fields
