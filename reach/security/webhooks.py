"""Signed callbacks, as the Standard Webhooks specification has them (standardwebhooks.com).

Every callback POST carries three headers when `security.webhook_key` is set:

    webhook-id          msg_<request_id>: the same on every delivery attempt of one callback,
                        so a receiver can drop a repeat it already handled
    webhook-timestamp   the attempt's time, Unix seconds (receivers refuse stale ones)
    webhook-signature   v1,<base64 HMAC-SHA256 of "<id>.<timestamp>.<body>">

The HMAC key is the caller's own secret, `whsec_<base64 of 32 bytes>`, derived from the master
key and the caller's name (`caller_secret`): each caller verifies with its secret and cannot sign
for another. The operator hands a caller its secret (`reach tokens webhook-secret CALLER`); any
Standard Webhooks library verifies the signature with it.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import math

SECRET_PREFIX = "whsec_"
DERIVATION_LABEL = "reach-webhook:"

HEADER_ID = "webhook-id"
HEADER_TIMESTAMP = "webhook-timestamp"
HEADER_SIGNATURE = "webhook-signature"


def caller_secret(master: str, caller: str) -> str:
    """The caller's signing secret: whsec_ + base64(HMAC-SHA256(master, "reach-webhook:" +
    caller)), 32 bytes of key. The same master and caller always give the same secret."""
    if not master:
        raise ValueError("the webhook master key is empty")
    digest = hmac.new(
        master.encode(), (DERIVATION_LABEL + caller).encode(), hashlib.sha256
    ).digest()
    return SECRET_PREFIX + base64.b64encode(digest).decode("ascii")


def secret_key(secret: str) -> bytes:
    """The HMAC key a `whsec_…` secret stands for (the prefix is optional)."""
    text = secret.removeprefix(SECRET_PREFIX)
    try:
        key = base64.b64decode(text + "=" * (-len(text) % 4), validate=True)
    except ValueError as exc:  # binascii.Error is a ValueError
        raise ValueError("a webhook secret is whsec_ followed by base64") from exc
    if not key:
        raise ValueError("the webhook secret is empty")
    return key


def sign(secret: str, msg_id: str, timestamp: int, body: bytes) -> str:
    """The `webhook-signature` value: v1,<base64 HMAC-SHA256 over "<msg_id>.<timestamp>." +
    body>, keyed with the secret's decoded bytes."""
    signed = f"{msg_id}.{timestamp}.".encode() + body
    digest = hmac.new(secret_key(secret), signed, hashlib.sha256).digest()
    return "v1," + base64.b64encode(digest).decode("ascii")


def webhook_headers(secret: str, msg_id: str, body: bytes, now: float) -> dict[str, str]:
    """The three headers of one delivery attempt at time `now` (Unix seconds)."""
    timestamp = math.floor(now)
    return {
        HEADER_ID: msg_id,
        HEADER_TIMESTAMP: str(timestamp),
        HEADER_SIGNATURE: sign(secret, msg_id, timestamp, body),
    }


def message_id(request_id: str) -> str:
    """The `webhook-id` of a request's callback: stable across its delivery attempts."""
    return f"msg_{request_id}"
