"""mTLS between Reach and agents (R18), on real loopback sockets: the SDK's servers require a
client certificate from the CA, and the connectors verify that the agent is the very instance
routed to (its certificate from Reach's CA, for its own id), on HTTP, gRPC and WebSocket alike.
"""

from __future__ import annotations

import json
import ssl
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from agent_reach_sdk import AgentRuntime
from agent_reach_sdk.servers import AgentServer
from agent_reach_sdk.servers.grpc import GrpcAgentServer
from agent_reach_sdk.servers.http import HttpAgentServer
from agent_reach_sdk.servers.websocket import WebSocketAgentServer
from agent_reach_sdk.wire import Answer, Inbound
from connectors.base import Connector
from connectors.grpc import GrpcConnector
from connectors.http import HttpConnector
from connectors.websocket import WebSocketConnector
from reach.config import SecuritySettings, TlsSettings
from reach.errors import AgentError, Forbidden, InvalidRequest, ReachError, TransportError
from reach.invocation import Endpoint
from reach.messages import Header, Message
from reach.security.certs import CaFiles, TlsFiles, init_ca, issue_agent
from tests.conftest import new_stack
from tests.helpers import Agent, GatewayProcess, free_port

pytestmark = pytest.mark.integration

TD = "reach.local"
SERVERS: dict[str, type[AgentServer]] = {
    "http": HttpAgentServer,
    "grpc": GrpcAgentServer,
    "websocket": WebSocketAgentServer,
}
CONNECTORS: dict[str, type[Connector]] = {
    "http": HttpConnector,
    "grpc": GrpcConnector,
    "websocket": WebSocketConnector,
}
PROTOCOLS = sorted(SERVERS)


@dataclass
class Pki:
    ca: CaFiles  # Reach's CA (and Reach's own certificate)
    other: CaFiles  # another CA: its certificates prove nothing to Reach
    dir: Path
    other_dir: Path

    def agent(self, instance_id: str, *, ca: str = "reach", trusts: str = "reach") -> TlsFiles:
        """Files for an agent server: a certificate for `instance_id` from CA `ca`, trusting
        clients whose certificates come from CA `trusts`."""
        cert, key = issue_agent(self.dir if ca == "reach" else self.other_dir, instance_id, TD)
        trusted = self.ca.ca_cert if trusts == "reach" else self.other.ca_cert
        return TlsFiles(trusted, cert, key)

    def security(self, *, enabled: bool = True) -> SecuritySettings:
        return SecuritySettings(
            allow_networks=["127.0.0.0/8"],
            tls=TlsSettings(
                enabled=enabled,
                ca_file=str(self.ca.ca_cert),
                cert_file=str(self.ca.reach_cert),
                key_file=str(self.ca.reach_key),
                trust_domain=TD,
            ),
        )


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    base = tmp_path_factory.mktemp("pki")
    return Pki(
        ca=init_ca(base / "reach-ca", TD),
        other=init_ca(base / "other-ca", TD),
        dir=base / "reach-ca",
        other_dir=base / "other-ca",
    )


CALLS: list[Inbound] = []


async def handler(request: Inbound) -> Answer:
    CALLS.append(request)
    return Answer(200, {"echo": json.loads(request.body or b"{}")})


@asynccontextmanager
async def agent(protocol: str, tls: TlsFiles | None, instance_id: str) -> AsyncIterator[str]:
    """An SDK agent server serving `handler`; yields the address it would join with."""
    server = SERVERS[protocol](
        handler,
        listen="127.0.0.1:0",
        advertise="127.0.0.1:0",
        instance_id=instance_id,
        max_body_bytes=1 << 20,
        tls=tls,
    )
    await server.start()
    try:
        yield server.service_address
    finally:
        await server.close(0)


def message(request_id: str = "req-1") -> Message:
    header = Header(
        request_id=request_id,
        caller="tester",
        target="cap",
        operation="echo",
        deadline_ms=int(time.time() * 1000) + 5000,
    )
    return Message(header=header, payload={"q": "x"})


