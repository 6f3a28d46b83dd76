"""The runtime's keyword arguments checked once, at construction: bounds, ids, mTLS files.

Everything here raises `ValueError` naming the argument, so a mistake fails where the agent is
built rather than at Join (where Reach would refuse it with less to go on).
"""

from __future__ import annotations

import os
import secrets
import socket
from collections.abc import Sequence
from pathlib import Path

from reach.security.certs import TlsFiles, identity_of

MAX_WEIGHT = 1000
MAX_INFLIGHT = 1_000_000


def reach_url(address: str | None) -> str:
    """The gateway's base URL: the argument, else `$REACH_ADDRESS`, else 127.0.0.1:7600."""
    address = (address or os.environ.get("REACH_ADDRESS", "127.0.0.1:7600")).rstrip("/")
    return address if "://" in address else f"http://{address}"


def reach_urls(addresses: str | Sequence[str] | None) -> tuple[str, ...]:
    """The gateways' base URLs, in the order given: a list of addresses, or one string of
    addresses separated by commas (so is `$REACH_ADDRESS`); each as `reach_url` reads it, each
    once. None (or an empty string) is `$REACH_ADDRESS`, else 127.0.0.1:7600."""
    if addresses is None or addresses == "":
        addresses = os.environ.get("REACH_ADDRESS") or "127.0.0.1:7600"
    if isinstance(addresses, str):
        given = addresses.split(",")
    elif isinstance(addresses, Sequence) and all(isinstance(a, str) for a in addresses):
        given = [part for address in addresses for part in address.split(",")]
    else:
        raise ValueError(
            f"reach_address must be an address, addresses separated by commas or a list of "
            f"addresses, not {addresses!r}"
        )
    urls = dict.fromkeys(reach_url(a.strip()) for a in given if a.strip() and a.strip("/ "))
    if not urls:
        raise ValueError(f"reach_address names no gateway: {addresses!r}")
    return tuple(urls)


def check_int(name: str, value: object, maximum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= maximum:
        raise ValueError(f"{name} must be an integer from 1 to {maximum}, not {value!r}")


def default_instance_id(capability: str) -> str:
    """Unique per process and start: `<capability>-<host>-<pid>-<4 hex>`."""
    host = socket.gethostname().split(".", 1)[0].lower() or "host"
    host = "".join(c if c.isalnum() or c in "-_" else "-" for c in host)[:32]
    return f"{capability}-{host}-{os.getpid()}-{secrets.token_hex(2)}"


def tls_files(protocol: str, cert: str | None, key: str | None, ca: str | None) -> TlsFiles | None:
    """The agent's mTLS files, from the arguments or else the environment; None without."""
    given = {
        "tls_cert": cert or os.environ.get("REACH_AGENT_TLS_CERT") or None,
        "tls_key": key or os.environ.get("REACH_AGENT_TLS_KEY") or None,
        "tls_ca": ca or os.environ.get("REACH_AGENT_TLS_CA") or None,
    }
    if not any(given.values()):
        return None
    missing = [name for name, value in given.items() if value is None]
    if missing:
        raise ValueError(
            f"mTLS needs tls_cert, tls_key and tls_ca (or $REACH_AGENT_TLS_CERT/KEY/CA); "
            f"missing: {', '.join(missing)}"
        )
    if protocol == "mqtt":
        raise ValueError(
            "mTLS is not served by the MQTT agent server: Reach reaches MQTT agents through "
            "the broker, which authenticates both sides (configure TLS on the broker)"
        )
    return TlsFiles(
        Path(str(given["tls_ca"])), Path(str(given["tls_cert"])), Path(str(given["tls_key"]))
    )


def certified_id(tls: TlsFiles | None) -> str | None:
    """The instance id in the agent's certificate (spiffe://<td>/agent/<id>), if any."""
    if tls is None:
        return None
    try:
        identity = identity_of(tls.cert)
    except OSError as exc:
        raise ValueError(f"cannot read the agent certificate {tls.cert}: {exc}") from None
    return identity[1] if identity else None


def check_certified(tls: TlsFiles | None, instance_id: str) -> None:
    certified = certified_id(tls)
    if tls is not None and certified != instance_id:
        raise ValueError(
            f"the certificate {tls.cert} is for agent {certified!r}, not {instance_id!r}: "
            "Reach would refuse the Join (issue one with `reach certs issue --agent "
            f"{instance_id}`)"
        )
