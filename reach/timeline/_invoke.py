"""Reading the invoke workflow's history (`workflows/invoke.py`): acceptance and its plan,
routing, each attempt and its outcome, waits on durable timers, late answers, the result."""

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
    SIGNAL_LATE_ANSWER,
    STALE_ROUTE,
    UPDATE_LATE_ANSWER,
    WORKFLOW_DELIVER_CALLBACK,
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
    seconds,
    shown_url,
    timestamp_ms,
)
from reach.timeline._story import Story


class InvokeStory(Story):
    """The invoke workflow's history, read event by event (`_on_<event type>`)."""

    def __init__(self, request_id: str) -> None:
        super().__init__(request_id)
        self.attempt = 1
        self.failed: tuple[str, dict[str, Any], str | None] | None = None
        self.waiting_late = False
        self.token_wait = False
        self.scheduled: dict[int, Activity] = {}
        self.ended = False
        self.plan_open: dict[str, bool] = {}
        self.timers: dict[str, tuple[float, float, TimelineEvent]] = {}
        self.retries_if_idempotent: Any = None
        self.queued: TimelineEvent | None = None  # the wait for a rate-limit token, if any

    def read_invoke(self, history: list[HistoryEvent]) -> None:
        ends = local_activity_ends(history)
        for event in history:
            handler = getattr(self, f"_on_{event.type}", None)
            if handler is not None:
                handler(event, ends)

    def _on_workflow_execution_started(self, event: HistoryEvent, _: Any) -> None:
        inp = as_dict(event.attrs.get("input"))
        self.request_id = str(inp.get("request_id") or self.request_id)
        accepted = inp.get("accepted_at_ms")
        self.base_ms = float(accepted) if isinstance(accepted, int | float) else event.time_ms
        plan = as_dict(inp.get("plan"))
        self.callback_url = shown_url(inp.get("callback"))
        deadline = inp.get("deadline_ms")
        deadline_in = round(deadline - self.base_ms) if isinstance(deadline, int | float) else None
        # Plans without these fields were settled by configuration alone.
        self.plan_open = {
            "idempotent": plan.get("idempotent_configured") is False,
            "timeout": plan.get("timeout_configured") is False,
        }
        self.retries_if_idempotent = plan.get("retries_if_idempotent")
        retries = plan.get("max_retries", 0)
        if self.plan_open["idempotent"]:
            idempotent = None
            safety = f"idempotent if the agents say so ({self.retries_if_idempotent} retries then)"
        else:
            idempotent = bool(plan.get("idempotent"))
            safety = (
                f"{'idempotent' if idempotent else 'not idempotent'}, "
                f"{retries} {'retry' if retries == 1 else 'retries'}"
            )
        policy = f"timeout {plan.get('timeout_ms')} ms, {safety}, {plan.get('mode', 'inline')}"
        how = f"callback to {self.callback_url}" if self.callback_url else "sync"
        queue = as_dict(plan.get("queue"))
        self.add(
            self.base_ms,
            "accepted",
            f"from {inp.get('caller')}: {inp.get('target')}.{inp.get('operation')}, deadline "
            f"+{deadline_in} ms ({policy}; {how})",
            caller=inp.get("caller"),
            capability=inp.get("target"),
            operation=inp.get("operation"),
            deadline_ms=deadline_in,
            timeout_ms=plan.get("timeout_ms"),
            retries=retries,
            idempotent=idempotent,
            retries_if_idempotent=self.retries_if_idempotent if idempotent is None else None,
            mode=plan.get("mode", "inline"),
            backoff_base_ms=plan.get("backoff_base_ms"),
            idempotency_key=inp.get("idempotency_key"),
            routing_key=inp.get("routing_key"),
            callback=self.callback_url,
            payload_bytes=inp.get("payload_bytes"),
            queue_until_ms=self.offset(queue.get("wait_until_ms")) if queue else None,
        )
        door = inp.get("endpoint")
        if isinstance(door, dict):
            self._chosen(self.base_ms, door, by="door")

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

    def _on_timer_started(self, event: HistoryEvent, _: Any) -> None:
        delay_ms = float(event.attrs.get("start_to_fire_ms") or 0)
        if self.failed is not None:
            where, error, instance = self.failed
            self.failed = None
            if where == "call" and error.get("outcome_unknown") and instance:
                shown = self.add(
                    event.time_ms,
                    "redeliver",
                    f"attempt {self.attempt}'s outcome is unknown: sent again to {instance} "
                    f"in {seconds(delay_ms)}",
                    attempt=self.attempt,
                    instance=instance,
                    delay_ms=round(delay_ms),
                )
            elif where == "store" or (where == "resolve" and error.get("type") == "unavailable"):
                shown = self.add(
                    event.time_ms,
                    "store_wait",
                    f"the store is away: trying again in {seconds(delay_ms)}",
                    delay_ms=round(delay_ms),
                )
            else:
                self.attempt += 1
                shown = self.add(
                    event.time_ms,
                    "backoff",
                    f"backoff {seconds(delay_ms)} before attempt {self.attempt}",
                    delay_ms=round(delay_ms),
                    next_attempt=self.attempt,
                )
        elif self.waiting_late:
            return  # the deadline's timer while waiting for a late answer: attempt_accepted says it
        elif self.token_wait:
            self.token_wait = False
            return
        else:
            shown = self.add(
                event.time_ms,
                "wait",
                f"waiting {seconds(delay_ms)}",
                delay_ms=round(delay_ms),
            )
        self.timers[str(event.attrs.get("timer_id"))] = (event.time_ms, delay_ms, shown)

    def _on_timer_fired(self, event: HistoryEvent, _: Any) -> None:
        """How long the wait really took: a busy server fires timers late."""
        found = self.timers.pop(str(event.attrs.get("timer_id")), None)
        if found is None:
            return
        started_ms, delay_ms, shown = found
        waited = round(event.time_ms - started_ms)
        shown.detail["waited_ms"] = waited
        if waited - delay_ms > max(50.0, delay_ms / 5):
            shown.summary += f" (the timer fired after {ms(waited)})"

    def _late_answer(self, event: HistoryEvent) -> None:
        args = event.attrs.get("args") or []
        answer = as_dict(args[0]) if args else {}
        status = answer.get("status", "success")
        instance = answer.get("instance_id") or self.endpoint.get("instance_id")
        words = f"{status}"
        if status != "success":
            words += (
                f" ({answer.get('error_type') or 'agent_error'}: {answer.get('error_message')})"
            )
        self.waiting_late = False
        self.add(
            event.time_ms,
            "late_answer",
            f"late answer from {instance}: {words}",
            instance=instance,
            status=status,
            error_type=answer.get("error_type"),
            error_message=answer.get("error_message"),
        )

    def _on_workflow_execution_update_accepted(self, event: HistoryEvent, _: Any) -> None:
        if event.attrs.get("name") == UPDATE_LATE_ANSWER:
            self._late_answer(event)

    def _on_workflow_execution_signaled(self, event: HistoryEvent, _: Any) -> None:
        if event.attrs.get("name") == SIGNAL_LATE_ANSWER:
            self._late_answer(event)

    def _on_start_child_workflow_execution_initiated(self, event: HistoryEvent, _: Any) -> None:
        if event.attrs.get("workflow_type") != WORKFLOW_DELIVER_CALLBACK:
            return
        url = shown_url(as_dict(event.attrs.get("input")).get("url")) or self.callback_url
        self.add(
            event.time_ms,
            "callback",
            f"result handed to callback delivery for {url}",
            url=url,
            workflow_id=event.attrs.get("workflow_id"),
        )

    def _on_start_child_workflow_execution_failed(self, event: HistoryEvent, _: Any) -> None:
        if event.attrs.get("workflow_type") == WORKFLOW_DELIVER_CALLBACK:
            self.add(
                event.time_ms,
                "callback_given_up",
                f"callback delivery could not start: {event.attrs.get('cause')}",
            )

    def _on_workflow_execution_completed(self, event: HistoryEvent, _: Any) -> None:
        self.ended = True
        response = as_dict(event.attrs.get("result"))
        status = str(response.get("status") or "success")
        self.status = status
        error = as_dict(response.get("error"))
        instance = response.get("instance_id")
        took = response.get("duration_ms")
        if status == "success":
            source = f" from {instance}" if instance else ""
            summary = f"success in {took} ms{source}"
            if response.get("replayed_from"):
                summary += f" (the result of request {response['replayed_from']})"
        elif status == "timeout":
            summary = f"timeout: {error.get('message', 'no answer in time')}"
        else:
            summary = f"{status} {error.get('type')}: {error.get('message')}"
        self.add(
            event.time_ms,
            "timeout" if status == "timeout" else "result",
            summary,
            status=status,
            duration_ms=took,
            instance=instance,
            attempts=len(response.get("attempts") or []) or None,
            error=error or None,
        )

    def _ended(self, event: HistoryEvent, status: str, summary: str) -> None:
        self.ended = True
        self.status = status
        self.add(event.time_ms, "ended", summary, status=status)

    def _on_workflow_execution_failed(self, event: HistoryEvent, _: Any) -> None:
        failure = as_dict(event.attrs.get("failure"))
        self._ended(event, "error", f"the request failed inside Reach: {failure.get('message')}")

    def _on_workflow_execution_terminated(self, event: HistoryEvent, _: Any) -> None:
        reason = event.attrs.get("reason") or "no reason given"
        self._ended(event, "error", f"terminated by an operator: {reason}")

    def _on_workflow_execution_canceled(self, event: HistoryEvent, _: Any) -> None:
        self._ended(event, "error", "cancelled by an operator")

    def _on_workflow_execution_timed_out(self, event: HistoryEvent, _: Any) -> None:
        self._ended(event, "timeout", "the workflow's own timeout (set outside Reach) ended it")


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
