"""A call's progress notes (reach.progress): bounded, encoded, read back, and merged into a
timeline by their time (pure logic)."""

from __future__ import annotations

import json
from datetime import UTC, datetime
from typing import Any

import pytest

from reach import progress
from reach.security.redact import digest, redact
from reach.timeline import Timeline, TimelineEvent, with_progress


def test_a_note_keeps_the_numbers_and_a_short_message() -> None:
    note = progress.note_of(
        {"progressToken": "r", "progress": 3, "total": 10, "message": "x" * 500}, 1000.4, 2
    )
    assert note == {
        "at_ms": 1000,
        "attempt": 2,
        "progress": 3.0,
        "total": 10.0,
        "message": "x" * progress.MAX_MESSAGE_CHARS,
    }
    assert progress.note_of({"progress": "3"}, 0, 1) is None
    assert progress.note_of({"progress": float("nan")}, 0, 1) is None
    assert progress.note_of({"progress": True}, 0, 1) is None
    assert progress.note_of("nope", 0, 1) is None
    assert progress.note_of({"progress": 1, "total": "x"}, 0, 1) == {
        "at_ms": 0,
        "attempt": 1,
        "progress": 1.0,
    }


def test_the_log_keeps_the_last_notes_and_counts_them_all() -> None:
    log = progress.ProgressLog(1, lambda: 5.0)
    for i in range(progress.MAX_NOTES + 7):
        assert log.add({"progress": i})
    assert not log.add({"nothing": 1})
    count, notes = progress.decode(log.encode())
    assert count == progress.MAX_NOTES + 7
    assert [n["progress"] for n in notes] == [float(i) for i in range(7, progress.MAX_NOTES + 7)]
    assert progress.decode(None) == (0, [])
    assert progress.decode("{not json") == (0, [])
    assert progress.decode('{"notes": [1, {"at_ms": "x"}]}') == (0, [])


def test_notes_are_placed_by_time_among_the_events() -> None:
    accepted = datetime.fromtimestamp(1000.0, UTC)

    def event(at: int, kind: str) -> TimelineEvent:
        return TimelineEvent(at_ms=at, kind=kind, summary=kind)

    story = Timeline(
        request_id="r",
        status="success",
        accepted_at=accepted,
        events=[event(0, "accepted"), event(5, "sent"), event(900, "result")],
    )
    notes = [
        {"at_ms": 1_000_400, "attempt": 1, "progress": 2.0, "total": 4.0},
        {"at_ms": 1_000_100, "attempt": 1, "progress": 1.0, "message": "half"},
    ]
    merged = with_progress(story, 5, notes)
    assert [e.kind for e in merged.events] == ["accepted", "sent", "progress", "progress", "result"]
    first, second = merged.events[2], merged.events[3]
    assert (first.at_ms, second.at_ms) == (100, 400)
    assert first.summary == "attempt 1 progress 1: half (3 earlier not kept)"
    assert second.summary == "attempt 1 progress 2 of 4"
    assert first.detail["earlier_not_kept"] == 3
    assert "earlier_not_kept" not in second.detail
    assert with_progress(story, 0, []) is story


def test_a_note_is_never_placed_before_its_attempt_was_sent() -> None:
    """An inline call's `sent` is written when the call ends (its local activity's marker):
    the notes the agent sent while it ran come after it, at its time, not before it."""
    accepted = datetime.fromtimestamp(1000.0, UTC)
    story = Timeline(
        request_id="r",
        status="success",
        accepted_at=accepted,
        events=[
            TimelineEvent(at_ms=0, kind="accepted", summary="accepted"),
            TimelineEvent(at_ms=1600, kind="instance_chosen", summary="chosen"),
            TimelineEvent(at_ms=1633, kind="sent", summary="sent", detail={"attempt": 1}),
            TimelineEvent(at_ms=1700, kind="result", summary="result"),
        ],
    )
    notes = [{"at_ms": 1_001_085, "attempt": 1, "progress": 1.0}]
    merged = with_progress(story, 1, notes)
    kinds = [e.kind for e in merged.events]
    assert kinds == ["accepted", "instance_chosen", "sent", "progress", "result"]
    assert merged.events[3].at_ms == 1633


