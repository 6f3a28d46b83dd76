"""Reading requests for operators: recent requests (Temporal visibility) and one request's
timeline (its workflow history), R16. `reach requests` and `reach trace` call these."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Query

from gateway_api import listing, timeline
from gateway_api.deps import GatewayDep, ReaderDep, RequestIdPath
from reach.errors import UnknownRequest
from reach.listing import (
    CALLER_FILTER,
    CAPABILITY_FILTER,
    DEFAULT_LIMIT,
    MAX_LIMIT,
    OPERATION_FILTER,
    SINCE_FILTER,
    ListStatus,
    RequestList,
    since_delta,
)
from reach.messages import ErrorResponse
from reach.timeline import Timeline

router = APIRouter(prefix="/reach", tags=["requests"])

_TEXT = {
    401: "Missing, invalid, expired or revoked token (when tokens are required)",
    403: "A token that may not read requests",
    404: "No such request, or not one this token's principal made (only its caller or an "
    "admin may read it)",
    422: "Invalid parameter: the message names it",
    503: "Temporal unavailable (Retry-After)",
}


def _codes(*codes: int) -> dict[int | str, Any]:
    return {c: {"model": ErrorResponse, "description": _TEXT[c]} for c in codes}


@router.get(
    "/requests",
    response_model=RequestList,
    responses=_codes(401, 403, 422, 503),
    summary="Recent requests, newest first, from Temporal's visibility (filters combine)",
    description="With tokens required, a principal that is not an admin sees only the requests "
    "it made. Visibility lags the requests themselves by a moment.",
)
async def list_requests(
    gateway: GatewayDep,
    reader: ReaderDep,
    capability: Annotated[
        str | None, Query(pattern=CAPABILITY_FILTER, description="Only this capability")
    ] = None,
    operation: Annotated[
        str | None, Query(pattern=OPERATION_FILTER, description="Only this operation")
    ] = None,
    caller: Annotated[
        str | None,
        Query(pattern=CALLER_FILTER, description="Only requests of this caller"),
    ] = None,
    status: Annotated[ListStatus | None, Query(description="Only requests in this state")] = None,
    since: Annotated[
        str | None,
        Query(
            pattern=SINCE_FILTER,
            description="Only requests started this long ago or later: 90s, 15m, 12h, 7d",
            examples=["15m"],
        ),
    ] = None,
    limit: Annotated[
        int, Query(ge=1, le=MAX_LIMIT, description="At most this many requests")
    ] = DEFAULT_LIMIT,
) -> RequestList:
    rows = await listing.list_requests(
        gateway.client,
        reader,
        capability=capability,
        operation=operation,
        caller=caller,
        status=status,
        since=since_delta(since) if since is not None else None,
        limit=limit,
        rpc_timeout=gateway.rpc_timeout,
    )
    return RequestList(requests=rows)


@router.get(
    "/requests/{request_id}/timeline",
    response_model=Timeline,
    responses=_codes(401, 403, 404, 422, 503),
    summary="A request's timeline from its workflow history: accepted, instance chosen, sent, "
    "each attempt, backoffs, late answer, result or timeout, callback delivery (R16)",
)
async def get_timeline(
    request_id: RequestIdPath, gateway: GatewayDep, reader: ReaderDep
) -> Timeline:
    try:
        return await timeline.read_timeline(
            gateway.client,
            request_id,
            reader,
            gateway.rpc_timeout,
            gateway.views.policy.state,
        )
    except UnknownRequest:
        # Refused at this gateway's door: it never started, and the 404 says so and why.
        refused = gateway.guard.refusals.get(request_id, reader) if gateway.guard else None
        if refused is None:
            raise
        raise UnknownRequest(refused.story(request_id)) from None
