"""A call's progress notes (reach.progress): bounded, encoded, read back, and merged into a
timeline by their time (pure logic)."""

from __future__ import annotations

from datetime import UTC, datetime

from reach import progress
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
    assert first.summary == "attempt 1 progress 1: half"
    assert second.summary == "attempt 1 progress 2 of 4"
    assert first.detail["earlier_not_kept"] == 3
    assert "earlier_not_kept" not in second.detail
    assert with_progress(story, 0, []) is story
