"""The timeline of a request (R16) read from workflow histories: the committed recordings of each
path the invoke workflow takes (tests/histories), hand-made events for what they do not cover,
and the visibility query behind `reach requests`."""

from __future__ import annotations

import dataclasses
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from google.protobuf.message import Message
from temporalio.client import WorkflowHistory
from temporalio.contrib.pydantic import pydantic_data_converter
from temporalio.converter import DataConverter

from activities.codec import EncryptionCodec
from gateway_api.timeline import decode_history
from reach.listing import CALLER_FILTER, quoted, since_delta, status_of, visibility_query
from reach.security.crypto import PayloadCipher
from reach.timeline import (
    PENDING_ACTIVITY,
    HistoryEvent,
    Timeline,
    build_timeline,
    failure_dict,
)

HISTORIES = Path(__file__).parent.parent / "histories"
T0 = 1_800_000_000_000.0  # epoch ms of the hand-made requests' acceptance


def recorded(name: str) -> WorkflowHistory:
    return WorkflowHistory.from_json(f"replay-{name}", (HISTORIES / f"{name}.json").read_text())


async def timeline_of(name: str, converter: DataConverter = pydantic_data_converter) -> Timeline:
    history = recorded(name)
    return build_timeline(history.workflow_id, await decode_history(history.events, converter))


def kinds(timeline: Timeline) -> list[str]:
    return [e.kind for e in timeline.events]


def the(timeline: Timeline, kind: str, nth: int = 0) -> Any:
    return [e for e in timeline.events if e.kind == kind][nth]


SUCCESS = ["accepted", "instance_chosen", "sent", "attempt_succeeded", "result"]
RETRY = [
    "accepted",
    "instance_chosen",
    "sent",
    "attempt_failed",
    "backoff",
    "instance_chosen",
    "sent",
    "attempt_succeeded",
    "result",
]
EXPECTED_STORE_OUTAGE = ["accepted", "routing_failed", "store_wait", *SUCCESS[1:]]
EXPECTED = {
    "success": SUCCESS,
    "retry": RETRY,
    # The deadline had passed before the first workflow task ran: nothing was tried.
    "timeout": ["accepted", "timeout"],
    "late-answer": [*SUCCESS[:3], "attempt_accepted", "late_answer", "result"],
    "late-answer-update": [*SUCCESS[:3], "attempt_accepted", "late_answer", "result"],
    # Before callbacks had a workflow of their own: an activity of the request's workflow.
    "callback": [*SUCCESS, "callback_delivered"],
    "callback-workflow": [*SUCCESS, "callback"],
    "door-routed": SUCCESS,
    "door-stale": [
        "accepted",
        "instance_chosen",
        "rerouted",
        "instance_chosen",
        "sent",
        "attempt_succeeded",
        "result",
    ],
    "door-retry": RETRY,
    "door-deadline": ["accepted", "instance_chosen", "released", "timeout"],
    "idempotency-key": ["accepted", "idempotency", *RETRY[1:]],
    "rate-limit-queue": ["accepted", "rate_limited", "token", *SUCCESS[1:]],
    "store-outage": EXPECTED_STORE_OUTAGE,
    "redeliver": [
        "accepted",
        "instance_chosen",
        "sent",
        "attempt_failed",
        "redeliver",
        "instance_chosen",
        "sent",
        "attempt_succeeded",
        "result",
    ],
    # An A2A agent's task followed by its handle until it ended.
    "a2a-task": [*SUCCESS[:3], "attempt_accepted", "result"],
    # The same, its agent pushing: a notification ended the wait before the fallback timer.
    "a2a-push": [*SUCCESS[:3], "attempt_accepted", "result"],
    # Pushed without pause: the looks keep their gap, the poll its own pace (a2a-push-pace).
    "a2a-push-paced": [*SUCCESS[:3], "attempt_accepted", "result"],
    # Followed by its stream (SubscribeToTask); and a stream cut mid-task, then polled.
    "a2a-stream": [*SUCCESS[:3], "attempt_accepted", "result"],
    "a2a-stream-cut": [*SUCCESS[:3], "attempt_accepted", "result"],
    # Ended in error or timeout: a Failed workflow carrying the envelope (ReachFailedOutcome).
    "failed-error": [*SUCCESS[:3], "attempt_failed", "result", "callback"],
    "failed-timeout": [*SUCCESS[:3], "attempt_failed", "timeout"],
    # Cancelled by its caller while following an A2A task, and while a queued call ran; the
    # -before pair was recorded before a cancel ended a request `canceled` (it ended internal).
    "cancel-a2a-task": [*SUCCESS[:3], "attempt_accepted", "result"],
    "cancel-a2a-task-before": [*SUCCESS[:3], "attempt_accepted", "ended"],
    "cancel-queued-call": ["accepted", "instance_chosen", "result"],
    "cancel-queued-call-before": ["accepted", "instance_chosen", "result"],
    # An attempt refused unsent (another run holds its send-once claim): reported at once with
    # that run's unknown outcome, never re-delivered (patch not-sent-not-redelivered).
    "not-sent": [*SUCCESS[:3], "attempt_failed", "result"],
    # A call refused unsent (its send-once claim met the store away), waited for and routed
    # again, its pin claimed again on a key of its own (patch pin-claims-counted).
    "unsent-again": RETRY,
    # Attempt 1 after a lost run of it: the store away until the deadline; the result says the
    # lost run may have sent it, naming its pin (patches lost-run-remembered and
    # name-lost-attempt-later).
    "lost-run": [
        "accepted",
        *["routing_failed", "store_wait"] * 2,
        "routing_failed",
        "result",
    ],
    # The store outage again, recorded after a failed inline resolve left its pin claim unsure
    # (patch pin-claim-unsure-made-again): the story reads the same.
    "store-outage-unsure": EXPECTED_STORE_OUTAGE,
    # Cancelled in a rate-limit wait, nothing in flight: the pin read finds no lost send
    # (patch cancel-reads-lost-pin), so plainly canceled.
    "cancel-rate-wait": ["accepted", "rate_limited", "result"],
    # After a lost first task, the key's claim met the store away until the deadline; attempt
    # 1's pin was another run's (patch lost-first-task-read-pin): it may have run, on i0.
    "lost-claim-read-pin": [
        "accepted",
        *["idempotency", "store_wait"] * 2,
        "idempotency",
        "timeout",
    ],
}
# Each recording's final status (the rest: success).
STATUS = {
    "timeout": "timeout",
    "door-deadline": "timeout",
    "failed-error": "error",
    "failed-timeout": "timeout",
    "cancel-a2a-task": "canceled",
    "cancel-queued-call": "canceled",
    "cancel-a2a-task-before": "error",
    "cancel-queued-call-before": "error",
    "not-sent": "error",
    "lost-run": "error",
    "cancel-rate-wait": "canceled",
    "lost-claim-read-pin": "timeout",
}


