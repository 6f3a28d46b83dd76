"""The development CA and the certificates it issues (R18): what each one says and allows."""

from __future__ import annotations

import datetime
import ssl
import stat
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID

from gateway_api.cli_certs import add_parser, cmd_certs
from reach.config import ReachSettings, TlsSettings
from reach.security.certs import (
    AGENT_ID_PATTERN,
    CaFiles,
    CertificateError,
    agent_server_name,
    agent_spiffe_id,
    check_agent_id,
    client_context,
    expires_at,
    identity_of,
    init_ca,
    issue_agent,
    peer_spiffe_ids,
    server_context,
)

TD = "reach.local"


def load(path: Path) -> x509.Certificate:
    return x509.load_pem_x509_certificate(path.read_bytes())


def san(cert: x509.Certificate) -> x509.SubjectAlternativeName:
    return cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value


def eku(cert: x509.Certificate) -> set[x509.ObjectIdentifier]:
    return set(cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value)


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


@pytest.fixture
def ca(tmp_path: Path) -> CaFiles:
    return init_ca(tmp_path / "certs", TD, days=30)


def test_the_ca_is_an_ec_p256_ca_that_signs_certificates(ca: CaFiles) -> None:
    cert = load(ca.ca_cert)
    key = cert.public_key()
    assert isinstance(key, ec.EllipticCurvePublicKey)
    assert key.curve.name == "secp256r1"
    basic = cert.extensions.get_extension_for_class(x509.BasicConstraints)
    assert basic.critical
    assert basic.value.ca
    usage = cert.extensions.get_extension_for_class(x509.KeyUsage)
    assert usage.critical
    assert usage.value.key_cert_sign
    assert not usage.value.digital_signature
    assert cert.issuer == cert.subject
    lifetime = cert.not_valid_after_utc - datetime.datetime.now(datetime.UTC)
    assert datetime.timedelta(days=29) < lifetime <= datetime.timedelta(days=30)


def test_keys_are_readable_by_their_owner_only(ca: CaFiles) -> None:
    assert mode(ca.ca_key) == 0o600
    assert mode(ca.reach_key) == 0o600
    assert mode(ca.ca_cert) == 0o644
    assert mode(ca.ca_cert.parent) == 0o700
    cert, key = issue_agent(ca.ca_cert.parent, "agent-1", TD)
    assert mode(key) == 0o600
    assert mode(cert) == 0o644
    assert not list(ca.ca_cert.parent.glob(".*")), "no temporary file is left behind"


def test_reachs_certificate_names_reach_and_works_both_ways(ca: CaFiles) -> None:
    cert = load(ca.reach_cert)
    names = san(cert)
    assert names.get_values_for_type(x509.UniformResourceIdentifier) == [
        "spiffe://reach.local/reach"
    ]
    assert names.get_values_for_type(x509.DNSName) == []  # it can never pass as an agent
    assert eku(cert) == {ExtendedKeyUsageOID.CLIENT_AUTH, ExtendedKeyUsageOID.SERVER_AUTH}
    assert not cert.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
    cert.verify_directly_issued_by(load(ca.ca_cert))
    assert ca.reach_id == "spiffe://reach.local/reach"


def test_an_agent_certificate_names_the_instance_twice_and_is_short_lived(ca: CaFiles) -> None:
    cert_path, key_path = issue_agent(ca.ca_cert.parent, "retriever-01", TD, hours=2)
    assert cert_path == ca.ca_cert.parent / "agents" / "retriever-01.pem"
    assert key_path == ca.ca_cert.parent / "agents" / "retriever-01-key.pem"
    cert = load(cert_path)
    names = san(cert)
    assert names.get_values_for_type(x509.UniformResourceIdentifier) == [
        "spiffe://reach.local/agent/retriever-01"
    ]
    assert names.get_values_for_type(x509.DNSName) == ["retriever-01.agent.reach.local"]
    assert eku(cert) == {ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH}
    usage = cert.extensions.get_extension_for_class(x509.KeyUsage).value
    assert usage.digital_signature
    assert not usage.key_cert_sign
    now = datetime.datetime.now(datetime.UTC)
    assert cert.not_valid_before_utc <= now
    assert datetime.timedelta(hours=1, minutes=59) < cert.not_valid_after_utc - now
    assert cert.not_valid_after_utc - now <= datetime.timedelta(hours=2)
    assert expires_at(cert_path) == cert.not_valid_after_utc
    cert.verify_directly_issued_by(load(ca.ca_cert))
    assert identity_of(cert_path) == (TD, "retriever-01")
    assert identity_of(ca.reach_cert) is None


def test_an_agent_certificate_never_outlives_its_ca(tmp_path: Path) -> None:
    files = init_ca(tmp_path, TD, days=1)
    cert, _ = issue_agent(tmp_path, "agent-1", TD, hours=48)
    assert load(cert).not_valid_after_utc <= load(files.ca_cert).not_valid_after_utc


