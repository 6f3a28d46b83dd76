"""The gateway's gRPC front: `reach.v1.Reach` (protos/agent_reach_proto/gateway.proto) beside
the HTTP API, in the same process and event loop, over the same service and acceptance code.

    Invoke      as POST /reach/invoke
    Join        as POST /reach/agents
    Heartbeat   as PUT /reach/agents/{instance_id}/heartbeat, one HeartbeatAck per report;
                a report with `batch` set as POST /reach/heartbeats, one ack whose `batch`
                answers each entry in order (each checked as a report of its own)

plus the standard `grpc.health.v1.Health` service (SERVING only while `/readyz` would answer
200) and server reflection, so generic clients (grpcurl, grpcui) can list and call it.

**The same door.** Every request is turned into the JSON body the HTTP route would have read
and handed to `reach.acceptance`, so the rules and their messages are the HTTP API's own. The
JSON-in-a-string fields are parsed first under the same rules, and refusals name them
(`payload_json`, `checks_json`). An empty proto3 string reads as an absent field: an empty
`target` is "Field required", an empty Join `protocol` is the default `http`, an empty
heartbeat `status` is `ok`. Join's `declared_operations` are the object entries of the HTTP
body's `operations`, after its plain names (so a refusal names one as `operations.N`); an
`input_schema_json` is parsed under the JSON rules and then bounded as the HTTP body's
`input_schema` is. A heartbeat's optional `session` is the HTTP header `X-Reach-Session`.

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

**Bounds.** At most `transport.grpc_max_connections` connections at once (gRPC core closes one
past them as it is accepted), at most `transport.grpc_max_concurrent_rpcs` Invoke and Join calls
in flight (`CallRoom`) and, in a room of their own, as many open Heartbeat streams: a call past
them ends UNAVAILABLE with the 503 envelope naming the setting, before its message is read. A
Heartbeat stream that reports nothing for `registry.heartbeat_timeout` is ended
(DEADLINE_EXCEEDED), so idle streams cannot hold the room. A connection
must finish its handshake within `transport.http_header_timeout_s`, and one without a call for
`transport.http_keep_alive_s` is closed (its client reconnects when it next calls).

**Lifecycle.** Started in the app's lifespan after the workers, stopped before them: at
shutdown health turns NOT_SERVING, new calls are refused, and calls in flight get `GRACE_S`
to finish (open Heartbeat streams end then too; their agents open new ones elsewhere).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable, Iterator
from typing import TypeAlias

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc  # type: ignore[import-untyped]
from grpc_reflection.v1alpha import reflection  # type: ignore[import-untyped]

from agent_reach_proto import gateway_pb2 as pb
from gateway_api._grpc_beats import serve_stream, single_ack
from gateway_api.errors import status_code_of
from gateway_api.gateway import Gateway
from gateway_api.grpc_wire import (
    AUTHORIZATION_KEY,
    REQUEST_ID_KEY,
    TRACEPARENT_KEY,
    Refusal,
    as_body,
    invoke_fields,
    join_fields,
    metadata_of,
    parse,
    refusal_of,
)
from reach import acceptance
from reach.config import ConfigError, ReachSettings
from reach.errors import ReachError, Unavailable
from reach.messages import dumps
from reach.security.tokens import Principal
from reach.telemetry import tracing

log = logging.getLogger("reach.gateway")

SERVICE = pb.DESCRIPTOR.services_by_name["Reach"].full_name  # "reach.v1.Reach"
DEFAULT_PORT = 7601
# In-flight calls get this long to finish at shutdown; the requests themselves are durable.
GRACE_S = 5.0
# How often readiness is re-checked for the health service.
HEALTH_EVERY_S = 1.0

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


OPEN_BEATS = "Heartbeat streams open"


class CallRoom:
    """The calls in flight on the front, at most `most` (`transport.grpc_max_concurrent_rpcs`,
    read at each call so a reload applies)."""

    def __init__(self, most: Callable[[], int], what: str = "calls in flight") -> None:
        self.most = most
        self.what = what
        self.held = 0

    def take(self) -> None:
        """Room for one more call, or `Unavailable` (503) naming the setting."""
        most = self.most()
        if self.held >= most:
            raise Unavailable(
                f"the gRPC front has {self.held} {self.what}, its most "
                f"(transport.grpc_max_concurrent_rpcs = {most}); nothing was read, try again",
                retry_after_s=1,
            )
        self.held += 1

    def release(self) -> None:
        self.held -= 1

    @contextlib.contextmanager
    def held_for(self) -> Iterator[None]:
        self.take()
        try:
            yield
        finally:
            self.release()


class ReachService:
    """`reach.v1.Reach` over a `Gateway`: each method is its HTTP route, told in gRPC."""

    def __init__(
        self, gateway: Gateway, room: CallRoom | None = None, beats: CallRoom | None = None
    ) -> None:
        self.gateway = gateway
        self.room = room if room is not None else CallRoom(lambda: 1_000_000)
        # Heartbeat streams have a room of their own: agents' open streams (or a flood of
        # idle ones) never take the calls' room.
        self.beats = beats if beats is not None else CallRoom(lambda: 1_000_000, OPEN_BEATS)

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
        try:
            self.room.take()
        except ReachError as exc:
            await refusal_of(exc, "Invoke", None).end(context)
        try:
            return await self._traced_invoke(raw, context)
        finally:
            self.room.release()

    async def _traced_invoke(self, raw: bytes, context: InvokeContext) -> pb.InvokeResponse:
        active = tracing.tracer
        if active is None:
            return await self._invoke(raw, context)
        # Read leniently here: an invalid traceparent is refused inside, as over HTTP.
        traceparent = metadata_of(context).get(TRACEPARENT_KEY)
        attributes = {"rpc.system": "grpc", "rpc.service": SERVICE, "rpc.method": "Invoke"}
        with tracing.server_span(active, f"{SERVICE}/Invoke", traceparent, attributes) as span:
            response = await self._invoke(raw, context)
            span.set_attribute("reach.request_id", response.request_id)
            return response

    async def _invoke(self, raw: bytes, context: InvokeContext) -> pb.InvokeResponse:
        front = _GrpcFront(context)
        try:
            body = _InvokeBody(parse(pb.InvokeRequest, raw), len(raw))
            response = await self.gateway.door.invoke(metadata_of(context), body, front)
        except asyncio.CancelledError:
            log.info(
                "gRPC Invoke %s: the caller stopped waiting; the request carries on",
                front.request_id,
            )
            raise
        except Exception as exc:
            await refusal_of(exc, "Invoke", front.request_id).end(context)
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
            with self.room.held_for():
                agent = self._agent(metadata_of(context).get(AUTHORIZATION_KEY))
                request = parse(pb.JoinRequest, raw)
                body = acceptance.join_request(as_body(join_fields(request)), self.gateway.limits)
                ack = await self.gateway.agents.join(body, agent)
        except Exception as exc:
            await refusal_of(exc, "Join", None).end(context)
        return pb.JoinAck(
            instance_id=ack.instance_id,
            capability=ack.capability,
            heartbeat_interval=ack.heartbeat_interval,
            heartbeat_timeout=ack.heartbeat_timeout,
            max_message_bytes=ack.max_message_bytes,
            async_callback=ack.async_callback,
            session=ack.session,
        )

    async def heartbeat(self, requests: AsyncIterator[bytes], context: HeartbeatContext) -> None:
        """One ack per report; a refused report (a malformed one too) is acked with its error
        and the stream goes on (`unknown_instance`: join again). The token is checked again
        for every report: one revoked (or a door closed by the first token) while the stream
        is open ends it with UNAUTHENTICATED, as the next HTTP heartbeat would get 401. Read
        and written with the reader/writer calls (`gateway_api._grpc_beats.serve_stream`)."""
        authorization = metadata_of(context).get(AUTHORIZATION_KEY)
        try:
            self.beats.take()
        except ReachError as exc:
            await refusal_of(exc, "Heartbeat", None).end(context)
        try:
            try:
                self._agent(authorization)
            except Exception as exc:
                await refusal_of(exc, "Heartbeat", None).end(context)
            await serve_stream(
                context,
                lambda: self.gateway.live.settings.registry.heartbeat_timeout,
                lambda: self._agent(authorization),
                self._beat,
            )
        finally:
            self.beats.release()

    def _agent(self, authorization: str | None) -> Principal | None:
        """The agent token in the call's `authorization` metadata (None: tokens are off)."""
        guard = self.gateway.guard
        if guard is None:
            return None
        return guard.auth.agent(authorization)

    async def _beat(self, raw: bytes, agent: Principal | None = None) -> pb.HeartbeatAck:
        return await single_ack(raw, self.gateway.agents, agent, self.gateway.limits)