# Histories of the callback delivery workflow (`<request_id>/callback`): a request's timeline
# is read from its invoke workflow's history, so these have none (tests/unit/test_replay.py
# replays them).
DELIVERIES = {"callback-delivery", "callback-delivery-before"}


def test_every_recorded_history_has_an_expected_timeline() -> None:
    assert {p.stem for p in HISTORIES.glob("*.json")} - DELIVERIES <= set(EXPECTED)
    assert {p.stem for p in HISTORIES.glob("*.json")} >= DELIVERIES


@pytest.mark.parametrize("name", sorted(EXPECTED))
async def test_recorded_history_reads_as_its_story(name: str) -> None:
    timeline = await timeline_of(name)
    assert timeline.request_id == f"replay-{name}"
    assert kinds(timeline) == EXPECTED[name]
    offsets = [e.at_ms for e in timeline.events]
    assert offsets[0] == 0
    assert offsets == sorted(offsets)
    assert timeline.status == STATUS.get(name, "success")
    accepted = the(timeline, "accepted")
    assert accepted.detail["caller"] == "recorder"
    assert accepted.detail["capability"] == "knowledge-retriever"
    assert timeline.accepted_at is not None


async def test_a_key_claim_after_a_lost_first_task_ends_unknown_naming_its_pin() -> None:
    end = the(await timeline_of("lost-claim-read-pin"), "timeout")
    assert end.detail["instance"] == "i0"
    assert end.detail["error"]["outcome_unknown"] is True
    assert end.detail["error"]["retryable"] is False


