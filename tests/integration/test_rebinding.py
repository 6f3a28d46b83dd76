"""DNS rebinding on the gRPC and WebSocket connectors (issue 25), over real sockets: the name an
agent joined with is resolved by the address guard whenever a connection is about to be opened,
the connection goes to the very address it vetted (never to the name, which gRPC would resolve
again on its own), and a name that now resolves outside the allowlist is refused, final. As in
test_guard, the name is resolved by a stand-in the guard calls instead of the resolver."""

from __future__ import annotations

import typing
from typing import Any

import pytest

from agent_reach_sdk.runtime import AgentRuntime
from agent_reach_sdk.servers.grpc import GrpcAgentServer
from agent_reach_sdk.servers.websocket import WebSocketAgentServer
from connectors import guard as guard_module
from connectors.base import Connector
from connectors.grpc import GrpcConnector
from connectors.websocket import WebSocketConnector
from reach.config import SecuritySettings
from reach.errors import TransportError
from reach.invocation import Endpoint
from tests.helpers import message, wait_until

pytestmark = pytest.mark.integration

LOOPBACK = ["127.0.0.0/8", "::1/128"]
Server = type[GrpcAgentServer] | type[WebSocketAgentServer]


def runtime(protocol: str) -> AgentRuntime:
    agent = AgentRuntime("cap", protocol=protocol, instance_id="rebound")

    @agent.operation("echo")
    async def echo(payload: dict[str, Any]) -> dict[str, Any]:
        return {"got": payload}

    return agent


@pytest.mark.parametrize(
    ("protocol", "server_class", "connector_class"),
    [
        ("grpc", GrpcAgentServer, GrpcConnector),
        ("websocket", WebSocketAgentServer, WebSocketConnector),
    ],
)
async def test_a_name_rebound_outside_the_allowlist_is_not_connected_to(
    monkeypatch: pytest.MonkeyPatch,
    protocol: str,
    server_class: Server,
    connector_class: type[Connector],
) -> None:
    answers = iter([["127.0.0.1"]])  # then the rebinding's answer, for ever
    asked: list[str] = []

    async def resolve(host: str, port: int) -> list[str]:
        asked.append(host)
        return next(answers, ["10.9.9.9"])

    monkeypatch.setattr(guard_module, "resolve", resolve)
    agent = runtime(protocol)

    def serve(port: int = 0) -> typing.Any:
        listen = f"127.0.0.1:{port}"
        return server_class(
            agent.dispatch,
            listen=listen,
            advertise=listen,
            instance_id="rebound",
            max_body_bytes=1 << 16,
        )

    server = serve()
    await server.start()
    port = server.port
    endpoint = Endpoint(
        instance_id="rebound", capability="cap", protocol=protocol, address=f"rebind.test:{port}"
    )
    connector: typing.Any = connector_class(security=SecuritySettings(allow_networks=LOOPBACK))
    try:
        # Resolved once, by the guard, and dialled at 127.0.0.1 (nobody resolves rebind.test).
        reply = await connector.invoke(endpoint, message("echo", {"n": 1}), 5.0)
        assert reply.result == {"got": {"n": 1}}
        reply = await connector.invoke(endpoint, message("echo", {"n": 2}), 5.0)
        assert reply.result == {"got": {"n": 2}}
        assert asked == ["rebind.test"]  # an open connection is used as it is

        # The agent restarts: the next connection is vetted again, and the name now points
        # into the private network (outside this allowlist).
        await server.close(0)
        server = serve(port)
        await server.start()
        refused: list[TransportError] = []

        async def rebound_refused() -> bool:
            try:
                await connector.invoke(endpoint, message("echo", {"n": 3}), 2.0)
            except TransportError as exc:
                if "10.9.9.9" in exc.message:
                    refused.append(exc)
                    return True
            return False

        await wait_until(rebound_refused, 10, every_s=0.2)
        assert refused[0].retryable is False
        assert "rebind.test (10.9.9.9)" in refused[0].message
        assert "private" in refused[0].message
        assert len(asked) >= 2
    finally:
        await connector.aclose()
        await server.close(0)
