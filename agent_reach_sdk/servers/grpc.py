"""The agent's gRPC server: `reach.agent.v1.Agent/Invoke` on a `grpc.aio` server.

The service is bound with grpcio's generic handlers (no generated `_pb2_grpc` stubs): the request
arrives as bytes and is decoded here, so a malformed one is answered INVALID_ARGUMENT rather than
failing inside grpcio. Each request becomes a `wire.Inbound` (the invocation metadata, lower case,
as its headers) and the runtime's `wire.Answer` goes back as:

    200        InvokeReply(result = the body as sent)
    202        InvokeReply(accepted = true)
    error      a status, its details the error's message (at most 1 KiB of UTF-8, cut between
               characters and marked with "…"), trailing metadata `x-reach-status` (the
               answer's HTTP-style status), `x-reach-error-type` (the error's type) and, when
               the answer says another attempt cannot help, `x-reach-retryable: false`

    504 DEADLINE_EXCEEDED   404 UNIMPLEMENTED        413 RESOURCE_EXHAUSTED (never retryable)
    429 RESOURCE_EXHAUSTED  400, 422 INVALID_ARGUMENT  401 UNAUTHENTICATED
    403 PERMISSION_DENIED   409 ALREADY_EXISTS       503 UNAVAILABLE
    other 5xx INTERNAL      other 4xx FAILED_PRECONDITION

`connectors.grpc` reads `x-reach-status` through the same table as HTTP, WebSocket and MQTT
(`connectors._answers`), so a caller cannot tell which protocol carried an answer; the code is
for generic gRPC clients, and reads back to the same error types and retry flags on its own (409
is ALREADY_EXISTS, not the retryable ABORTED, for that reason).

Why the byte budget: `grpc-message` travels percent-encoded (a non-ASCII byte is three
characters), and gRPC clients refuse trailers past 8 KiB at random and past 16 KiB always
(RESOURCE_EXHAUSTED "received metadata size exceeds"), which would turn an agent's final answer
into a retryable transport failure. 1 KiB of UTF-8 is at most 3 KiB on the wire.

gRPC's receive limit is fixed when the server starts (`max_body_bytes` then, plus the request's
framing); `max_body_bytes` lowered after Join is enforced here, per request, with the 413 answer.

The wire contract it serves: `docs/protocols/grpc.md` (names: `agent_reach_proto.wire`).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import grpc
import grpc.aio
from google.protobuf.message import DecodeError

from agent_reach_proto import wire
from agent_reach_proto.agent_pb2 import InvokeReply, InvokeRequest
from agent_reach_sdk.servers import AgentServer, split_hostport
from agent_reach_sdk.wire import INTERNAL_ERROR, Answer, Dispatch, Inbound, error_answer
from reach.security.certs import CertificateError, TlsFiles, reach_identity_for

log = logging.getLogger("agent_reach_sdk.server")

SERVICE = wire.GRPC_AGENT_SERVICE
ERROR_TYPE = wire.GRPC_ERROR_TYPE
RETRYABLE = wire.GRPC_RETRYABLE
STATUS = wire.GRPC_STATUS
# The error's message in `grpc-message`, in UTF-8 bytes (at most three times that on the wire).
DETAILS_MAX_BYTES = 1024
# The error's type in `x-reach-error-type` (visible ASCII, so characters are bytes).
ERROR_TYPE_MAX_BYTES = 64
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


def clip_utf8(text: str, max_bytes: int) -> str:
    """`text` in at most `max_bytes` of UTF-8, never half a character; a cut ends in "…".

    A lone surrogate (no UTF-8 of its own) becomes "?", as grpc core could not send it."""
    raw = text.encode("utf-8", "replace")
    if len(raw) <= max_bytes:
        return raw.decode("utf-8")
    mark = "…" if max_bytes >= 3 else ""  # the mark is 3 bytes of UTF-8
    # Cut bytes, then drop the partial character the cut may have left at the end.
    return raw[: max_bytes - len(mark.encode())].decode("utf-8", "ignore") + mark


def _header_value(value: object) -> str:
    """Visible ASCII only: anything else would make grpc core refuse the whole status."""
    text = "".join(c if " " <= c <= "~" else "?" for c in str(value))
    return text[:ERROR_TYPE_MAX_BYTES].strip() or "agent_error"


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
    details = clip_utf8(str(err.get("message") or ""), DETAILS_MAX_BYTES)
    trailing: TrailingMetadata = (
        (STATUS, str(answer.status)),
        (ERROR_TYPE, _header_value(err.get("type") or "agent_error")),
    )
    if answer.status == 413 or err.get("retryable") is False:
        trailing += ((RETRYABLE, "false"),)
    return code, details, trailing


def _headers(metadata: Iterable[tuple[str, str | bytes]] | None) -> dict[str, str]:
    """Text metadata under lower-case names (`-bin` entries carry bytes and are not headers)."""
    return {key.lower(): value for key, value in metadata or () if isinstance(value, str)}


def _bind_host(host: str) -> str:
    return f"[{host}]" if ":" in host else host


def _is_peer(context: grpc.aio.ServicerContext[bytes, bytes], identity: str) -> bool:
    """Whether the client's certificate names `identity` (its SAN: gRPC's peer identities)."""
    wanted = identity.encode()
    return any(found == wanted for found in context.peer_identities() or ())


def _credentials(tls: TlsFiles) -> grpc.ServerCredentials:
    """mTLS: this agent's certificate, and a client certificate from the CA required."""
    try:
        chain, key, ca = (Path(p).read_bytes() for p in (tls.cert, tls.key, tls.ca))
    except OSError as exc:
        raise CertificateError(f"the agent's TLS files cannot be read: {exc}") from None
    return grpc.ssl_server_credentials(
        [(key, chain)], root_certificates=ca, require_client_auth=True
    )


class GrpcAgentServer(AgentServer):
    protocol = "grpc"

    def __init__(self, dispatch: Dispatch, **kwargs: Any) -> None:
        super().__init__(dispatch, **kwargs)
        self._server: grpc.aio.Server | None = None
        self.port = 0
        # mTLS: the one client identity served (Reach's); None: any certificate from the CA.
        self.client_id = None if self.tls is None else reach_identity_for(self.tls.cert)

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
        bind = f"{_bind_host(host)}:{port}"
        try:
            if self.tls is None:
                self.port = server.add_insecure_port(bind)
            else:
                self.port = server.add_secure_port(bind, _credentials(self.tls))
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
        if self.client_id is not None and not _is_peer(context, self.client_id):
            log.warning("refused a TLS client that is not %s", self.client_id)
            return error_answer(403, "forbidden", f"only {self.client_id} may call this agent")
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
