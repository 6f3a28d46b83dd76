"""The payload codec that keeps workflow history opaque to whoever reads the Temporal store.

Every payload the SDK writes (workflow input and result, activity input and result, local
activity markers, signals, updates, queries, failure details) passes `EncryptionCodec.encode`
on its way out: the whole `Payload` (metadata and data) is serialized and sealed, and only
`encoding: binary/encrypted` and the key id stay readable. Search attributes do not pass
through a codec (the SDK encodes them with the plain payload converter): they stay the index.

With encryption on, failures also carry their message and stack trace inside an encrypted
attribute (Temporal's `DefaultFailureConverterWithEncodedAttributes`): an agent's error message
can quote what it was sent.

Payloads without the encrypted encoding pass through `decode` unchanged, so requests recorded
before encryption was switched on stay readable.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from google.protobuf.message import DecodeError
from temporalio.api.common.v1 import Payload
from temporalio.contrib.pydantic import pydantic_data_converter
from temporalio.converter import (
    DataConverter,
    DefaultFailureConverterWithEncodedAttributes,
    PayloadCodec,
)

from reach.config import ReachSettings
from reach.security.crypto import CryptoError, PayloadCipher

ENCODING = b"binary/encrypted"
KEY_ID = "encryption-key-id"
# Bound into every tag: a blob sealed for another purpose with the same key does not open here.
AAD = b"reach/temporal-payload/v1"


class EncryptionCodec(PayloadCodec):
    """AES-256-GCM over whole payloads; the active key seals, every known key opens."""

    def __init__(self, cipher: PayloadCipher) -> None:
        self.cipher = cipher

    async def encode(self, payloads: Sequence[Payload]) -> list[Payload]:
        return [self.encrypt(p) for p in payloads]

    async def decode(self, payloads: Sequence[Payload]) -> list[Payload]:
        return [self.decrypt(p) for p in payloads]

    def encrypt(self, payload: Payload) -> Payload:
        key_id, blob = self.cipher.encrypt(payload.SerializeToString(), AAD)
        return Payload(metadata={"encoding": ENCODING, KEY_ID: key_id.encode()}, data=blob)

    def decrypt(self, payload: Payload) -> Payload:
        """The payload `encrypt` sealed; any other payload as it is. CryptoError when it
        cannot be opened (unknown key id, tampered blob)."""
        if payload.metadata.get("encoding") != ENCODING:
            return payload
        raw_id = payload.metadata.get(KEY_ID)
        if raw_id is None:
            raise CryptoError(f"encrypted payload without its {KEY_ID} metadata")
        key_id = raw_id.decode("utf-8", errors="replace")
        plain = Payload()
        try:
            plain.ParseFromString(self.cipher.decrypt(key_id, payload.data, AAD))
        except DecodeError as exc:  # authenticated, so only a bug on the sealing side
            raise CryptoError(f"decrypted payload under key {key_id!r} is not a Payload") from exc
        return plain


def data_converter(settings: ReachSettings) -> DataConverter:
    """The converter every client of this deployment uses: pydantic's, with the encryption
    codec (and encoded failure attributes) when `security.encryption.enabled`."""
    cipher = PayloadCipher.from_settings(settings.security.encryption)
    if cipher is None:
        return pydantic_data_converter
    return dataclasses.replace(
        pydantic_data_converter,
        payload_codec=EncryptionCodec(cipher),
        failure_converter_class=DefaultFailureConverterWithEncodedAttributes,
    )