def endpoint(protocol: str, address: str, instance_id: str) -> Endpoint:
    return Endpoint(instance_id=instance_id, capability="cap", protocol=protocol, address=address)


async def call(protocol: str, pki: Pki, address: str, instance_id: str) -> dict[str, Any]:
    async with CONNECTORS[protocol](security=pki.security()) as connector:
        reply = await connector.invoke(endpoint(protocol, address, instance_id), message(), 5)
    assert reply.status == "ok"
    assert reply.result is not None
    return reply.result


async def refused(protocol: str, pki: Pki, address: str, instance_id: str) -> TransportError:
    """The connector's refusal to call (nothing reaches the agent's handler)."""
    before = len(CALLS)
    async with CONNECTORS[protocol](security=pki.security()) as connector:
        with pytest.raises(TransportError) as caught:
            await connector.invoke(endpoint(protocol, address, instance_id), message(), 5)
    assert len(CALLS) == before, "the agent's handler ran"
    assert not caught.value.outcome_unknown  # nothing was delivered: safe to send elsewhere
    return caught.value


# -- (a) the call succeeds ------------------------------------------------------------------------


@pytest.mark.parametrize("protocol", PROTOCOLS)
async def test_a_call_over_mtls_succeeds(protocol: str, pki: Pki) -> None:
    async with agent(protocol, pki.agent("agent-ok"), "agent-ok") as address:
        if protocol == "http":
            assert address.startswith("https://")
        if protocol == "websocket":
            assert address.startswith("wss://")
        assert await call(protocol, pki, address, "agent-ok") == {"echo": {"q": "x"}}


@pytest.mark.parametrize("protocol", ["http", "websocket"])
async def test_a_host_port_address_is_called_over_tls_when_mtls_is_on(
    protocol: str, pki: Pki
) -> None:
    async with agent(protocol, pki.agent("agent-hp"), "agent-hp") as address:
        hostport = address.split("://", 1)[1].split("/", 1)[0]
        assert await call(protocol, pki, hostport, "agent-hp") == {"echo": {"q": "x"}}


async def test_many_calls_share_the_instances_connections(pki: Pki) -> None:
    async with (
        agent("http", pki.agent("agent-pool"), "agent-pool") as address,
        HttpConnector(security=pki.security()) as connector,
    ):
        ep = endpoint("http", address, "agent-pool")
        for i in range(20):
            reply = await connector.invoke(ep, message(f"req-pool-{i}"), 5)
            assert reply.status == "ok"
        counts = connector.stats.of("cap")["http"]
        assert counts["opened"] == 1
        assert counts["reused"] == 19


# -- (b) the agent refuses a client without a certificate from the CA -----------------------------


async def test_the_sdk_server_refuses_a_client_without_a_certificate(pki: Pki) -> None:
    before = len(CALLS)
    async with agent("http", pki.agent("agent-b"), "agent-b") as address:
        verify = ssl.create_default_context(cafile=str(pki.ca.ca_cert))
        async with httpx.AsyncClient(verify=verify, trust_env=False) as plain:
            with pytest.raises(httpx.TransportError):
                await plain.post(
                    f"{address}/reach/echo",
                    json={"q": "x"},
                    extensions={"sni_hostname": f"agent-b.agent.{TD}"},
                )
        # Nor does plaintext get anywhere.
        async with httpx.AsyncClient(trust_env=False) as plain:
            with pytest.raises(httpx.TransportError):
                await plain.post(address.replace("https://", "http://") + "/reach/echo", json={})
    assert len(CALLS) == before


