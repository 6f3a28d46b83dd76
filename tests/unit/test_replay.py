"""Committed histories must replay on today's workflow code: requests in flight survive deploys."""

from __future__ import annotations

import base64
import json
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from temporalio import workflow
from temporalio.client import WorkflowHistory
from temporalio.worker import Replayer

from activities.codec import PAYLOAD_CONVERTER
from workflows.callback import DeliverCallbackWorkflow
from workflows.invoke import InvokeWorkflow

HISTORIES = sorted((Path(__file__).parent.parent / "histories").glob("*.json"))


def test_there_are_histories_to_replay() -> None:
    names = {p.stem for p in HISTORIES}
    assert {"success", "retry", "timeout", "late-answer", "callback"} <= names
    # Today's paths, beside the ones requests accepted by older versions still take.
    assert {"late-answer-update", "callback-workflow"} <= names
    assert {"door-routed", "door-stale", "door-retry", "door-deadline"} <= names
    # A caller's cancel ends it canceled; before that rule, internal or without a result.
    assert {"cancel-queued-call", "cancel-a2a-task"} <= names
    assert {"cancel-queued-call-before", "cancel-a2a-task-before"} <= names
    assert "a2a-push" in names  # a task whose agent pushes notifications (PATCH_A2A_PUSH)
    # A push flood that neither grows the poll's wait nor makes looks closer than a second
    # (PATCH_A2A_PUSH_PACE); a task followed by its stream, and one whose stream was cut
    # (PATCH_A2A_STREAM).
    assert {"a2a-push-paced", "a2a-stream", "a2a-stream-cut"} <= names
    # An attempt a lost run may have sent, remembered and named at the end (PATCH_LOST_RUN).
    assert "lost-run" in names
    # The delivery workflow's POST with a heartbeat timeout (PATCH_CALLBACK_HEARTBEAT), and
    # without one, as deliveries started before it run on.
    assert {"callback-delivery", "callback-delivery-before"} <= names


@pytest.mark.parametrize("path", HISTORIES, ids=lambda p: p.stem)
async def test_history_replays_without_nondeterminism(path: Path) -> None:
    replayer = Replayer(
        workflows=[InvokeWorkflow, DeliverCallbackWorkflow], data_converter=PAYLOAD_CONVERTER
    )
    history = WorkflowHistory.from_json(f"replay-{path.stem}", path.read_text())
    result = await replayer.replay_workflow(history, raise_on_replay_failure=True)
    assert result.replay_failure is None


# Histories whose timers an earlier formula set: their count is checked, not their lengths.
EARLIER_TIMERS = {"rate-limit-queue": "recorded before queued waiters woke less often (1.25**n)"}


def _seconds(duration: str) -> float:
    assert duration.endswith("s")
    return float(duration[:-1])


