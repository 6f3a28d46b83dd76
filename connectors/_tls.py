"""Reach's side of mTLS to agents (R18), shared by the HTTP, gRPC and WebSocket connectors.

With `security.tls.enabled`, every connection to an agent presents Reach's certificate and
verifies the agent's: signed by `security.tls.ca_file`, and for the TLS server name
`agent_server_name(instance_id, trust_domain)` (`reach.security.certs`), so that the peer is the
very instance the registry routed to. The connectors pass that name as SNI / server_hostname;
the address's own host only says where to connect.

A failed handshake is a `transport_error` naming the identity that was expected and what went
wrong. Reach's own verification of the agent fails before anything is sent, so it is not
`outcome_unknown`; it is retryable in the policy's sense (another instance may be fine), and
the workflow's retries never go back to the instance that failed (`reach.policy.next_step`
avoids it), while the breaker and outlier ejection count it against that instance.

The other direction, an agent refusing Reach's certificate: under TLS 1.3 the agent checks it
only after Reach's half of the handshake, and then just closes the connection (asyncio and gRPC
servers send no alert). gRPC and WebSocket send nothing before the agent has answered, so they
read it as a failed handshake; over HTTP the request was already written, so it reads as a
connection broken mid-call, its outcome unknown, which is honest but not helpful. The Join
probe keeps such an agent from being registered in the first place.

`probe` is the Join-time check: a TLS handshake with the agent's address, before it is
registered, so an agent without a certificate from the CA for its own id is refused at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import os
import ssl
from dataclasses import dataclass

import httpx

from reach.config import SecuritySettings
from reach.errors import Forbidden, InternalError, InvalidRequest, TransportError
from reach.security.certs import (
    CertificateError,
    agent_server_name,
    agent_spiffe_id,
    client_context,
)
from reach.security.netguard import AddressGuard

PROBE_TIMEOUT_S = 5.0
# How long the probe waits for an agent's first byte after the handshake (see `probe`).
SETTLE_S = 2.0


@functools.cache
def public_context() -> ssl.SSLContext:
    """The TLS context for agents reached without Reach's mTLS (verified against the system's
    CAs): one per process for every connector's clients. Building one reads the CA bundle
    (~15 ms of CPU), which a context per client paid again for each agent (and each reopened
    pool)."""
    return httpx.create_ssl_context(trust_env=False)


def http_poke(server_name: str) -> bytes:
    """A harmless HTTP/1.1 request for `ReachTls.probe` (an agent answers it 404 or so)."""
    return (
        f"GET /reach HTTP/1.1\r\nHost: {server_name}\r\nUser-Agent: agent-reach-probe\r\n"
        "Connection: close\r\n\r\n"
    ).encode("ascii")


def tls_cause(exc: BaseException) -> ssl.SSLError | None:
    """The `ssl.SSLError` behind `exc` (itself, or in its cause/context chain), if any."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        if isinstance(current, ssl.SSLError):
            return current
        seen.add(id(current))
        current = current.__cause__ or current.__context__
    return None


def _reason(error: ssl.SSLError) -> str:
    if isinstance(error, ssl.SSLCertVerificationError):
        return error.verify_message or str(error)
    return error.reason or str(error)


