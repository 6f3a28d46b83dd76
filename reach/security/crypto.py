"""AES-256-GCM for payloads at rest (R26): the cipher behind the Temporal payload codec.

Every blob is `nonce (12 random bytes) || ciphertext || tag (16 bytes)`, and travels with the
id of the key that sealed it. One key (`active`) seals; every key still listed opens, so a key
is rotated by adding a new id, making it active, and keeping the old ids for as long as
requests sealed with them are kept.
"""

from __future__ import annotations

import base64
import os
from collections.abc import Mapping
from typing import TYPE_CHECKING

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

# A key as `security.encryption.keys` writes it, parsed where the settings check it too (and
# still importable from here).
from reach.config.parsing import KEY_BYTES as KEY_BYTES
from reach.config.parsing import decode_key as decode_key

if TYPE_CHECKING:
    from reach.config import EncryptionSettings

NONCE_BYTES = 12
TAG_BYTES = 16


class CryptoError(Exception):
    """A blob cannot be opened: its key id is unknown, or it is not what that key sealed."""


def new_key() -> str:
    """A fresh key for `security.encryption.keys`: base64 of 32 random bytes."""
    return base64.b64encode(os.urandom(KEY_BYTES)).decode("ascii")


class PayloadCipher:
    """Seal with the active key, open with any known key."""

    def __init__(self, keys: Mapping[str, bytes], active: str) -> None:
        if active not in keys:
            raise ValueError(f"active key {active!r} is not among the keys {sorted(keys)}")
        for key_id, key in keys.items():
            if not key_id:
                raise ValueError("a key id cannot be empty")
            if len(key) != KEY_BYTES:
                raise ValueError(f"key {key_id!r} must be {KEY_BYTES} bytes, not {len(key)}")
        # One AESGCM per key, built once: constructing it costs as much as sealing a payload.
        self._aead = {key_id: AESGCM(bytes(key)) for key_id, key in keys.items()}
        self.active = active

    @property
    def key_ids(self) -> frozenset[str]:
        return frozenset(self._aead)

    def encrypt(self, plaintext: bytes, aad: bytes = b"") -> tuple[str, bytes]:
        """`(key id, nonce || ciphertext || tag)` under the active key."""
        nonce = os.urandom(NONCE_BYTES)
        return self.active, nonce + self._aead[self.active].encrypt(nonce, plaintext, aad)

    def decrypt(self, key_id: str, blob: bytes, aad: bytes = b"") -> bytes:
        """The plaintext of `blob`; CryptoError if `key_id` is unknown or the blob (or its
        `aad`) is not what that key sealed."""
        aead = self._aead.get(key_id)
        if aead is None:
            raise CryptoError(
                f"unknown encryption key id {key_id!r} (known: {', '.join(sorted(self._aead))}); "
                "keep old ids in security.encryption.keys to read what they sealed"
            )
        if len(blob) < NONCE_BYTES + TAG_BYTES:
            raise CryptoError(f"encrypted blob of {len(blob)} bytes is too short to be one")
        try:
            return aead.decrypt(blob[:NONCE_BYTES], blob[NONCE_BYTES:], aad)
        except InvalidTag:
            raise CryptoError(
                f"encrypted blob failed authentication under key {key_id!r}: "
                "tampered with, truncated, or sealed by another key of that id"
            ) from None

    @classmethod
    def from_settings(cls, settings: EncryptionSettings) -> PayloadCipher | None:
        """The cipher `security.encryption` describes, or None when encryption is off."""
        if not settings.enabled or settings.active_key is None:
            return None
        keys = {kid: decode_key(secret.get_secret_value()) for kid, secret in settings.keys.items()}
        return cls(keys, settings.active_key)
