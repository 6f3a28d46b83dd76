"""Which Host and Origin the MCP front answers (DNS rebinding), as pure rules over the
settings: the live checks are tests/integration/test_mcp_front.py's."""

from __future__ import annotations

from types import SimpleNamespace

import httpx
import pytest
from starlette.datastructures import State

from gateway_api.mcp_front import McpFront, host_allowed, origin_allowed
from reach.config import ReachSettings


def settings(listen_host: str, public_url: str | None = None) -> ReachSettings:
    return ReachSettings(listen_host=listen_host, public_url=public_url)


@pytest.mark.parametrize(
    ("listen", "host", "allowed"),
    [
        ("127.0.0.1", "127.0.0.1", True),
        ("127.0.0.1", "localhost", True),
        ("127.0.0.1", "evil.example", False),  # a name rebound to 127.0.0.1
        ("127.0.0.1", None, False),
        ("10.0.0.5", "10.0.0.5", True),
        ("0.0.0.0", "evil.example", True),  # every address: any name
    ],
)
def test_hosts(listen: str, host: str | None, allowed: bool) -> None:
    assert host_allowed(settings(listen), host) is allowed


def test_a_page_from_its_own_host_is_refused_on_an_open_gateway_on_every_address() -> None:
    # evil.example rebound to the gateway's address: its page's Origin is the Host it sends.
    wide = settings("0.0.0.0")
    assert not origin_allowed(wide, "evil.example", "evil.example", tokens=False)
    assert origin_allowed(wide, "evil.example", "evil.example", tokens=True)  # a token needed
    assert origin_allowed(wide, "localhost", "evil.example", tokens=False)
    named = settings("0.0.0.0", "https://reach.example.com")
    assert origin_allowed(named, "reach.example.com", "reach.example.com", tokens=False)
    assert not origin_allowed(named, "evil.example", "evil.example", tokens=False)
    # On one address a rebound name is not its Host (refused before the Origin is read).
    assert origin_allowed(settings("127.0.0.1"), "localhost", "127.0.0.1", tokens=False)
    assert not origin_allowed(settings("127.0.0.1"), "evil.example", "127.0.0.1", tokens=False)
    assert not origin_allowed(settings("127.0.0.1"), None, "127.0.0.1", tokens=False)


async def test_the_metadata_names_a_host_only_when_it_is_a_host() -> None:
    # On every address any Host is served; one that is not a name and port is not written into
    # the document (nor into the 401's WWW-Authenticate) as it came.
    wide = settings("0.0.0.0")
    front = McpFront(State({"gateway": SimpleNamespace(settings=wide, guard=None)}), 1 << 20)
    async with httpx.AsyncClient(
        transport=httpx.ASGITransport(app=front), base_url="http://gw"
    ) as http:
        path = "/.well-known/oauth-protected-resource"
        named = await http.get(path, headers={"Host": "reach.example.com:7600"})
        assert named.json()["resource"] == "http://reach.example.com:7600/mcp"
        odd = await http.get(path, headers={"Host": 'a", error="x'})
        assert odd.json()["resource"] == f"{wide.gateway_url}/mcp"