def _read(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


@dataclass
class _Loaded:
    stamp: tuple[tuple[int, int], ...]
    context: ssl.SSLContext
    pem: tuple[bytes, bytes, bytes]  # CA, key, certificate chain (for gRPC's credentials)


class ReachTls:
    """One connector's view of `security.tls`: Reach's client context, reloaded when the files
    change on disk (a renewed certificate is used by the next connection opened)."""

    def __init__(self, security: SecuritySettings) -> None:
        self.settings = security.tls
        self.allow_networks = list(security.allow_networks)
        self.enabled = security.tls.enabled
        self.trust_domain = security.tls.trust_domain
        self._loaded: _Loaded | None = None
        self._names: dict[str, str] = {}

    def _stamp(self) -> tuple[tuple[int, int], ...]:
        t = self.settings
        stamps = []
        for path in (t.ca_file, t.cert_file, t.key_file):
            try:
                st = os.stat(path)
            except OSError:
                stamps.append((-1, -1))
            else:
                stamps.append((st.st_mtime_ns, st.st_size))
        return tuple(stamps)

    def _load(self) -> _Loaded:
        stamp = self._stamp()
        loaded = self._loaded
        if loaded is not None and loaded.stamp == stamp:
            return loaded
        t = self.settings
        try:
            context = client_context(t)
            pem = (_read(t.ca_file), _read(t.key_file), _read(t.cert_file))
        except (CertificateError, OSError) as exc:
            # Reach's own configuration, not the agent's fault: not counted against it.
            raise InternalError(str(exc)) from None
        self._loaded = _Loaded(stamp, context, pem)
        return self._loaded

    def context(self) -> ssl.SSLContext:
        """Reach's client context (`InternalError` when its files cannot be loaded)."""
        return self._load().context

    def fresh_context(self) -> ssl.SSLContext:
        """A client context of its own (not shared with any connection)."""
        try:
            return client_context(self.settings)
        except CertificateError as exc:
            raise InternalError(str(exc)) from None

    def pem(self) -> tuple[bytes, bytes, bytes]:
        """(CA certificates, Reach's key, Reach's certificate chain) as PEM bytes."""
        return self._load().pem

    def server_name(self, instance_id: str) -> str:
        """The name instance `instance_id` must prove; a non-retryable `TransportError` when the
        id cannot be an mTLS identity (it joined before mTLS was turned on)."""
        name = self._names.get(instance_id)
        if name is None:
            try:
                name = agent_server_name(instance_id, self.trust_domain)
            except CertificateError as exc:
                raise TransportError(
                    f"mTLS is on and agent {instance_id[:80]!r} cannot be verified: {exc}",
                    retryable=False,
                ) from None
            if len(self._names) > 10_000:
                self._names.clear()
            self._names[instance_id] = name
        return name

    def refused(
        self, exc: BaseException, address: str, instance_id: str, *, sent: bool = False
    ) -> TransportError | None:
        """The `TransportError` for a TLS failure behind `exc`, or None if it is not one.
        `sent`: the request may have been written before it (then its outcome is unknown)."""
        cause = tls_cause(exc)
        if cause is None:
            return None
        return TransportError(self.describe(cause, address, instance_id), outcome_unknown=sent)

    def describe(self, error: ssl.SSLError, address: str, instance_id: str) -> str:
        """What went wrong in a handshake with `instance_id` at `address`, in words that name
        the identity expected."""
        if isinstance(error, ssl.SSLCertVerificationError):
            return self.unproven(address, instance_id, _reason(error))
        return self.handshake_failed(address, instance_id, _reason(error))

    def unproven(self, address: str, instance_id: str, reason: str) -> str:
        """The agent's certificate did not verify (another CA, another identity, expired)."""
        return (
            f"TLS: agent at {address} did not prove the identity {self.expected(instance_id)}: "
            f"{reason} (is its certificate issued by Reach's CA for that id, and current?)"
        )

    def handshake_failed(self, address: str, instance_id: str, reason: str) -> str:
        """The handshake failed otherwise (no TLS there, Reach's certificate refused)."""
        return (
            f"TLS handshake with agent at {address} (expected {self.expected(instance_id)}) "
            f"failed: {reason} (does the agent serve TLS and trust Reach's CA?)"
        )

    def expected(self, instance_id: str) -> str:
        try:
            spiffe = agent_spiffe_id(instance_id, self.trust_domain)
            return f"{spiffe} (server name {agent_server_name(instance_id, self.trust_domain)})"
        except CertificateError:
            return f"agent {instance_id[:80]!r}"

    def plaintext(self, address: str, instance_id: str) -> TransportError:
        """The error for an agent whose address asks for plaintext while mTLS is on."""
        return TransportError(
            f"mTLS is on: refusing to call agent {instance_id} at {address} without TLS "
            "(join with a TLS address: host:port, https:// or wss://)",
            retryable=False,
        )

    async def probe(
        self,
        host: str,
        port: int,
        instance_id: str,
        address: str,
        *,
        poke: bytes = b"",
        alpn: list[str] | None = None,
        timeout_s: float = PROBE_TIMEOUT_S,
    ) -> None:
        """Handshake with the agent at host:port as a call would. `Forbidden` if it cannot
        prove `instance_id` or refuses Reach's certificate; `InvalidRequest` if the id cannot
        be an identity, the address guard refuses the address, or nobody answers there.

        Under TLS 1.3 a server checks the client's certificate only once the client's side of
        the handshake is over, and an agent that refuses it just closes the connection. So the
        probe then sends `poke` (a harmless request in the agent's protocol; nothing for one
        whose server speaks first, as HTTP/2's does) and waits for the first byte: the
        connection closed instead is a refusal. Silence (`SETTLE_S`) is taken as acceptance.
        `alpn`: the protocols to offer (gRPC servers close a connection that did not agree on
        h2)."""
        try:
            name = agent_server_name(instance_id, self.trust_domain)
        except CertificateError as exc:
            raise InvalidRequest(f"mTLS is on: {exc}") from None
        # Only where Reach may connect at all (the address guard), to the address it vetted.
        ips = await AddressGuard(self.allow_networks).resolve_checked(host.strip("[]"), port)
        context = self.context()
        if alpn:
            context = self.fresh_context()  # the shared one's ALPN belongs to its connections
            context.set_alpn_protocols(alpn)
        try:
            async with asyncio.timeout(timeout_s):
                reader, writer = await asyncio.open_connection(
                    ips[0],
                    port,
                    ssl=context,
                    server_hostname=name,
                    ssl_handshake_timeout=timeout_s,
                )
        except ssl.SSLError as exc:
            raise Forbidden(self.describe(exc, address, instance_id)) from None
        except (ConnectionResetError, ConnectionAbortedError, BrokenPipeError) as exc:
            # Connected, then dropped in the handshake: no TLS there, or not ours.
            reason = f"the connection was dropped during the handshake ({exc!r})"
            raise Forbidden(self.handshake_failed(address, instance_id, reason)) from None
        except (OSError, TimeoutError) as exc:
            raise InvalidRequest(
                f"mTLS is on: cannot reach agent {instance_id} at {address} to verify its "
                f"certificate: {exc!r}"
            ) from None
        try:
            try:
                async with asyncio.timeout(min(timeout_s, SETTLE_S)):
                    if poke:
                        writer.write(poke)
                        await writer.drain()
                    first = await reader.read(1)
            except TimeoutError:
                return  # it proved its identity and refused nothing
            except (OSError, ssl.SSLError):
                first = b""
            if not first:
                raise Forbidden(
                    self.handshake_failed(
                        address,
                        instance_id,
                        "the agent closed the connection after the handshake, so it refuses "
                        "Reach's certificate",
                    )
                )
        finally:
            writer.close()
            with contextlib.suppress(OSError, ssl.SSLError, TimeoutError):
                async with asyncio.timeout(1.0):
                    await writer.wait_closed()
