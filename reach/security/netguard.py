"""The address guard against request forgery: where Reach may open a connection.

Callers name callback URLs and agents name service addresses, and Reach connects to both from
inside the network it runs in. Without a guard, a caller could point a callback at the cloud
metadata service (169.254.169.254), at a database on the gateway's own network, or at the
gateway itself; an agent could join with such an address. The guard decides, for one IP address,
whether Reach may connect to it:

- an address inside a network listed in `security.allow_networks` is allowed;
- otherwise only global unicast addresses are: loopback, private (RFC 1918), link-local (the
  metadata address included), shared/CGNAT (100.64.0.0/10), unique-local (fc00::/7),
  multicast, unspecified, broadcast, reserved, documentation and benchmarking ranges are
  refused, each named in the reason.

IPv6 forms that carry an IPv4 address are unwrapped and the IPv4 address is judged as well (it
must be allowed itself): IPv4-mapped ::ffff:a.b.c.d (judged as the IPv4 address, which is what
the socket reaches), NAT64 64:ff9b::/96 and 64:ff9b:1::/48, 6to4 2002::/16 and Teredo 2001::/32.
Python's own `is_global` is not used alone: in 3.11 it calls 64:ff9b::a00:1 (10.0.0.1 behind
NAT64), 2002:7f00:1:: (127.0.0.1 over 6to4) and fec0::/10 global, so every rule is explicit.

A name is judged by every address it resolves to (`AddressGuard.resolve_checked`); one address
refused refuses the name. What connects after a check must connect to the very addresses that
were checked (the HTTP transport in `connectors.guard` does), or a name that answers
differently the second time (DNS rebinding) gets past the check.
"""

from __future__ import annotations

import asyncio
import ipaddress
import socket
from collections.abc import Iterable, Mapping
from urllib.parse import urlsplit

# The settings check `allow_networks` with the same parser (reach.config.parsing): it lives
# there, so that reach.config needs nothing of reach.security; still importable from here.
from reach.config.parsing import ALLOW_NETWORKS_SETTING
from reach.config.parsing import IPNetwork as IPNetwork
from reach.config.parsing import parse_networks as parse_networks
from reach.errors import InvalidRequest, Unavailable

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address

SETTING = ALLOW_NETWORKS_SETTING
# A name that takes longer than this to resolve is refused for now (503), never waited on.
RESOLVE_TIMEOUT_S = 5.0

_V4 = ipaddress.IPv4Network
_V6 = ipaddress.IPv6Network

# The first match names the address's kind. Global unicast is what matches none of these
# (and, belt and braces, what Python also calls global).
_V4_SPECIAL: tuple[tuple[ipaddress.IPv4Network, str], ...] = (
    (_V4("0.0.0.0/32"), "the unspecified address"),
    (_V4("0.0.0.0/8"), "in 0.0.0.0/8 ('this network')"),
    (_V4("10.0.0.0/8"), "a private address"),
    (_V4("100.64.0.0/10"), "a shared (carrier-grade NAT) address"),
    (_V4("127.0.0.0/8"), "a loopback address"),
    (_V4("169.254.169.254/32"), "the link-local cloud metadata address"),
    (_V4("169.254.0.0/16"), "a link-local address"),
    (_V4("172.16.0.0/12"), "a private address"),
    (_V4("192.0.0.0/24"), "a reserved address (IETF protocol assignments)"),
    (_V4("192.0.2.0/24"), "a documentation address"),
    (_V4("192.88.99.0/24"), "a reserved address (6to4 relay anycast)"),
    (_V4("192.168.0.0/16"), "a private address"),
    (_V4("198.18.0.0/15"), "a benchmarking address"),
    (_V4("198.51.100.0/24"), "a documentation address"),
    (_V4("203.0.113.0/24"), "a documentation address"),
    (_V4("224.0.0.0/4"), "a multicast address"),
    (_V4("255.255.255.255/32"), "the broadcast address"),
    (_V4("240.0.0.0/4"), "a reserved address"),
)

_NAT64 = _V6("64:ff9b::/96")
_NAT64_LOCAL = _V6("64:ff9b:1::/48")
_SIX_TO_FOUR = _V6("2002::/16")
_TEREDO = _V6("2001::/32")
_GLOBAL_UNICAST_V6 = _V6("2000::/3")