def test_a_log_message_is_kept_redacted_and_bounded() -> None:
    params = {"level": "warning", "logger": "l" * 300, "data": {"api_key": "k", "n": 1}}
    note = progress.log_of(params, 7.6, 2, 3, keys=("api_key",))
    assert note == {
        "at_ms": 8,
        "attempt": 2,
        "seq": 3,
        "level": "warning",
        "data": {"api_key": "***", "n": 1},
        "logger": "l" * 128,
    }
    cut = progress.log_of({"level": "info", "data": "y" * 5000}, 0, 1, 1)
    assert cut is not None
    assert cut["data"] == "y" * progress.MAX_LOG_CHARS
    big = {"level": "info", "data": [str(i) * 50 for i in range(200)]}
    huge = progress.log_of(big, 0, 1, 1)
    assert huge is not None
    assert set(huge["data"]) == {"len", "sha256"}
    assert progress.log_of({"level": "loud", "data": "x"}, 0, 1, 1) is None
    assert progress.log_of("nope", 0, 1, 1) is None


def test_a_large_log_message_is_digested_without_being_walked(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A server may flood its stream with large log messages: each was walked item by item
    by the redactor (dict of 60,000 keys: ~150 ms of the call's event loop) only to be
    digested; now past MAX_LOG_BYTES as JSON it is digested at once, a small one still
    redacted."""
    walked: list[object] = []

    def counting(value: object, **kw: Any) -> object:
        walked.append(value)
        return redact(value, **kw)

    monkeypatch.setattr(progress, "redact", counting)
    data = {f"k{i}": "v" * 8 for i in range(60_000)}
    note = progress.log_of({"level": "info", "data": data}, 0, 1, 1)
    assert note is not None
    assert note["data"] == digest(json.dumps(data, separators=(",", ":")))
    assert walked == []
    small = progress.log_of({"level": "info", "data": {"token": "t"}}, 0, 1, 2)
    assert small is not None
    assert small["data"] == {"token": "***"}
    assert len(walked) == 1
    deep: list[Any] = []
    for _ in range(5000):  # deeper than json.dumps goes: redacted, bounded
        deep = [deep]
    assert progress.log_of({"level": "info", "data": deep}, 0, 1, 3) is not None


def test_the_record_keeps_the_last_log_messages_beside_the_notes() -> None:
    log = progress.ProgressLog(1, lambda: 5.0)
    assert log.add({"progress": 1})
    assert progress.ProgressLog(1, lambda: 5.0).encode() == '{"count":0,"notes":[]}'
    for i in range(progress.MAX_LOGS + 3):
        assert log.add_log({"level": "info", "data": str(i)})
    assert not log.add_log({"data": "no level"})
    assert log.changes == 1 + progress.MAX_LOGS + 3
    raw = log.encode()
    count, logs = progress.decode_logs(raw)
    assert count == progress.MAX_LOGS + 3
    assert [n["seq"] for n in logs] == list(range(4, progress.MAX_LOGS + 4))
    assert progress.decode(raw)[0] == 1  # the notes are read as before
    assert progress.decode_logs(None) == (0, [])
    assert progress.decode_logs('{"logs": [{"at_ms": 1, "level": "loud", "seq": 1}]}') == (0, [])
    assert progress.level_at_least("error", "warning")
    assert not progress.level_at_least("info", "warning")
    assert not progress.level_at_least("loud", "debug")


async def test_the_front_relays_each_log_message_once_at_or_above_the_level() -> None:
    from gateway_api.mcp_front import Relay
    from reach.policy.state import MemoryPolicyState

    state = MemoryPolicyState()
    frames: list[bytes] = []

    async def send(message: dict[str, object]) -> None:
        body = message.get("body")
        if isinstance(body, bytes) and body:
            frames.append(body)

    log = progress.ProgressLog(1, lambda: 5.0)
    for level in ("debug", "warning", "error"):
        log.add_log({"level": level, "data": level})
    await state.put(progress.progress_key("r"), log.encode(), 60)
    relay = Relay(state, "r", None, "warning")
    assert await relay.forward(send)
    assert not await relay.forward(send)  # nothing new: nothing sent again
    again = progress.ProgressLog(2, lambda: 6.0)  # a retried attempt's messages are new
    again.add_log({"level": "error", "data": "second"})
    await state.put(progress.progress_key("r"), again.encode(), 60)
    assert await relay.forward(send)
    sent = b"".join(frames).decode()
    assert sent.count("notifications/message") == 3
    assert '"data":"debug"' not in sent
    assert "progress" not in sent
    assert sent.index('"data":"warning"') < sent.index('"data":"error"') < sent.index("second")
