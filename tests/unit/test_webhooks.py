"""Signed callbacks: what Reach signs verifies with the Standard Webhooks reference library."""

from __future__ import annotations

import base64
import hashlib
import hmac
import time

import pytest
from standardwebhooks.webhooks import Webhook, WebhookVerificationError

from reach.security.webhooks import (
    caller_secret,
    message_id,
    secret_key,
    sign,
    webhook_headers,
)

MASTER = "master-key-for-tests"
BODY = b'{"request_id":"req-1","status":"success","result":{"answer":42}}'


def test_caller_secret_is_derived_per_caller() -> None:
    secret = caller_secret(MASTER, "orchestrator")
    assert secret.startswith("whsec_")
    assert len(secret_key(secret)) == 32
    expected = hmac.new(MASTER.encode(), b"reach-webhook:orchestrator", hashlib.sha256).digest()
    assert secret == "whsec_" + base64.b64encode(expected).decode()
    assert caller_secret(MASTER, "orchestrator") == secret  # stable
    assert caller_secret(MASTER, "someone-else") != secret
    assert caller_secret("another-master", "orchestrator") != secret
    with pytest.raises(ValueError, match="empty"):
        caller_secret("", "orchestrator")


def test_signature_verifies_with_standardwebhooks() -> None:
    secret = caller_secret(MASTER, "orchestrator")
    headers = webhook_headers(secret, message_id("req-1"), BODY, time.time())
    assert set(headers) == {"webhook-id", "webhook-timestamp", "webhook-signature"}
    assert headers["webhook-id"] == "msg_req-1"
    assert headers["webhook-signature"].startswith("v1,")
    assert Webhook(secret).verify(BODY, headers) == {
        "request_id": "req-1",
        "status": "success",
        "result": {"answer": 42},
    }


def test_sign_matches_the_spec_by_hand() -> None:
    secret = caller_secret(MASTER, "c")
    key = base64.b64decode(secret.removeprefix("whsec_"))
    digest = hmac.new(key, b"msg_x.1700000000." + BODY, hashlib.sha256).digest()
    assert sign(secret, "msg_x", 1700000000, BODY) == "v1," + base64.b64encode(digest).decode()
    # The reference library's own signer agrees.
    from datetime import UTC, datetime

    when = datetime.fromtimestamp(1700000000, tz=UTC)
    assert Webhook(secret).sign("msg_x", when, BODY.decode()) == sign(
        secret, "msg_x", 1700000000, BODY
    )


@pytest.mark.parametrize("what", ["body", "id", "timestamp", "secret", "signature"])
def test_tampering_fails_verification(what: str) -> None:
    secret = caller_secret(MASTER, "orchestrator")
    now = time.time()
    headers = webhook_headers(secret, "msg_req-1", BODY, now)
    body = BODY
    verifier = Webhook(secret)
    if what == "body":
        body = BODY.replace(b"42", b"43")
    elif what == "id":
        headers["webhook-id"] = "msg_req-2"
    elif what == "timestamp":
        headers["webhook-timestamp"] = str(int(now) - 1)
    elif what == "secret":
        verifier = Webhook(caller_secret(MASTER, "someone-else"))
    else:
        headers["webhook-signature"] = "v1," + base64.b64encode(b"\0" * 32).decode()
    with pytest.raises(WebhookVerificationError):
        verifier.verify(body, headers)


def test_a_stale_timestamp_is_refused_by_receivers() -> None:
    secret = caller_secret(MASTER, "orchestrator")
    headers = webhook_headers(secret, "msg_req-1", BODY, time.time() - 3600)
    with pytest.raises(WebhookVerificationError, match="too old"):
        Webhook(secret).verify(BODY, headers)


def test_timestamp_is_whole_seconds() -> None:
    headers = webhook_headers(caller_secret(MASTER, "c"), "msg_1", BODY, 1700000000.987)
    assert headers["webhook-timestamp"] == "1700000000"


def test_secret_key_refuses_what_is_not_base64() -> None:
    with pytest.raises(ValueError, match="base64"):
        secret_key("whsec_not base64!")
    assert secret_key("whsec_" + base64.b64encode(b"k" * 24).decode()) == b"k" * 24
