"""mTLS to A2A agents: with `security.tls`, the A2A connector presents Reach's certificate (made
by `reach certs`' own code, `init_ca`) to an a2a-sdk agent served by uvicorn that requires one
(ssl_cert_reqs=CERT_REQUIRED), and verifies the agent's certificate for its URL's host against
`ca_file`; without Reach's certificate, or with one from another CA, the agent refuses."""

from __future__ import annotations

import datetime
import ipaddress
import ssl
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from connectors.a2a import A2AConnector
from reach.config import SecuritySettings, TlsSettings
from reach.errors import InternalError, ReachError
from reach.invocation import Endpoint
from reach.security.certs import CaFiles, init_ca
from tests.a2a_agents import A2AAgentProcess
from tests.helpers import message

pytestmark = pytest.mark.integration

TD = "reach.local"


def server_cert(ca: CaFiles, out: Path) -> tuple[str, str]:
    """A certificate for 127.0.0.1 from the CA (the agent's, named by its URL's host)."""
    ca_cert = x509.load_pem_x509_certificate(ca.ca_cert.read_bytes())
    ca_key = serialization.load_pem_private_key(ca.ca_key.read_bytes(), None)
    assert isinstance(ca_key, ec.EllipticCurvePrivateKey)
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")]))
        .issuer_name(ca_cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(hours=1))
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .add_extension(
            x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
            critical=False,
        )
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()),
            critical=False,
        )
        .sign(ca_key, hashes.SHA256())
    )
    cert_path, key_path = out / "agent.pem", out / "agent-key.pem"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    return str(cert_path), str(key_path)


def tls_of(ca: CaFiles, *, enabled: bool = True) -> SecuritySettings:
    return SecuritySettings(
        allow_networks=["127.0.0.0/8"],
        tls=TlsSettings(
            enabled=enabled,
            ca_file=str(ca.ca_cert),
            cert_file=str(ca.reach_cert),
            key_file=str(ca.reach_key),
            trust_domain=TD,
        ),
    )


@pytest.fixture(scope="module")
async def pki_agent(
    tmp_path_factory: pytest.TempPathFactory,
) -> AsyncIterator[tuple[CaFiles, CaFiles, A2AAgentProcess]]:
    tmp = tmp_path_factory.mktemp("a2a-mtls")
    ca = init_ca(tmp / "pki", TD)
    other = init_ca(tmp / "other", TD)
    cert, key = server_cert(ca, tmp)
    client = ssl.create_default_context(cafile=str(ca.ca_cert))
    client.load_cert_chain(str(ca.reach_cert), str(ca.reach_key))
    agent = A2AAgentProcess(tmp, "mtls", tls=(cert, key, str(ca.ca_cert)), client=client)
    try:
        yield ca, other, await agent.ready()
    finally:
        agent.proc.stop()


async def test_reach_presents_its_certificate_to_an_agent_that_requires_one(
    pki_agent: tuple[CaFiles, CaFiles, A2AAgentProcess],
) -> None:
    ca, _, agent = pki_agent
    async with A2AConnector(security=tls_of(ca)) as connector:
        found = await connector.discover(agent.url)
        assert found.details["url"] == f"{agent.url}/"
        endpoint = Endpoint(
            instance_id="mtls-1",
            capability="cap",
            protocol="a2a",
            address=agent.url,
            details=found.details,
        )
        reply = await connector.invoke(endpoint, message("echo", {"q": "over mTLS"}), 10)
    assert reply.result == {"echo": {"q": "over mTLS"}}
    assert (await agent.counts())["counts"]["echo"] >= 1


async def test_without_reach_s_certificate_or_with_another_ca_s_the_agent_refuses(
    pki_agent: tuple[CaFiles, CaFiles, A2AAgentProcess],
) -> None:
    ca, other, agent = pki_agent
    before = (await agent.counts())["counts"].get("total", 0)
    # No mTLS: no client certificate (and the agent's CA is not a public one).
    async with A2AConnector(security=tls_of(ca, enabled=False)) as plain:
        with pytest.raises(ReachError):
            await plain.discover(agent.url)
    # Reach's certificate from another CA: the agent's handshake refuses it.
    async with A2AConnector(security=tls_of(other)) as stranger:
        with pytest.raises(ReachError):
            await stranger.discover(agent.url)
    assert (await agent.counts())["counts"].get("total", 0) == before


async def test_missing_certificate_files_are_reach_s_own_error(tmp_path: Path) -> None:
    gone = str(tmp_path / "nothing.pem")
    security = SecuritySettings(
        allow_networks=["127.0.0.0/8"],
        tls=TlsSettings(enabled=True, ca_file=gone, cert_file=gone, key_file=gone),
    )
    async with A2AConnector(security=security) as connector:
        with pytest.raises(InternalError, match="mTLS to A2A agents is on"):
            await connector.discover("https://127.0.0.1:9")
