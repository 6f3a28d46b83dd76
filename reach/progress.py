"""A call's progress and log messages as its agent reports them (an MCP server's
`notifications/progress` and `notifications/message`), kept beside the request for its timeline.

A call in flight writes nothing to its workflow's history (an activity's result is recorded
only when it ends), so progress cannot come from there. Instead the connector reports each
notification it reads (`report`, through the sink the activity set for the call), and the
activity keeps a bounded record of them in the policy state every gateway shares (Redis when
they share one): the last `MAX_NOTES` notes, the count of all, written at most every
`WRITE_EVERY_S` and once more when the call ends, kept `KEPT_S` past the request's deadline.
The timeline (`GET /reach/requests/{id}/timeline`, `reach trace`) reads it and shows each note
as a `progress` event. Workflows are not involved: nothing here touches their history.

Log messages (`log_of`) go in the same record, bounded alike: the last `MAX_LOGS`, the count of
all, each numbered within its attempt (`seq`) so that a reader can tell which it has seen. A
message whose level is none of `LOG_LEVELS` is dropped; its `data` is redacted as the audit
redacts (values under the audit's secret keys are `***`), a text longer than `MAX_LOG_CHARS`
is cut, and a message still over `MAX_LOG_BYTES` keeps only its data's length and digest (data
over it as JSON is digested whole, unredacted and unwalked: a flood of large messages costs one
encoding each, not a walk of every item).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable
from contextvars import ContextVar
from typing import Any, Protocol

from reach.config import SECRET_KEY_NAMES
from reach.security.redact import digest, redact

MAX_NOTES = 20
"""Notes kept per request (the last ones)."""
MAX_MESSAGE_CHARS = 200
WRITE_EVERY_S = 1.0
"""A call's record is written at most this often while it runs (and once at its end)."""
KEPT_S = 600.0
"""How long the record outlives the request's deadline."""

MAX_LOGS = 50
"""Log messages kept per request (the last ones)."""
MAX_LOG_CHARS = 1000
MAX_LOG_BYTES = 4096
LOG_LEVELS = ("debug", "info", "notice", "warning", "error", "critical", "alert", "emergency")
"""MCP's (RFC 5424's) severities, lowest first."""


class Sink(Protocol):
    def note(self, params: dict[str, Any]) -> None: ...

    def log(self, params: dict[str, Any]) -> None: ...


# The sink of the call running in this context (set by the activity around the connector's
# invoke; None: nobody records progress).
SINK: ContextVar[Sink | None] = ContextVar("reach_progress_sink", default=None)


def progress_key(request_id: str) -> str:
    """The record's key in the policy state."""
    return f"progress:{request_id}"


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value) if value == value and abs(value) != float("inf") else None


def note_of(params: Any, at_ms: float, attempt: int) -> dict[str, Any] | None:
    """A progress notification's params as a note (None: it carries no progress number)."""
    if not isinstance(params, dict):
        return None
    progress = _number(params.get("progress"))
    if progress is None:
        return None
    note: dict[str, Any] = {"at_ms": round(at_ms), "attempt": attempt, "progress": progress}
    total = _number(params.get("total"))
    if total is not None:
        note["total"] = total
    message = params.get("message")
    if isinstance(message, str) and message:
        note["message"] = message[:MAX_MESSAGE_CHARS]
    return note


def log_of(
    params: Any, at_ms: float, attempt: int, seq: int, keys: Iterable[str] = SECRET_KEY_NAMES
) -> dict[str, Any] | None:
    """A log message's params as a note (None: no level MCP knows); see the module docstring."""
    if not isinstance(params, dict) or params.get("level") not in LOG_LEVELS:
        return None
    data = params.get("data")
    if isinstance(data, str):
        data = data[:MAX_LOG_CHARS]
    else:
        whole = _compact(data)
        if whole is not None and len(whole) > MAX_LOG_BYTES:
            # Its digest only, never walked: redacting 1 MB of small items was 100-200 ms of
            # the call's event loop a message, for a record that keeps none of them.
            data = digest(whole)
        else:
            data = redact(data, keys=keys, max_string=MAX_LOG_CHARS)
    note: dict[str, Any] = {
        "at_ms": round(at_ms),
        "attempt": attempt,
        "seq": seq,
        "level": params["level"],
        "data": data,
    }
    logger = params.get("logger")
    if isinstance(logger, str) and logger:
        note["logger"] = logger[:128]
    if len(json.dumps(note, separators=(",", ":"), default=str)) > MAX_LOG_BYTES:
        note["data"] = digest(json.dumps(data, separators=(",", ":"), default=str))
    return note


