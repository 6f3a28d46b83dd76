"""The per-task token of an A2A agent's push notifications to Reach.

When an A2A agent's card says it sends push notifications, the connector sends the message
with a push-notification config pointing at the gateway, `POST /reach/a2a/push/{request_id}`,
and this token, which the agent sends back on every notification
(`X-A2A-Notification-Token`). The token is an HMAC of the request id under the master
`security.webhook_key`: any gateway of the deployment checks it without storing anything, one
request's token is worth nothing for another, and it is compared in constant time. Without a
webhook key no push config is sent (the task is followed by polling alone).
"""

from __future__ import annotations

import base64
import hashlib
import hmac

PUSH_PATH = "/reach/a2a/push"
TOKEN_HEADER = "X-A2A-Notification-Token"
_LABEL = "reach-a2a-push:"


def push_token(master: str, request_id: str) -> str:
    """base64url(HMAC-SHA256(master, "reach-a2a-push:" + request_id)), unpadded."""
    if not master:
        raise ValueError("the webhook master key is empty")
    digest = hmac.new(master.encode(), (_LABEL + request_id).encode(), hashlib.sha256).digest()
    return base64.urlsafe_b64encode(digest).decode("ascii").rstrip("=")


def push_token_ok(master: str, request_id: str, token: str) -> bool:
    """Whether `token` is the request's push token (in constant time)."""
    return hmac.compare_digest(push_token(master, request_id).encode(), token.encode())


def push_url(gateway_url: str, request_id: str) -> str:
    return f"{gateway_url.rstrip('/')}{PUSH_PATH}/{request_id}"


SIGNAL_A2A_PUSH = "a2a_push"
"""The Invoke workflow's signal a push notification becomes: "look at the task now"."""
