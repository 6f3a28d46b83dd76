"""The gateway's gRPC front: `reach.v1.Reach` (protos/agent_reach_proto/gateway.proto) beside
the HTTP API, in the same process and event loop, over the same service and acceptance code.

    Invoke      as POST /reach/invoke
    Join        as POST /reach/agents
    Heartbeat   as PUT /reach/agents/{instance_id}/heartbeat, one HeartbeatAck per report

plus the standard `grpc.health.v1.Health` service (SERVING only while `/readyz` would answer
200) and server reflection, so generic clients (grpcurl, grpcui) can list and call it.

**The same door.** Every request is turned into the JSON body the HTTP route would have read
and handed to `reach.acceptance`, so the rules and their messages are the HTTP API's own. The
JSON-in-a-string fields are parsed first under the same rules, and refusals name them
(`payload_json`, `checks_json`). An empty proto3 string reads as an absent field: an empty
`target` is "Field required", an empty Join `protocol` is the default `http`, an empty
heartbeat `status` is `ok`. Join's `declared_operations` are the object entries of the HTTP
body's `operations`, after its plain names (so a refusal names one as `operations.N`).

**Metadata** `authorization`, `x-reach-caller`, `traceparent` and `idempotency-key` mean what
the HTTP headers of the same names mean, and are checked by the same rules (the same tokens,
rules and audit: `Gateway.invoke`, `Gateway.join`, `Gateway.heartbeat`).

**Errors.** A request HTTP would refuse ends with a gRPC status instead: Reach's error type
decides the HTTP status (`reach.errors`), and the HTTP status the gRPC code (`GRPC_CODES`, the
table at the top of gateway.proto). The status details are the error's message; the HTTP
API's JSON envelope travels as UTF-8 bytes in the trailing metadata key `x-reach-error-bin`,
beside `x-reach-request-id` when the request got that far, and `grpc-retry-pushback-ms: 1000`
where HTTP says `Retry-After: 1` (503, 429). A sync invoke that ends in an error envelope
(agent_error, timeout, a request still running at its deadline) ends the same way, with the
whole envelope. A message past `Limits.max_body_bytes` is refused by gRPC itself before it is
read (RESOURCE_EXHAUSTED without an envelope, where HTTP answers 413 with one). Bytes that are
not the method's message (or a string field that is not UTF-8) are INVALID_ARGUMENT with the
envelope HTTP gives a body that is not JSON (422 `invalid_request`, `request_id` null); in a
Heartbeat stream such a report is acked with that error and the stream goes on.

**Trailer size.** gRPC clients refuse trailing metadata past 8 KiB at random and past 16 KiB
always (RESOURCE_EXHAUSTED "received metadata size exceeds", which would hide Reach's verdict),
and `grpc-message` is percent-encoded (a non-ASCII byte is three characters). So the details are
the message cut to 1 KiB of UTF-8 (between characters, ending in "…"), and the whole trailer
stays within `TRAILERS_MAX_BYTES` (6 KiB, counted as a base64-encoding client counts it): when
the envelope would not fit, its longest strings are cut the same way until it does (it stays
valid JSON with every field; only long texts, an agent's message say, are shortened). The
complete envelope is always there to read over HTTP: `GET /reach/requests/{request_id}`.

**A caller's own gRPC deadline.** The request's deadline is its `timeout_ms` (or the policy's),
never the gRPC deadline. A client whose gRPC deadline passes first gets DEADLINE_EXCEEDED from
its own library (no `x-reach-error-bin`: that is how it tells the two apart), and the request
carries on durably in Temporal. So that it can still be found, a call that carries a deadline
is sent `x-reach-request-id` in the initial metadata as soon as the request is accepted (a
client can also choose `request_id` itself): `GET /reach/requests/{id}` reads the verdict, and
repeating the Invoke with the same `request_id` attaches to it.

**Port.** `transport.ports.grpc` (7601 by default; `REACH_TRANSPORT__PORTS__GRPC` overrides it
like `REACH_LISTEN_PORT` does the HTTP one), on the HTTP API's `listen_host`. 0 binds any free
port, negative turns the front off. The bound port is logged as
`gRPC front listening on HOST:PORT`. The port is never shared (SO_REUSEPORT is off): a second
gateway on the same port fails at start-up instead of silently splitting the traffic.

**Lifecycle.** Started in the app's lifespan after the workers, stopped before them: at
shutdown health turns NOT_SERVING, new calls are refused, and calls in flight get `GRACE_S`
to finish (open Heartbeat streams end then too; their agents open new ones elsewhere).
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import logging
import math
from collections.abc import AsyncIterator
from typing import Any, Never, TypeAlias, TypeVar

import grpc
from google.protobuf.message import DecodeError, Message
from grpc_health.v1 import health, health_pb2, health_pb2_grpc  # type: ignore[import-untyped]
from grpc_reflection.v1alpha import reflection  # type: ignore[import-untyped]
from pydantic import TypeAdapter, ValidationError
from temporalio.service import RPCError

from agent_reach_proto import gateway_pb2 as pb
from agent_reach_proto import wire
from gateway_api.errors import error_body, reach_error_of_rpc
from gateway_api.service import Gateway, status_code_of
from reach import acceptance
from reach.acceptance import describe_validation_error
from reach.config import ConfigError, ReachSettings
from reach.errors import (
    ERRORS_BY_TYPE,
    InternalError,
    InvalidRequest,
    ReachError,
    RequestClosed,
    UnknownRequest,
)
from reach.limits import MAX_DEPTH
from reach.messages import InstanceId, dumps, new_request_id
from reach.security.tokens import Principal
from reach.telemetry import tracing
from reach.telemetry.logs import current_request_id

log = logging.getLogger("reach.gateway")

SERVICE = pb.DESCRIPTOR.services_by_name["Reach"].full_name  # "reach.v1.Reach"
DEFAULT_PORT = 7601
# In-flight calls get this long to finish at shutdown; the requests themselves are durable.
GRACE_S = 5.0
# How often readiness is re-checked for the health service.
HEALTH_EVERY_S = 1.0

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

_INSTANCE_ID: TypeAdapter[str] = TypeAdapter(InstanceId)
M = TypeVar("M", bound=Message)

# Requests arrive as bytes and are parsed here, so a malformed one is refused with the envelope.
InvokeContext: TypeAlias = grpc.aio.ServicerContext[bytes, pb.InvokeResponse]
JoinContext: TypeAlias = grpc.aio.ServicerContext[bytes, pb.JoinAck]
HeartbeatContext: TypeAlias = grpc.aio.ServicerContext[bytes, pb.HeartbeatAck]


def grpc_port(settings: ReachSettings) -> int | None:
    """The configured port of the front (0: any free one), or None when it is turned off."""
    port = settings.transport.ports.get("grpc", DEFAULT_PORT)
    if port < 0:
        return None
    if port > 65535:
        raise ConfigError(
            f"transport.ports.grpc={port} is not a TCP port (0-65535; 0 = any free port, "
            "negative = no gRPC front)"
        )
    return port


def grpc_address(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


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
        return cls(err.http_status, err.message, body)

    def trailers(self) -> tuple[str, tuple[tuple[str, str | bytes], ...]]:
        """The details and trailing metadata, within what every gRPC client accepts."""
        details = clip_utf8(self.message, DETAILS_MAX_BYTES)
        trailing: list[tuple[str, str | bytes]] = []
        request_id = self.envelope.get("request_id")
        if isinstance(request_id, str):
            trailing.append((REQUEST_ID_KEY, request_id))
        if self.status in (429, 503):
            # HTTP's Retry-After: 1, in the words gRPC's own retry policies read (gRFC A6).
            trailing.append((PUSHBACK_KEY, "1000"))
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


def _metadata(context: grpc.aio.ServicerContext[Any, Any]) -> dict[str, str]:
    """The call's text metadata, first value of each key (keys arrive lower-case)."""
    found: dict[str, str] = {}
    for key, value in context.invocation_metadata() or ():
        if isinstance(value, str):
            found.setdefault(key, value)
    return found


