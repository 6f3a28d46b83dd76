"""Reading the invoke workflow's history (`workflows/invoke.py`): acceptance and its plan,
waits on durable timers, late answers, the callback's hand-over, the result. Routing and each
attempt's outcome, read from the activities, are `_attempts`'."""

from __future__ import annotations

from typing import Any

from reach.invocation import (
    SIGNAL_LATE_ANSWER,
    UPDATE_LATE_ANSWER,
    WORKFLOW_DELIVER_CALLBACK,
)
from reach.outcome import FAILED_OUTCOME
from reach.timeline._attempts import AttemptStory, local_activity_ends
from reach.timeline._model import (
    HistoryEvent,
    TimelineEvent,
    as_dict,
    ms,
    seconds,
    shown_url,
)


class InvokeStory(AttemptStory):
    """The invoke workflow's history, read event by event (`_on_<event type>`); what its
    activities did is `AttemptStory`'s."""

    def __init__(self, request_id: str) -> None:
        super().__init__(request_id)
        self.timers: dict[str, tuple[float, float, TimelineEvent]] = {}

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
        if inp.get("idempotency_key") and not plan.get("idempotent"):
            # The key is what makes a retry safe, whatever the agents say of the operation.
            idempotent = None
            safety = f"keyed (idempotency_key), {retries} {'retry' if retries == 1 else 'retries'}"
        elif self.plan_open["idempotent"]:
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
        self._result(event, as_dict(event.attrs.get("result")))

    def _result(self, event: HistoryEvent, response: dict[str, Any]) -> None:
        self.ended = True
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
        details = failure.get("details") or []
        if failure.get("type") == FAILED_OUTCOME and len(details) == 1:
            self._result(event, as_dict(details[0]))  # its error or timeout (reach.outcome)
            return
        self._ended(event, "error", f"the request failed inside Reach: {failure.get('message')}")

    def _on_workflow_execution_terminated(self, event: HistoryEvent, _: Any) -> None:
        reason = event.attrs.get("reason") or "no reason given"
        self._ended(event, "error", f"terminated by an operator: {reason}")

    def _on_workflow_execution_canceled(self, event: HistoryEvent, _: Any) -> None:
        self._ended(event, "error", "cancelled by an operator")

    def _on_workflow_execution_timed_out(self, event: HistoryEvent, _: Any) -> None:
        self._ended(event, "timeout", "the workflow's own timeout (set outside Reach) ended it")
