"""gRPC connector: one unary call, `reach.agent.v1.Agent/Invoke`, per request.

The wire contract (what an agent written without the SDK implements: the service in
`protos/agent_reach_proto/agent.proto`, the address, the request metadata, the reply, what a
failure's code and trailers mean, mTLS) is `docs/protocols/grpc.md`; its names are
`agent_reach_proto.wire`'s. Here a failure with `x-reach-status` is read through the table every
protocol shares (`connectors._answers`), one without it through `STATUS_TABLE`; trailers up to
`MAX_METADATA_BYTES` are read, since gRPC's 8 KiB default would turn a chatty agent's final answer
into a retryable failure. The call's gRPC deadline is the request's remaining time, and Reach
also ends the call itself at that moment.

Connections: one `grpc.aio` channel per instance and address (HTTP/2 multiplexes every request
on it), opened on first use, closed when idle past `transport.idle_timeout_s` or when the instance
leaves the registry. `failed` counts calls that found no connection (UNAVAILABLE while the
channel is not READY) and connections that broke between calls; `reconnected` counts a channel
that had failed becoming READY again.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Literal

import grpc
import grpc.aio
from google.protobuf.message import DecodeError

from agent_reach_proto import wire
from agent_reach_proto.agent_pb2 import InvokeReply, InvokeRequest
from connectors._address import check_characters, check_host, check_port, refuse
from connectors._answers import reply_for_status, too_large
from connectors._pools import ConnectionStats, Entry, Pools
from connectors.base import PooledConnector
from reach.acceptance import check_json, parse_json
from reach.config import SecuritySettings, TransportSettings
from reach.errors import (
    AgentError,
    AgentFault,
    DeadlineExceeded,
    InternalError,
    InvalidRequest,
    ReachError,
    TransportError,
)
from reach.invocation import Endpoint
from reach.messages import Message, Reply, dumps
from reach.security.netguard import host_port

METHOD = wire.GRPC_INVOKE_METHOD

# The contract's metadata keys under this module's older names.
MD_REQUEST_ID = wire.REQUEST_ID
MD_CALLER = wire.CALLER
MD_ATTEMPT = wire.ATTEMPT
MD_DEADLINE = wire.DEADLINE_MS
MD_IDEMPOTENCY_KEY = wire.IDEMPOTENCY_KEY
MD_TRACEPARENT = wire.TRACEPARENT
MD_ERROR_TYPE = wire.GRPC_ERROR_TYPE
MD_RETRYABLE = wire.GRPC_RETRYABLE
MD_STATUS = wire.GRPC_STATUS

# InvokeReply's framing around `result`: tags, a length varint and `accepted`. A reply within
# the limit always fits; one past it is refused by gRPC before it is held whole.
REPLY_OVERHEAD_BYTES = 64
# Keepalive pings only while calls are in flight, no more often than the 5 minutes that gRPC
# servers (C core, Go, Java) accept by default: a more eager client is sent GOAWAY
# "too_many_pings". Each call's own deadline bounds it anyway; this finds dead peers under
# long calls.
KEEPALIVE_TIME_MS = 300_000
KEEPALIVE_TIMEOUT_MS = 20_000
# gRPC's own channel idleness (30 min by default) must not come before the pool reaper's, or an
# idle channel would look like a broken one.
MIN_CLIENT_IDLE_MS = 30 * 60 * 1000
# Calls on a channel that failed to connect fail at once (no wait_for_ready) until its backoff
# ends; gRPC's default backoff (1 s, growing to 120 s) would keep a restarted agent unreachable
# long after it is back.
INITIAL_RECONNECT_BACKOFF_MS = 250
MAX_RECONNECT_BACKOFF_MS = 10_000
INT32_MAX = 2**31 - 1
# Trailers an agent may send (gRPC's own default is 8 KiB, refused at random past it and always
# past 16 KiB: an agent's long non-ASCII message, percent-encoded, would be a transport failure).
MAX_METADATA_BYTES = 64 * 1024

_TOO_BIG = re.compile(r"larger than max \((\d+) vs\. (\d+)\)")
_HTTP_STATUS = re.compile(r"[1-5][0-9][0-9]")
# gRPC metadata values: visible ASCII and space (anything else fails inside grpc core).
_METADATA_VALUE = re.compile(r"[\x20-\x7e]*")
# How grpc core words a failed TLS handshake, and one whose peer certificate did not verify.
_TLS_FAILURE = re.compile(r"(?i)handshake failed|verification check failed|peer name")
_TLS_UNVERIFIED = re.compile(r"(?i)CERTIFICATE_VERIFY_FAILED|verification check failed|peer name")

Kind = Literal["ok", "timeout", "transport", "agent"]

STATUS_TABLE: dict[grpc.StatusCode, tuple[Kind, bool]] = {
    # code                               (Reach's reading, retryable)
    grpc.StatusCode.OK: ("ok", False),
    grpc.StatusCode.DEADLINE_EXCEEDED: ("timeout", False),
    # No connection, or it broke: another attempt (maybe elsewhere) can succeed.
    grpc.StatusCode.UNAVAILABLE: ("transport", True),
    grpc.StatusCode.CANCELLED: ("transport", True),  # the agent's server cancelled (shutdown)
    # The agent is overloaded or failed on its side: it may succeed later.
    grpc.StatusCode.RESOURCE_EXHAUSTED: ("agent", True),
    grpc.StatusCode.ABORTED: ("agent", True),
    grpc.StatusCode.INTERNAL: ("agent", True),
    grpc.StatusCode.UNKNOWN: ("agent", True),  # also an agent handler that raised
    grpc.StatusCode.DATA_LOSS: ("agent", True),
    # The agent refused this request: the same request gets the same answer.
    grpc.StatusCode.INVALID_ARGUMENT: ("agent", False),
    grpc.StatusCode.NOT_FOUND: ("agent", False),
    grpc.StatusCode.ALREADY_EXISTS: ("agent", False),
    grpc.StatusCode.PERMISSION_DENIED: ("agent", False),
    grpc.StatusCode.FAILED_PRECONDITION: ("agent", False),
    grpc.StatusCode.OUT_OF_RANGE: ("agent", False),
    grpc.StatusCode.UNIMPLEMENTED: ("agent", False),  # no such service or operation
    grpc.StatusCode.UNAUTHENTICATED: ("agent", False),
}
assert set(STATUS_TABLE) == set(grpc.StatusCode), "every gRPC status code is mapped"


def check_grpc_address(address: str) -> str:
    """`host:port` or `grpc://host:port`, normalized to `host:port`; else `InvalidRequest`."""
    check_characters(address)
    scheme, sep, rest = address.partition("://")
    if not sep:
        rest = address
    elif scheme.lower() != "grpc":
        raise refuse(address, f"scheme {scheme!r} is not grpc (host:port or grpc://host:port)")
    if "/" in rest or "?" in rest or "#" in rest:
        raise refuse(address, "a gRPC address has no path, query or fragment: host:port")
    if "@" in rest:
        raise refuse(address, "userinfo (user@host) is not allowed")
    if rest.startswith("["):
        end = rest.find("]")
        if end < 0:
            raise refuse(address, "an IPv6 literal needs its closing ']'")
        host, port = rest[: end + 1], rest[end + 1 :]
        if not port.startswith(":"):
            raise refuse(address, "no port ([addr]:port)")
        port = port[1:]
    else:
        if rest.count(":") > 1:
            raise refuse(address, "an IPv6 literal goes in brackets: [addr]:port")
        host, colon, port = rest.partition(":")
        if not colon:
            raise refuse(address, "no port (host:port)")
    return f"{check_host(address, host)}:{check_port(address, port)}"


def wire_metadata(message: Message) -> list[tuple[str, str]]:
    """The request's metadata, each entry only when the request has it."""
    return wire.metadata(message.header)


