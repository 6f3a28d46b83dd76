"""gRPC connector: one unary call, `reach.agent.v1.Agent/Invoke`, per request.

The wire contract (what an agent written without the SDK implements: the service in
`protos/agent_reach_proto/agent.proto`, the address, the request metadata, the reply, what a
failure's code and trailers mean, mTLS, connections) is docs/protocols/grpc.md; its names are
`agent_reach_proto.wire`'s. Here the call: a message becomes an `InvokeRequest` and its metadata,
an OK reply a `Reply` (`reply_of`), a failure a Reach error: with `x-reach-status` through the
table every protocol shares (`connectors._answers`), without it through `STATUS_TABLE`
(`error_for_status`, `map_grpc_exceptions`). The call's gRPC deadline is the request's remaining
time, and Reach also ends the call itself at that moment. The channels it is made on (options,
keepalive, reconnect backoff, credentials) are `connectors._grpc_channel`'s; this module counts
their `failed` and `reconnected` from each call's outcome.
"""

from __future__ import annotations

import asyncio
import re

import grpc
import grpc.aio

from agent_reach_proto import wire
from agent_reach_proto.agent_pb2 import InvokeRequest
from connectors._address import check_characters, check_host, check_port, refuse
from connectors._grpc_answers import STATUS_TABLE, error_for_status, map_grpc_exceptions, reply_of
from connectors._grpc_channel import Channel, ChannelMaker, close_channel, dial_target
from connectors._guard import vetted_addresses
from connectors._pools import ConnectionStats, Entry, Pools
from connectors.base import PooledConnector
from reach.config import SecuritySettings, TransportSettings
from reach.errors import InvalidRequest, TransportError
from reach.invocation import Endpoint
from reach.messages import Message, Reply, dumps
from reach.security.netguard import AddressGuard, host_port

# This module's names and those that moved to the role modules (importable from here as before).
# The older names of the contract's constants below stay importable, unlisted: their home is wire.
__all__ = [
    "STATUS_TABLE",
    "GrpcConnector",
    "check_grpc_address",
    "error_for_status",
    "map_grpc_exceptions",
    "reply_of",
    "wire_metadata",
]

# The contract's names under this module's older names.
METHOD = wire.GRPC_INVOKE_METHOD
MD_REQUEST_ID = wire.REQUEST_ID
MD_CALLER = wire.CALLER
MD_ATTEMPT = wire.ATTEMPT
MD_DEADLINE = wire.DEADLINE_MS
MD_IDEMPOTENCY_KEY = wire.IDEMPOTENCY_KEY
MD_TRACEPARENT = wire.TRACEPARENT
MD_ERROR_TYPE = wire.GRPC_ERROR_TYPE
MD_RETRYABLE = wire.GRPC_RETRYABLE
MD_STATUS = wire.GRPC_STATUS

# gRPC metadata values: visible ASCII and space (anything else fails inside grpc core).
_METADATA_VALUE = re.compile(r"[\x20-\x7e]*")
# How grpc core words a failed TLS handshake, and one whose peer certificate did not verify.
_TLS_FAILURE = re.compile(r"(?i)handshake failed|verification check failed|peer name")
_TLS_UNVERIFIED = re.compile(r"(?i)CERTIFICATE_VERIFY_FAILED|verification check failed|peer name")


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
        make_channel = ChannelMaker(self.transport.idle_timeout_s, lambda: self.tls)
        self._pools: Pools[Channel] = self._new_pools(make_channel, close_channel)
        # Connections only where the address guard allows (reach.security.netguard), as over
        # HTTP; a connector built without security settings (tests, embedding code) has none.
        self._guard = AddressGuard(self.security.allow_networks) if security is not None else None
        self._dialed: dict[str, str] = {}  # pool key -> the vetted address its channel dials

    @classmethod
    def check_address(cls, address: str) -> str:
        return check_grpc_address(address)

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
        # Per instance, address and reply limit: a re-join with either changed gets a fresh one;
        # and per vetted address, where the guard pins one.
        key = f"{endpoint.instance_id} {address} {limit}"
        dial = await self._dial(key, address)
        entry = self._pools.acquire(
            f"{key} {dial}",
            endpoint.capability,
            f"{limit} {dial} {address}{tls_name}",
            instance_id=endpoint.instance_id,
        )
        try:
            return await self._call(entry, endpoint, request, metadata, timeout_s, limit)
        finally:
            self._pools.release(entry)

    async def _dial(self, key: str, address: str) -> str:
        """Where the channel for `key` connects. With the address guard: an address the host
        resolves to and the guard allows, vetted again whenever the channel is not READY (a
        new one, or one about to reconnect), so gRPC's own resolver never picks the address
        (DNS rebinding); a READY channel is used as it is, like a kept-alive HTTP connection."""
        if self._guard is None:
            return address
        dial = self._dialed.get(key)
        if dial is not None:
            held = self._pools.get(f"{key} {dial}")
            if held is not None and held.value.state() is grpc.ChannelConnectivity.READY:
                return dial
        host, port = host_port(address, {}) or (address, 0)
        ips = await vetted_addresses(self._guard, host, port, address)
        if len(self._dialed) > 4 * max(self.transport.max_pools, 1):
            self._dialed = {k: v for k, v in self._dialed.items() if f"{k} {v}" in self._pools}
        self._dialed[key] = dial = dial_target(ips[0], port)
        return dial

    async def _call(
        self,
        entry: Entry[Channel],
        endpoint: Endpoint,
        request: bytes,
        metadata: list[tuple[str, str]],
        timeout_s: float,
        limit: int,
    ) -> Reply:
        channel = entry.value
        timeout = max(timeout_s, 0.001)
        dropped = channel.take_dropped()
        if channel.up and (dropped or channel.state() is not grpc.ChannelConnectivity.READY):
            # READY after the last call, not now (or not all along): it broke in between.
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

    def _observe(self, entry: Entry[Channel], code: grpc.StatusCode) -> None:
        """Count a failed connection or a reconnect, from the channel's state after a call."""
        channel = entry.value
        if channel.state() is grpc.ChannelConnectivity.READY:
            if channel.take_dropped() and channel.up and not channel.broken:
                # It broke while this call was on its way, and gRPC sent it on a new one.
                channel.broken = True
                self.stats.count(entry.capability, self.protocol, "failed")
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