def _json_text(text: str, what: str) -> Any:
    """A JSON-as-text field, under the rules of a JSON body."""
    return acceptance.parse_json(text.encode(), what=what)


def _body(fields: dict[str, Any], what: str = "body") -> bytes:
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


def _invoke_fields(request: pb.InvokeRequest) -> dict[str, Any]:
    fields: dict[str, Any] = {}
    if request.HasField("request_id"):
        fields["request_id"] = request.request_id
    if request.target:
        fields["target"] = request.target
    if request.operation:
        fields["operation"] = request.operation
    if request.payload_json:
        fields["payload"] = _json_text(request.payload_json, "payload_json")
    for name in ("timeout_ms", "callback", "idempotency_key", "routing_key"):
        if request.HasField(name):
            fields[name] = getattr(request, name)
    return fields


def _join_fields(request: pb.JoinRequest) -> dict[str, Any]:
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
        for name in ("idempotent", "timeout_ms"):
            if declared.HasField(name):
                entry[name] = getattr(declared, name)
        operations.append(entry)
    if operations:
        fields["operations"] = operations
    if request.labels:
        fields["labels"] = dict(request.labels)
    return fields


class ReachService:
    """`reach.v1.Reach` over a `Gateway`: each method is its HTTP route, told in gRPC."""

    def __init__(self, gateway: Gateway) -> None:
        self.gateway = gateway

    def handler(self) -> grpc.GenericRpcHandler:
        return grpc.method_handlers_generic_handler(
            SERVICE,
            {
                # No request_deserializer: bytes in, parsed by the method (`parse`), so that a
                # malformed message is refused with the envelope instead of inside grpcio.
                "Invoke": grpc.unary_unary_rpc_method_handler(
                    self.invoke, response_serializer=pb.InvokeResponse.SerializeToString
                ),
                "Join": grpc.unary_unary_rpc_method_handler(
                    self.join, response_serializer=pb.JoinAck.SerializeToString
                ),
                "Heartbeat": grpc.stream_stream_rpc_method_handler(
                    self.heartbeat, response_serializer=pb.HeartbeatAck.SerializeToString
                ),
            },
        )

    # -- Invoke -------------------------------------------------------------------------------

    async def invoke(self, raw: bytes, context: InvokeContext) -> pb.InvokeResponse:
        """POST /reach/invoke's steps, with the call's metadata for its headers; with tracing
        on, in a server span that continues the call's `traceparent`."""
        active = tracing.tracer
        if active is None:
            return await self._invoke(raw, context)
        # Read leniently here: an invalid traceparent is refused inside, as over HTTP.
        traceparent = _metadata(context).get(TRACEPARENT_KEY)
        attributes = {"rpc.system": "grpc", "rpc.service": SERVICE, "rpc.method": "Invoke"}
        with tracing.server_span(active, f"{SERVICE}/Invoke", traceparent, attributes) as span:
            response = await self._invoke(raw, context)
            span.set_attribute("reach.request_id", response.request_id)
            return response

    async def _invoke(self, raw: bytes, context: InvokeContext) -> pb.InvokeResponse:
        gateway = self.gateway
        request_id: str | None = None
        try:
            request = parse(pb.InvokeRequest, raw)
            headers = _metadata(context)
            claimed = acceptance.caller_header(headers.get(CALLER_KEY))
            door = gateway.door
            caller = (
                door.auth.caller(headers.get(AUTHORIZATION_KEY), claimed).name
                if door is not None
                else claimed or "anonymous"
            )
            traceparent = acceptance.traceparent_header(headers.get(TRACEPARENT_KEY))
            key = acceptance.idempotency_key_header(headers.get(IDEMPOTENCY_KEY))
            raw = _body(_invoke_fields(request), "payload_json")
            body, payload_json = acceptance.invoke_request(raw, gateway.limits)
            body.idempotency_key = acceptance.one_idempotency_key(body.idempotency_key, key)
            body.request_id = request_id = body.request_id or new_request_id()
            if context.time_remaining() is not None:
                # The caller's own deadline may pass before the verdict: give it the id first.
                await context.send_initial_metadata(((REQUEST_ID_KEY, request_id),))
            token = current_request_id.set(request_id)  # on this request's log records
            try:
                response = await gateway.invoke(body, payload_json, caller, traceparent)
            finally:
                current_request_id.reset(token)
        except asyncio.CancelledError:
            log.info(
                "gRPC Invoke %s: the caller stopped waiting; the request carries on", request_id
            )
            raise
        except Exception as exc:
            await refusal_of(exc, "Invoke", request_id).end(context)
        # A sync caller still without a verdict at the deadline gets a gateway timeout.
        status = status_code_of(response, running=504)
        if status >= 300:
            message = response.error.message if response.error else response.status
            envelope = response.model_dump(mode="json", exclude_none=True)
            await Refusal(status, message, envelope).end(context)
        return pb.InvokeResponse(
            request_id=response.request_id,
            status=response.status,
            duration_ms=response.duration_ms,
            result_json=dumps(response.result).decode() if response.result is not None else "",
            instance_id=response.instance_id or "",
        )

    # -- Join and Heartbeat -------------------------------------------------------------------

    async def join(self, raw: bytes, context: JoinContext) -> pb.JoinAck:
        try:
            agent = self._agent(context)
            request = parse(pb.JoinRequest, raw)
            body = acceptance.join_request(_body(_join_fields(request)), self.gateway.limits)
            ack = await self.gateway.join(body, agent)
        except Exception as exc:
            await refusal_of(exc, "Join", None).end(context)
        return pb.JoinAck(
            instance_id=ack.instance_id,
            capability=ack.capability,
            heartbeat_interval=ack.heartbeat_interval,
            heartbeat_timeout=ack.heartbeat_timeout,
            max_message_bytes=ack.max_message_bytes,
            async_callback=ack.async_callback,
        )

    async def heartbeat(
        self, requests: AsyncIterator[bytes], context: HeartbeatContext
    ) -> AsyncIterator[pb.HeartbeatAck]:
        """One ack per report; a refused report (a malformed one too) is acked with its error
        and the stream goes on (`unknown_instance`: join again)."""
        try:
            agent = self._agent(context)
        except Exception as exc:
            await refusal_of(exc, "Heartbeat", None).end(context)
        async for raw in requests:
            yield await self._beat(raw, agent)

    def _agent(self, context: grpc.aio.ServicerContext[Any, Any]) -> Principal | None:
        """The agent token in the call's `authorization` metadata (None: tokens are off)."""
        door = self.gateway.door
        if door is None:
            return None
        return door.auth.agent(_metadata(context).get(AUTHORIZATION_KEY))

    async def _beat(self, raw: bytes, agent: Principal | None = None) -> pb.HeartbeatAck:
        instance_id = ""
        try:
            report = parse(pb.HeartbeatRequest, raw)
            instance_id = report.instance_id
            try:
                _INSTANCE_ID.validate_python(instance_id)
            except ValidationError as exc:
                raise InvalidRequest(describe_validation_error(exc, root="instance_id")) from None
            fields: dict[str, Any] = {"inflight": report.inflight}
            if report.status:
                fields["status"] = report.status
            if report.checks_json:
                fields["checks"] = _json_text(report.checks_json, "checks_json")
            body = acceptance.health_report(_body(fields, "checks_json"), self.gateway.limits)
            record = await self.gateway.heartbeat(instance_id, body, agent)
        except Exception as exc:
            refusal = refusal_of(exc, "Heartbeat", None)
            error = refusal.envelope["error"]
            return pb.HeartbeatAck(
                instance_id=instance_id, error_type=error["type"], message=error["message"]
            )
        return pb.HeartbeatAck(
            instance_id=instance_id,
            status=record.status,
            heartbeat_interval=record.heartbeat_interval,
        )