def _trailing(exc: grpc.aio.AioRpcError) -> dict[str, str]:
    found: dict[str, str] = {}
    for key, value in exc.trailing_metadata() or ():
        if isinstance(value, str):
            found.setdefault(key.lower(), value)
    return found


def _text(value: str) -> str:
    return value.encode("utf-8", "replace").decode("utf-8").strip()


def said_status(trailing: Mapping[str, str]) -> int | None:
    """The HTTP-style status in `x-reach-status`, when it is one a failure can have."""
    value = trailing.get(MD_STATUS, "").strip()
    if not _HTTP_STATUS.fullmatch(value) or value in ("200", "202"):
        return None
    return int(value)


def error_for_answer(
    endpoint: Endpoint,
    status: int,
    details: str,
    said_type: str | None,
    withheld: bool,
    limit: int,
) -> ReachError:
    """An answer with an HTTP-style status, read by the table every other protocol is read with
    (`reply_for_status`): its words, its error type and retry flag cannot tell gRPC apart."""
    error: dict[str, object] = {"message": details.encode("utf-8", "replace").decode("utf-8")}
    if said_type is not None:
        error["type"] = said_type
    if withheld:
        error["retryable"] = False
    try:
        reply_for_status(endpoint, status, dumps({"error": error}), limit)
    except ReachError as exc:
        return exc
    return InternalError(  # said_status never lets a success status through
        f"gRPC connector read status {status} from {endpoint.instance_id} as a success"
    )


