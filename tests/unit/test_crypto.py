"""Payload encryption: the AES-256-GCM cipher, the Temporal codec over it, the settings that
describe its keys, and the codec-server routes (in process; the real stack is in
tests/integration/test_encrypted_history.py)."""

from __future__ import annotations

import base64
import json
import os
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi import FastAPI
from google.protobuf import json_format
from temporalio.api.common.v1 import Payload, Payloads
from temporalio.api.failure.v1 import Failure
from temporalio.exceptions import ApplicationError

from activities.codec import ENCODING, KEY_ID, PAYLOAD_CONVERTER, EncryptionCodec, data_converter
from gateway_api.deps import require_admin
from gateway_api.errors import install_error_handlers
from gateway_api.routes import codec as codec_routes
from reach.config import (
    ConfigError,
    EncryptionSettings,
    ReachSettings,
    SecuritySettings,
    load_settings,
)
from reach.errors import Unauthorized
from reach.security.crypto import CryptoError, PayloadCipher, decode_key, new_key

K1, K2 = os.urandom(32), os.urandom(32)


def b64(raw: bytes) -> str:
    return base64.b64encode(raw).decode()


def enc_settings(active: str = "k1", **keys: bytes) -> EncryptionSettings:
    chosen = keys or {"k1": K1}
    return EncryptionSettings.model_validate(
        {"enabled": True, "active_key": active, "keys": {k: b64(v) for k, v in chosen.items()}}
    )


# --- the cipher -------------------------------------------------------------------------


def test_roundtrip_with_a_fresh_nonce_each_time() -> None:
    cipher = PayloadCipher({"k1": K1}, "k1")
    kid, blob = cipher.encrypt(b"secret marker", b"ctx")
    kid2, blob2 = cipher.encrypt(b"secret marker", b"ctx")
    assert kid == kid2 == "k1"
    assert blob != blob2  # random nonce: the same plaintext never looks the same
    assert len(blob) == 12 + len(b"secret marker") + 16
    assert b"secret marker" not in blob
    assert cipher.decrypt(kid, blob, b"ctx") == b"secret marker"
    assert cipher.decrypt(kid2, blob2, b"ctx") == b"secret marker"
    assert cipher.decrypt(*cipher.encrypt(b"")) == b""


def test_wrong_key_under_the_same_id_fails_the_tag() -> None:
    kid, blob = PayloadCipher({"k1": K1}, "k1").encrypt(b"x")
    with pytest.raises(CryptoError, match="failed authentication under key 'k1'"):
        PayloadCipher({"k1": K2}, "k1").decrypt(kid, blob)


@pytest.mark.parametrize("where", [0, 12, -1])  # nonce, ciphertext, tag
def test_a_tampered_blob_fails(where: int) -> None:
    cipher = PayloadCipher({"k1": K1}, "k1")
    kid, blob = cipher.encrypt(b"payload bytes")
    bad = bytearray(blob)
    bad[where] ^= 0x01
    with pytest.raises(CryptoError, match="failed authentication"):
        cipher.decrypt(kid, bytes(bad))


def test_other_aad_or_truncation_fails() -> None:
    cipher = PayloadCipher({"k1": K1}, "k1")
    kid, blob = cipher.encrypt(b"payload", b"one")
    with pytest.raises(CryptoError, match="failed authentication"):
        cipher.decrypt(kid, blob, b"two")
    with pytest.raises(CryptoError, match="too short"):
        cipher.decrypt(kid, blob[:20])


def test_unknown_key_id_names_the_known_ones() -> None:
    cipher = PayloadCipher({"k1": K1, "k2": K2}, "k2")
    with pytest.raises(CryptoError, match=r"unknown encryption key id 'k0' \(known: k1, k2\)"):
        cipher.decrypt("k0", b"\0" * 40)


def test_rotation_new_key_seals_old_still_opens() -> None:
    old = PayloadCipher({"k1": K1}, "k1")
    sealed_before = old.encrypt(b"before")
    rotated = PayloadCipher({"k1": K1, "k2": K2}, "k2")
    kid, blob = rotated.encrypt(b"after")
    assert kid == "k2"
    assert rotated.decrypt(*sealed_before) == b"before"
    assert rotated.decrypt(kid, blob) == b"after"
    with pytest.raises(CryptoError, match="unknown encryption key id 'k2'"):
        old.decrypt(kid, blob)