def _compact(value: Any) -> str | None:
    """`value` as compact JSON (None: too deep for the encoder; the redactor bounds it)."""
    try:
        return json.dumps(value, separators=(",", ":"), default=str)
    except (RecursionError, ValueError):
        return None


def level_at_least(level: Any, floor: str) -> bool:
    """Whether a note's `level` is `floor` or more severe."""
    return level in LOG_LEVELS and LOG_LEVELS.index(level) >= LOG_LEVELS.index(floor)


def report(params: Any) -> None:
    """Hand a progress notification's params to the running call's sink, if any."""
    sink = SINK.get()
    if sink is not None:
        sink.note(params if isinstance(params, dict) else {})


def report_log(params: Any) -> None:
    """Hand a log message's params to the running call's sink, if any."""
    sink = SINK.get()
    if sink is not None:
        sink.log(params if isinstance(params, dict) else {})


class ProgressLog:
    """One call's notes: the last `MAX_NOTES`, and how many came in all; its log messages
    alike (`MAX_LOGS`)."""

    def __init__(
        self, attempt: int, clock: Callable[[], float], keys: Iterable[str] = SECRET_KEY_NAMES
    ) -> None:
        self.attempt = attempt
        self.clock = clock  # epoch seconds
        self.keys = tuple(keys)
        self.notes: list[dict[str, Any]] = []
        self.count = 0
        self.logs: list[dict[str, Any]] = []
        self.log_count = 0

    @property
    def changes(self) -> int:
        """Every note and message added (a record written at this count holds them all)."""
        return self.count + self.log_count

    def add(self, params: Any) -> bool:
        note = note_of(params, self.clock() * 1000, self.attempt)
        if note is None:
            return False
        self.count += 1
        self.notes.append(note)
        del self.notes[:-MAX_NOTES]
        return True

    def add_log(self, params: Any) -> bool:
        note = log_of(params, self.clock() * 1000, self.attempt, self.log_count + 1, self.keys)
        if note is None:
            return False
        self.log_count += 1
        self.logs.append(note)
        del self.logs[:-MAX_LOGS]
        return True

    def encode(self) -> str:
        record: dict[str, Any] = {"count": self.count, "notes": self.notes}
        if self.log_count:
            record.update(log_count=self.log_count, logs=self.logs)
        return json.dumps(record, separators=(",", ":"), default=str)


def decode(raw: str | None) -> tuple[int, list[dict[str, Any]]]:
    """A stored record as (how many notes came, the notes kept); nothing or garbage: none."""
    if not raw:
        return 0, []
    try:
        value = json.loads(raw)
    except ValueError:
        return 0, []
    if not isinstance(value, dict) or not isinstance(value.get("notes"), list):
        return 0, []
    notes = [n for n in value["notes"] if isinstance(n, dict) and _number(n.get("at_ms"))]
    count = value.get("count")
    return (count if isinstance(count, int) else len(notes)), notes[-MAX_NOTES:]


def decode_logs(raw: str | None) -> tuple[int, list[dict[str, Any]]]:
    """A stored record's log messages as (how many came, those kept); none: (0, [])."""
    if not raw:
        return 0, []
    try:
        value = json.loads(raw)
    except ValueError:
        return 0, []
    if not isinstance(value, dict) or not isinstance(value.get("logs"), list):
        return 0, []
    logs = [
        n
        for n in value["logs"]
        if isinstance(n, dict)
        and _number(n.get("at_ms"))
        and n.get("level") in LOG_LEVELS
        and isinstance(n.get("seq"), int)
    ]
    count = value.get("log_count")
    return (count if isinstance(count, int) else len(logs)), logs[-MAX_LOGS:]