_V6_SPECIAL: tuple[tuple[ipaddress.IPv6Network, str], ...] = (
    (_V6("::/128"), "the unspecified address"),
    (_V6("::1/128"), "a loopback address"),
    (_NAT64_LOCAL, "a local-use NAT64 address"),
    (_V6("100::/64"), "a discard-only address"),
    (_V6("2001:2::/48"), "a benchmarking address"),
    (_V6("2001:db8::/32"), "a documentation address"),
    (_V6("3fff::/20"), "a documentation address"),
    (_V6("fc00::/7"), "a unique-local address"),
    (_V6("fe80::/10"), "a link-local address"),
    (_V6("fec0::/10"), "a site-local address (deprecated)"),
    (_V6("ff00::/8"), "a multicast address"),
    (_V6("::/8"), "a reserved address"),
)
# Translation prefixes whose own addresses are globally routed: what they reach is the
# embedded IPv4 address, judged on its own.
_V6_WRAPPERS = (_NAT64, _SIX_TO_FOUR, _TEREDO)


def _ip(value: str | IPAddress) -> IPAddress:
    """An address object (brackets and an IPv6 zone id dropped), or `ValueError`."""
    if isinstance(value, ipaddress.IPv4Address | ipaddress.IPv6Address):
        addr: IPAddress = value
    else:
        text = value.strip()
        if text.startswith("[") and text.endswith("]"):
            text = text[1:-1]
        addr = ipaddress.ip_address(text.partition("%")[0])
    if isinstance(addr, ipaddress.IPv6Address) and addr.scope_id:
        addr = ipaddress.IPv6Address(addr.compressed.partition("%")[0])
    return addr


def _v4_kind(ip: ipaddress.IPv4Address) -> str | None:
    """What makes an IPv4 address not global unicast, or None when it is."""
    for network, kind in _V4_SPECIAL:
        if ip in network:
            return kind
    return None if ip.is_global else "a non-global address"


def _v6_kind(ip: ipaddress.IPv6Address) -> str | None:
    """What makes an IPv6 address (not IPv4-mapped) not global unicast, or None."""
    if any(ip in wrapper for wrapper in _V6_WRAPPERS):
        return None  # the embedded address decides (64:ff9b::/96 lies inside ::/8)
    for network, kind in _V6_SPECIAL:
        if ip in network:
            return kind
    if ip not in _GLOBAL_UNICAST_V6:
        return "a reserved address (outside global unicast 2000::/3)"
    if ip in _V6("2001::/23"):
        return "a reserved address (IETF protocol assignments)"
    return None if ip.is_global else "a non-global address"


def embedded_ipv4(ip: ipaddress.IPv6Address) -> list[tuple[ipaddress.IPv4Address, str]]:
    """The IPv4 addresses an IPv6 address carries (NAT64, 6to4, Teredo), each with its form."""
    if ip in _NAT64 or ip in _NAT64_LOCAL:
        return [(ipaddress.IPv4Address(int(ip) & 0xFFFFFFFF), "NAT64")]
    if ip.sixtofour is not None:
        return [(ip.sixtofour, "6to4")]
    if ip.teredo is not None:
        server, client = ip.teredo
        return [(client, "Teredo client"), (server, "Teredo server")]
    return []


