"""The address guard on real sockets, loopback only: the guarded HTTP transport, callback
delivery (no redirect followed), the HTTP connector, and a real gateway refusing a loopback
callback and a loopback agent when its allowlist is empty.

Nothing here resolves a name through DNS: "localhost" comes from /etc/hosts, and the name used
for the rebinding test is resolved by a stand-in that the guard calls instead of the resolver.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import typing
import uuid
from collections.abc import AsyncIterator

import httpcore
import httpx
import pytest
from temporalio.exceptions import ApplicationError
from temporalio.testing import ActivityEnvironment

from activities import ReachActivities
from connectors import AddressRefused, ConnectorSet, GuardedBackend, guarded_client, refusal_in
from connectors import guard as guard_module
from connectors.http import HttpConnector
from reach.config import PolicySettings, RegistrySettings, RoutingSettings, SecuritySettings
from reach.errors import TransportError
from reach.invocation import CallbackInput, Endpoint
from reach.messages import Header, InvokeResponse, Message
from reach.policy.engine import PolicyEngine
from reach.policy.state import MemoryPolicyState
from reach.registry import Registry
from reach.routing import Router
from reach.security.netguard import AddressGuard
from reach.store import MemoryStore
from tests.conftest import new_stack
from tests.helpers import GatewayProcess

pytestmark = pytest.mark.integration

LOOPBACK = ["127.0.0.0/8", "::1/128"]


class RawHttp:
    """A loopback HTTP/1.1 server that counts connections, records requests and answers each
    with `status` (and `headers`)."""

    def __init__(self, status: int = 200, headers: dict[str, str] | None = None) -> None:
        self.status = status
        self.headers = headers or {}
        self.connections = 0
        self.peers: list[str] = []
        self.requests: list[tuple[str, dict[str, str], bytes]] = []
        self._server: asyncio.Server | None = None

    async def __aenter__(self) -> RawHttp:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._server is not None
        self._server.close()
        await self._server.wait_closed()

    @property
    def port(self) -> int:
        assert self._server is not None
        port: int = self._server.sockets[0].getsockname()[1]
        return port

    def url(self, host: str = "127.0.0.1", path: str = "/callback") -> str:
        return f"http://{host}:{self.port}{path}"

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        self.peers.append(writer.get_extra_info("peername")[0])
        try:
            head = await reader.readuntil(b"\r\n\r\n")
            line, *fields = head.decode("latin-1").split("\r\n")
            headers = {}
            for field_line in fields:
                name, sep, value = field_line.partition(":")
                if sep:
                    headers[name.strip().lower()] = value.strip()
            body = await reader.readexactly(int(headers.get("content-length", "0")))
            self.requests.append((line, headers, body))
            extra = "".join(f"{k}: {v}\r\n" for k, v in self.headers.items())
            writer.write(
                f"HTTP/1.1 {self.status} X\r\n{extra}Content-Length: 2\r\n"
                "Connection: close\r\n\r\n{}".encode()
            )
            await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()
            with contextlib.suppress(ConnectionError):
                await writer.wait_closed()


# -- the guarded transport ----------------------------------------------------------------------


async def test_a_name_resolving_to_loopback_is_refused_before_connecting() -> None:
    async with RawHttp() as server, guarded_client(AddressGuard()) as client:
        assert client.follow_redirects is False
        with pytest.raises(httpx.ConnectError) as caught:
            await client.get(server.url("localhost"))
        reason = refusal_in(caught.value)
        assert reason is not None
        assert "localhost" in reason
        assert "loopback" in reason
        assert "security.allow_networks" in reason
        # And an IP literal the same way, without DNS.
        with pytest.raises(httpx.ConnectError) as literal:
            await client.get(server.url("127.0.0.1"))
        assert "127.0.0.1 is a loopback address" in (refusal_in(literal.value) or "")
        await asyncio.sleep(0.2)
        assert server.connections == 0  # nothing reached the socket


async def test_with_the_allowlist_it_connects() -> None:
    async with RawHttp() as server, guarded_client(AddressGuard(LOOPBACK)) as client:
        r = await client.get(server.url("localhost", "/x"))
        assert r.status_code == 200
        r = await client.get(server.url("127.0.0.1", "/y"))
        assert r.status_code == 200
        assert [line for line, _, _ in server.requests] == ["GET /x HTTP/1.1", "GET /y HTTP/1.1"]
        assert server.requests[0][1]["host"] == f"localhost:{server.port}"


class Recording(httpcore.AsyncNetworkBackend):
    """An inner backend that records where it is asked to connect (refusing any name, so a
    wrong backend would fail here instead of asking DNS) and the TLS server name."""

    def __init__(self) -> None:
        self.inner = httpcore.AnyIOBackend()
        self.hosts: list[str] = []
        self.tls_names: list[str | None] = []

    async def connect_tcp(
        self,
        host: str,
        port: int,
        timeout: float | None = None,  # noqa: ASYNC109 (httpcore's signature)
        local_address: str | None = None,
        socket_options: typing.Iterable[guard_module.SocketOption] | None = None,
    ) -> httpcore.AsyncNetworkStream:
        ipaddress.ip_address(host)  # only ever an address the guard vetted
        self.hosts.append(host)
        stream = await self.inner.connect_tcp(host, port, timeout=timeout)
        return RecordingStream(stream, self)

    async def sleep(self, seconds: float) -> None:
        await self.inner.sleep(seconds)


class RecordingStream(httpcore.AsyncNetworkStream):
    def __init__(self, stream: httpcore.AsyncNetworkStream, owner: Recording) -> None:
        self.stream = stream
        self.owner = owner

    async def read(self, max_bytes: int, timeout: float | None = None) -> bytes:  # noqa: ASYNC109
        return await self.stream.read(max_bytes, timeout)

    async def write(self, buffer: bytes, timeout: float | None = None) -> None:  # noqa: ASYNC109
        await self.stream.write(buffer, timeout)

    async def aclose(self) -> None:
        await self.stream.aclose()

    async def start_tls(
        self,
        ssl_context: typing.Any,
        server_hostname: str | None = None,
        timeout: float | None = None,  # noqa: ASYNC109
    ) -> httpcore.AsyncNetworkStream:
        self.owner.tls_names.append(server_hostname)
        await self.stream.aclose()  # as httpcore's own streams do when a handshake fails
        raise httpcore.ConnectError("no TLS in this test")

    def get_extra_info(self, info: str) -> typing.Any:
        return self.stream.get_extra_info(info)


async def test_connects_to_the_address_it_checked_and_tls_keeps_the_name(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """DNS rebinding: the name is resolved once, by the guard, and the socket opens to that
    very address; a second answer is never asked for. TLS still names the host."""
    answers = iter([["127.0.0.1"], ["10.9.9.9"]])  # the second answer would be a rebinding
    asked: list[str] = []

    async def resolve(host: str, port: int) -> list[str]:
        asked.append(host)
        return next(answers)

    monkeypatch.setattr(guard_module, "resolve", resolve)
    inner = Recording()
    backend = GuardedBackend(AddressGuard(LOOPBACK), inner)
    async with RawHttp() as server:
        pool = httpcore.AsyncConnectionPool(network_backend=backend)
        async with pool:
            r = await pool.request("GET", f"http://rebind.test:{server.port}/a")
            assert r.status == 200
        assert asked == ["rebind.test"]
        assert inner.hosts == ["127.0.0.1"]
        assert server.peers == ["127.0.0.1"]
        assert server.requests[0][1]["host"] == f"rebind.test:{server.port}"
        # The next new connection resolves again, and the rebound answer is refused.
        async with httpcore.AsyncConnectionPool(network_backend=backend) as again:
            with pytest.raises(AddressRefused, match=r"rebind\.test \(10\.9\.9\.9\).*private"):
                await again.request("GET", f"http://rebind.test:{server.port}/b")
        assert inner.hosts == ["127.0.0.1"]
        assert server.connections == 1

    monkeypatch.setattr(guard_module, "resolve", _fixed("127.0.0.1"))
    async with RawHttp() as server:
        async with httpcore.AsyncConnectionPool(network_backend=backend) as tls:
            with pytest.raises(httpcore.ConnectError, match="no TLS"):
                await tls.request("GET", f"https://rebind.test:{server.port}/")
        assert inner.tls_names == ["rebind.test"]


def _fixed(*ips: str) -> typing.Callable[[str, int], typing.Awaitable[list[str]]]:
    async def resolve(host: str, port: int) -> list[str]:
        return list(ips)

    return resolve


async def test_one_refused_address_refuses_the_name(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(guard_module, "resolve", _fixed("127.0.0.1", "169.254.169.254"))
    async with RawHttp() as server, guarded_client(AddressGuard(LOOPBACK)) as client:
        with pytest.raises(httpx.ConnectError) as caught:
            await client.get(server.url("two.test"))
        assert "metadata" in (refusal_in(caught.value) or "")
        assert server.connections == 0


# -- callback delivery --------------------------------------------------------------------------


@contextlib.asynccontextmanager
async def activities(security: SecuritySettings) -> AsyncIterator[ReachActivities]:
    store = MemoryStore()
    acts = ReachActivities(
        Registry(store, RegistrySettings()),
        Router(lambda _capability: RoutingSettings(strategy="round_robin")),
        ConnectorSet(),
        PolicyEngine(PolicySettings(), MemoryPolicyState()),
        security=security,
    )
    try:
        yield acts
    finally:
        await acts.aclose()


def callback(url: str) -> CallbackInput:
    response = InvokeResponse(request_id=f"req-{uuid.uuid4().hex}", status="success", result={})
    return CallbackInput(url=url, response=response, caller="orchestrator")


async def test_a_callback_redirect_is_not_followed_and_fails() -> None:
    async with RawHttp() as elsewhere:
        async with (
            RawHttp(302, {"Location": elsewhere.url(path="/stolen")}) as receiver,
            activities(SecuritySettings(allow_networks=LOOPBACK)) as acts,
        ):
            assert acts._http.follow_redirects is False
            with pytest.raises(ApplicationError) as caught:
                await ActivityEnvironment().run(acts.deliver_callback, callback(receiver.url()))
            assert caught.value.type == "callback_rejected"
            assert caught.value.non_retryable
            assert "302" in caught.value.message
            assert len(receiver.requests) == 1
        await asyncio.sleep(0.2)
        assert elsewhere.connections == 0  # the redirect's target got nothing


async def test_a_callback_to_a_refused_address_is_rejected_for_good() -> None:
    async with RawHttp() as receiver, activities(SecuritySettings()) as acts:
        for host in ("127.0.0.1", "localhost"):
            with pytest.raises(ApplicationError) as caught:
                await ActivityEnvironment().run(acts.deliver_callback, callback(receiver.url(host)))
            assert caught.value.type == "callback_rejected"
            assert caught.value.non_retryable
            assert "loopback" in caught.value.message
            assert "security.allow_networks" in caught.value.message
        assert receiver.connections == 0


async def test_an_allowed_callback_is_delivered() -> None:
    async with (
        RawHttp() as receiver,
        activities(SecuritySettings(allow_networks=LOOPBACK)) as acts,
    ):
        attempt = await ActivityEnvironment().run(acts.deliver_callback, callback(receiver.url()))
        assert attempt == 1
        assert len(receiver.requests) == 1
        assert "webhook-signature" not in receiver.requests[0][1]  # no webhook_key: unsigned


# -- the HTTP connector -------------------------------------------------------------------------


def endpoint(address: str) -> Endpoint:
    return Endpoint(
        capability="cap", instance_id=f"i-{uuid.uuid4().hex[:6]}", address=address, protocol="http"
    )


def message() -> Message:
    return Message(
        header=Header(request_id=f"req-{uuid.uuid4().hex}", caller="c", target="cap", operation="q")
    )


async def test_the_http_connector_refuses_without_retry() -> None:
    async with RawHttp() as agent:
        async with HttpConnector(security=SecuritySettings()) as conn:
            for host in ("127.0.0.1", "localhost"):
                with pytest.raises(TransportError) as caught:
                    await conn.invoke(endpoint(f"{host}:{agent.port}"), message(), 2.0)
                assert caught.value.retryable is False
                assert "loopback" in caught.value.message
        assert agent.connections == 0
        async with HttpConnector(security=SecuritySettings(allow_networks=LOOPBACK)) as conn:
            reply = await conn.invoke(endpoint(f"localhost:{agent.port}"), message(), 2.0)
            assert reply.status == "ok"
        assert agent.connections == 1


# -- a real gateway with an empty allowlist -----------------------------------------------------


@pytest.fixture(scope="module")
async def strict_gateway(
    temporal_server: str, tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[GatewayProcess]:
    stack = new_stack(
        temporal_server,
        tmp_path_factory.mktemp("strict"),
        extra={"REACH_SECURITY__ALLOW_NETWORKS": "[]"},
    )
    async with GatewayProcess(stack, "strict") as gw:
        yield gw


async def test_gateway_refuses_a_loopback_callback(
    strict_gateway: GatewayProcess, http: httpx.AsyncClient, capability: str
) -> None:
    for url in ("http://127.0.0.1:9/x", "http://localhost:9/x", "http://[::1]:9/x"):
        r = await http.post(
            f"{strict_gateway.url}/reach/invoke",
            json={"target": capability, "operation": "q", "payload": {}, "callback": url},
        )
        assert r.status_code == 422, r.text
        error = r.json()["error"]
        assert error["type"] == "invalid_request"
        assert "loopback" in error["message"]
        assert "security.allow_networks" in error["message"]
    # A sync invoke is not checked (nor slowed): an unknown capability is still a 404.
    r = await http.post(
        f"{strict_gateway.url}/reach/invoke",
        json={"target": capability, "operation": "q", "payload": {}},
    )
    assert r.status_code == 404, r.text


async def test_gateway_refuses_a_loopback_agent(
    strict_gateway: GatewayProcess, http: httpx.AsyncClient, capability: str
) -> None:
    for address, protocol in [
        ("127.0.0.1:9", "http"),
        ("http://localhost:9/agent", "http"),
        ("169.254.169.254:80", "http"),
        ("127.0.0.1:9", "grpc"),
        ("ws://127.0.0.1:9/reach", "websocket"),
        ("mqtt://127.0.0.1:1883/reach/agents/x", "mqtt"),
    ]:
        r = await http.post(
            f"{strict_gateway.url}/reach/agents",
            json={
                "capability": capability,
                "instance_id": f"{capability}-1",
                "service_address": address,
                "protocol": protocol,
            },
        )
        assert r.status_code == 422, (address, r.text)
        message = r.json()["error"]["message"]
        assert "security.allow_networks" in message, message
        assert "service address" in message
    r = await http.get(f"{strict_gateway.url}/reach/capabilities/{capability}")
    assert r.status_code == 404, r.text  # nothing joined
