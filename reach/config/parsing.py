"""Setting values that need more than a type to be valid, parsed: the networks of
`security.allow_networks` and the base64 keys of `security.encryption.keys`.

Here, beside the settings that check them, so that the settings import nothing of
`reach.security`; the address guard (`reach.security.netguard`) and the payload cipher
(`reach.security.crypto`) use the same parsers on the same values. Standard library only.
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import ipaddress
from collections.abc import Iterable

IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network

ALLOW_NETWORKS_SETTING = "security.allow_networks"
KEY_BYTES = 32  # AES-256


def parse_networks(values: Iterable[str]) -> tuple[IPNetwork, ...]:
    """`allow_networks` as networks, or `ValueError` naming the first entry that is not one."""
    networks: list[IPNetwork] = []
    for value in values:
        text = str(value).strip()
        try:
            network = ipaddress.ip_network(text, strict=True)
        except ValueError as exc:
            hint = ""
            with contextlib.suppress(ValueError):
                hint = f"; did you mean {ipaddress.ip_network(text, strict=False)}?"
            raise ValueError(
                f"{ALLOW_NETWORKS_SETTING}: {value!r} is not a network in CIDR form "
                f"(e.g. 10.0.0.0/8): {exc}{hint}"
            ) from None
        networks.append(network)
    return tuple(networks)


def decode_key(encoded: str) -> bytes:
    """The 32 bytes of a base64 key; ValueError (naming no key material) when it is not one."""
    try:
        raw = base64.b64decode(encoded.strip(), validate=True)
    except (binascii.Error, ValueError):
        raise ValueError("is not valid base64") from None
    if len(raw) != KEY_BYTES:
        raise ValueError(f"must be {KEY_BYTES} bytes once base64-decoded, not {len(raw)}")
    return raw