class _GrpcFront:
    """The gRPC front's side of the door: a call that carries a deadline is sent the
    RequestID in its initial metadata as soon as the request has one (its own deadline may
    pass before the verdict)."""

    __slots__ = ("context", "request_id")

    def __init__(self, context: InvokeContext) -> None:
        self.context = context
        self.request_id: str | None = None

    async def named(self, request_id: str, caller: str) -> None:
        self.request_id = request_id
        if self.context.time_remaining() is not None:
            await self.context.send_initial_metadata(((REQUEST_ID_KEY, request_id),))


class _InvokeBody:
    """The Invoke message as `POST /reach/invoke`'s body, made when the door reads it (after
    the metadata passed, as HTTP reads its body after the headers)."""

    __slots__ = ("held_bytes", "message")

    def __init__(self, message: pb.InvokeRequest, held_bytes: int) -> None:
        self.message = message
        self.held_bytes = held_bytes  # grpcio holds the whole message already (admission)

    async def read(self) -> bytes:
        return as_body(invoke_fields(self.message), "payload_json")


class GrpcFront:
    """The gRPC server: bound at start, health re-checked every second, stopped with grace."""

    def __init__(self, settings: ReachSettings, gateway: Gateway, port: int) -> None:
        self.gateway = gateway
        self.host = settings.listen_host
        self.port = port
        self.health = health.aio.HealthServicer()
        transport = settings.transport
        most = lambda: gateway.live.settings.transport.grpc_max_concurrent_rpcs  # noqa: E731
        self.room, self.beats = CallRoom(most), CallRoom(most, OPEN_BEATS)
        self.server = grpc.aio.server(
            options=[
                # A busy port is an error at start-up, never two gateways splitting the calls.
                ("grpc.so_reuseport", 0),
                # Past this, gRPC refuses the message itself; below it acceptance answers 413.
                ("grpc.max_receive_message_length", gateway.limits.max_body_bytes),
                ("grpc.max_send_message_length", -1),
                # The bounds (see the module): connections, handshakes, idle connections.
                ("grpc.max_allowed_incoming_connections", transport.grpc_max_connections),
                ("grpc.server_handshake_timeout_ms", int(transport.http_header_timeout_s * 1000)),
                ("grpc.max_connection_idle_ms", transport.http_keep_alive_s * 1000),
            ],
            # gRPC's own bound, past the room's (health and reflection calls go on meanwhile).
            maximum_concurrent_rpcs=2 * transport.grpc_max_concurrent_rpcs + 64,
        )
        service = ReachService(gateway, self.room, self.beats)
        self.server.add_generic_rpc_handlers((service.handler(),))
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
            checks = await self.gateway.views.readiness()
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