class GrpcFront:
    """The gRPC server: bound at start, health re-checked every second, stopped with grace."""

    def __init__(self, settings: ReachSettings, gateway: Gateway, port: int) -> None:
        self.gateway = gateway
        self.host = settings.listen_host
        self.port = port
        self.health = health.aio.HealthServicer()
        self.server = grpc.aio.server(
            options=[
                # A busy port is an error at start-up, never two gateways splitting the calls.
                ("grpc.so_reuseport", 0),
                # Past this, gRPC refuses the message itself; below it acceptance answers 413.
                ("grpc.max_receive_message_length", gateway.limits.max_body_bytes),
                ("grpc.max_send_message_length", -1),
            ]
        )
        self.server.add_generic_rpc_handlers((ReachService(gateway).handler(),))
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        reflection.enable_server_reflection(
            [SERVICE, health.SERVICE_NAME, reflection.SERVICE_NAME], self.server
        )
        self._watcher: asyncio.Task[None] | None = None
        self._serving: bool | None = None

    async def start(self) -> int:
        address = grpc_address(self.host, self.port)
        try:
            self.port = self.server.add_insecure_port(address)
        except RuntimeError as exc:
            raise RuntimeError(
                f"the gRPC front cannot bind {address} (in use?); choose another port with "
                "reach.transport.ports.grpc / REACH_TRANSPORT__PORTS__GRPC (negative: no "
                "gRPC front)"
            ) from exc
        await self._check()
        await self.server.start()
        self._watcher = asyncio.create_task(self._watch())
        log.info("gRPC front listening on %s", grpc_address(self.host, self.port))
        return self.port

    async def stop(self, grace_s: float = GRACE_S) -> None:
        if self._watcher is not None:
            self._watcher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._watcher
        await self.health.enter_graceful_shutdown()
        await self.server.stop(grace_s)
        log.info("gRPC front stopped")

    async def _check(self) -> None:
        try:
            checks = await self.gateway.readiness()
        except Exception:
            log.exception("gRPC health check failed")
            checks = {"check": False}
        serving = all(checks.values())
        if serving == self._serving:
            return
        status = (
            health_pb2.HealthCheckResponse.SERVING
            if serving
            else health_pb2.HealthCheckResponse.NOT_SERVING
        )
        for service in (health.OVERALL_HEALTH, SERVICE):
            await self.health.set(service, status)
        if self._serving is not None or not serving:
            down = ", ".join(name for name, ok in checks.items() if not ok)
            log.warning(
                "gRPC health: %s", "SERVING" if serving else f"NOT_SERVING ({down} not answering)"
            )
        self._serving = serving

    async def _watch(self) -> None:
        while True:
            await asyncio.sleep(HEALTH_EVERY_S)
            await self._check()


@contextlib.asynccontextmanager
async def serving(settings: ReachSettings, gateway: Gateway) -> AsyncIterator[GrpcFront | None]:
    """The gRPC front for as long as the block runs (None when `transport.ports.grpc` < 0)."""
    port = grpc_port(settings)
    if port is None:
        log.info("gRPC front off (transport.ports.grpc is negative)")
        yield None
        return
    front = GrpcFront(settings, gateway, port)
    await front.start()
    try:
        yield front
    finally:
        await front.stop()