def test_cipher_refuses_bad_keys() -> None:
    with pytest.raises(ValueError, match="active key 'k9'"):
        PayloadCipher({"k1": K1}, "k9")
    with pytest.raises(ValueError, match="must be 32 bytes"):
        PayloadCipher({"k1": K1[:16]}, "k1")


def test_new_key_is_base64_of_32_random_bytes() -> None:
    a, b = new_key(), new_key()
    assert a != b
    assert len(decode_key(a)) == 32


# --- settings ---------------------------------------------------------------------------


@pytest.fixture
def empty_yaml(tmp_path: Path) -> Path:
    path = tmp_path / "reach.yaml"
    path.write_text("reach: {}\n")
    return path


def test_from_settings() -> None:
    assert PayloadCipher.from_settings(EncryptionSettings()) is None
    cipher = PayloadCipher.from_settings(enc_settings("k2", k1=K1, k2=K2))
    assert cipher is not None
    assert cipher.active == "k2"
    assert cipher.key_ids == {"k1", "k2"}


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("not base64!", "keys.k1 is not valid base64"),
        (b64(os.urandom(16)), "keys.k1 must be 32 bytes once base64-decoded, not 16"),
        (b64(os.urandom(33)), "not 33"),
    ],
    # Fixed ids: ids made from the random keys would differ between pytest-xdist's workers,
    # and xdist refuses to run when the workers collect different tests.
    ids=["not-base64", "16-bytes", "33-bytes"],
)
def test_settings_refuse_a_key_that_is_not_aes256(
    value: str, message: str, monkeypatch: pytest.MonkeyPatch, empty_yaml: Path
) -> None:
    monkeypatch.setenv("REACH_SECURITY__ENCRYPTION__ENABLED", "true")
    monkeypatch.setenv("REACH_SECURITY__ENCRYPTION__ACTIVE_KEY", "k1")
    monkeypatch.setenv("REACH_SECURITY__ENCRYPTION__KEYS", json.dumps({"k1": value}))
    with pytest.raises(ConfigError) as info:
        load_settings(empty_yaml)
    assert message in str(info.value)
    assert "security.encryption" in str(info.value)
    assert value not in str(info.value) or value == "not base64!"  # key material never echoed


def test_settings_from_the_environment(monkeypatch: pytest.MonkeyPatch, empty_yaml: Path) -> None:
    monkeypatch.setenv("REACH_SECURITY__ENCRYPTION__ENABLED", "true")
    monkeypatch.setenv("REACH_SECURITY__ENCRYPTION__ACTIVE_KEY", "k2")
    monkeypatch.setenv(
        "REACH_SECURITY__ENCRYPTION__KEYS", json.dumps({"k1": b64(K1), "k2": b64(K2)})
    )
    enc = load_settings(empty_yaml).security.encryption
    assert enc.codec_cors_origins == ["http://localhost:8233", "http://127.0.0.1:8233"]
    cipher = PayloadCipher.from_settings(enc)
    assert cipher is not None
    assert cipher.active == "k2"


# --- the codec --------------------------------------------------------------------------


def payload(text: str) -> Payload:
    return Payload(metadata={"encoding": b"json/plain"}, data=json.dumps({"t": text}).encode())


async def test_codec_seals_the_whole_payload_and_restores_it() -> None:
    codec = EncryptionCodec(PayloadCipher({"k1": K1}, "k1"))
    originals = [payload("marker-123"), payload("other")]
    encoded = await codec.encode(originals)
    assert len(encoded) == 2
    for p in encoded:
        assert dict(p.metadata) == {"encoding": ENCODING, KEY_ID: b"k1"}
        assert b"marker-123" not in p.SerializeToString()
        assert b"json/plain" not in p.SerializeToString()  # metadata sealed too
    assert await codec.decode(encoded) == originals


