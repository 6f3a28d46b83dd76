"""The address guard's decisions (no packets: nothing here resolves a name or connects)."""

from __future__ import annotations

import ipaddress

import pytest

from reach.config import ConfigError, SecuritySettings, load_settings
from reach.errors import InvalidRequest
from reach.security.netguard import AddressGuard, embedded_ipv4, host_port, resolve

OPEN = AddressGuard()  # no allowlist: global unicast only


@pytest.mark.parametrize(
    ("ip", "words"),
    [
        ("127.0.0.1", "loopback"),
        ("10.0.0.1", "private"),
        ("172.16.5.4", "private"),
        ("192.168.1.1", "private"),
        ("169.254.169.254", "metadata"),
        ("169.254.1.1", "link-local"),
        ("100.64.0.1", "carrier-grade NAT"),
        ("fc00::1", "unique-local"),
        ("fd12:3456::1", "unique-local"),
        ("fe80::1", "link-local"),
        ("fe80::1%eth0", "link-local"),
        ("::1", "loopback"),
        ("::ffff:127.0.0.1", "loopback"),
        ("::ffff:10.1.2.3", "private"),
        ("64:ff9b::a00:1", "10.0.0.1"),  # NAT64 of a private address
        ("64:ff9b::7f00:1", "127.0.0.1"),
        ("64:ff9b:1::808:808", "local-use NAT64"),
        ("2002:7f00:1::1", "127.0.0.1"),  # 6to4 of loopback
        ("2002:a9fe:a9fe::1", "metadata"),  # 6to4 of 169.254.169.254
        ("2001:0:4136:e378:8000:63bf:80ff:fffe", "127.0.0.1"),  # Teredo client 127.0.0.1
        ("0.0.0.0", "unspecified"),
        ("0.1.2.3", "0.0.0.0/8"),
        ("::", "unspecified"),
        ("224.0.0.1", "multicast"),
        ("ff02::1", "multicast"),
        ("255.255.255.255", "broadcast"),
        ("240.0.0.1", "reserved"),
        ("192.0.2.1", "documentation"),
        ("198.51.100.7", "documentation"),
        ("203.0.113.9", "documentation"),
        ("2001:db8::1", "documentation"),
        ("198.18.0.1", "benchmarking"),
        ("198.19.255.1", "benchmarking"),
        ("2001:2::1", "benchmarking"),
        ("fec0::1", "site-local"),
        ("::a00:1", "reserved"),  # IPv4-compatible (deprecated)
        ("100::1", "discard-only"),
        ("4000::1", "outside global unicast"),
    ],
)
def test_refused_without_an_allowlist(ip: str, words: str) -> None:
    reason = OPEN.refusal(ip)
    assert reason is not None, ip
    assert words in reason
    assert "security.allow_networks" in reason


def test_the_reason_names_the_address_and_the_setting() -> None:
    assert OPEN.refusal("10.0.0.1") == (
        "10.0.0.1 is a private address; allow it in security.allow_networks"
    )


@pytest.mark.parametrize(
    "ip",
    [
        "8.8.8.8",
        "1.1.1.1",
        "2606:4700::1111",
        "2a00:1450:4001:80b::200e",
        "::ffff:8.8.8.8",
        "64:ff9b::808:808",  # NAT64 of a global address
        "2002:808:808::1",  # 6to4 of a global address
        ipaddress.ip_address("9.9.9.9"),
        ipaddress.ip_address("2620:fe::fe"),
    ],
)
def test_global_unicast_is_allowed(ip: str | ipaddress.IPv4Address) -> None:
    assert OPEN.refusal(ip) is None


def test_python_is_global_gaps_are_closed() -> None:
    # What Python 3.11 calls global (or fails to refuse); the guard refuses each.
    for ip in ("100.64.0.1", "64:ff9b::a00:1", "2002:7f00:1::1", "fec0::1"):
        assert OPEN.refusal(ip) is not None, ip


def test_an_allowlist_allows_its_networks_only() -> None:
    guard = AddressGuard(["127.0.0.0/8"])
    assert guard.refusal("127.0.0.1") is None
    assert guard.refusal("127.5.6.7") is None
    assert guard.refusal("::ffff:127.0.0.1") is None  # the IPv4 address it maps
    assert guard.refusal("10.0.0.1") is not None
    assert guard.refusal("::1") is not None  # IPv6 loopback is another network
    assert guard.refusal("8.8.8.8") is None


def test_embedded_ipv4_must_be_allowed_itself() -> None:
    # Allowing the local-use NAT64 prefix does not allow what it carries.
    guard = AddressGuard(["64:ff9b:1::/48"])
    assert guard.refusal("64:ff9b:1::808:808") is None
    reason = guard.refusal("64:ff9b:1::a00:1")
    assert reason is not None
    assert "10.0.0.1" in reason
    both = AddressGuard(["64:ff9b:1::/48", "10.0.0.0/8"])
    assert both.refusal("64:ff9b:1::a00:1") is None
    # And allowing the IPv4 network allows it over NAT64 (well-known prefix) and 6to4.
    private = AddressGuard(["10.0.0.0/8"])
    assert private.refusal("64:ff9b::a00:1") is None
    assert private.refusal("2002:a00:1::1") is None