async def test_a_retry_names_attempts_instances_and_the_backoff() -> None:
    timeline = await timeline_of("retry")
    failed = the(timeline, "attempt_failed").detail
    assert failed["attempt"] == 1
    assert failed["instance"] == "i0"
    assert failed["error"] == {"type": "transport_error", "message": "refused", "retryable": True}
    backoff = the(timeline, "backoff")
    assert backoff.detail["delay_ms"] == 1000
    assert backoff.detail["next_attempt"] == 2
    assert backoff.detail["waited_ms"] >= 1000  # the timer's own firing
    second = the(timeline, "sent", 1)
    assert (second.detail["attempt"], second.detail["instance"]) == (2, "i1")
    assert second.detail["protocol"] == "http"
    assert second.at_ms - backoff.at_ms >= 1000
    result = the(timeline, "result")
    assert result.detail["instance"] == "i1"
    assert result.summary.startswith("success in")
    accepted = the(timeline, "accepted")
    assert accepted.detail["deadline_ms"] == 5000
    assert accepted.detail["idempotent"] is True
    assert accepted.detail["retries"] == 2
    assert "timeout 5000 ms, idempotent, 2 retries, inline; sync" in accepted.summary


async def test_attempt_1_chosen_at_the_door_is_said_so() -> None:
    timeline = await timeline_of("door-routed")
    chosen = the(timeline, "instance_chosen")
    assert chosen.at_ms == 0
    assert chosen.detail["chosen_by"] == "door"
    assert chosen.detail["instance"] == "door"
    stale = await timeline_of("door-stale")
    assert "left before anything was sent" in the(stale, "rerouted").summary
    assert the(stale, "instance_chosen", 1).detail["chosen_by"] == "router"


async def test_a_late_answer_is_the_agent_s_word() -> None:
    for name in ("late-answer", "late-answer-update"):  # a signal before, an update now
        timeline = await timeline_of(name)
        late = the(timeline, "late_answer")
        assert late.detail["status"] == "success"
        assert late.detail["instance"] == "i0"
        assert the(timeline, "attempt_accepted").at_ms <= late.at_ms


async def test_an_encrypted_history_reads_the_same_with_the_codec() -> None:
    cipher = PayloadCipher({"k1": bytes(range(32))}, "k1")
    codec = EncryptionCodec(cipher)
    history = recorded("retry")
    for event in history.events:
        _seal(event, codec)
    sealed = dataclasses.replace(pydantic_data_converter, payload_codec=codec)
    timeline = build_timeline("replay-retry", await decode_history(history.events, sealed))
    plain = await timeline_of("retry")
    assert timeline == plain
    # Without the key the story still reads, only without what the payloads said.
    blind = build_timeline(
        "replay-retry", await decode_history(history.events, pydantic_data_converter)
    )
    assert blind.events
    assert blind.events[0].kind == "accepted"


def _seal(message: Message, codec: EncryptionCodec) -> None:
    """Encrypt every payload inside a history event, as the SDK's codec would have."""
    for field, value in message.ListFields():
        kind = field.message_type
        if kind is None:
            continue
        if kind.full_name == "temporal.api.common.v1.Payload":
            for payload in value if field.is_repeated else [value]:
                payload.CopyFrom(codec.encrypt(payload))
        elif kind.GetOptions().map_entry:
            for item in value.values():
                if isinstance(item, Message):
                    _seal(item, codec)
        elif field.is_repeated:
            for item in value:
                _seal(item, codec)
        else:
            _seal(value, codec)


# -- hand-made histories: what the recordings do not cover ----------------------------------


def ev(event_id: int, type_: str, at: float, **attrs: Any) -> HistoryEvent:
    return HistoryEvent(event_id=event_id, type=type_, time_ms=T0 + at, attrs=attrs)


def started(**extra: Any) -> HistoryEvent:
    plan = {
        "timeout_ms": 3000,
        "idempotent": False,
        "max_retries": 0,
        "mode": "queue",
        "idempotent_configured": False,
        "timeout_configured": True,
        "retries_if_idempotent": 2,
    }
    inp = {
        "request_id": "req-1",
        "caller": "orchestrator",
        "target": "knowledge-retriever",
        "operation": "query",
        "accepted_at_ms": T0,
        "deadline_ms": T0 + 3000,
        "plan": plan,
        **extra,
    }
    return ev(1, "workflow_execution_started", 2, input=inp)


