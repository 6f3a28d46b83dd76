"""The gRPC connector's connections: one `grpc.aio` channel per instance, address and reply limit,
with its keepalive, reconnect backoff, idleness and mTLS credentials (what they mean for an
agent: docs/protocols/grpc.md, its "Connections"). `connectors.grpc` makes the calls on them.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from dataclasses import dataclass, field

import grpc
import grpc.aio

from agent_reach_proto.wire import GRPC_INVOKE_METHOD
from connectors._tls import ReachTls

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


@dataclass
class Channel:
    """A channel and what the connector knows of its connection's history."""

    channel: grpc.aio.Channel
    invoke: grpc.aio.UnaryUnaryMultiCallable[bytes, bytes]
    receive_limit: int
    up: bool = False  # READY after the last call
    broken: bool = False  # failed since it was last READY (a READY then is a reconnect)
    # Left READY since the connector last looked: seen by `watch`, so a connection that broke
    # and came back between two looks (an agent restarted while a call was on its way) still
    # counts as a failure and a reconnect.
    dropped: bool = False
    watcher: asyncio.Task[None] | None = field(default=None, repr=False)

    def state(self) -> grpc.ChannelConnectivity:
        return self.channel.get_state(try_to_connect=False)

    def take_dropped(self) -> bool:
        dropped, self.dropped = self.dropped, False
        return dropped

    async def watch(self) -> None:
        state = self.state()
        while True:
            await self.channel.wait_for_state_change(state)
            new = self.state()
            if state is grpc.ChannelConnectivity.READY and new is not state:
                self.dropped = True
            state = new


async def close_channel(channel: Channel) -> None:
    if channel.watcher is not None:
        channel.watcher.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await channel.watcher
    await channel.channel.close(grace=None)


def client_idle_ms(idle_timeout_s: float) -> int:
    """gRPC's own idleness for a pool that reclaims channels idle past `idle_timeout_s`."""
    return min(max(MIN_CLIENT_IDLE_MS, int(idle_timeout_s * 2000)), INT32_MAX)


def dial_target(ip: str, port: int) -> str:
    """gRPC's target for one address (`ipv4:` / `ipv6:`): a channel to it never resolves a
    name, so it reconnects to this very address (no DNS rebinding)."""
    return f"ipv6:[{ip}]:{port}" if ":" in ip else f"ipv4:{ip}:{port}"


class ChannelMaker:
    """Opens the channel for a pool target `"<reply limit> <dial> <address>[ <mTLS name>]"`:
    `dial` is where it connects (a vetted address, `dial_target`, or the address itself when
    no guard pins it), `address` the agent's own `host:port`, sent as the `:authority`."""

    def __init__(self, idle_timeout_s: float, tls: Callable[[], ReachTls]) -> None:
        self.idle_ms = client_idle_ms(idle_timeout_s)
        # Only read when a target names an mTLS identity: a plaintext connector never builds
        # Reach's TLS side.
        self._tls = tls
        self._credentials: tuple[tuple[bytes, bytes, bytes], grpc.ChannelCredentials] | None = None

    def __call__(self, target: str) -> Channel:
        limit, dial, address, *tls_name = target.split(" ", 3)
        receive_limit = int(limit) + REPLY_OVERHEAD_BYTES
        options: list[tuple[str, str | int]] = [
            # The agent's host:port as the :authority (mTLS: the name it proves, below).
            *([] if tls_name else [("grpc.default_authority", address)]),
            ("grpc.max_receive_message_length", receive_limit),
            ("grpc.max_metadata_size", MAX_METADATA_BYTES),
            # Reach checked the payload against the smallest limit before sending.
            ("grpc.max_send_message_length", -1),
            ("grpc.keepalive_time_ms", KEEPALIVE_TIME_MS),
            ("grpc.keepalive_timeout_ms", KEEPALIVE_TIMEOUT_MS),
            ("grpc.keepalive_permit_without_calls", 0),
            ("grpc.http2.max_pings_without_data", 0),
            ("grpc.client_idle_timeout_ms", self.idle_ms),
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
            channel = grpc.aio.secure_channel(dial, self.credentials(), options=options)
        else:
            channel = grpc.aio.insecure_channel(dial, options=options)
        # Bytes in and out: the connector encodes and decodes, so a reply that is not an
        # InvokeReply is this request's typed error, not grpcio's logged exception.
        invoke: grpc.aio.UnaryUnaryMultiCallable[bytes, bytes] = channel.unary_unary(
            GRPC_INVOKE_METHOD
        )
        made = Channel(channel, invoke, receive_limit)
        made.watcher = asyncio.get_running_loop().create_task(made.watch())
        return made

    def credentials(self) -> grpc.ChannelCredentials:
        """Reach's mTLS credentials, made again when its files change on disk."""
        pem = self._tls().pem()
        if self._credentials is None or self._credentials[0] != pem:
            ca, key, chain = pem
            credentials = grpc.ssl_channel_credentials(ca, key, chain)
            self._credentials = (pem, credentials)
        return self._credentials[1]