def error_for_status(
    endpoint: Endpoint,
    code: grpc.StatusCode,
    details: str,
    trailing: Mapping[str, str],
    receive_limit: int | None = None,
    limit: int | None = None,
) -> ReachError:
    """The Reach error a failed call's status stands for: `x-reach-status` through the shared
    HTTP-style table when the agent sent one, else the code through `STATUS_TABLE`.

    `receive_limit` is the channel's max_receive_message_length and `limit` the reply limit, to
    tell gRPC's refusal of a too-large reply from an agent refusing the payload.
    """
    kind, retryable = STATUS_TABLE[code]
    if kind == "ok":  # a caller's bug: OK is not a failure
        return InternalError(f"gRPC connector asked to map status OK from {endpoint.instance_id}")
    said_type = trailing.get(MD_ERROR_TYPE)
    withheld = trailing.get(MD_RETRYABLE, "").strip().lower() == "false"
    status = said_status(trailing)
    if status is not None:
        return error_for_answer(
            endpoint, status, details, said_type, withheld, limit or receive_limit or 0
        )
    name = code.name
    where = f"agent {endpoint.instance_id} answered gRPC {name}"
    fault = AgentFault(
        type=_text(said_type or "") or "agent_error", message=_text(details), status=code.value[0]
    )
    said = f": {fault.message}" if fault.message else ""
    if withheld:
        retryable = False  # an agent can never make a final code retryable
    if kind == "timeout":
        return DeadlineExceeded(
            f"agent {endpoint.instance_id} did not answer in time (gRPC {name}){said}"
        )
    if kind == "transport" and said_type is None:
        return TransportError(
            f"cannot reach agent at {endpoint.address}: {name}{said}", retryable=retryable
        )
    if code is grpc.StatusCode.RESOURCE_EXHAUSTED:
        size = _TOO_BIG.search(details)
        if size is not None and receive_limit is not None and int(size[2]) == receive_limit:
            error = too_large(endpoint, size[1], limit if limit is not None else receive_limit)
            error.fault = fault
            return error
        if size is not None:
            return AgentError(
                f"{where}: it refused the payload as too large{said}", retryable=False, fault=fault
            )
    return AgentError(f"{where}{said}", retryable=retryable, fault=fault)


def reply_of(endpoint: Endpoint, raw: bytes, limit: int) -> Reply:
    """The Reply in an OK call's bytes, or the non-retryable `AgentError` they amount to."""
    where = f"agent {endpoint.instance_id} answered 200"  # gRPC OK, worded as on every protocol
    try:
        reply = InvokeReply.FromString(raw)
    except DecodeError as exc:
        raise AgentError(
            f"{where} with bytes that are not an InvokeReply", retryable=False
        ) from exc
    if reply.accepted:
        return Reply(status="accepted")
    try:
        data = parse_json(reply.result, what="result") if reply.result else {}
        result = data if isinstance(data, dict) else {"value": data}
        # As Reach will carry it: re-encoded, within the limit, nesting and charset rules.
        check_json(result, what="its result", limit=limit)
    except ReachError as exc:
        raise AgentError(f"{where}; {exc.message}", retryable=False) from exc
    return Reply(status="ok", result=result)


@dataclass
class _Channel:
    """A channel and what the connector knows of its connection's history."""

    channel: grpc.aio.Channel
    invoke: grpc.aio.UnaryUnaryMultiCallable[bytes, bytes]
    receive_limit: int
    up: bool = False  # READY after the last call
    broken: bool = False  # failed since it was last READY (a READY then is a reconnect)

    def state(self) -> grpc.ChannelConnectivity:
        return self.channel.get_state(try_to_connect=False)


async def _close_channel(channel: _Channel) -> None:
    await channel.channel.close(grace=None)