@pytest.mark.parametrize("path", HISTORIES, ids=lambda p: p.stem)
async def test_a_replay_sets_the_timers_its_history_recorded(
    path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Replay checks which commands a workflow emits, not how long a timer runs: a changed
    backoff, re-delivery or store wait would replay cleanly. So each timer the code sets
    (`workflow.sleep`, a `wait_condition` timeout) is compared with the one recorded."""
    set_s: list[float] = []
    sleep, wait_condition = workflow.sleep, workflow.wait_condition

    async def timed_sleep(duration: float | timedelta, **kw: Any) -> None:
        set_s.append(duration.total_seconds() if isinstance(duration, timedelta) else duration)
        await sleep(duration, **kw)

    async def timed_wait(fn: Any, **kw: Any) -> None:
        limit = kw.get("timeout")
        if limit is not None:
            set_s.append(limit.total_seconds() if isinstance(limit, timedelta) else limit)
        await wait_condition(fn, **kw)

    monkeypatch.setattr(workflow, "sleep", timed_sleep)
    monkeypatch.setattr(workflow, "wait_condition", timed_wait)
    history = WorkflowHistory.from_json(f"replay-{path.stem}", path.read_text())
    replayer = Replayer(
        workflows=[InvokeWorkflow, DeliverCallbackWorkflow], data_converter=PAYLOAD_CONVERTER
    )
    result = await replayer.replay_workflow(history, raise_on_replay_failure=True)
    assert result.replay_failure is None
    recorded = [
        _seconds(e["timerStartedEventAttributes"]["startToFireTimeout"])
        for e in _events(path.stem)
        if "timerStartedEventAttributes" in e
    ]
    if path.stem in EARLIER_TIMERS:
        assert len(set_s) == len(recorded)
    else:
        assert set_s == pytest.approx(recorded, abs=1e-6)


def _events(name: str) -> list[dict[str, Any]]:
    events: list[dict[str, Any]] = json.loads(
        (Path(__file__).parent.parent / "histories" / f"{name}.json").read_text()
    )["events"]
    return events


def _result(events: list[dict[str, Any]]) -> dict[str, Any]:
    [done] = [e for e in events if "workflowExecutionCompletedEventAttributes" in e]
    data = done["workflowExecutionCompletedEventAttributes"]["result"]["payloads"][0]["data"]
    result: dict[str, Any] = json.loads(base64.b64decode(data))
    return result


def _steps(events: list[dict[str, Any]]) -> list[str]:
    """The local activities a request ran, in order, and its search-attribute writes."""
    steps = []
    for e in events:
        if "markerRecordedEventAttributes" in e:
            data = e["markerRecordedEventAttributes"]["details"]["data"]["payloads"][0]["data"]
            steps.append(json.loads(base64.b64decode(data))["activity_type"])
        elif "upsertWorkflowSearchAttributesEventAttributes" in e:
            fields = e["upsertWorkflowSearchAttributesEventAttributes"]["searchAttributes"]
            steps.append("upsert " + ",".join(sorted(fields["indexedFields"])))
    return steps


def test_attempt_1_routed_at_the_door_is_one_call_and_its_end_writes_nothing() -> None:
    events = _events("door-routed")
    assert _steps(events) == ["reach.call"]
    assert _result(events)["instance_id"] == "door"
    # Before, the same request: resolve, call, and the outcome's search attributes.
    assert _steps(_events("success")) == [
        "reach.resolve",
        "reach.call",
        "upsert ReachInstance,ReachStatus",
    ]


def test_an_instance_gone_before_the_call_is_routed_again_and_recorded_once() -> None:
    events = _events("door-stale")
    assert _steps(events) == ["reach.call", "reach.resolve", "reach.call", "upsert ReachInstance"]
    result = _result(events)
    assert result["status"] == "success"
    assert result["instance_id"] == "i0"
    assert [a["instance_id"] for a in result["attempts"]] == ["i0"]


def test_a_retry_elsewhere_updates_the_instance_the_start_named() -> None:
    events = _events("door-retry")
    assert _steps(events) == ["reach.call", "reach.resolve", "reach.call", "upsert ReachInstance"]
    result = _result(events)
    assert [(a["attempt"], a["instance_id"]) for a in result["attempts"]] == [
        (1, "door"),
        (2, "i1"),
    ]


def test_a_request_that_ends_before_its_door_route_is_called_frees_the_door_s_count() -> None:
    events = _events("door-deadline")
    assert _steps(events) == ["reach.release_route", "upsert ReachStatus"]
    assert _result(events)["status"] == "timeout"


def test_an_a2a_task_is_sent_once_then_only_looked_at() -> None:
    """The call answered with the task's handle; everything after asks about that task, so a
    worker replaying this history after a crash sends nothing again."""
    events = _events("a2a-task")
    assert _steps(events) == ["reach.call"]
    looks = [
        e["activityTaskScheduledEventAttributes"]["activityType"]["name"]
        for e in events
        if "activityTaskScheduledEventAttributes" in e
    ]
    assert looks == ["reach.follow_task", "reach.follow_task"]
    assert _result(events)["result"] == {"answer": 42}


def test_a_push_notification_ends_the_wait_and_the_next_look_asks_once() -> None:
    """Its agent pushes: the wait after the first look is the push fallback's (10 s), a signal
    ends it before it fires, and each look is one question (no window of polling)."""
    events = _events("a2a-push")
    markers = [
        e["markerRecordedEventAttributes"] for e in events if "markerRecordedEventAttributes" in e
    ]
    assert [m["markerName"] for m in markers] == ["core_local_activity", "core_patch"]
    timers = [
        e["timerStartedEventAttributes"] for e in events if "timerStartedEventAttributes" in e
    ]
    assert [_seconds(t["startToFireTimeout"]) for t in timers] == [10.0]
    assert any("timerCanceledEventAttributes" in e for e in events)
    signals = [
        e["workflowExecutionSignaledEventAttributes"]["signalName"]
        for e in events
        if "workflowExecutionSignaledEventAttributes" in e
    ]
    assert signals == ["a2a_push"]
    looks = [
        e["activityTaskScheduledEventAttributes"]
        for e in events
        if "activityTaskScheduledEventAttributes" in e
    ]
    assert len(looks) == 2
    assert _result(events)["result"] == {"answer": 42}


@pytest.mark.parametrize(
    ("name", "heartbeat"),
    [("callback-delivery", "5s"), ("callback-delivery-before", "0s"), ("callback", "0s")],
)
def test_a_delivery_post_has_a_heartbeat_timeout_only_since_its_patch(
    name: str, heartbeat: str
) -> None:
    """Replay does not compare an activity's timeouts, so which history holds which is read
    here: a worker SIGKILLed mid-POST is noticed in 5 s since PATCH_CALLBACK_HEARTBEAT."""
    events = _events(name)
    [post] = [
        e["activityTaskScheduledEventAttributes"]
        for e in events
        if "activityTaskScheduledEventAttributes" in e
        and e["activityTaskScheduledEventAttributes"]["activityType"]["name"]
        == "reach.deliver_callback"
    ]
    assert post["heartbeatTimeout"] == heartbeat
    patches = [
        e["markerRecordedEventAttributes"]
        for e in events
        if e.get("markerRecordedEventAttributes", {}).get("markerName") == "core_patch"
    ]
    assert bool(patches) == (heartbeat != "0s")