async def test_codec_passes_unencrypted_payloads_through() -> None:
    codec = EncryptionCodec(PayloadCipher({"k1": K1}, "k1"))
    plain = payload("written before encryption")
    mixed = [plain, *(await codec.encode([payload("new")]))]
    assert await codec.decode(mixed) == [plain, payload("new")]


async def test_codec_rotation_and_unknown_ids() -> None:
    old = EncryptionCodec(PayloadCipher({"k1": K1}, "k1"))
    new = EncryptionCodec(PayloadCipher({"k1": K1, "k2": K2}, "k2"))
    [sealed_old] = await old.encode([payload("old")])
    [sealed_new] = await new.encode([payload("new")])
    assert sealed_new.metadata[KEY_ID] == b"k2"
    assert await new.decode([sealed_old, sealed_new]) == [payload("old"), payload("new")]
    with pytest.raises(CryptoError, match="unknown encryption key id 'k2'"):
        await old.decode([sealed_new])
    no_id = Payload(metadata={"encoding": ENCODING}, data=sealed_old.data)
    with pytest.raises(CryptoError, match="without its encryption-key-id"):
        await new.decode([no_id])


async def test_data_converter_roundtrips_models_and_failures() -> None:
    assert data_converter(ReachSettings()) is PAYLOAD_CONVERTER
    settings = ReachSettings(security=SecuritySettings(encryption=enc_settings()))
    converter = data_converter(settings)
    assert isinstance(converter.payload_codec, EncryptionCodec)
    value = {"text": "marker-xyz", "n": [1, 2, 3]}
    [p] = await converter.encode([value])
    assert b"marker-xyz" not in p.SerializeToString()
    assert await converter.decode([p], [dict[str, Any]]) == [value]
    # Failures: message and stack trace are sealed along with the details.
    failure = Failure()
    err = ApplicationError("agent said marker-xyz", {"echo": "marker-xyz"}, type="agent_error")
    await converter.encode_failure(err, failure)
    assert b"marker-xyz" not in failure.SerializeToString()
    back = await converter.decode_failure(failure)
    assert isinstance(back, ApplicationError)
    assert back.message == "agent said marker-xyz"
    assert back.details == ({"echo": "marker-xyz"},)


def test_codec_cost_is_small() -> None:
    """Sanity bound only (the measured figure is in the report): a ~200-byte payload set
    sealed and opened well under a millisecond."""
    import timeit

    codec = EncryptionCodec(PayloadCipher({"k1": K1}, "k1"))
    one = payload("x" * 180)

    def roundtrip() -> None:
        codec.decrypt(codec.encrypt(one))

    best = min(timeit.repeat(roundtrip, number=200, repeat=3)) / 200
    assert best < 0.001, best


# --- the codec-server routes ------------------------------------------------------------


async def an_admin() -> None:
    return None


async def no_token() -> None:
    raise Unauthorized("missing credentials: send Authorization: Bearer <token>")


def app_with(
    settings: EncryptionSettings, admin: Callable[[], Awaitable[None]] = an_admin
) -> FastAPI:
    """The codec routes alone; the admin check (the door's, tested with it) stubbed."""
    app = FastAPI()
    install_error_handlers(app)
    app.include_router(codec_routes.router(settings))
    app.dependency_overrides[require_admin] = admin
    return app


@pytest.fixture
async def client() -> AsyncIterator[httpx.AsyncClient]:
    app = app_with(enc_settings("k2", k1=K1, k2=K2))
    async with httpx.AsyncClient(
        transport=httpx.ASGITransport(app=app), base_url="http://gw"
    ) as http:
        yield http


def as_json(payloads: list[Payload]) -> dict[str, Any]:
    return json.loads(json_format.MessageToJson(Payloads(payloads=payloads)))  # type: ignore[no-any-return]


async def test_encode_then_decode_over_http(client: httpx.AsyncClient) -> None:
    originals = [payload("marker-http"), payload("b")]
    r = await client.post("/codec/encode", json=as_json(originals))
    assert r.status_code == 200, r.text
    assert "marker-http" not in r.text
    encoded = json_format.Parse(r.text, Payloads())
    assert [p.metadata[KEY_ID] for p in encoded.payloads] == [b"k2", b"k2"]
    r = await client.post("/codec/decode", json=r.json(), headers={"X-Namespace": "default"})
    assert r.status_code == 200, r.text
    assert list(json_format.Parse(r.text, Payloads()).payloads) == originals