@pytest.mark.parametrize("protocol", PROTOCOLS)
async def test_the_sdk_server_serves_reach_only_not_another_agent(protocol: str, pki: Pki) -> None:
    # A client with a good certificate from the same CA, but an agent's: it may not call
    # agents directly (that would pass by Reach's authorization and audit).
    before = len(CALLS)
    cert, key = issue_agent(pki.dir, "agent-sneaky", TD)
    sneaky = pki.security()
    sneaky.tls = sneaky.tls.model_copy(update={"cert_file": str(cert), "key_file": str(key)})
    async with (
        agent(protocol, pki.agent("agent-s"), "agent-s") as address,
        CONNECTORS[protocol](security=sneaky) as connector,
    ):
        with pytest.raises(ReachError) as caught:
            await connector.invoke(endpoint(protocol, address, "agent-s"), message(), 5)
    assert "403" in caught.value.message
    assert not caught.value.retryable
    if protocol != "websocket":  # the handshake refused: there is no answer to carry words
        assert isinstance(caught.value, AgentError)
        assert caught.value.fault is not None
        assert "only spiffe://reach.local/reach may call" in caught.value.fault.message
    assert len(CALLS) == before


@pytest.mark.parametrize("protocol", ["grpc", "websocket"])
async def test_an_agent_refusing_reachs_certificate_is_a_tls_transport_error(
    protocol: str, pki: Pki
) -> None:
    # The agent's certificate is good, but it trusts another CA for its clients: under TLS 1.3
    # it can only close the connection, before any request was sent on these protocols.
    tls = pki.agent("agent-picky", trusts="other")
    async with agent(protocol, tls, "agent-picky") as address:
        error = await refused(protocol, pki, address, "agent-picky")
    assert error.retryable  # another instance may take it
    assert "TLS handshake" in error.message
    assert "spiffe://reach.local/agent/agent-picky" in error.message


async def test_an_http_agent_refusing_reachs_certificate_never_runs_the_request(
    pki: Pki,
) -> None:
    # Over HTTP the request follows the client's half of the TLS 1.3 handshake at once, so the
    # refusal looks like a connection broken mid-call (its outcome unknown to Reach); the Join
    # probe is what keeps such an agent out (below).
    before = len(CALLS)
    async with (
        agent("http", pki.agent("agent-picky", trusts="other"), "agent-picky") as address,
        HttpConnector(security=pki.security()) as connector,
    ):
        with pytest.raises(TransportError):
            await connector.invoke(endpoint("http", address, "agent-picky"), message(), 5)
    assert len(CALLS) == before


# -- (c) an agent with a certificate from another CA ----------------------------------------------


@pytest.mark.parametrize("protocol", PROTOCOLS)
async def test_an_agent_with_a_certificate_from_another_ca_is_refused(
    protocol: str, pki: Pki
) -> None:
    tls = pki.agent("agent-c", ca="other")
    async with agent(protocol, tls, "agent-c") as address:
        error = await refused(protocol, pki, address, "agent-c")
    assert "did not prove the identity spiffe://reach.local/agent/agent-c" in error.message
    assert "agent-c.agent.reach.local" in error.message
    assert error.retryable  # elsewhere: the workflow never retries the instance that failed


# -- (d) a certificate for another instance -------------------------------------------------------


@pytest.mark.parametrize("protocol", PROTOCOLS)
async def test_an_agent_registered_under_another_id_is_refused(protocol: str, pki: Pki) -> None:
    # A certificate from the right CA, for agent-x, at the address registered for agent-y.
    async with agent(protocol, pki.agent("agent-x"), "agent-x") as address:
        error = await refused(protocol, pki, address, "agent-y")
    assert "did not prove the identity spiffe://reach.local/agent/agent-y" in error.message


@pytest.mark.parametrize("protocol", PROTOCOLS)
async def test_a_plaintext_agent_is_refused_when_mtls_is_on(protocol: str, pki: Pki) -> None:
    async with agent(protocol, None, "agent-plain") as address:
        error = await refused(protocol, pki, address, "agent-plain")
    assert "TLS" in error.message


