"""Step 2, accept: the body becomes the standard request, or a 413/422 naming the problem.

The rules of what is accepted are `reach.acceptance`'s (sizes, nesting, standard JSON); this
step adds what the identity brings: one idempotency key, and a RequestID for every request.
"""

from __future__ import annotations

from gateway_api.steps.identify import Identity
from reach import acceptance
from reach.limits import Limits
from reach.messages import InvokeRequest, new_request_id


def accept(raw: bytes, limits: Limits, identity: Identity) -> tuple[InvokeRequest, int]:
    """The request (its `request_id` always set) and its payload's size as sent, in bytes."""
    request, payload_json = acceptance.invoke_request(raw, limits)
    request.idempotency_key = acceptance.one_idempotency_key(
        request.idempotency_key, identity.idempotency_key
    )
    request.request_id = request.request_id or new_request_id()
    return request, len(payload_json)
