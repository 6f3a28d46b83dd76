"""Recent requests from Temporal's visibility store (`GET /reach/requests`).

Visibility is eventually consistent: a request shows up (and its status changes) a moment after
the workflow does. SQL visibility (the dev server, PostgreSQL) cannot ORDER BY: it lists running
workflows first, then the most recently closed; the rows are then sorted newest first.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

from temporalio.client import Client, WorkflowExecution

from reach.invocation import WORKFLOW_INVOKE
from reach.listing import (
    MEMO_CONTEXT,
    PAGE_PARTS,
    ListStatus,
    PageToken,
    RequestRow,
    page_token_of,
    page_token_text,
    status_of,
    visibility_query,
)
from reach.security.tokens import Principal
from workflows.invoke import SA_CALLER, SA_CAPABILITY, SA_INSTANCE, SA_OPERATION, SA_STATUS


async def list_requests(
    client: Client,
    principal: Principal | None,
    *,
    capability: str | None = None,
    operation: str | None = None,
    caller: str | None = None,
    status: ListStatus | None = None,
    since: timedelta | None = None,
    limit: int = 50,
    rpc_timeout: timedelta | None = None,
) -> list[RequestRow]:
    """At most `limit` requests, newest first. With tokens required, a reader that is not an
    admin sees only the requests it made."""
    owner = principal.name if principal is not None and principal.kind != "admin" else None
    started_after = datetime.now(UTC) - since if since is not None else None
    query = visibility_query(
        WORKFLOW_INVOKE,
        capability=capability,
        operation=operation,
        caller=caller,
        status=status,
        started_after=started_after,
        owner=owner,
    )
    # Running and closed requests apart: SQL visibility lists running ones first, so `limit`
    # old running requests would otherwise hide every newer one. One row per request (a reset
    # workflow has several runs).
    where = f"({query}) AND " if query else ""
    rows: dict[str, RequestRow] = {}
    for part in ("ExecutionStatus = 'Running'", "ExecutionStatus != 'Running'"):
        async for execution in client.list_workflows(
            where + part, limit=limit, page_size=min(limit, 1000), rpc_timeout=rpc_timeout
        ):
            row = await with_context(execution)
            held = rows.get(row.request_id)
            if held is None or row.started_at > held.started_at:
                rows[row.request_id] = row
    return sorted(rows.values(), key=lambda r: r.started_at, reverse=True)[:limit]


@dataclass(frozen=True)
class Page:
    rows: list[RequestRow]
    next_token: str  # "" on the last page
    total: int  # how many requests the whole list holds (visibility's count)


async def list_page(
    client: Client,
    principal: Principal | None,
    *,
    page_size: int,
    page_token: str = "",
    capability: str | None = None,
    caller: str | None = None,
    status: ListStatus | None = None,
    since: timedelta | None = None,
    rpc_timeout: timedelta | None = None,
) -> Page:
    """One page of at most `page_size` requests (running ones first, then the most recently
    closed) and the token of the next, from visibility's own paging (Temporal's next-page
    token): a caller pages through all its requests, not only the newest `MAX_LIMIT`.
    ValueError when `page_token` is not one this same list handed out."""
    owner = principal.name if principal is not None and principal.kind != "admin" else None
    # The filters' query without `since` pins the token (`since` is relative to now: the first
    # page's instant travels in the token, so every page lists from the same one).
    base = visibility_query(
        WORKFLOW_INVOKE, capability=capability, caller=caller, status=status, owner=owner
    )
    if page_token:
        at = page_token_of(page_token, base)
    else:
        after = datetime.now(UTC) - since if since is not None else None
        at = PageToken(0, None, after)
    query = base
    if at.started_after is not None:
        query = visibility_query(
            WORKFLOW_INVOKE,
            capability=capability,
            caller=caller,
            status=status,
            owner=owner,
            started_after=at.started_after,
        )
    rows: list[RequestRow] = []
    part, temporal = at.part, at.temporal
    while True:
        listed = client.list_workflows(
            f"({query}) AND {PAGE_PARTS[part]}",
            page_size=page_size - len(rows),
            next_page_token=temporal,
            rpc_timeout=rpc_timeout,
        )
        await listed.fetch_next_page()
        rows.extend([await with_context(e) for e in listed.current_page or ()])
        temporal = listed.next_page_token
        if temporal is None:  # this part is read to its end
            if part + 1 == len(PAGE_PARTS):
                break
            part += 1
        if len(rows) >= page_size:
            break
    ended = temporal is None and part + 1 == len(PAGE_PARTS)
    following = PageToken(part, temporal, at.started_after)
    next_token = "" if ended else page_token_text(following, base)
    counted = await client.count_workflows(query, rpc_timeout=rpc_timeout)
    return Page(rows, next_token, counted.count)


async def with_context(execution: WorkflowExecution) -> RequestRow:
    """`row_of`, with the conversation a request continues from its memo (decoded only for
    such requests: a memo passes the payload codec)."""
    row = row_of(execution)
    if MEMO_CONTEXT in execution.raw_info.memo.fields:
        value = await execution.memo_value(MEMO_CONTEXT, None)
        row.context_id = value if isinstance(value, str) else None
    return row


def row_of(execution: WorkflowExecution) -> RequestRow:
    attrs = execution.typed_search_attributes
    started = execution.start_time
    closed = execution.close_time
    execution_status = execution.status.name if execution.status is not None else "RUNNING"
    return RequestRow(
        request_id=execution.id,
        capability=attrs.get(SA_CAPABILITY),
        operation=attrs.get(SA_OPERATION),
        caller=attrs.get(SA_CALLER),
        status=status_of(execution_status, attrs.get(SA_STATUS)),
        instance=attrs.get(SA_INSTANCE),
        started_at=started,
        closed_at=closed,
        duration_ms=round((closed - started).total_seconds() * 1000) if closed else None,
    )