def test_embedded_forms() -> None:
    v6 = ipaddress.IPv6Address
    assert embedded_ipv4(v6("64:ff9b::a00:1")) == [(ipaddress.IPv4Address("10.0.0.1"), "NAT64")]
    assert embedded_ipv4(v6("2002:7f00:1::1")) == [(ipaddress.IPv4Address("127.0.0.1"), "6to4")]
    teredo = embedded_ipv4(v6("2001:0:4136:e378:8000:63bf:80ff:fffe"))
    assert (ipaddress.IPv4Address("127.0.0.1"), "Teredo client") in teredo
    assert embedded_ipv4(v6("2606:4700::1111")) == []


def test_what_is_not_an_ip_is_refused() -> None:
    reason = OPEN.refusal("example.com")
    assert reason is not None
    assert "not an IP address" in reason


@pytest.mark.parametrize(
    ("networks", "words"),
    [
        (["10.0.0.1/8"], "did you mean 10.0.0.0/8"),
        (["not-a-network"], "'not-a-network'"),
        (["127.0.0.0/8", "300.0.0.0/8"], "'300.0.0.0/8'"),
        (["fc00::/200"], "'fc00::/200'"),
    ],
)
def test_a_bad_network_is_named(networks: list[str], words: str) -> None:
    with pytest.raises(ValueError, match=r"security\.allow_networks") as caught:
        AddressGuard(networks)
    assert words in str(caught.value)


def test_configuration_refuses_a_bad_network(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("REACH_SECURITY__ALLOW_NETWORKS", '["127.0.0.0/8", "10.0.0.1/33"]')
    with pytest.raises(ConfigError, match=r"security\.allow_networks.*'10\.0\.0\.1/33'"):
        load_settings()
    monkeypatch.setenv("REACH_SECURITY__ALLOW_NETWORKS", "[]")
    assert load_settings().security.allow_networks == []
    assert SecuritySettings(allow_networks=["::1/128"]).allow_networks == ["::1/128"]


@pytest.mark.parametrize(
    ("address", "defaults", "expected"),
    [
        ("10.0.1.8:9001", {}, ("10.0.1.8", 9001)),
        ("[fd00::8]:9001", {}, ("fd00::8", 9001)),
        ("retriever.internal:9001", {}, ("retriever.internal", 9001)),
        ("http://agents.example.com/retriever", {"http": 80}, ("agents.example.com", 80)),
        ("https://[::1]/x", {"https": 443}, ("::1", 443)),
        ("https://h:8443", {"https": 443}, ("h", 8443)),
        ("wss://h", {"ws": 80, "wss": 443}, ("h", 443)),
        ("grpc-without-port", {}, None),
        ("unix:///run/agent.sock", {}, None),
    ],
)
def test_host_port(
    address: str, defaults: dict[str, int], expected: tuple[str, int] | None
) -> None:
    assert host_port(address, defaults) == expected


def test_each_connector_names_the_host_it_connects_to() -> None:
    from connectors.grpc import GrpcConnector
    from connectors.http import HttpConnector
    from connectors.mqtt import MqttConnector
    from connectors.websocket import WebSocketConnector

    assert HttpConnector.address_host_port("127.0.0.1:9") == ("127.0.0.1", 9)
    assert HttpConnector.address_host_port("https://a.example") == ("a.example", 443)
    assert GrpcConnector.address_host_port("[::1]:7") == ("::1", 7)
    assert WebSocketConnector.address_host_port("ws://h/path") == ("h", 80)
    assert MqttConnector.address_host_port("mqtt://broker:1884/reach/agents/x") == ("broker", 1884)
    assert MqttConnector.address_host_port("mqtt://[::1]/t") == ("[::1]", 1883)


async def test_ip_literals_skip_dns_and_are_judged() -> None:
    assert await resolve("[::1]", 80) == ["::1"]
    assert await resolve("127.0.0.1", 80) == ["127.0.0.1"]
    with pytest.raises(InvalidRequest, match=r"refused 127\.0\.0\.1: 127\.0\.0\.1 is a loopback"):
        await OPEN.resolve_checked("127.0.0.1", 80)
    assert await AddressGuard(["127.0.0.0/8"]).resolve_checked("127.0.0.1", 80) == ["127.0.0.1"]
    with pytest.raises(InvalidRequest, match="only http:// and https://"):
        await OPEN.check_url("ftp://8.8.8.8/x")
    with pytest.raises(InvalidRequest, match=r"169\.254\.169\.254"):
        await OPEN.check_url("http://169.254.169.254/latest/meta-data")
