"""The story being told: its events in order, the timeline they make, and the callback
delivery's part (its own workflow, or the inline activity of requests accepted before it)."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from reach.timeline._model import (
    PENDING_ACTIVITY,
    Activity,
    Entry,
    HistoryEvent,
    Timeline,
    TimelineEvent,
    as_dict,
    failure_dict,
    shown_url,
)


class Story:
    """The events read so far, and how they become a timeline (offsets from acceptance)."""

    def __init__(self, request_id: str) -> None:
        self.request_id = request_id
        self.entries: list[Entry] = []
        self.after_result: list[Entry] = []  # the callback's story follows the result's
        self.base_ms: float | None = None
        self.status = "running"
        self.endpoint: dict[str, Any] = {}
        self.callback_url: str | None = None

    # -- output -------------------------------------------------------------------------

    def add(self, time_ms: float, kind: str, summary: str, **detail: Any) -> TimelineEvent:
        event = TimelineEvent(
            at_ms=0,
            kind=kind,
            summary=summary,
            detail={k: v for k, v in detail.items() if v is not None},
        )
        target = self.after_result if kind.startswith("callback") else self.entries
        target.append(Entry(time_ms, event))
        return event

    def timeline(self) -> Timeline:
        base = self.base_ms
        entries = self.entries + self.after_result
        if base is None:
            base = entries[0].time_ms if entries else 0.0
        events: list[TimelineEvent] = []
        last = 0
        for entry in entries:
            last = max(last, round(entry.time_ms - base))
            events.append(entry.event.model_copy(update={"at_ms": last}))
        accepted = datetime.fromtimestamp(base / 1000, UTC) if self.base_ms else None
        return Timeline(
            request_id=self.request_id, status=self.status, accepted_at=accepted, events=events
        )

    def offset(self, epoch_ms: float | None) -> int | None:
        if epoch_ms is None or self.base_ms is None:
            return None
        return round(epoch_ms - self.base_ms)

    # -- the callback delivery ----------------------------------------------------------

    def read_delivery(self, history: list[HistoryEvent]) -> None:
        scheduled: dict[int, Activity] = {}
        done = False
        for event in history:
            attrs = event.attrs
            if event.type == "workflow_execution_started":
                self.callback_url = (
                    shown_url(as_dict(attrs.get("input")).get("url")) or self.callback_url
                )
            elif event.type == "activity_task_scheduled":
                scheduled[event.event_id] = Activity(
                    type=str(attrs.get("activity_type")), start_ms=event.time_ms
                )
            elif event.type == "activity_task_started":
                act = scheduled.get(attrs.get("scheduled_event_id", -1))
                if act is not None:
                    act.attempt = int(attrs.get("attempt") or 1)
                    if act.attempt > 1:
                        self._callback_retrying(
                            event.time_ms, act.attempt, attrs.get("last_failure")
                        )
            elif event.type in ("activity_task_completed", "activity_task_failed"):
                act = scheduled.get(attrs.get("scheduled_event_id", -1))
                attempt = act.attempt if act is not None else 1
                self._delivery_done(
                    event.time_ms, attempt, attrs.get("result"), attrs.get("failure")
                )
                done = True
            elif event.type == "activity_task_timed_out":
                act = scheduled.get(attrs.get("scheduled_event_id", -1))
                failure = as_dict(attrs.get("failure"))
                cause = as_dict(failure.get("cause"))
                self._delivery_done(
                    event.time_ms,
                    act.attempt if act is not None else 1,
                    None,
                    cause
                    or failure_dict("timeout", "timeout", "the retry window (callback) ended"),
                )
                done = True
            elif event.type == "workflow_execution_completed" and not done:
                outcome = as_dict(attrs.get("result"))
                self._delivery_done(
                    event.time_ms,
                    int(outcome.get("attempts") or 1),
                    outcome.get("attempts") if outcome.get("status") == "delivered" else None,
                    None
                    if outcome.get("status") == "delivered"
                    else failure_dict("other", "given_up", str(outcome.get("last_error"))),
                )
                done = True
            elif event.type in ("workflow_execution_terminated", "workflow_execution_timed_out"):
                if not done:
                    self.add(
                        event.time_ms,
                        "callback_given_up",
                        "callback delivery ended without delivering "
                        f"({event.type.removeprefix('workflow_execution_')})",
                    )
                done = True
            elif event.type == PENDING_ACTIVITY and not done:
                last = as_dict(attrs.get("last_failure"))
                attempt = int(attrs.get("attempt") or 1)
                next_at = self.offset(attrs.get("next_attempt_ms"))
                when = f"; next attempt at +{next_at} ms" if next_at is not None else ""
                self.add(
                    event.time_ms,
                    "callback_pending",
                    f"callback to {self.callback_url} pending: attempt {attempt}"
                    + (f", last error: {last.get('message')}" if last else "")
                    + when,
                    attempt=attempt,
                    last_error=last.get("message"),
                    next_attempt_at_ms=next_at,
                )

    def _callback_retrying(self, time_ms: float, attempt: int, last: Any) -> None:
        failure = as_dict(last)
        tried = "attempt 1" if attempt == 2 else f"attempts 1-{attempt - 1}"
        why = f" (last: {failure['message']})" if failure.get("message") else ""
        self.add(
            time_ms,
            "callback_retrying",
            f"callback {tried} failed{why}; attempt {attempt}",
            attempt=attempt,
            last_error=failure.get("message"),
        )

    def _delivery_done(
        self, time_ms: float, attempt: int, result: Any, failure: dict[str, Any] | None
    ) -> None:
        if failure is None:
            delivered_on = result if isinstance(result, int) and result > 0 else attempt
            self.add(
                time_ms,
                "callback_delivered",
                f"callback delivered to {self.callback_url} (attempt {delivered_on})",
                url=self.callback_url,
                attempts=delivered_on,
            )
            return
        details = failure.get("details") or []
        first = as_dict(details[0]) if details else {}
        attempts = first.get("attempt") if isinstance(first.get("attempt"), int) else attempt
        self.add(
            time_ms,
            "callback_given_up",
            f"callback to {self.callback_url} given up after {attempts} "
            f"attempt{'s' if attempts != 1 else ''}: {failure.get('message')}",
            url=self.callback_url,
            attempts=attempts,
            last_error=failure.get("message"),
        )