def test_agent_server_name_and_spiffe_id() -> None:
    assert agent_server_name("agent-1", TD) == "agent-1.agent.reach.local"
    assert agent_spiffe_id("agent-1", "prod.example.com") == (
        "spiffe://prod.example.com/agent/agent-1"
    )
    with pytest.raises(CertificateError, match="trust domain"):
        agent_server_name("agent-1", "Bad_Domain")


@pytest.mark.parametrize(
    "instance_id",
    [
        "Retriever-1",  # DNS names ignore case: it would share a name with retriever-1
        "retriever.1",  # another label
        "retriever_1",
        "retriever:1",
        "-retriever",
        "retriever-",
        "r" * 64,
        "",
    ],
)
def test_ids_that_cannot_be_a_dns_label_are_refused_not_mapped(
    instance_id: str, ca: CaFiles
) -> None:
    with pytest.raises(CertificateError, match="cannot be an mTLS identity"):
        check_agent_id(instance_id)
    with pytest.raises(CertificateError):
        issue_agent(ca.ca_cert.parent, instance_id, TD)
    with pytest.raises(CertificateError):
        agent_server_name(instance_id, TD)


@pytest.mark.parametrize("instance_id", ["a", "retriever-01", "0", "r" * 63, "a-b-c"])
def test_dns_label_ids_are_accepted(instance_id: str) -> None:
    assert check_agent_id(instance_id) == instance_id
    assert AGENT_ID_PATTERN.startswith("^")


def test_init_refuses_to_replace_a_ca_unless_forced(ca: CaFiles) -> None:
    before = ca.ca_cert.read_bytes()
    with pytest.raises(CertificateError, match="exists"):
        init_ca(ca.ca_cert.parent, TD)
    assert ca.ca_cert.read_bytes() == before
    init_ca(ca.ca_cert.parent, TD, force=True)
    assert ca.ca_cert.read_bytes() != before


def test_issuing_without_a_ca_says_what_to_do(tmp_path: Path) -> None:
    with pytest.raises(CertificateError, match="reach certs init"):
        issue_agent(tmp_path, "agent-1", TD)


def test_lifetimes_out_of_range_are_refused(ca: CaFiles, tmp_path: Path) -> None:
    with pytest.raises(CertificateError, match="hours"):
        issue_agent(ca.ca_cert.parent, "agent-1", TD, hours=0)
    with pytest.raises(CertificateError, match="days"):
        init_ca(tmp_path / "other", TD, days=0)


def test_the_contexts_require_certificates_and_tls_1_2(ca: CaFiles) -> None:
    tls = TlsSettings(
        enabled=True,
        ca_file=str(ca.ca_cert),
        cert_file=str(ca.reach_cert),
        key_file=str(ca.reach_key),
    )
    client = client_context(tls)
    assert client.verify_mode == ssl.CERT_REQUIRED
    assert client.check_hostname
    assert client.minimum_version == ssl.TLSVersion.TLSv1_2
    cert, key = issue_agent(ca.ca_cert.parent, "agent-1", TD)
    server = server_context(ca.ca_cert, cert, key)
    assert server.verify_mode == ssl.CERT_REQUIRED
    assert server.minimum_version == ssl.TLSVersion.TLSv1_2
    missing = tls.model_copy(update={"cert_file": str(ca.ca_cert.parent / "nope.pem")})
    with pytest.raises(CertificateError, match="cannot be loaded"):
        client_context(missing)


def test_peer_spiffe_ids_reads_getpeercert() -> None:
    peer = {"subjectAltName": (("DNS", "x"), ("URI", "spiffe://reach.local/reach"))}
    assert peer_spiffe_ids(peer) == ["spiffe://reach.local/reach"]
    assert peer_spiffe_ids(None) == []


def test_the_cli_writes_and_names_what_it_wrote(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import argparse

    parser = argparse.ArgumentParser()
    add_parser(parser.add_subparsers(dest="command"))
    settings = ReachSettings()
    where = str(tmp_path / "pki")
    assert cmd_certs(settings, parser.parse_args(["certs", "init", "--dir", where])) == 0
    out = capsys.readouterr().out
    assert "spiffe://reach.local/reach" in out
    assert f"{where}/ca.pem" in out
    args = ["certs", "issue", "--agent", "retriever-01", "--hours", "1", "--dir", where]
    assert cmd_certs(settings, parser.parse_args(args)) == 0
    out = capsys.readouterr().out
    assert "spiffe://reach.local/agent/retriever-01" in out
    assert "retriever-01.agent.reach.local" in out
    assert (tmp_path / "pki" / "agents" / "retriever-01.pem").exists()
    bad = ["certs", "issue", "--agent", "Retriever.01", "--dir", where]
    assert cmd_certs(settings, parser.parse_args(bad)) == 1
    assert "cannot be an mTLS identity" in capsys.readouterr().err