ENDPOINT = {
    "instance_id": "retriever-03",
    "capability": "knowledge-retriever",
    "protocol": "grpc",
    "address": "10.0.1.8:9001",
    "strategy": "least_request",
    "skipped": ["retriever-01"],
    "bypassed": ["retriever-02"],
    "declared_idempotent": True,
}


def call_input(attempt: int) -> dict[str, Any]:
    return {
        "endpoint": ENDPOINT,
        "message": {"header": {"request_id": "req-1", "attempt": attempt}},
        "timeout_ms": 2900,
    }


def test_queue_mode_activities_and_the_seed_s_outage_story() -> None:
    """The seed's troubleshooting story: chosen, sent via gRPC, then nothing until the
    deadline. Here as regular activities on the capability's task queue."""
    lost = failure_dict(
        "timeout", "timeout", "activity Heartbeat timeout", timeout_type="heartbeat"
    )
    history = [
        started(),
        ev(5, "activity_task_scheduled", 3, activity_type="reach.resolve", activity_id="1"),
        ev(6, "activity_task_started", 4, scheduled_event_id=5, attempt=1),
        ev(7, "activity_task_completed", 5, scheduled_event_id=5, result=ENDPOINT),
        ev(
            11,
            "activity_task_scheduled",
            6,
            activity_type="reach.call",
            activity_id="2",
            input=call_input(1),
            task_queue="reach-cap-knowledge-retriever",
        ),
        ev(12, "activity_task_started", 7, scheduled_event_id=11, attempt=1),
        ev(13, "activity_task_timed_out", 1507, scheduled_event_id=11, failure=lost),
        ev(14, "timer_started", 1508, timer_id="1", start_to_fire_ms=500.0),
        ev(15, "timer_fired", 2008, timer_id="1"),
        ev(
            21,
            "activity_task_scheduled",
            2010,
            activity_type="reach.call",
            activity_id="4",
            input=call_input(1),
            task_queue="reach-cap-knowledge-retriever",
        ),
        ev(
            30,
            "workflow_execution_completed",
            3011,
            result={
                "request_id": "req-1",
                "status": "timeout",
                "error": {"type": "timeout", "message": "no answer within timeout_ms=3000"},
                "instance_id": "retriever-03",
            },
        ),
    ]
    timeline = build_timeline("req-1", history)
    assert kinds(timeline) == [
        "accepted",
        "instance_chosen",
        "sent",
        "attempt_failed",
        "redeliver",
        "timeout",
    ]
    assert [e.at_ms for e in timeline.events] == [0, 5, 7, 1507, 1508, 3011]
    chosen = the(timeline, "instance_chosen")
    assert chosen.summary == (
        "retriever-03 via grpc (least_request; skipped retriever-01 (ejected); bypassed "
        "retriever-02 (at max_inflight)) — the agents declare it idempotent (2 retries)"
    )
    assert the(timeline, "sent").summary == "attempt 1 sent to retriever-03 via grpc"
    assert the(timeline, "sent").detail["task_queue"] == "reach-cap-knowledge-retriever"
    failed = the(timeline, "attempt_failed").detail["error"]
    assert failed["type"] == "transport_error"
    assert failed["outcome_unknown"] is True
    assert the(timeline, "redeliver").detail["instance"] == "retriever-03"
    assert timeline.status == "timeout"
    accepted = the(timeline, "accepted")
    assert "idempotent if the agents say so (2 retries then)" in accepted.summary

    # Read while the re-delivery waits for a worker of the capability's queue.
    pending = ev(0, PENDING_ACTIVITY, 2500, activity_id="4", state="scheduled", attempt=1)
    waiting = [*history[:-1], pending]
    running = build_timeline("req-1", waiting)
    assert running.status == "running"
    assert kinds(running)[-1] == "waiting_for_worker"
    assert "reach-cap-knowledge-retriever" in running.events[-1].summary
    under_way = ev(
        0, PENDING_ACTIVITY, 2500, activity_id="4", state="started", attempt=1, started_ms=T0 + 2020
    )
    in_flight = [*history[:-1], under_way]
    assert kinds(build_timeline("req-1", in_flight))[-2:] == ["sent", "in_flight"]


