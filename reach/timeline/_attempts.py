"""Reading what the invoke workflow's activities did (`workflows/invoke.py`): the instance
chosen and why, each attempt sent and how it ended, the idempotency key's claim, the rate-limit
token. The workflow's own events (acceptance, timers, late answers, the end) are `_invoke`'s;
the state both read and write is here, set up once."""

from __future__ import annotations

from typing import Any

from reach.invocation import (
    ACTIVITY_CALL,
    ACTIVITY_CLAIM_KEY,
    ACTIVITY_DELIVER_CALLBACK,
    ACTIVITY_FOLLOW,
    ACTIVITY_RELEASE_KEY,
    ACTIVITY_RELEASE_ROUTE,
    ACTIVITY_RESOLVE,
    ACTIVITY_TAKE_TOKEN,
    STALE_ROUTE,
)
from reach.timeline._model import (
    LOCAL_ACTIVITY_MARKER,
    Activity,
    HistoryEvent,
    TimelineEvent,
    as_dict,
    error_of,
    failure_dict,
    ms,
    timestamp_ms,
)
from reach.timeline._story import Story


class AttemptStory(Story):
    """The activities of the invoke workflow's history, each read when it ends (`_done`)."""

    def __init__(self, request_id: str) -> None:
        super().__init__(request_id)
        self.attempt = 1
        self.failed: tuple[str, dict[str, Any], str | None] | None = None
        self.waiting_late = False
        self.token_wait = False
        self.scheduled: dict[int, Activity] = {}
        self.ended = False
        self.plan_open: dict[str, bool] = {}
        self.retries_if_idempotent: Any = None
        self.queued: TimelineEvent | None = None  # the wait for a rate-limit token, if any

    def _chosen(self, time_ms: float, endpoint: dict[str, Any], by: str) -> None:
        self.endpoint = endpoint
        instance = endpoint.get("instance_id")
        strategy = endpoint.get("strategy")
        parts = [f"{instance} via {endpoint.get('protocol')}"]
        why = [strategy] if strategy else []
        if endpoint.get("skipped"):
            why.append(f"skipped {', '.join(endpoint['skipped'])} (ejected)")
        if endpoint.get("bypassed"):
            why.append(f"bypassed {', '.join(endpoint['bypassed'])} (at max_inflight)")
        if endpoint.get("route_note"):
            why.append(str(endpoint["route_note"]))
        if endpoint.get("probe"):
            why.append("a half-open breaker's probe")
        if why:
            parts.append(f"({'; '.join(why)})")
        if by == "door":
            parts.append("at the door")
        # What the agents declare settles what configuration left open (reach.policy.refine_plan).
        declared: dict[str, Any] = {}
        if self.plan_open.get("idempotent") and endpoint.get("declared_idempotent") is not None:
            self.plan_open["idempotent"] = False
            declared["idempotent"] = endpoint["declared_idempotent"]
            parts.append(
                f"— the agents declare it idempotent ({self.retries_if_idempotent} retries)"
                if declared["idempotent"]
                else "— the agents declare it not idempotent"
            )
        if self.plan_open.get("timeout") and endpoint.get("declared_timeout_ms") is not None:
            self.plan_open["timeout"] = False
            declared["timeout_ms"] = endpoint["declared_timeout_ms"]
            parts.append(f"— declared timeout {declared['timeout_ms']} ms")
        self.add(
            time_ms,
            "instance_chosen",
            " ".join(parts),
            attempt=self.attempt,
            instance=instance,
            protocol=endpoint.get("protocol"),
            strategy=strategy,
            skipped=endpoint.get("skipped") or None,
            bypassed=endpoint.get("bypassed") or None,
            note=endpoint.get("route_note"),
            breaker=endpoint.get("breaker"),
            chosen_by=by,
            declared=declared or None,
        )

    def _on_marker_recorded(self, event: HistoryEvent, ends: dict[int, float]) -> None:
        attrs = event.attrs
        if attrs.get("marker") != LOCAL_ACTIVITY_MARKER:
            return
        data = as_dict(attrs.get("data"))
        start = timestamp_ms(data.get("original_schedule_time")) or event.time_ms
        act = Activity(type=str(data.get("activity_type")), start_ms=start)
        self._done(
            act, ends.get(event.event_id, event.time_ms), attrs.get("result"), attrs.get("failure")
        )

    def _on_activity_task_scheduled(self, event: HistoryEvent, _: Any) -> None:
        attrs = event.attrs
        self.scheduled[event.event_id] = Activity(
            type=str(attrs.get("activity_type")),
            start_ms=event.time_ms,
            input=attrs.get("input"),
            task_queue=attrs.get("task_queue"),
            activity_id=attrs.get("activity_id"),
        )

    def _on_activity_task_started(self, event: HistoryEvent, _: Any) -> None:
        act = self.scheduled.get(event.attrs.get("scheduled_event_id", -1))
        if act is None:
            return
        act.started_ms = event.time_ms
        act.attempt = int(event.attrs.get("attempt") or 1)
        act.last_failure = event.attrs.get("last_failure")
        if act.type == ACTIVITY_DELIVER_CALLBACK and act.attempt > 1:
            self._callback_retrying(event.time_ms, act.attempt, act.last_failure)

    def _on_pending_activity(self, event: HistoryEvent, _: Any) -> None:
        """A regular activity under way when the history was read (the reader adds these)."""
        attrs = event.attrs
        if self.ended:  # read just after it ended: the history already says how
            return
        act = next(
            (a for a in self.scheduled.values() if a.activity_id == attrs.get("activity_id")),
            None,
        )
        if act is None or act.type != ACTIVITY_CALL:
            return
        attempt = self._attempt_of(act)
        started = attrs.get("started_ms")
        if attrs.get("state") == "started" and isinstance(started, int | float):
            self._sent(act, started)
            self.add(
                event.time_ms,
                "in_flight",
                f"attempt {attempt} still under way (worker attempt {attrs.get('attempt')})",
                attempt=attempt,
            )
        else:
            self.add(
                act.start_ms,
                "waiting_for_worker",
                f"attempt {attempt} waits for a worker on task queue {act.task_queue}",
                attempt=attempt,
                task_queue=act.task_queue,
            )

    def _on_activity_task_completed(self, event: HistoryEvent, _: Any) -> None:
        act = self.scheduled.pop(event.attrs.get("scheduled_event_id", -1), None)
        if act is not None:
            self._done(act, event.time_ms, event.attrs.get("result"), None)

    def _on_activity_task_failed(self, event: HistoryEvent, _: Any) -> None:
        act = self.scheduled.pop(event.attrs.get("scheduled_event_id", -1), None)
        if act is not None:
            failure = event.attrs.get("failure") or failure_dict("other", "internal", "failed")
            self._done(act, event.time_ms, None, failure)

    _on_activity_task_timed_out = _on_activity_task_failed

    def _attempt_of(self, act: Activity) -> int:
        header = as_dict(as_dict(as_dict(act.input).get("message")).get("header"))
        attempt = header.get("attempt")
        return attempt if isinstance(attempt, int) else self.attempt

    def _sent(self, act: Activity, time_ms: float) -> None:
        endpoint = as_dict(as_dict(act.input).get("endpoint")) or self.endpoint
        attempt = self.attempt = self._attempt_of(act)
        instance = endpoint.get("instance_id")
        self.add(
            time_ms,
            "sent",
            f"attempt {attempt} sent to {instance} via {endpoint.get('protocol')}",
            attempt=attempt,
            instance=instance,
            protocol=endpoint.get("protocol"),
            task_queue=act.task_queue,
        )

    def _done(
        self,
        act: Activity,
        end_ms: float,
        result: Any,
        failure: dict[str, Any] | None,
    ) -> None:
        took = round(end_ms - (act.started_ms or act.start_ms))
        if act.type == ACTIVITY_RESOLVE:
            self._resolved(end_ms, result, failure)
        elif act.type == ACTIVITY_CALL:
            self._called(act, end_ms, took, result, failure)
        elif act.type == ACTIVITY_CLAIM_KEY:
            self._claimed(end_ms, result, failure)
        elif act.type == ACTIVITY_FOLLOW:
            if failure is None:
                first = as_dict(result)
                self.add(
                    end_ms,
                    "idempotency",
                    f"answered with request {first.get('request_id')}'s result "
                    f"({first.get('status')})",
                    replayed_from=first.get("request_id"),
                )
        elif act.type == ACTIVITY_TAKE_TOKEN:
            self._token(end_ms, result, failure)
        elif act.type == ACTIVITY_RELEASE_KEY and failure is None:
            self.add(end_ms, "released", "idempotency key freed: nothing was sent")
        elif act.type == ACTIVITY_RELEASE_ROUTE and failure is None:
            self.add(
                end_ms,
                "released",
                f"the door's in-flight slot on {self.endpoint.get('instance_id')} freed: the "
                "call never began",
            )
        elif act.type == ACTIVITY_DELIVER_CALLBACK:
            self._delivery_done(end_ms, act.attempt, result, failure)

    def _resolved(self, end_ms: float, result: Any, failure: dict[str, Any] | None) -> None:
        if failure is None:
            self._chosen(end_ms, as_dict(result), by="router")
            return
        error = error_of(failure)
        self.failed = ("resolve", error, None)
        self.add(
            end_ms,
            "routing_failed",
            f"attempt {self.attempt}: no instance — {error['type']}: {error['message']}",
            attempt=self.attempt,
            error=error,
        )

    def _called(
        self,
        act: Activity,
        end_ms: float,
        took: int,
        result: Any,
        failure: dict[str, Any] | None,
    ) -> None:
        attempt = self._attempt_of(act)
        instance = (as_dict(as_dict(act.input).get("endpoint")) or self.endpoint).get("instance_id")
        stale = failure is not None and failure.get("type") == STALE_ROUTE
        if not stale:  # a stale route's call stopped before sending
            self._sent(act, act.started_ms or act.start_ms)
        if failure is None:
            reply = as_dict(result)
            if reply.get("status") == "accepted":
                self.waiting_late = True
                self.add(
                    end_ms,
                    "attempt_accepted",
                    f"attempt {attempt}: {instance} accepted it (202) after {ms(took)}; "
                    "waiting for its late answer",
                    attempt=attempt,
                    instance=instance,
                    duration_ms=took,
                )
            else:
                self.add(
                    end_ms,
                    "attempt_succeeded",
                    f"attempt {attempt}: {instance} answered in {ms(took)}",
                    attempt=attempt,
                    instance=instance,
                    duration_ms=took,
                )
            return
        if stale:
            self.add(
                end_ms,
                "rerouted",
                f"{instance} left before anything was sent: attempt {attempt} is routed again",
                attempt=attempt,
                instance=instance,
            )
            return
        error = error_of(failure)
        self.failed = ("call", error, instance)
        self.add(
            end_ms,
            "attempt_failed",
            f"attempt {attempt} on {instance} failed after {ms(took)}: {error['type']}: "
            f"{error['message']}",
            attempt=attempt,
            instance=instance,
            duration_ms=took,
            error=error,
        )

    def _claimed(self, end_ms: float, result: Any, failure: dict[str, Any] | None) -> None:
        if failure is not None:
            error = error_of(failure)
            self.failed = ("store", error, None)
            self.add(
                end_ms,
                "idempotency",
                f"idempotency key not claimed: {error['type']}: {error['message']}",
                error=error,
            )
            return
        claim = as_dict(result)
        owner = claim.get("owner")
        if owner == self.request_id:
            self.add(end_ms, "idempotency", "idempotency key claimed", owner=owner)
        elif claim.get("same_request"):
            self.add(
                end_ms,
                "idempotency",
                f"idempotency key already used by request {owner}: following its result",
                owner=owner,
            )
        else:
            self.add(
                end_ms,
                "idempotency",
                f"idempotency key already used by request {owner} for another payload",
                owner=owner,
            )

    def _token(self, end_ms: float, result: Any, failure: dict[str, Any] | None) -> None:
        if failure is not None:
            error = error_of(failure)
            self.failed = ("store", error, None)
            self.add(
                end_ms,
                "rate_limited",
                f"rate-limit token not taken: {error['type']}: {error['message']}",
                error=error,
            )
        elif isinstance(result, int | float) and result > 0:
            self.token_wait = True
            if self.queued is not None:  # one more look while queued: counted, not repeated
                self.queued.detail["tries"] = self.queued.detail.get("tries", 1) + 1
                return
            self.queued = self.add(
                end_ms,
                "rate_limited",
                f"no rate-limit token yet (one frees in {result:.1f} s): queued",
                token_in_s=result,
            )
        else:
            tries = self.queued.detail.get("tries", 1) + 1 if self.queued is not None else 1
            self.queued = None
            self.add(
                end_ms,
                "token",
                "rate-limit token taken" + (f" (try {tries})" if tries > 1 else ""),
                tries=tries,
            )


def local_activity_ends(history: list[HistoryEvent]) -> dict[int, float]:
    """When each local activity ended, as near as history says: a marker is written when its
    workflow task completes, and the next local activity of the same task was scheduled as soon
    as this one ended (the workflow runs them one after the other)."""
    ends: dict[int, float] = {}
    markers = [
        e
        for e in history
        if e.type == "marker_recorded" and e.attrs.get("marker") == LOCAL_ACTIVITY_MARKER
    ]
    for marker, following in zip(markers, [*markers[1:], None], strict=False):
        end = marker.time_ms
        if following is not None and following.attrs.get("task") == marker.attrs.get("task"):
            start = timestamp_ms(as_dict(following.attrs.get("data")).get("original_schedule_time"))
            if start is not None:
                end = min(end, start)
        ends[marker.event_id] = end
    return ends
