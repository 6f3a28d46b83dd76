"""The conversation a request continues (`context_id`) is its caller's own, with the same
target: a request naming another caller's, an unknown one or another target's is refused
before anything starts. A request naming its own RequestID starts a conversation (nothing to
check); one naming any request of a conversation joins that conversation's first (the id every
request of it carries, and its agent is sent).

Costs one history read (the named request's input, one event) per request that continues a
conversation; nothing for any other.
"""

from __future__ import annotations

from temporalio.service import RPCError, RPCStatusCode

from gateway_api.engine import Engine
from reach.errors import InvalidRequest, UnknownRequest
from reach.messages import InvokeRequest


async def continued(engine: Engine, request: InvokeRequest, caller: str) -> None:
    """Check `request.context_id` and set it to its conversation's first RequestID; raises
    `UnknownRequest` (404: no such request, or another caller's, alike) or `InvalidRequest`
    (another target's)."""
    named = request.context_id
    if named is None or named == request.request_id:
        return
    try:
        original = await engine.original(engine.handle(named))
    except RPCError as exc:
        if exc.status != RPCStatusCode.NOT_FOUND:
            raise
        original = None
    if original is None or original.caller != caller:
        raise UnknownRequest(
            f"context_id {named!r}: no request of yours with that id (a conversation goes on "
            "only with its own caller)"
        )
    if original.target != request.target:
        raise InvalidRequest(
            f"context_id {named!r}: a conversation with {original.target!r}, not {request.target!r}"
        )
    request.context_id = original.context_id or named