def delivery_history(*tail: HistoryEvent) -> list[HistoryEvent]:
    return [
        ev(1, "workflow_execution_started", 100, input={"url": "http://orchestrator/cb"}),
        ev(5, "activity_task_scheduled", 101, activity_type="reach.deliver_callback"),
        *tail,
    ]


def with_callback() -> list[HistoryEvent]:
    return [
        started(callback="http://orchestrator/cb", endpoint=ENDPOINT),
        ev(
            5,
            "marker_recorded",
            60,
            marker="core_local_activity",
            task=4,
            data={
                "activity_type": "reach.call",
                "original_schedule_time": {"seconds": 1_800_000_000, "nanos": 10_000_000},
            },
            result={"status": "ok", "result": {}},
        ),
        ev(
            8,
            "start_child_workflow_execution_initiated",
            61,
            workflow_type="DeliverCallbackWorkflow",
            workflow_id="req-1/callback",
        ),
        ev(
            9,
            "workflow_execution_completed",
            62,
            result={"request_id": "req-1", "status": "success", "duration_ms": 50},
        ),
    ]


def test_callback_delivery_retried_then_delivered() -> None:
    delivery = delivery_history(
        ev(
            6,
            "activity_task_started",
            2300,
            scheduled_event_id=5,
            attempt=3,
            last_failure=failure_dict(
                "application", "callback_failed", "callback answered HTTP 503"
            ),
        ),
        ev(7, "activity_task_completed", 2310, scheduled_event_id=5, result=3),
        ev(10, "workflow_execution_completed", 2311, result={"status": "delivered", "attempts": 3}),
    )
    timeline = build_timeline("req-1", with_callback(), delivery)
    assert kinds(timeline) == [
        "accepted",
        "instance_chosen",
        "sent",
        "attempt_succeeded",
        "result",
        "callback",
        "callback_retrying",
        "callback_delivered",
    ]
    assert [e.at_ms for e in timeline.events] == [0, 0, 10, 60, 62, 62, 2300, 2310]
    retrying = the(timeline, "callback_retrying")
    assert retrying.summary == (
        "callback attempts 1-2 failed (last: callback answered HTTP 503); attempt 3"
    )
    assert the(timeline, "callback_delivered").detail == {
        "url": "http://orchestrator/cb",
        "attempts": 3,
    }


def test_callback_given_up_and_pending() -> None:
    given_up = delivery_history(
        ev(6, "activity_task_started", 9000, scheduled_event_id=5, attempt=4),
        ev(
            7,
            "activity_task_failed",
            9001,
            scheduled_event_id=5,
            failure=failure_dict(
                "application",
                "callback_rejected",
                "callback answered HTTP 404",
                details=[{"attempt": 4}],
            ),
        ),
        ev(10, "workflow_execution_completed", 9002, result={"status": "given_up", "attempts": 4}),
    )
    timeline = build_timeline("req-1", with_callback(), given_up)
    last = timeline.events[-1]
    assert last.kind == "callback_given_up"
    assert last.detail["attempts"] == 4
    assert last.detail["last_error"] == "callback answered HTTP 404"
    assert timeline.status == "success"  # the result stands whatever the delivery does

    pending = delivery_history(
        ev(
            0,
            PENDING_ACTIVITY,
            5000,
            activity_id="1",
            attempt=3,
            last_failure=failure_dict("application", "transport_error", "connection refused"),
            next_attempt_ms=T0 + 6000,
        )
    )
    timeline = build_timeline("req-1", with_callback(), pending)
    last = timeline.events[-1]
    assert last.kind == "callback_pending"
    assert last.detail == {
        "attempt": 3,
        "last_error": "connection refused",
        "next_attempt_at_ms": 6000,
    }


def test_a_request_ended_by_an_operator_and_one_still_running() -> None:
    terminated = build_timeline(
        "req-1", [started(), ev(5, "workflow_execution_terminated", 900, reason="stuck")]
    )
    assert kinds(terminated) == ["accepted", "ended"]
    assert terminated.status == "error"
    assert terminated.events[-1].summary == "terminated by an operator: stuck"
    running = build_timeline("req-1", [started()])
    assert running.status == "running"
    assert kinds(running) == ["accepted"]


