"""The agent's protocol servers: one module per protocol, one `AgentServer` interface.

A server receives requests in its protocol, hands each to the runtime as a `wire.Inbound`, and
sends back the runtime's `wire.Answer` in its protocol's terms. It knows nothing about
operations, deduplication or Reach: switching protocol is switching server.
"""

from __future__ import annotations

import importlib
from abc import ABC, abstractmethod
from typing import ClassVar

from agent_reach_sdk.wire import Dispatch
from reach.security.certs import TlsFiles

SERVERS = {
    "http": "agent_reach_sdk.servers.http:HttpAgentServer",
    "grpc": "agent_reach_sdk.servers.grpc:GrpcAgentServer",
    "websocket": "agent_reach_sdk.servers.websocket:WebSocketAgentServer",
    "mqtt": "agent_reach_sdk.servers.mqtt:MqttAgentServer",
}


class AgentServer(ABC):
    protocol: ClassVar[str]
    # The service address to assume when the agent gives none.
    default_address: ClassVar[str] = "127.0.0.1:0"

    def __init__(
        self,
        dispatch: Dispatch,
        *,
        listen: str,
        advertise: str,
        instance_id: str,
        max_body_bytes: int,
        tls: TlsFiles | None = None,
    ) -> None:
        """`listen`: where to bind (host:port; port 0 picks one). `advertise`: the service
        address the agent asked to be called at (its port may be 0 until `start`). `tls`: serve
        mTLS with this certificate, requiring a client certificate signed by `tls.ca` (the
        HTTP, gRPC and WebSocket servers; `service_address` then names a TLS address)."""
        self.dispatch = dispatch
        self.listen = listen
        self.advertise = advertise
        self.instance_id = instance_id
        self.max_body_bytes = max_body_bytes  # updated after Join to the negotiated size
        self.tls = tls

    @abstractmethod
    async def start(self) -> None:
        """Bind and start serving; return once requests can arrive."""

    @property
    @abstractmethod
    def service_address(self) -> str:
        """The address to join with, valid after `start` (the bound port filled in)."""

    @abstractmethod
    async def close(self, grace_s: float = 5.0) -> None:
        """Stop taking requests at once; let those in flight finish for up to `grace_s`."""


def server_class(protocol: str) -> type[AgentServer]:
    target = SERVERS.get(protocol)
    if target is None:
        known = ", ".join(sorted(SERVERS))
        raise ValueError(f"protocol {protocol!r} is not served by this SDK; known: {known}")
    module, _, name = target.partition(":")
    cls = getattr(importlib.import_module(module), name)
    if not (isinstance(cls, type) and issubclass(cls, AgentServer)):
        raise TypeError(f"{target} is not an AgentServer")
    return cls


def split_hostport(address: str, default_port: int = 0) -> tuple[str, int]:
    """`host:port`, `scheme://host:port/...` or `[v6]:port` -> (host, port)."""
    hostport = address.split("://", 1)[-1].split("/", 1)[0]
    if hostport.startswith("["):
        host, _, rest = hostport[1:].partition("]")
        port = rest.lstrip(":")
    else:
        host, sep, port = hostport.rpartition(":")
        if not sep:
            host, port = hostport, ""
    return host or "127.0.0.1", int(port) if port else default_port