@contextlib.contextmanager
def map_grpc_exceptions(endpoint: Endpoint, receive_limit: int, limit: int) -> Iterator[None]:
    """The one place grpcio's exceptions (and the call's own deadline) become Reach errors.

    `receive_limit` is the channel's max_receive_message_length, `limit` the reply limit.
    """
    try:
        yield
    except TimeoutError as exc:  # asyncio.timeout: the whole call, whatever gRPC was doing
        raise DeadlineExceeded(f"agent at {endpoint.address} did not answer in time") from exc
    except grpc.aio.AioRpcError as exc:
        raise error_for_status(
            endpoint,
            exc.code(),
            exc.details() or "",
            _trailing(exc),
            receive_limit=receive_limit,
            limit=limit,
        ) from exc
    except grpc.aio.InternalError as exc:  # grpc core refused to start the call (its batch)
        raise TransportError(
            f"cannot send this request to agent at {endpoint.address}: {exc!r}", retryable=False
        ) from exc
    except (grpc.aio.BaseError, grpc.RpcError) as exc:
        # A closed channel used, or a non-aio error from the aio API: nothing the agent did.
        raise InternalError(
            f"gRPC connector misused grpcio for {endpoint.address}: {exc!r}"
        ) from exc


class GrpcConnector(PooledConnector):
    protocol = "grpc"

    def __init__(
        self,
        transport: TransportSettings | None = None,
        *,
        stats: ConnectionStats | None = None,
        security: SecuritySettings | None = None,
    ) -> None:
        super().__init__(transport, stats=stats, security=security)
        idle_ms = min(max(MIN_CLIENT_IDLE_MS, int(self.transport.idle_timeout_s * 2000)), INT32_MAX)

        def make_channel(target: str) -> _Channel:
            limit, address, *tls_name = target.split(" ", 2)
            receive_limit = int(limit) + REPLY_OVERHEAD_BYTES
            options: list[tuple[str, str | int]] = [
                ("grpc.max_receive_message_length", receive_limit),
                ("grpc.max_metadata_size", MAX_METADATA_BYTES),
                # Reach checked the payload against the smallest limit before sending.
                ("grpc.max_send_message_length", -1),
                ("grpc.keepalive_time_ms", KEEPALIVE_TIME_MS),
                ("grpc.keepalive_timeout_ms", KEEPALIVE_TIMEOUT_MS),
                ("grpc.keepalive_permit_without_calls", 0),
                ("grpc.http2.max_pings_without_data", 0),
                ("grpc.client_idle_timeout_ms", idle_ms),
                ("grpc.initial_reconnect_backoff_ms", INITIAL_RECONNECT_BACKOFF_MS),
                ("grpc.max_reconnect_backoff_ms", MAX_RECONNECT_BACKOFF_MS),
                ("grpc.primary_user_agent", "agent-reach"),
                # Its own connection: grpc would otherwise share one among channels to the
                # same address, and closing an instance's channel would close nothing.
                ("grpc.use_local_subchannel_pool", 1),
            ]
            if tls_name:
                # mTLS: Reach's certificate; the agent's must be from the CA and carry this
                # instance's name (checked in place of the address's host).
                options.append(("grpc.ssl_target_name_override", tls_name[0]))
                channel = grpc.aio.secure_channel(address, self._credentials(), options=options)
            else:
                channel = grpc.aio.insecure_channel(address, options=options)
            # Bytes in and out: the connector encodes and decodes, so a reply that is not an
            # InvokeReply is this request's typed error, not grpcio's logged exception.
            invoke: grpc.aio.UnaryUnaryMultiCallable[bytes, bytes] = channel.unary_unary(METHOD)
            return _Channel(channel, invoke, receive_limit)

        self._tls_credentials: tuple[tuple[bytes, bytes, bytes], grpc.ChannelCredentials] | None
        self._tls_credentials = None
        self._pools: Pools[_Channel] = self._new_pools(make_channel, _close_channel)

    @classmethod
    def check_address(cls, address: str) -> str:
        return check_grpc_address(address)

    def _credentials(self) -> grpc.ChannelCredentials:
        """Reach's mTLS credentials, made again when its files change on disk."""
        pem = self.tls.pem()
        if self._tls_credentials is None or self._tls_credentials[0] != pem:
            ca, key, chain = pem
            credentials = grpc.ssl_channel_credentials(ca, key, chain)
            self._tls_credentials = (pem, credentials)
        return self._tls_credentials[1]

    async def verify_identity(self, address: str, instance_id: str) -> None:
        if not self.tls.enabled:
            return
        hostport = check_grpc_address(address)
        host, _, port = hostport.rpartition(":")
        # gRPC servers speak first (HTTP/2 SETTINGS) once h2 is agreed: no request is needed.
        await self.tls.probe(host, int(port), instance_id, address, alpn=["h2"])

    async def invoke(self, endpoint: Endpoint, message: Message, timeout_s: float) -> Reply:
        limit = endpoint.max_message_bytes or self.transport.max_message_bytes
        try:
            address = check_grpc_address(endpoint.address)
        except InvalidRequest as exc:
            raise TransportError(
                f"cannot send this request to agent at {endpoint.address}: {exc.message}",
                retryable=False,
            ) from exc
        metadata = wire_metadata(message)
        for name, value in metadata:
            if not _METADATA_VALUE.fullmatch(value):
                raise TransportError(
                    f"cannot send this request to agent at {address}: metadata {name} has "
                    "characters gRPC metadata cannot carry (visible ASCII only)",
                    retryable=False,
                )
        try:
            payload = dumps(message.payload)
        except ValueError as exc:  # NaN, or a lone surrogate: refused at the door, normally
            raise TransportError(
                f"cannot send this request to agent at {address}: the payload is not standard "
                f"JSON ({exc})",
                retryable=False,
            ) from exc
        request = InvokeRequest(
            operation=message.header.operation, payload=payload
        ).SerializeToString()
        # mTLS: the name the agent's certificate must carry, passed on to the channel.
        tls_name = f" {self.tls.server_name(endpoint.instance_id)}" if self.tls.enabled else ""
        # Per instance, address and reply limit: a re-join with either changed gets a fresh one.
        entry = self._pools.acquire(
            f"{endpoint.instance_id} {address} {limit}",
            endpoint.capability,
            f"{limit} {address}{tls_name}",
            instance_id=endpoint.instance_id,
        )
        try:
            return await self._call(entry, endpoint, request, metadata, timeout_s, limit)
        finally:
            self._pools.release(entry)

    async def _call(
        self,
        entry: Entry[_Channel],
        endpoint: Endpoint,
        request: bytes,
        metadata: list[tuple[str, str]],
        timeout_s: float,
        limit: int,
    ) -> Reply:
        channel = entry.value
        timeout = max(timeout_s, 0.001)
        if channel.up and channel.state() is not grpc.ChannelConnectivity.READY:
            # READY after the last call, not now: the connection broke in between.
            channel.up, channel.broken = False, True
            self.stats.count(entry.capability, self.protocol, "failed")
        code = grpc.StatusCode.OK
        try:
            with map_grpc_exceptions(endpoint, channel.receive_limit, limit):
                try:
                    # gRPC's deadline tells the agent; this one bounds the call on our side.
                    async with asyncio.timeout(timeout):
                        raw = await channel.invoke(request, timeout=timeout, metadata=metadata)
                except grpc.aio.AioRpcError as exc:
                    code = exc.code()
                    if self.tls.enabled:
                        self._tls_refusal(exc, endpoint, connected=channel.up)
                    raise
        finally:
            self._observe(entry, code)
        return reply_of(endpoint, raw, limit)

    def _tls_refusal(
        self, exc: grpc.aio.AioRpcError, endpoint: Endpoint, *, connected: bool
    ) -> None:
        """Raise the `TransportError` for a failed mTLS handshake, naming the identity
        expected; return for any other failure. `connected`: the channel was READY before."""
        details = exc.details() or ""
        if exc.code() is not grpc.StatusCode.UNAVAILABLE:
            return
        reason = details.rpartition("last error: ")[2].strip() or details
        address, instance_id = endpoint.address, endpoint.instance_id
        if _TLS_UNVERIFIED.search(details):
            raise TransportError(self.tls.unproven(address, instance_id, reason)) from exc
        if _TLS_FAILURE.search(details):
            raise TransportError(self.tls.handshake_failed(address, instance_id, reason)) from exc
        if not connected and "failed to connect" in details and "Socket closed" in details:
            # Under TLS 1.3 an agent that refuses Reach's certificate just closes the socket.
            reason += " (the agent closed the connection)"
            raise TransportError(self.tls.handshake_failed(address, instance_id, reason)) from exc

    def _observe(self, entry: Entry[_Channel], code: grpc.StatusCode) -> None:
        """Count a failed connection or a reconnect, from the channel's state after a call."""
        channel = entry.value
        if channel.state() is grpc.ChannelConnectivity.READY:
            if channel.broken:
                self.stats.count(entry.capability, self.protocol, "reconnected")
            channel.up, channel.broken = True, False
        elif code is grpc.StatusCode.UNAVAILABLE:
            # Not READY after UNAVAILABLE: no connection (an agent's own UNAVAILABLE comes over
            # a READY one).
            channel.up, channel.broken = False, True
            self.stats.count(entry.capability, self.protocol, "failed")

    @classmethod
    def address_host_port(cls, address: str) -> tuple[str, int] | None:
        """A gRPC address is `host:port` (checked): that host and port."""
        return host_port(address, {})
