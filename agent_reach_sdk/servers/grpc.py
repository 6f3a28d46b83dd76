"""The agent's gRPC server: `reach.agent.v1.Agent/Invoke` on a `grpc.aio` server.

The service is bound with grpcio's generic handlers (no generated `_pb2_grpc` stubs): the request
arrives as bytes and is decoded here, so a malformed one is answered INVALID_ARGUMENT rather than
failing inside grpcio. Each request becomes a `wire.Inbound` (the invocation metadata, lower case,
as its headers) and the runtime's `wire.Answer` goes back as:

    200        InvokeReply(result = the body as sent)
    202        InvokeReply(accepted = true)
    error      a status, its details the error's message (at most 1000 characters), trailing
               metadata `x-reach-error-type` (the error's type) and, when the answer says
               another attempt cannot help, `x-reach-retryable: false`

    504 DEADLINE_EXCEEDED   404 UNIMPLEMENTED        413 RESOURCE_EXHAUSTED (never retryable)
    429 RESOURCE_EXHAUSTED  400, 422 INVALID_ARGUMENT  401 UNAUTHENTICATED
    403 PERMISSION_DENIED   409 ALREADY_EXISTS       503 UNAVAILABLE
    other 5xx INTERNAL      other 4xx FAILED_PRECONDITION

These are the statuses `connectors.grpc` reads back to the same error types and retry flags as
the HTTP table in `connectors._answers` (409 is ALREADY_EXISTS, not the retryable ABORTED, for
that reason).

gRPC's receive limit is fixed when the server starts (`max_body_bytes` then, plus the request's
framing); `max_body_bytes` lowered after Join is enforced here, per request, with the 413 answer.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

import grpc
import grpc.aio
from google.protobuf.message import DecodeError

from agent_reach_proto.agent_pb2 import InvokeReply, InvokeRequest
from agent_reach_sdk.servers import AgentServer, split_hostport
from agent_reach_sdk.wire import INTERNAL_ERROR, Answer, Dispatch, Inbound, error_answer
from reach.errors import AGENT_TEXT_MAX

log = logging.getLogger("agent_reach_sdk.server")

SERVICE = "reach.agent.v1.Agent"
ERROR_TYPE = "x-reach-error-type"
RETRYABLE = "x-reach-retryable"
# InvokeRequest around its payload: the operation name (64 characters at most) and framing.
REQUEST_OVERHEAD_BYTES = 1024

_CODES = {
    400: grpc.StatusCode.INVALID_ARGUMENT,
    401: grpc.StatusCode.UNAUTHENTICATED,
    403: grpc.StatusCode.PERMISSION_DENIED,
    404: grpc.StatusCode.UNIMPLEMENTED,
    409: grpc.StatusCode.ALREADY_EXISTS,
    413: grpc.StatusCode.RESOURCE_EXHAUSTED,
    422: grpc.StatusCode.INVALID_ARGUMENT,
    429: grpc.StatusCode.RESOURCE_EXHAUSTED,
    503: grpc.StatusCode.UNAVAILABLE,
    504: grpc.StatusCode.DEADLINE_EXCEEDED,
}

TrailingMetadata = tuple[tuple[str, str], ...]


def _header_value(value: object) -> str:
    """Visible ASCII only: anything else would make grpc core refuse the whole status."""
    text = "".join(c if " " <= c <= "~" else "?" for c in str(value))
    return text[:64].strip() or "agent_error"


def status_for(answer: Answer) -> tuple[grpc.StatusCode, str, TrailingMetadata]:
    """The gRPC status, details and trailing metadata of an error answer."""
    code = _CODES.get(answer.status)
    if code is None:
        code = (
            grpc.StatusCode.INTERNAL
            if answer.status >= 500
            else grpc.StatusCode.FAILED_PRECONDITION
        )
    err = answer.error
    message = str(err.get("message") or "")[:AGENT_TEXT_MAX]
    details = message.encode("utf-8", "replace").decode("utf-8")
    trailing: TrailingMetadata = ((ERROR_TYPE, _header_value(err.get("type") or "agent_error")),)
    if answer.status == 413 or err.get("retryable") is False:
        trailing += ((RETRYABLE, "false"),)
    return code, details, trailing


def _headers(metadata: Iterable[tuple[str, str | bytes]] | None) -> dict[str, str]:
    """Text metadata under lower-case names (`-bin` entries carry bytes and are not headers)."""
    return {key.lower(): value for key, value in metadata or () if isinstance(value, str)}


def _bind_host(host: str) -> str:
    return f"[{host}]" if ":" in host else host


class GrpcAgentServer(AgentServer):
    protocol = "grpc"

    def __init__(self, dispatch: Dispatch, **kwargs: Any) -> None:
        super().__init__(dispatch, **kwargs)
        self._server: grpc.aio.Server | None = None
        self.port = 0

    async def start(self) -> None:
        host, port = split_hostport(self.listen)
        server = grpc.aio.server(
            options=[
                ("grpc.max_receive_message_length", self.max_body_bytes + REQUEST_OVERHEAD_BYTES),
                ("grpc.max_send_message_length", -1),  # the runtime bounds results
                # A port another process holds is an error, not a silently shared port.
                ("grpc.so_reuseport", 0),
            ]
        )
        handler: grpc.RpcMethodHandler[bytes, bytes] = grpc.unary_unary_rpc_method_handler(
            self._invoke
        )
        server.add_generic_rpc_handlers(
            (grpc.method_handlers_generic_handler(SERVICE, {"Invoke": handler}),)
        )
        try:
            self.port = server.add_insecure_port(f"{_bind_host(host)}:{port}")
        except RuntimeError as exc:  # grpcio's words for "cannot bind"
            raise OSError(f"gRPC agent server cannot listen on {self.listen}: {exc}") from exc
        await server.start()
        self._server = server

    @property
    def service_address(self) -> str:
        host, port = split_hostport(self.advertise)
        return f"{_bind_host(host)}:{port or self.port}"

    async def close(self, grace_s: float = 5.0) -> None:
        """New calls are refused at once; those running get `grace_s`, then are cancelled."""
        if self._server is None:
            return
        server, self._server = self._server, None
        await server.stop(grace_s)

    async def _invoke(
        self, request: bytes, context: grpc.aio.ServicerContext[bytes, bytes]
    ) -> bytes:
        answer = await self._answer(request, context)
        if answer.status in (200, 202):
            try:
                content = answer.content() if answer.status == 200 else b""
            except (TypeError, ValueError):
                log.exception("an operation answered with a body that is not JSON")
                answer = INTERNAL_ERROR
            else:
                reply = (
                    InvokeReply(accepted=True)
                    if answer.status == 202
                    else InvokeReply(result=content)
                )
                return reply.SerializeToString()
        code, details, trailing = status_for(answer)
        await context.abort(code, details, trailing_metadata=trailing)

    async def _answer(
        self, request: bytes, context: grpc.aio.ServicerContext[bytes, bytes]
    ) -> Answer:
        try:
            message = InvokeRequest.FromString(request)
        except DecodeError:
            return error_answer(400, "invalid_request", "the request is not an InvokeRequest")
        if len(message.payload) > self.max_body_bytes:
            return error_answer(
                413,
                "payload_too_large",
                f"the payload is {len(message.payload)} bytes; the limit is {self.max_body_bytes}",
            )
        inbound = Inbound(
            message.operation, _headers(context.invocation_metadata()), message.payload
        )
        try:
            return await self.dispatch(inbound)
        except Exception:
            log.exception("operation handler crashed")
            return INTERNAL_ERROR
