"""Recent requests through Temporal's visibility: the filters a caller may give, the query they
become, and one request's row (`GET /reach/requests`, `reach requests`).

Nothing a caller typed reaches the query unchecked: every value matches a pattern without
quotes or backslashes first (a 422 names the parameter otherwise), and is quoted and escaped
again when it is written into the query.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import json
import re
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Literal

from pydantic import BaseModel, Field

CAPABILITY_FILTER = r"^[a-z0-9][a-z0-9._-]{0,63}$"
OPERATION_FILTER = r"^[A-Za-z0-9_][A-Za-z0-9_.-]{0,63}$"
# A caller's name is visible ASCII (a header); here without ', ", \ and ` (a query's quotes).
CALLER_FILTER = r"^[!#-&(-\[\]-_a-~]{1,128}$"
# 90 (seconds), 90s, 15m, 12h, 7d.
SINCE_FILTER = r"^[0-9]{1,9}(\.[0-9]{1,3})?[smhd]?$"
MAX_SINCE = timedelta(days=3650)
DEFAULT_LIMIT = 50
MAX_LIMIT = 500

ListStatus = Literal["running", "success", "error", "timeout", "input_required", "canceled"]
LIST_STATUSES: tuple[ListStatus, ...] = (
    "running",
    "success",
    "error",
    "timeout",
    "input_required",
    "canceled",
)
# What a completed request's ReachStatus can say (input_required, canceled: an A2A agent's task).
FINAL_STATUSES = frozenset({"success", "error", "timeout", "input_required", "canceled"})
# A request's statuses before it ends (what a cancel can still stop, a task still working).
UNDER_WAY = frozenset({"accepted", "running"})
_UNIT_S = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86_400}
_SINCE = re.compile(SINCE_FILTER)


def since_delta(text: str) -> timedelta:
    """`90`, `90s`, `15m`, `12h`, `7d` as a timedelta (at most ten years); ValueError else."""
    found = _SINCE.match(text.strip())
    if not found:
        raise ValueError(f"{text!r}: a duration like 90s, 15m, 12h or 7d")
    text = text.strip()
    unit = text[-1] if text[-1] in "smhd" else ""
    seconds = float(text.removesuffix(unit)) * _UNIT_S[unit]
    return timedelta(seconds=min(seconds, MAX_SINCE.total_seconds()))


def quoted(value: str) -> str:
    """A string literal of the visibility query language."""
    return "'" + value.replace("\\", "\\\\").replace("'", "\\'") + "'"


def _checked(name: str, value: str, pattern: str) -> str:
    if not re.fullmatch(pattern, value):
        raise ValueError(f"{name}: {value!r} does not match {pattern}")
    return quoted(value)


def visibility_query(
    workflow_type: str,
    *,
    capability: str | None = None,
    operation: str | None = None,
    caller: str | None = None,
    status: ListStatus | None = None,
    started_after: datetime | None = None,
    owner: str | None = None,
) -> str:
    """The list query for these filters. `owner`: a non-admin reader's own name (with tokens
    required, only its own requests are listed, whatever `caller` says)."""
    terms = [f"WorkflowType = {quoted(workflow_type)}"]
    if capability is not None:
        terms.append(f"ReachCapability = {_checked('capability', capability, CAPABILITY_FILTER)}")
    if operation is not None:
        terms.append(f"ReachOperation = {_checked('operation', operation, OPERATION_FILTER)}")
    if caller is not None:
        terms.append(f"ReachCaller = {_checked('caller', caller, CALLER_FILTER)}")
    if owner is not None:
        terms.append(f"ReachCaller = {quoted(owner)}")
    if status == "running":
        terms.append("ExecutionStatus = 'Running'")
    elif status == "success":
        terms.append("ExecutionStatus = 'Completed' AND ReachStatus = 'success'")
    elif status == "error":
        # An error fails its workflow (reach.outcome; before that rule it completed); one that
        # ended without its own verdict (terminated, a bug) reads as an error too.
        terms.append(
            "((ExecutionStatus = 'Completed' AND ReachStatus = 'error') OR "
            "(ExecutionStatus = 'Failed' AND ReachStatus != 'timeout') OR "
            "ExecutionStatus IN ('Terminated', 'Canceled'))"
        )
    elif status in ("input_required", "canceled"):
        # An A2A agent's task that asked for input (or auth) or canceled itself, or a request
        # cancelled by its caller: each completes its workflow with that ReachStatus.
        terms.append(f"ExecutionStatus = 'Completed' AND ReachStatus = {quoted(status)}")
    elif status == "timeout":
        terms.append(
            "((ExecutionStatus IN ('Completed', 'Failed') AND ReachStatus = 'timeout') OR "
            "ExecutionStatus = 'TimedOut')"
        )
    if started_after is not None:
        stamp = started_after.strftime("%Y-%m-%dT%H:%M:%S.%fZ")
        terms.append(f"StartTime >= {quoted(stamp)}")
    return " AND ".join(terms)


def status_of(execution: str, reach_status: str | None) -> str:
    """A request's status from its workflow's execution status (`RUNNING`, `COMPLETED`, ...)
    and the ReachStatus search attribute (set at the start, updated when the result differs)."""
    if execution in ("RUNNING", "CONTINUED_AS_NEW"):
        return "running"
    if execution == "COMPLETED":
        return reach_status if reach_status in FINAL_STATUSES else "error"
    if execution == "FAILED":  # an error or a timeout (reach.outcome), or a bug: an error
        return "timeout" if reach_status == "timeout" else "error"
    if execution == "TIMED_OUT":
        return "timeout"
    return "error"


# The memo key of a request that continues a conversation: its first RequestID.
MEMO_CONTEXT = "reach_context"


class RequestRow(BaseModel):
    """One request in a list: what visibility knows without reading its history."""

    request_id: str
    capability: str | None
    operation: str | None
    caller: str | None
    status: str = Field(description="running, success, error, timeout, input_required or canceled")
    instance: str | None = Field(description="The instance that answered (or was last tried).")
    started_at: datetime
    closed_at: datetime | None
    duration_ms: int | None = Field(description="From start to close; null while running.")
    context_id: str | None = Field(
        default=None,
        description="The conversation it continues (its first RequestID); null: none, or it "
        "is a conversation's first.",
    )


class RequestList(BaseModel):
    requests: list[RequestRow] = Field(description="Newest first.")


# -- pages ------------------------------------------------------------------------------------
# A list is read in two parts, running requests then closed ones (SQL visibility lists running
# ones first whatever the query says). A page token says which part the next page starts in,
# Temporal's own token within it, and a digest of the query it pages, so a token handed back
# with other filters (or by another reader: the owner is in the query) is refused, not
# silently applied to another list.
PAGE_PARTS = ("ExecutionStatus = 'Running'", "ExecutionStatus != 'Running'")
PAGE_TOKEN_MAX = 4096


@dataclass(frozen=True)
class PageToken:
    part: int  # index into PAGE_PARTS
    temporal: bytes | None  # Temporal's next_page_token within that part (None: its start)
    started_after: datetime | None = None  # the first page's `since`, as an instant


def query_digest(query: str) -> str:
    return hashlib.sha256(query.encode()).hexdigest()[:16]


def page_token_text(token: PageToken, query: str) -> str:
    body = {
        "p": token.part,
        "t": base64.urlsafe_b64encode(token.temporal).decode() if token.temporal else "",
        "q": query_digest(query),
        "s": token.started_after.timestamp() if token.started_after else None,
    }
    return base64.urlsafe_b64encode(json.dumps(body, separators=(",", ":")).encode()).decode()


def page_token_of(text: str, query: str) -> PageToken:
    """The page token a previous page handed out for this same query; ValueError naming what is
    wrong else."""
    if len(text) > PAGE_TOKEN_MAX:
        raise ValueError(f"pageToken: {len(text)} characters, at most {PAGE_TOKEN_MAX}")
    try:
        body = json.loads(base64.urlsafe_b64decode(text.encode()))
        part, temporal, digest, since = body["p"], body["t"], body["q"], body["s"]
        if not isinstance(part, int) or part not in range(len(PAGE_PARTS)):
            raise ValueError(part)
        if not isinstance(temporal, str) or not isinstance(digest, str):
            raise ValueError(temporal)
        raw = base64.urlsafe_b64decode(temporal.encode()) if temporal else None
        if since is not None and (isinstance(since, bool) or not isinstance(since, int | float)):
            raise ValueError(since)
        after = datetime.fromtimestamp(since, UTC) if since is not None else None
    except (ValueError, TypeError, KeyError, OverflowError, OSError, binascii.Error) as err:
        raise ValueError("pageToken: not a token a page of this list handed out") from err
    if not hmac.compare_digest(digest, query_digest(query)):
        raise ValueError(
            "pageToken: handed out by a list with other filters (or another reader's); "
            "page with the same filters"
        )
    return PageToken(part, raw, after)
