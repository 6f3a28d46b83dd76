"""Recent requests through Temporal's visibility: the filters a caller may give, the query they
become, and one request's row (`GET /reach/requests`, `reach requests`).

Nothing a caller typed reaches the query unchecked: every value matches a pattern without
quotes or backslashes first (a 422 names the parameter otherwise), and is quoted and escaped
again when it is written into the query.
"""

from __future__ import annotations

import re
from datetime import datetime, timedelta
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

ListStatus = Literal["running", "success", "error", "timeout"]
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


class RequestRow(BaseModel):
    """One request in a list: what visibility knows without reading its history."""

    request_id: str
    capability: str | None
    operation: str | None
    caller: str | None
    status: str = Field(description="running, success, error or timeout")
    instance: str | None = Field(description="The instance that answered (or was last tried).")
    started_at: datetime
    closed_at: datetime | None
    duration_ms: int | None = Field(description="From start to close; null while running.")


class RequestList(BaseModel):
    requests: list[RequestRow] = Field(description="Newest first.")
