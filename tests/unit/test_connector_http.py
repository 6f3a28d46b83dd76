"""The HTTP connector's pure decisions: exception mapping and service-address checks."""

from __future__ import annotations

import inspect

import httpx
import pytest

from connectors import Connector, ConnectorSet
from connectors.http import HttpConnector, map_httpx_exceptions
from reach.config import TransportSettings
from reach.errors import InvalidRequest, ReachError


def _httpx_exceptions() -> list[type[Exception]]:
    found = {
        obj
        for _, obj in inspect.getmembers(httpx, inspect.isclass)
        if issubclass(obj, Exception) and obj.__module__.startswith("httpx")
    }
    return sorted(found, key=lambda c: c.__name__)


def _instance(exc_type: type[Exception]) -> Exception:
    if issubclass(exc_type, httpx.HTTPStatusError):
        request = httpx.Request("POST", "http://127.0.0.1:1/reach/op")
        return exc_type("boom", request=request, response=httpx.Response(500, request=request))
    try:
        return exc_type("boom")
    except TypeError:  # the stream errors take no message
        return exc_type()


NOT_RETRYABLE_TRANSPORT = (
    httpx.LocalProtocolError,
    httpx.UnsupportedProtocol,
    httpx.InvalidURL,
)


def _expected(exc_type: type[Exception]) -> tuple[str, bool]:
    if issubclass(exc_type, httpx.TimeoutException):
        return "timeout", False
    if issubclass(exc_type, NOT_RETRYABLE_TRANSPORT):
        return "transport_error", False
    if issubclass(exc_type, httpx.TransportError) or exc_type is httpx.RequestError:
        return "transport_error", True
    if issubclass(exc_type, httpx.DecodingError | httpx.TooManyRedirects):
        return "agent_error", False
    return "internal", False


def test_the_list_covers_httpx_exception_tree() -> None:
    names = {c.__name__ for c in _httpx_exceptions()}
    assert {"ConnectTimeout", "PoolTimeout", "RemoteProtocolError", "InvalidURL"} <= names
    assert {"StreamClosed", "HTTPStatusError", "CookieConflict", "DecodingError"} <= names


@pytest.mark.parametrize("exc_type", _httpx_exceptions(), ids=lambda c: c.__name__)
def test_every_httpx_exception_is_mapped_deliberately(exc_type: type[Exception]) -> None:
    exc = _instance(exc_type)
    with pytest.raises(ReachError) as err, map_httpx_exceptions("127.0.0.1:1"):
        raise exc
    assert (err.value.type, err.value.retryable) == _expected(exc_type)
    assert err.value.__cause__ is exc


def test_a_request_reach_could_not_encode_is_not_retried() -> None:
    with pytest.raises(ReachError) as err, map_httpx_exceptions("127.0.0.1:1"):
        "é".encode("ascii")
    assert (err.value.type, err.value.retryable) == ("transport_error", False)


def test_reach_errors_pass_through_unchanged() -> None:
    original = InvalidRequest("mine")
    with pytest.raises(InvalidRequest) as err, map_httpx_exceptions("127.0.0.1:1"):
        raise original
    assert err.value is original


@pytest.mark.parametrize(
    ("address", "normalized"),
    [
        ("127.0.0.1:9001", "127.0.0.1:9001"),
        ("Retriever.Internal:9001", "retriever.internal:9001"),
        ("agent_1:80", "agent_1:80"),
        ("[FD00::0008]:9001", "[fd00::8]:9001"),
        ("http://10.0.0.5", "http://10.0.0.5"),
        ("HTTPS://Agents.Example.com:8443/", "https://agents.example.com:8443"),
        ("https://agents.example.com/team/retriever/", "https://agents.example.com/team/retriever"),
        ("http://[::1]:8080/a%20b", "http://[::1]:8080/a%20b"),
        ("localhost:65535", "localhost:65535"),
    ],
)
def test_addresses_the_http_connector_accepts(address: str, normalized: str) -> None:
    assert HttpConnector.check_address(address) == normalized


@pytest.mark.parametrize(
    ("address", "why"),
    [
        ("", "empty"),
        ("127.0.0.1", "no port"),
        ("127.0.0.1:0", "port '0'"),
        ("127.0.0.1:65536", "port '65536'"),
        ("127.0.0.1:99999", "port '99999'"),
        ("127.0.0.1:http", "port 'http'"),
        ("host:", "port ''"),
        ("::1:80", "brackets"),
        ("[::1:80", "closing"),
        ("[fe80::1%eth0]:80", "zone"),
        ("[nothex::]:80", "not an IPv6"),
        ("999.1.1.1:80", "not an IPv4"),
        ("bad host:80", "spaces"),
        ("host\n:80", "control"),
        ("ágent:80", "ASCII"),
        ("-agent:80", "not a hostname"),
        ("a..b:80", "not a hostname"),
        ("user:pw@host:80", "userinfo"),
        ("http://user@host", "userinfo"),
        ("http://host/a?b=1", "query"),
        ("http://host/#top", "fragment"),
        ("ftp://host:21", "scheme 'ftp'"),
        ("host:80/path", "URL form"),
        ("http://host/a%zz", "path"),
        ("http://host/a\\b", "path"),
        ("http://" + "a" * 2050, "longer"),
    ],
)
def test_addresses_the_http_connector_refuses(address: str, why: str) -> None:
    with pytest.raises(InvalidRequest, match=why):
        HttpConnector.check_address(address)


def test_a_connector_without_an_address_syntax_accepts_any_address() -> None:
    class Pigeon(Connector):
        protocol = "pigeon"

        async def invoke(self, *args: object) -> object:  # type: ignore[override]
            raise NotImplementedError

    assert Pigeon.check_address("the old oak, third branch") == "the old oak, third branch"
    assert Pigeon().transport == TransportSettings()


def test_connectors_get_their_settings_at_construction() -> None:
    settings = TransportSettings(max_message_bytes=4096, idle_timeout_s=7, max_pools=3)
    connector = ConnectorSet(settings).get("http")
    assert isinstance(connector, HttpConnector)
    assert connector.transport is settings
    assert HttpConnector().transport == TransportSettings()