class AddressGuard:
    """Decides where Reach may connect: `allow_networks`, else global unicast only."""

    def __init__(self, allow_networks: Iterable[str] = ()) -> None:
        self.networks = parse_networks(allow_networks)

    def _allowlisted(self, ip: IPAddress) -> bool:
        return any(ip in network for network in self.networks)

    def _v4_refusal(self, ip: ipaddress.IPv4Address) -> str | None:
        if self._allowlisted(ip):
            return None
        return _v4_kind(ip)

    def refusal(self, ip: str | IPAddress) -> str | None:
        """None when Reach may connect to `ip`, else why not (naming the setting to change)."""
        try:
            addr = _ip(ip)
        except ValueError:
            return f"{str(ip)[:80]!r} is not an IP address"
        if isinstance(addr, ipaddress.IPv4Address):
            kind = self._v4_refusal(addr)
            return None if kind is None else f"{addr} is {kind}; allow it in {SETTING}"
        mapped = addr.ipv4_mapped
        if mapped is not None:  # the socket reaches the IPv4 address itself
            kind = self._v4_refusal(mapped)
            if kind is None:
                return None
            return f"::ffff:{mapped} is IPv4 {mapped}, {kind}; allow {mapped} in {SETTING}"
        if not self._allowlisted(addr):
            kind = _v6_kind(addr)
            if kind is not None:
                return f"{addr} is {kind}; allow it in {SETTING}"
        for inner, form in embedded_ipv4(addr):
            kind = self._v4_refusal(inner)
            if kind is not None:
                return f"{addr} carries IPv4 {inner} ({form}), {kind}; allow {inner} in {SETTING}"
        return None

    def check(self, host: str, ips: Iterable[str]) -> list[str]:
        """`ips` (what `host` resolved to) when every one is allowed, else `InvalidRequest`."""
        vetted = list(ips)
        for ip in vetted:
            reason = self.refusal(ip)
            if reason is not None:
                raise InvalidRequest(refused_message(host, ip, reason))
        return vetted

    async def resolve_checked(self, host: str, port: int) -> list[str]:
        """The addresses `host` resolves to, each allowed; else `InvalidRequest` naming the host,
        the address and the reason. A name that does not exist is an `InvalidRequest` too; a
        resolver that fails or is slow, `Unavailable` (try again). IP literals skip DNS."""
        try:
            ips = await resolve(host, port)
        except TimeoutError:
            raise Unavailable(
                f"resolving {host!r} took longer than {RESOLVE_TIMEOUT_S:.0f}s; try again"
            ) from None
        except socket.gaierror as exc:
            if exc.errno in _NO_SUCH_NAME:
                raise InvalidRequest(f"host {host!r} does not resolve: {exc.strerror}") from None
            raise Unavailable(f"cannot resolve {host!r} now: {exc.strerror}") from None
        except (OSError, UnicodeError) as exc:
            raise InvalidRequest(f"cannot resolve host {host!r}: {exc}") from None
        return self.check(host, ips)

    async def check_url(self, url: str) -> list[str]:
        """Vet an http(s) URL's host (a callback): scheme, host and every address it resolves
        to; `InvalidRequest` naming what is refused."""
        try:
            parts = urlsplit(url)
            port = parts.port
        except ValueError as exc:
            raise InvalidRequest(f"URL {url[:80]!r} is not valid: {exc}") from None
        scheme = parts.scheme.lower()
        if scheme not in DEFAULT_PORTS or not parts.hostname:
            raise InvalidRequest(f"URL {url[:80]!r}: only http:// and https:// URLs with a host")
        return await self.resolve_checked(parts.hostname, port or DEFAULT_PORTS[scheme])


DEFAULT_PORTS: Mapping[str, int] = {"http": 80, "https": 443}
_NO_SUCH_NAME = frozenset(
    code
    for code in (
        getattr(socket, "EAI_NONAME", None),
        getattr(socket, "EAI_NODATA", None),
        getattr(socket, "EAI_ADDRFAMILY", None),
    )
    if code is not None
)


def refused_message(host: str, ip: str, reason: str) -> str:
    """Names the host (when it is a name), the address and the reason."""
    bare = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    try:
        same = _ip(bare) == _ip(ip)
    except ValueError:
        same = False
    return f"refused {bare}: {reason}" if same else f"refused {bare} ({ip}): {reason}"


def ip_literal(host: str) -> IPAddress | None:
    """`host` as an IP address when it is one (brackets allowed), else None."""
    try:
        return _ip(host)
    except ValueError:
        return None


async def resolve(host: str, port: int, *, timeout_s: float = RESOLVE_TIMEOUT_S) -> list[str]:
    """Every address `host` resolves to for a TCP connection, in the resolver's order, once
    each (through the running loop's getaddrinfo; an IP literal is returned as it is)."""
    literal = ip_literal(host)
    if literal is not None:
        return [str(literal)]
    loop = asyncio.get_running_loop()
    async with asyncio.timeout(timeout_s):
        infos = await loop.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    seen: dict[str, None] = {}
    for family, _, _, _, sockaddr in infos:
        if family in (socket.AF_INET, socket.AF_INET6):
            seen.setdefault(str(_ip(str(sockaddr[0]))), None)
    if not seen:
        raise socket.gaierror(socket.EAI_NONAME, "no IPv4 or IPv6 address")
    return list(seen)


def host_port(address: str, default_ports: Mapping[str, int]) -> tuple[str, int] | None:
    """(host, port) of a normalized address `host:port` or `scheme://host[:port][/...]`: the
    host without IPv6 brackets, the port written or the scheme's from `default_ports` (the
    key "" for an address without a scheme); None when there is no host or port to name."""
    scheme, sep, rest = address.partition("://")
    if not sep:
        scheme, rest = "", address
    authority = rest.partition("/")[0].rpartition("@")[2]
    if authority.startswith("["):
        end = authority.find("]")
        if end < 0:
            return None
        host, port_text = authority[1:end], authority[end + 1 :].removeprefix(":")
    else:
        host, colon, port_text = authority.rpartition(":")
        if not colon:
            host, port_text = authority, ""
    if not host:
        return None
    if port_text:
        if not port_text.isdigit():
            return None
        return host, int(port_text)
    port = default_ports.get(scheme.lower())
    return None if port is None else (host, port)