async def test_decode_passes_plain_payloads_and_refuses_unknown_keys(
    client: httpx.AsyncClient,
) -> None:
    plain = as_json([payload("plain")])
    r = await client.post("/codec/decode", json=plain)
    assert r.status_code == 200
    assert r.json() == plain
    stranger = EncryptionCodec(PayloadCipher({"k9": K1}, "k9")).encrypt(payload("x"))
    r = await client.post("/codec/decode", json=as_json([payload("ok"), stranger]))
    assert r.status_code == 422
    assert r.json()["error"]["type"] == "invalid_request"
    assert "payloads[1]: unknown encryption key id 'k9'" in r.json()["error"]["message"]


@pytest.mark.parametrize(
    "body",
    [b"", b"not json", b"[]", b'{"payloads": 3}', b'{"payloads": [{"data": "!!"}]}', b"\xff"],
)
async def test_a_bad_body_is_422_in_the_envelope(client: httpx.AsyncClient, body: bytes) -> None:
    for op in ("encode", "decode"):
        r = await client.post(f"/codec/{op}", content=body)
        assert r.status_code == 422, r.text
        data = r.json()
        assert data["status"] == "error"
        assert data["error"]["type"] == "invalid_request"
        assert "Payloads JSON" in data["error"]["message"]


async def test_preflight_from_the_ui_needs_no_auth(client: httpx.AsyncClient) -> None:
    for origin in ("http://localhost:8233", "http://127.0.0.1:8233"):
        r = await client.options(
            "/codec/decode",
            headers={
                "Origin": origin,
                "Access-Control-Request-Method": "POST",
                "Access-Control-Request-Headers": "authorization,content-type,x-namespace",
            },
        )
        assert r.status_code == 204, r.text
        assert r.headers["access-control-allow-origin"] == origin
        assert r.headers["access-control-allow-credentials"] == "true"
        allowed = {h.strip().lower() for h in r.headers["access-control-allow-headers"].split(",")}
        assert {"authorization", "content-type", "x-namespace"} <= allowed
        assert "POST" in r.headers["access-control-allow-methods"]
    r = await client.options(
        "/codec/decode",
        headers={"Origin": "http://evil.example", "Access-Control-Request-Method": "POST"},
    )
    assert r.status_code == 403
    assert "access-control-allow-origin" not in r.headers
    # The POST answer (and an error's) carries the origin too, or the browser hides it.
    r = await client.post(
        "/codec/decode", content=b"nope", headers={"Origin": "http://localhost:8233"}
    )
    assert r.status_code == 422
    assert r.headers["access-control-allow-origin"] == "http://localhost:8233"


async def test_encode_and_decode_need_an_admin_but_preflight_does_not() -> None:
    app = app_with(enc_settings(), admin=no_token)
    async with httpx.AsyncClient(
        transport=httpx.ASGITransport(app=app), base_url="http://gw"
    ) as http:
        for op in ("encode", "decode"):
            r = await http.post(
                f"/codec/{op}", json={"payloads": []}, headers={"Origin": "http://localhost:8233"}
            )
            assert r.status_code == 401, r.text
            assert r.json()["error"]["type"] == "unauthorized"
            assert r.headers["access-control-allow-origin"] == "http://localhost:8233"
            r = await http.options(
                f"/codec/{op}",
                headers={
                    "Origin": "http://localhost:8233",
                    "Access-Control-Request-Method": "POST",
                },
            )
            assert r.status_code == 204, r.text


async def test_routes_say_encryption_is_off() -> None:
    app = app_with(EncryptionSettings())
    async with httpx.AsyncClient(
        transport=httpx.ASGITransport(app=app), base_url="http://gw"
    ) as http:
        r = await http.post("/codec/decode", json={"payloads": []})
        assert r.status_code == 404
        assert "encryption is off" in r.json()["error"]["message"]