def test_offsets_never_go_backwards_across_clocks() -> None:
    """A worker clock behind the server's must not reorder the story."""
    behind = {"seconds": 1_799_999_999, "nanos": 0}  # a second before acceptance
    history = [
        started(endpoint=ENDPOINT),
        ev(
            5,
            "marker_recorded",
            40,
            marker="core_local_activity",
            task=4,
            data={"activity_type": "reach.call", "original_schedule_time": behind},
            result={"status": "ok"},
        ),
    ]
    timeline = build_timeline("req-1", history)
    assert kinds(timeline) == ["accepted", "instance_chosen", "sent", "attempt_succeeded"]
    assert [e.at_ms for e in timeline.events] == [0, 0, 0, 40]


# -- the visibility query ----------------------------------------------------------------------


def test_visibility_query_combines_the_filters() -> None:
    since = datetime(2026, 12, 1, 10, 0, 0, tzinfo=UTC)
    query = visibility_query(
        "InvokeWorkflow",
        capability="knowledge-retriever",
        operation="query",
        caller="orchestrator",
        status="error",
        started_after=since,
        owner="alice",
    )
    assert query == (
        "WorkflowType = 'InvokeWorkflow' AND ReachCapability = 'knowledge-retriever' AND "
        "ReachOperation = 'query' AND ReachCaller = 'orchestrator' AND ReachCaller = 'alice' "
        "AND ((ExecutionStatus = 'Completed' AND ReachStatus = 'error') OR (ExecutionStatus = "
        "'Failed' AND ReachStatus != 'timeout') OR ExecutionStatus IN ('Terminated', 'Canceled'))"
        " AND StartTime >= '2026-12-01T10:00:00.000000Z'"
    )
    assert visibility_query("InvokeWorkflow", status="running").endswith(
        "ExecutionStatus = 'Running'"
    )


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("caller", "x' OR ReachCaller != 'y"),
        ("caller", 'quote"d'),
        ("caller", "back\\slash"),
        ("caller", "with space"),
        ("capability", "Knowledge Retriever"),
        ("operation", "query'"),
    ],
)
def test_nothing_typed_reaches_the_query_raw(name: str, value: str) -> None:
    with pytest.raises(ValueError, match=name):
        visibility_query("InvokeWorkflow", **{name: value})


def test_caller_filter_allows_visible_ascii_but_quotes_and_backslash() -> None:
    import re

    allowed = [chr(c) for c in range(0x21, 0x7F) if re.fullmatch(CALLER_FILTER, chr(c))]
    assert set(map(chr, range(0x21, 0x7F))) - set(allowed) == {"'", '"', "\\", "`"}
    assert quoted("it's") == "'it\\'s'"


def test_since_and_status() -> None:
    assert since_delta("90") == timedelta(seconds=90)
    assert since_delta("10m") == timedelta(minutes=10)
    assert since_delta("1.5h") == timedelta(minutes=90)
    assert since_delta("999999999.999d") == timedelta(days=3650)  # clamped
    with pytest.raises(ValueError, match="duration"):
        since_delta("ten minutes")
    assert status_of("RUNNING", "success") == "running"  # a door-routed start says success
    assert status_of("COMPLETED", "timeout") == "timeout"
    assert status_of("COMPLETED", "input_required") == "input_required"  # an A2A task asks
    assert status_of("COMPLETED", "canceled") == "canceled"
    assert status_of("FAILED", "timeout") == "timeout"  # a timeout fails its workflow
    assert status_of("FAILED", "error") == "error"
    assert status_of("FAILED", "success") == "error"  # a bug after a door-routed start
    assert status_of("TERMINATED", "running") == "error"
    assert status_of("TIMED_OUT", None) == "timeout"


def test_a_keyed_request_says_its_key_is_what_makes_retries_safe() -> None:
    """Not 'idempotent if the agents say so': with a key, retries are safe whatever they say."""
    event = started(idempotency_key="order-7")
    event.attrs["input"]["plan"]["max_retries"] = 2
    accepted = the(build_timeline("req-1", [event]), "accepted")
    assert "keyed (idempotency_key), 2 retries, queue" in accepted.summary
    assert "order-7" not in accepted.summary  # the caller's key is not shown
