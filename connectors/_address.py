"""Which service addresses the HTTP connector can call, checked once when an agent joins.

An address that passes here is one httpx can parse and that names one HTTP endpoint, so a bad
address is refused at the door (422) instead of failing every request routed to it.

    host:port                       10.0.1.8:9001, retriever.internal:9001, [fd00::8]:9001
    http(s)://host[:port][/path]    https://agents.example.com/retriever

The host is a hostname or an IP literal (IPv6 in brackets); no userinfo, query or fragment;
ASCII only (an internationalized name goes in its punycode form, as DNS carries it).

`refuse`, `check_host` and `check_port` are public: the other connectors' address checks
(gRPC, MQTT) build on them, so every protocol names hosts and ports alike and refuses alike.
"""

from __future__ import annotations

import ipaddress
import re

import httpx

from reach.errors import InvalidRequest

MAX_ADDRESS_CHARS = 2048
# RFC 1123 labels, plus `_`: container and compose service names use it and resolvers accept it.
_LABEL = re.compile(r"^[a-z0-9_](?:[a-z0-9_-]{0,61}[a-z0-9_])?$")
# RFC 3986 path characters (pchar and "/"), percent-escapes checked separately.
_PATH = re.compile(r"^[A-Za-z0-9\-._~!$&'()*+,;=:@/%]*$")
_ESCAPE = re.compile(r"%(?![0-9A-Fa-f]{2})")


def refuse(address: str, why: str) -> InvalidRequest:
    """The `InvalidRequest` that refuses `address`, shown escaped and cut to 80 characters."""
    shown = address[:80].encode("unicode_escape").decode()
    return InvalidRequest(f"service address {shown!r}: {why}")


def check_host(address: str, host: str) -> str:
    """`host` (as written in a URL, IPv6 in brackets) normalized, or `refuse`d: every
    connector's addresses name their hosts alike."""
    if host.startswith("["):
        if not host.endswith("]"):
            raise refuse(address, "an IPv6 literal needs its closing ']'")
        literal = host[1:-1]
        if "%" in literal:
            raise refuse(address, "IPv6 zone ids are not supported")
        try:
            return f"[{ipaddress.IPv6Address(literal).compressed}]"
        except ValueError:
            raise refuse(address, f"{literal!r} is not an IPv6 address") from None
    if ":" in host:
        raise refuse(address, "an IPv6 literal goes in brackets: [addr]:port")
    name = host.lower().removesuffix(".")
    if not name:
        raise refuse(address, "no host")
    labels = name.split(".")
    if all(label.isdigit() for label in labels):
        try:
            return str(ipaddress.IPv4Address(name))
        except ValueError:
            raise refuse(address, f"{host!r} is not an IPv4 address") from None
    if len(name) > 253 or not all(_LABEL.match(label) for label in labels):
        raise refuse(address, f"{host!r} is not a hostname")
    return name


def check_port(address: str, port: str) -> int:
    """`port` (the text after the colon) as a number from 1 to 65535, or `refuse`d."""
    if not port.isdigit() or not 1 <= int(port) <= 65535:
        raise refuse(address, f"port {port!r} is not a number from 1 to 65535")
    return int(port)


def check_characters(address: str) -> None:
    """What every protocol's address needs: not empty, not too long, visible ASCII."""
    if not address:
        raise InvalidRequest("service address is empty")
    if len(address) > MAX_ADDRESS_CHARS:
        raise refuse(address, f"longer than {MAX_ADDRESS_CHARS} characters")
    if not address.isascii():
        raise refuse(address, "not ASCII (use the punycode form of an international name)")
    if any(c <= " " or c == "\x7f" for c in address):
        raise refuse(address, "contains spaces or control characters")


def check_http_address(address: str) -> str:
    """Return `address` normalized (lower-case scheme and host), or raise `InvalidRequest`."""
    check_characters(address)
    if "?" in address or "#" in address:
        raise refuse(address, "a query or fragment is not allowed")
    scheme, sep, rest = address.partition("://")
    if not sep:
        scheme, rest = "", address
    elif scheme.lower() not in ("http", "https"):
        raise refuse(address, f"scheme {scheme!r} is not http or https")
    authority, slash, path = rest.partition("/")
    if "@" in authority:
        raise refuse(address, "userinfo (user@host) is not allowed")
    if scheme and (not _PATH.match(path) or _ESCAPE.search(path)):
        raise refuse(address, "the path has characters a URL path cannot hold")
    if not scheme and path:
        raise refuse(address, "a path needs the URL form: http://host:port/path")
    host, port = authority, None
    colon = authority.rfind(":")
    if colon > authority.rfind("]") and (authority.startswith("[") or authority.count(":") == 1):
        host, port = authority[:colon], authority[colon + 1 :]
    hostpart = check_host(address, host)
    if port is None and not scheme:
        raise refuse(address, "no port (host:port, or the URL form http://host)")
    portpart = "" if port is None else f":{check_port(address, port)}"
    if not scheme:
        normalized = f"{hostpart}{portpart}"
    else:
        tail = f"/{path}".rstrip("/") if slash else ""
        normalized = f"{scheme.lower()}://{hostpart}{portpart}{tail}"
    try:
        httpx.URL(normalized if scheme else f"http://{normalized}")
    except httpx.InvalidURL as exc:  # belt and braces: what passes here, httpx must parse
        raise refuse(address, str(exc)) from None
    return normalized