@pytest.mark.parametrize(("protocol", "scheme"), [("http", "http"), ("websocket", "ws")])
async def test_a_plaintext_address_is_never_called_when_mtls_is_on(
    protocol: str, scheme: str, pki: Pki
) -> None:
    error = await refused(protocol, pki, f"{scheme}://127.0.0.1:{free_port()}", "agent-p")
    assert "without TLS" in error.message
    assert not error.retryable


async def test_an_id_mtls_cannot_name_is_refused_before_connecting(pki: Pki) -> None:
    error = await refused("http", pki, f"127.0.0.1:{free_port()}", "Agent_1")
    assert "cannot be an mTLS identity" in error.message
    assert not error.retryable


# -- (f) the Join-time probe ----------------------------------------------------------------------


@pytest.mark.parametrize("protocol", PROTOCOLS)
async def test_the_join_probe_accepts_an_agent_with_its_own_certificate(
    protocol: str, pki: Pki
) -> None:
    async with (
        agent(protocol, pki.agent("agent-j"), "agent-j") as address,
        CONNECTORS[protocol](security=pki.security()) as connector,
    ):
        await connector.verify_identity(connector.check_address(address), "agent-j")


@pytest.mark.parametrize("protocol", PROTOCOLS)
async def test_the_join_probe_refuses_an_agent_without_a_certificate_from_the_ca(
    protocol: str, pki: Pki
) -> None:
    async with CONNECTORS[protocol](security=pki.security()) as connector:
        async with agent(protocol, pki.agent("agent-f", ca="other"), "agent-f") as address:
            with pytest.raises(Forbidden) as other_ca:
                await connector.verify_identity(connector.check_address(address), "agent-f")
        assert "did not prove the identity spiffe://reach.local/agent/agent-f" in (
            other_ca.value.message
        )
        async with agent(protocol, pki.agent("agent-g"), "agent-g") as address:
            with pytest.raises(Forbidden) as wrong_id:
                await connector.verify_identity(connector.check_address(address), "agent-h")
        assert "spiffe://reach.local/agent/agent-h" in wrong_id.value.message
        async with agent(protocol, None, "agent-i") as address:
            with pytest.raises(Forbidden):
                await connector.verify_identity(connector.check_address(address), "agent-i")
        # Its own certificate, but it does not trust Reach's (TLS 1.3: it closes after the
        # handshake, which the probe waits to see).
        picky = pki.agent("agent-picky", trusts="other")
        async with agent(protocol, picky, "agent-picky") as address:
            with pytest.raises(Forbidden, match="refuses Reach's certificate"):
                await connector.verify_identity(connector.check_address(address), "agent-picky")


async def test_the_join_probe_refuses_what_it_cannot_check(pki: Pki) -> None:
    async with HttpConnector(security=pki.security()) as connector:
        with pytest.raises(InvalidRequest, match="cannot reach"):
            await connector.verify_identity(f"127.0.0.1:{free_port()}", "agent-k")
        with pytest.raises(InvalidRequest, match="without TLS"):
            await connector.verify_identity(f"http://127.0.0.1:{free_port()}", "agent-k")
        with pytest.raises(InvalidRequest, match="cannot be an mTLS identity"):
            await connector.verify_identity(f"127.0.0.1:{free_port()}", "Agent.K")
    async with WebSocketConnector(security=pki.security()) as connector:
        with pytest.raises(InvalidRequest, match="without TLS"):
            await connector.verify_identity(f"ws://127.0.0.1:{free_port()}/reach", "agent-k")


async def test_the_join_probe_only_connects_where_the_address_guard_allows(pki: Pki) -> None:
    guarded = pki.security()
    guarded.allow_networks = []  # loopback is not global unicast: refused before any connect
    async with (
        agent("http", pki.agent("agent-guard"), "agent-guard") as address,
        HttpConnector(security=guarded) as connector,
    ):
        with pytest.raises(InvalidRequest, match=r"127\.0\.0\.1"):
            await connector.verify_identity(address, "agent-guard")


