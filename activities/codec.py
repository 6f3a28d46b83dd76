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
from typing import Any

from google.protobuf.message import DecodeError
from pydantic import TypeAdapter
from temporalio import workflow
from temporalio.api.common.v1 import Payload
from temporalio.contrib.pydantic import PydanticJSONPlainPayloadConverter, PydanticPayloadConverter
from temporalio.converter import (
    CompositePayloadConverter,
    DataConverter,
    DefaultFailureConverterWithEncodedAttributes,
    EncodingPayloadConverter,
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


class _SharedJSONConverter(PydanticJSONPlainPayloadConverter):
    """Pydantic's JSON converter, whose type-adapter cache serves the whole process — except
    inside the workflow sandbox, which imports every module a workflow does not pass through
    afresh for each run: such a module's classes would each take an entry and keep their copy
    of the module alive. (Reach's own models are passed through; a sandboxed decode builds its
    adapter each time, as pydantic's per-instance cache did.)"""

    def from_payload(self, payload: Payload, type_hint: type | None = None) -> Any:
        if type_hint is not None and workflow.unsafe.in_sandbox():
            return TypeAdapter(type_hint).validate_json(payload.data)
        return super().from_payload(payload, type_hint)


class SharedPydanticPayloadConverter(PydanticPayloadConverter):
    """Pydantic's payload converter, built once per process and shared.

    The SDK builds a new payload converter for every workflow it runs (`DataConverter`'s
    `__post_init__` calls the class), and pydantic's builds a new type-adapter cache each time,
    so every workflow built its `TypeAdapter`s again (py-spy, 16 in flight: ~0.1 ms of a
    gateway's ~7 ms of CPU per invoke). Every instance of this one holds the same encoding
    converters, and so one bounded cache of type adapters. The bytes written are pydantic's.
    """

    _shared: tuple[EncodingPayloadConverter, ...] | None = None

    def __init__(self) -> None:
        cls = SharedPydanticPayloadConverter
        if cls._shared is None:
            json_converter = _SharedJSONConverter()
            cls._shared = tuple(
                json_converter if c.encoding == json_converter.encoding else c
                for c in PydanticPayloadConverter().converters.values()
            )
        CompositePayloadConverter.__init__(self, *cls._shared)


PAYLOAD_CONVERTER = DataConverter(payload_converter_class=SharedPydanticPayloadConverter)


def data_converter(settings: ReachSettings) -> DataConverter:
    """The converter every client of this deployment uses: pydantic's (shared, above), with
    the encryption codec (and encoded failure attributes) when `security.encryption.enabled`."""
    cipher = PayloadCipher.from_settings(settings.security.encryption)
    if cipher is None:
        return PAYLOAD_CONVERTER
    return dataclasses.replace(
        PAYLOAD_CONVERTER,
        payload_codec=EncryptionCodec(cipher),
        failure_converter_class=DefaultFailureConverterWithEncodedAttributes,
    )
