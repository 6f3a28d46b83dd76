"""Certificates for mTLS between Reach and its agents (R18): a development CA, Reach's client
certificate, short-lived agent certificates, and the TLS contexts both sides use.

Identities are SPIFFE ids in the certificates' URI SAN:

    spiffe://<trust-domain>/reach            Reach (gateway and workers), as a client
    spiffe://<trust-domain>/agent/<id>       agent instance <id>

Every agent certificate also carries the DNS SAN `<id>.agent.<trust-domain>`
(`agent_server_name`). Reach calls an agent with that name as the TLS server name (SNI), so
ordinary hostname verification, which every TLS client (ssl, httpx, grpc, websockets) performs,
checks that the peer holds a certificate for that very instance: a certificate from the CA for
another instance, or from another CA, fails the handshake. Reach's own certificate has no DNS
name, so it can never pass as an agent.

Instance ids under mTLS: an id must be usable as that DNS label, so it must match
`AGENT_ID_PATTERN` (1-63 of a-z, 0-9 and '-', starting and ending with a letter or digit).
Other ids (upper case, '.', '_', ':' — all valid registry ids) are refused, never mapped:
DNS names compare case-insensitively, so any mapping would let two registry ids share one name
(`Retriever-1` and `retriever-1`) and one instance's certificate pass for the other.

Files (`init_ca` / `issue_agent`, mode 0o600 for every key, written atomically):

    <dir>/ca.pem, ca-key.pem                    the CA (EC P-256, CA:true, keyCertSign)
    <dir>/reach.pem, reach-key.pem              Reach's certificate (clientAuth + serverAuth)
    <dir>/agents/<id>.pem, agents/<id>-key.pem  an agent's certificate (hours, not days)

This is a development CA: for production, issue the same shapes from your own PKI (SPIFFE/SPIRE,
Vault, cert-manager) and point `security.tls` at the files.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import re
import ssl
import tempfile
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from reach.config import TlsSettings

AGENT_ID_PATTERN = r"^[a-z0-9](?:[a-z0-9-]{0,61}[a-z0-9])?$"
# The same rule as `TlsSettings.trust_domain`, with labels checked one by one below.
_TRUST_DOMAIN = re.compile(r"^[a-z0-9][a-z0-9.-]{0,252}$")
# A DNS label: an agent's id under mTLS, and each label of a trust domain.
_LABEL = _AGENT_ID = re.compile(AGENT_ID_PATTERN)

CA_CERT = "ca.pem"
CA_KEY = "ca-key.pem"
REACH_CERT = "reach.pem"
REACH_KEY = "reach-key.pem"
AGENTS_DIR = "agents"

DEFAULT_CA_DAYS = 365
DEFAULT_AGENT_HOURS = 24
MAX_AGENT_HOURS = 24 * 90
# Certificates start a few minutes in the past: a peer whose clock is a little behind must not
# refuse a certificate issued a second ago.
BACKDATE = datetime.timedelta(minutes=5)


class CertificateError(ValueError):
    """A certificate cannot be issued or loaded as asked (the message says why)."""


@dataclass(frozen=True)
class CaFiles:
    """What `init_ca` wrote."""

    ca_cert: Path
    ca_key: Path
    reach_cert: Path
    reach_key: Path
    reach_id: str


@dataclass(frozen=True)
class TlsFiles:
    """An agent's side of mTLS: the CA that signs Reach's certificate, and its own pair."""

    ca: Path
    cert: Path
    key: Path


# -- names ----------------------------------------------------------------------------------------


def check_trust_domain(trust_domain: str) -> str:
    """`trust_domain` if it is a DNS name of lower-case labels, else `CertificateError`."""
    if not _TRUST_DOMAIN.match(trust_domain) or not all(
        _LABEL.match(label) for label in trust_domain.split(".")
    ):
        raise CertificateError(
            f"trust domain {trust_domain!r} is not a lower-case DNS name (e.g. reach.local)"
        )
    return trust_domain


def check_agent_id(instance_id: str) -> str:
    """`instance_id` if mTLS can name it (see the module docstring), else `CertificateError`."""
    if not _AGENT_ID.match(instance_id):
        raise CertificateError(
            f"instance id {instance_id[:80]!r} cannot be an mTLS identity: it must be a DNS "
            "label, 1-63 of a-z, 0-9 and '-', starting and ending with a letter or digit"
        )
    return instance_id


def agent_spiffe_id(instance_id: str, trust_domain: str) -> str:
    return f"spiffe://{check_trust_domain(trust_domain)}/agent/{check_agent_id(instance_id)}"


def reach_spiffe_id(trust_domain: str) -> str:
    return f"spiffe://{check_trust_domain(trust_domain)}/reach"


def agent_server_name(instance_id: str, trust_domain: str) -> str:
    """The TLS server name instance `instance_id` proves (its certificate's DNS SAN)."""
    name = f"{check_agent_id(instance_id)}.agent.{check_trust_domain(trust_domain)}"
    if len(name) > 253:
        raise CertificateError(f"{name[:80]!r}... is longer than a DNS name may be (253)")
    return name


# -- files ----------------------------------------------------------------------------------------


def _write(path: Path, data: bytes, mode: int) -> None:
    """Write `data` to `path` atomically (a reader sees the old file or the new one, whole),
    created with `mode` from the start: a key is never readable by others, not even briefly."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        os.fchmod(fd, mode)
        with os.fdopen(fd, "wb") as out:
            out.write(data)
            out.flush()
            os.fsync(out.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def _key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )


def _cert_pem(cert: x509.Certificate) -> bytes:
    return cert.public_bytes(serialization.Encoding.PEM)


def _load_ca(directory: Path) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    cert_path, key_path = directory / CA_CERT, directory / CA_KEY
    try:
        cert = x509.load_pem_x509_certificate(cert_path.read_bytes())
        key = serialization.load_pem_private_key(key_path.read_bytes(), password=None)
    except FileNotFoundError as exc:
        raise CertificateError(
            f"no CA in {directory} ({exc.filename} is missing): run `reach certs init` first"
        ) from None
    except ValueError as exc:
        raise CertificateError(f"the CA in {directory} cannot be read: {exc}") from None
    if not isinstance(key, ec.EllipticCurvePrivateKey):
        raise CertificateError(f"{key_path} is not an EC private key")
    return cert, key


# -- issuing --------------------------------------------------------------------------------------


def _now() -> datetime.datetime:
    return datetime.datetime.now(datetime.UTC).replace(microsecond=0)


def _leaf(
    *,
    common_name: str,
    sans: list[x509.GeneralName],
    ca_cert: x509.Certificate,
    ca_key: ec.EllipticCurvePrivateKey,
    lifetime: datetime.timedelta,
) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    """A leaf certificate for a new key, both ways usable (TLS client and server)."""
    key = ec.generate_private_key(ec.SECP256R1())
    now = _now()
    # A certificate cannot outlive the CA that vouches for it.
    not_after = min(now + lifetime, ca_cert.not_valid_after_utc)
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)]))
        .issuer_name(ca_cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - BACKDATE)
        .not_valid_after(not_after)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=False,
                crl_sign=False,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(
            x509.ExtendedKeyUsage(
                [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]
            ),
            critical=False,
        )
        .add_extension(x509.SubjectAlternativeName(sans), critical=False)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()),
            critical=False,
        )
        .sign(ca_key, hashes.SHA256())
    )
    return cert, key


def init_ca(
    directory: str | os.PathLike[str],
    trust_domain: str,
    days: int = DEFAULT_CA_DAYS,
    *,
    force: bool = False,
) -> CaFiles:
    """Create a development CA in `directory`, and Reach's certificate signed by it.

    Refuses (`CertificateError`) to replace an existing CA unless `force`: every certificate
    it issued would stop being trusted."""
    check_trust_domain(trust_domain)
    if not 1 <= days <= 3650:
        raise CertificateError(f"days must be from 1 to 3650, not {days}")
    d = Path(directory)
    if (d / CA_CERT).exists() and not force:
        raise CertificateError(
            f"{d / CA_CERT} exists; replacing it would invalidate every certificate it issued "
            "(use --force to do it anyway)"
        )
    d.mkdir(parents=True, exist_ok=True, mode=0o700)
    key = ec.generate_private_key(ec.SECP256R1())
    now = _now()
    name = x509.Name(
        [
            x509.NameAttribute(NameOID.ORGANIZATION_NAME, "Agent-Reach"),
            x509.NameAttribute(NameOID.COMMON_NAME, f"Agent-Reach development CA {trust_domain}"),
        ]
    )
    ca = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - BACKDATE)
        .not_valid_after(now + datetime.timedelta(days=days))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=False,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=True,
                crl_sign=True,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .sign(key, hashes.SHA256())
    )
    reach_id = reach_spiffe_id(trust_domain)
    reach_cert, reach_key = _leaf(
        common_name="reach",
        sans=[x509.UniformResourceIdentifier(reach_id)],
        ca_cert=ca,
        ca_key=key,
        lifetime=datetime.timedelta(days=days),
    )
    files = CaFiles(d / CA_CERT, d / CA_KEY, d / REACH_CERT, d / REACH_KEY, reach_id)
    _write(files.ca_key, _key_pem(key), 0o600)
    _write(files.ca_cert, _cert_pem(ca), 0o644)
    _write(files.reach_key, _key_pem(reach_key), 0o600)
    _write(files.reach_cert, _cert_pem(reach_cert), 0o644)
    return files


def agent_files(directory: str | os.PathLike[str], instance_id: str) -> tuple[Path, Path]:
    """Where `issue_agent` writes instance `instance_id`'s certificate and key."""
    agents = Path(directory) / AGENTS_DIR
    return agents / f"{check_agent_id(instance_id)}.pem", agents / f"{instance_id}-key.pem"


def issue_agent(
    directory: str | os.PathLike[str],
    instance_id: str,
    trust_domain: str,
    hours: float = DEFAULT_AGENT_HOURS,
) -> tuple[Path, Path]:
    """Issue a short-lived certificate for agent instance `instance_id` from the CA in
    `directory`; returns (certificate path, key path). Issue a new one before it expires (the
    agent reloads it on restart)."""
    if not 0 < hours <= MAX_AGENT_HOURS:
        raise CertificateError(f"hours must be more than 0 and at most {MAX_AGENT_HOURS}")
    spiffe = agent_spiffe_id(instance_id, trust_domain)
    dns = agent_server_name(instance_id, trust_domain)
    ca_cert, ca_key = _load_ca(Path(directory))
    if ca_cert.not_valid_after_utc <= _now():
        raise CertificateError(f"the CA in {directory} expired at {ca_cert.not_valid_after_utc}")
    cert, key = _leaf(
        common_name=instance_id,
        sans=[x509.UniformResourceIdentifier(spiffe), x509.DNSName(dns)],
        ca_cert=ca_cert,
        ca_key=ca_key,
        lifetime=datetime.timedelta(hours=hours),
    )
    cert_path, key_path = agent_files(directory, instance_id)
    cert_path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    _write(key_path, _key_pem(key), 0o600)
    _write(cert_path, _cert_pem(cert), 0o644)
    return cert_path, key_path


# -- reading --------------------------------------------------------------------------------------


def spiffe_ids(cert: x509.Certificate) -> list[str]:
    """The spiffe:// URIs in a certificate's SAN."""
    try:
        san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except x509.ExtensionNotFound:
        return []
    return [
        uri
        for uri in san.get_values_for_type(x509.UniformResourceIdentifier)
        if uri.startswith("spiffe://")
    ]


def identity_of(cert_file: str | os.PathLike[str]) -> tuple[str, str] | None:
    """(trust domain, instance id) of an agent certificate, or None if it names no agent."""
    try:
        cert = x509.load_pem_x509_certificate(Path(cert_file).read_bytes())
    except ValueError as exc:
        raise CertificateError(f"{cert_file} is not a PEM certificate: {exc}") from None
    for uri in spiffe_ids(cert):
        domain, _, path = uri.removeprefix("spiffe://").partition("/")
        kind, _, instance_id = path.partition("/")
        if kind == "agent" and instance_id and "/" not in instance_id:
            return domain, instance_id
    return None


def reach_identity_for(agent_cert: str | os.PathLike[str]) -> str | None:
    """The one client an agent serves: Reach, in the trust domain of the agent's own
    certificate. None when that certificate names no agent (a PKI of another shape): then any
    client certificate from the CA is accepted."""
    identity = identity_of(agent_cert)
    return None if identity is None else f"spiffe://{identity[0]}/reach"


def expires_at(cert_file: str | os.PathLike[str]) -> datetime.datetime:
    """When a certificate file's certificate expires (UTC)."""
    return x509.load_pem_x509_certificate(Path(cert_file).read_bytes()).not_valid_after_utc


def peer_spiffe_ids(peercert: object) -> list[str]:
    """The spiffe:// URIs of a peer certificate as `ssl.SSLSocket.getpeercert()` gives it."""
    if not isinstance(peercert, dict):
        return []
    found = []
    for entry in peercert.get("subjectAltName", ()):
        if isinstance(entry, tuple) and len(entry) == 2 and entry[0] == "URI":
            value = str(entry[1])
            if value.startswith("spiffe://"):
                found.append(value)
    return found


# -- TLS contexts ---------------------------------------------------------------------------------


def _strict(context: ssl.SSLContext) -> ssl.SSLContext:
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    # RFC 5280 conformance checks (our certificates pass them; Python 3.13's default).
    context.verify_flags |= ssl.VERIFY_X509_STRICT
    return context


def client_context(tls: TlsSettings) -> ssl.SSLContext:
    """Reach's client side: present Reach's certificate, verify the agent's against the CA
    and its name (each connection passes `agent_server_name(...)` as the server name)."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)  # CERT_REQUIRED and check_hostname on
    try:
        context.load_verify_locations(cafile=tls.ca_file)
        context.load_cert_chain(tls.cert_file, tls.key_file)
    except (OSError, ssl.SSLError) as exc:
        raise CertificateError(
            f"mTLS is on but Reach's certificates cannot be loaded (security.tls: ca_file "
            f"{tls.ca_file}, cert_file {tls.cert_file}, key_file {tls.key_file}): {exc}"
        ) from None
    return _strict(context)


def server_context(
    ca: str | os.PathLike[str], cert: str | os.PathLike[str], key: str | os.PathLike[str]
) -> ssl.SSLContext:
    """An agent's server side: present its certificate, and require a client certificate
    signed by the CA (a client without one fails the handshake)."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    try:
        context.load_cert_chain(cert, key)
        context.load_verify_locations(cafile=ca)
    except (OSError, ssl.SSLError) as exc:
        raise CertificateError(
            f"the agent's TLS files cannot be loaded (ca {ca}, cert {cert}, key {key}): {exc}"
        ) from None
    context.verify_mode = ssl.CERT_REQUIRED
    return _strict(context)