async def test_the_join_probe_does_nothing_when_mtls_is_off(pki: Pki) -> None:
    for connector_class in CONNECTORS.values():
        async with connector_class(security=pki.security(enabled=False)) as connector:
            await connector.verify_identity(f"127.0.0.1:{free_port()}", "Not.A.Label")


# -- the SDK runtime ------------------------------------------------------------------------------


@pytest.mark.parametrize("protocol", PROTOCOLS)
async def test_the_runtime_serves_mtls_from_its_environment(
    protocol: str, pki: Pki, monkeypatch: pytest.MonkeyPatch
) -> None:
    cert, key = issue_agent(pki.dir, f"rt-{protocol}", TD)
    monkeypatch.setenv("REACH_AGENT_TLS_CERT", str(cert))
    monkeypatch.setenv("REACH_AGENT_TLS_KEY", str(key))
    monkeypatch.setenv("REACH_AGENT_TLS_CA", str(pki.ca.ca_cert))
    # No gateway listens there: the runtime serves anyway and keeps trying to join.
    runtime = AgentRuntime("cap", reach_address=f"127.0.0.1:{free_port()}", protocol=protocol)
    assert runtime.instance_id == f"rt-{protocol}"  # the certificate's

    @runtime.operation("echo")
    def echo(payload: dict[str, Any]) -> dict[str, Any]:
        return {"echo": payload}

    async with runtime:
        address = runtime.service_address
        assert address.startswith({"http": "https://", "websocket": "wss://"}.get(protocol, "1"))
        assert await call(protocol, pki, address, runtime.instance_id) == {"echo": {"q": "x"}}


def test_the_runtime_refuses_a_certificate_for_another_id(pki: Pki) -> None:
    files = pki.agent("rt-mine")
    with pytest.raises(ValueError, match="is for agent 'rt-mine', not 'rt-yours'"):
        AgentRuntime(
            "cap",
            instance_id="rt-yours",
            tls_cert=str(files.cert),
            tls_key=str(files.key),
            tls_ca=str(files.ca),
        )
    with pytest.raises(ValueError, match="missing: tls_ca"):
        AgentRuntime("cap", tls_cert=str(files.cert), tls_key=str(files.key))


# -- end to end: the gateway's configuration, the demo agent's flags ------------------------------


@pytest.mark.parametrize("protocol", PROTOCOLS)
async def test_an_invoke_through_a_gateway_with_mtls_on(
    protocol: str, pki: Pki, temporal_server: str, tmp_path: Path
) -> None:
    stack = new_stack(
        temporal_server,
        tmp_path,
        extra={
            "REACH_SECURITY__TLS__ENABLED": "true",
            "REACH_SECURITY__TLS__CA_FILE": str(pki.ca.ca_cert),
            "REACH_SECURITY__TLS__CERT_FILE": str(pki.ca.reach_cert),
            "REACH_SECURITY__TLS__KEY_FILE": str(pki.ca.reach_key),
            "REACH_SECURITY__ALLOW_NETWORKS": '["127.0.0.0/8"]',
        },
    )
    gateway = await GatewayProcess(stack).ready()
    instance_id = f"e2e-{protocol}"
    files = pki.agent(instance_id)
    agent_proc = await Agent(
        gateway,
        instance_id,
        "mtls-cap",
        "--protocol",
        protocol,
        "--tls-cert",
        str(files.cert),
        "--tls-key",
        str(files.key),
        "--tls-ca",
        str(files.ca),
    ).ready()
    assert "serving at" in agent_proc.proc.output()
    async with httpx.AsyncClient(trust_env=False, timeout=30) as http:
        r = await http.post(
            f"{gateway.url}/reach/invoke",
            json={
                "target": "mtls-cap",
                "operation": "query",
                "payload": {"text": "durable retries", "top_k": 1},
                "timeout_ms": 10_000,
            },
        )
    assert r.status_code == 200, r.text
    assert r.json()["status"] == "success"
    assert r.json()["instance_id"] == instance_id
