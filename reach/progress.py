"""A call's progress as its agent reports it (an MCP server's `notifications/progress`), kept
beside the request for its timeline.

A call in flight writes nothing to its workflow's history (an activity's result is recorded
only when it ends), so progress cannot come from there. Instead the connector reports each
notification it reads (`report`, through the sink the activity set for the call), and the
activity keeps a bounded record of them in the policy state every gateway shares (Redis when
they share one): the last `MAX_NOTES` notes, the count of all, written at most every
`WRITE_EVERY_S` and once more when the call ends, kept `KEPT_S` past the request's deadline.
The timeline (`GET /reach/requests/{id}/timeline`, `reach trace`) reads it and shows each note
as a `progress` event. Workflows are not involved: nothing here touches their history.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from contextvars import ContextVar
from typing import Any

MAX_NOTES = 20
"""Notes kept per request (the last ones)."""
MAX_MESSAGE_CHARS = 200
WRITE_EVERY_S = 1.0
"""A call's record is written at most this often while it runs (and once at its end)."""
KEPT_S = 600.0
"""How long the record outlives the request's deadline."""

Sink = Callable[[dict[str, Any]], None]
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


def report(params: Any) -> None:
    """Hand a progress notification's params to the running call's sink, if any."""
    sink = SINK.get()
    if sink is not None:
        sink(params if isinstance(params, dict) else {})


class ProgressLog:
    """One call's notes: the last `MAX_NOTES`, and how many came in all."""

    def __init__(self, attempt: int, clock: Callable[[], float]) -> None:
        self.attempt = attempt
        self.clock = clock  # epoch seconds
        self.notes: list[dict[str, Any]] = []
        self.count = 0

    def add(self, params: Any) -> bool:
        note = note_of(params, self.clock() * 1000, self.attempt)
        if note is None:
            return False
        self.count += 1
        self.notes.append(note)
        del self.notes[:-MAX_NOTES]
        return True

    def encode(self) -> str:
        return json.dumps({"count": self.count, "notes": self.notes}, separators=(",", ":"))


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
