"""Progress and log events: the notes and log messages an agent reported while a call ran
(`reach.progress`), merged into a timeline by their time."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from reach.timeline._model import Timeline, TimelineEvent


def _summary(note: dict[str, Any]) -> str:
    done = f"{note['progress']:g}"
    if note.get("total") is not None:
        done += f" of {note['total']:g}"
    said = f": {note['message']}" if note.get("message") else ""
    return f"attempt {note.get('attempt', 1)} progress {done}{said}"


def _log_summary(note: dict[str, Any]) -> str:
    data = note.get("data")
    said = data if isinstance(data, str) else json.dumps(data, separators=(",", ":"))
    logger = f" {note['logger']}" if note.get("logger") else ""
    return f"attempt {note.get('attempt', 1)} log {note['level']}{logger}: {said[:200]}"


def with_logs(timeline: Timeline, count: int, logs: list[dict[str, Any]]) -> Timeline:
    """`timeline` with a `log` event for each log message kept, placed by its time."""
    keys = ("attempt", "level", "logger", "data")
    return _merged(timeline, count, logs, "log", _log_summary, keys)


def with_progress(timeline: Timeline, count: int, notes: list[dict[str, Any]]) -> Timeline:
    """`timeline` with a `progress` event for each note, placed by its time (after the events
    that came before it); `count` is how many came in all (the first of those kept says how
    many earlier ones were not)."""
    keys = ("attempt", "progress", "total", "message")
    return _merged(timeline, count, notes, "progress", _summary, keys)


def _merged(
    timeline: Timeline,
    count: int,
    notes: list[dict[str, Any]],
    kind: str,
    summary: Callable[[dict[str, Any]], str],
    keys: tuple[str, ...],
) -> Timeline:
    if not notes or timeline.accepted_at is None:
        return timeline
    base_ms = timeline.accepted_at.timestamp() * 1000
    events = list(timeline.events)
    dropped = max(0, count - len(notes))
    for i, note in enumerate(sorted(notes, key=lambda n: float(n["at_ms"]))):
        at = max(0, round(float(note["at_ms"]) - base_ms))
        detail: dict[str, Any] = {k: note[k] for k in keys if k in note}
        if i == 0 and dropped:
            detail["earlier_not_kept"] = dropped
        # Not before its attempt's `sent`: an inline call's is written when the call ends (the
        # local activity's marker), after the notes the agent sent while it ran.
        floor = _after_sent(events, note.get("attempt", 1))
        if floor:
            at = max(at, events[floor - 1].at_ms)
        said = summary(note) + (f" ({dropped} earlier not kept)" if i == 0 and dropped else "")
        event = TimelineEvent(at_ms=at, kind=kind, summary=said, detail=detail)
        place = len(events)
        while place > floor and events[place - 1].at_ms > at:
            place -= 1
        events.insert(place, event)
    return timeline.model_copy(update={"events": events})


def _after_sent(events: list[TimelineEvent], attempt: Any) -> int:
    """The index just past `attempt`'s `sent` event (0: none)."""
    for i in range(len(events) - 1, -1, -1):
        event = events[i]
        if event.kind == "sent" and event.detail.get("attempt", 1) == attempt:
            return i + 1
    return 0
