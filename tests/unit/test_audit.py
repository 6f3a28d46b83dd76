"""The audit log (R20): what each sink writes, when, and that nothing fails the gateway."""

from __future__ import annotations

import asyncio
import errno
import io
import json
import logging
import os
import re
import stat
import threading
from pathlib import Path
from typing import Any

import pytest

from reach.config import AuditSettings
from reach.security.audit import AuditLog

TS = re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z$")
INVOKE: dict[str, Any] = {
    "request_id": "r-1",
    "caller": "orchestrator",
    "capability": "knowledge-retriever",
    "operation": "query",
    "instance": "kr-1",
    "duration_ms": 12.5,
    "status": 200,
    "outcome": "success",
    "error_type": None,
    "attempts": 1,
    "rule": "orchestrator->knowledge-retriever",
    "principal": "orchestrator",
}


def _lines(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def _file_log(path: Path, **kwargs: Any) -> AuditLog:
    return AuditLog(AuditSettings(sink="file", file=str(path), **kwargs))


def test_file_sink_writes_redacted_json_lines_and_fsyncs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    synced: list[int] = []
    real_fsync = os.fsync

    def fsync(fd: int) -> None:
        synced.append(fd)
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    path = tmp_path / "deep" / "er" / "audit.jsonl"
    log = _file_log(path)
    log.record("invoke", **INVOKE)
    log.record("token_issued", principal="ops", token="t-123", note="x" * 300)
    assert not path.exists()  # nothing is written on the caller's path
    log.flush_now()

    first, second = _lines(path)
    assert TS.match(first.pop("ts"))
    assert first == {"event": "invoke", **{k: v for k, v in INVOKE.items() if v is not None}}
    assert list(first)[:2] == ["event", "request_id"]
    assert second["token"] == "***"
    assert second["note"]["len"] == 300
    assert "t-123" not in path.read_text()
    assert len(synced) == 1  # one fsync per batch
    assert stat.S_IMODE(path.stat().st_mode) == 0o600

    log.flush_now()  # nothing pending: no write, no fsync
    assert len(synced) == 1


def test_file_sink_appends(tmp_path: Path) -> None:
    path = tmp_path / "audit.jsonl"
    path.write_text('{"earlier": true}\n')
    for _ in range(2):
        log = _file_log(path)
        log.record("join", agent_id="a1")
        log.flush_now()
    lines = _lines(path)
    assert lines[0] == {"earlier": True}
    assert [line["event"] for line in lines[1:]] == ["join", "join"]


def test_ts_and_event_are_the_logs_own(tmp_path: Path) -> None:
    path = tmp_path / "audit.jsonl"
    log = _file_log(path)
    log.record("invoke", ts="forged", event="forged", caller="c")
    log.flush_now()
    (line,) = _lines(path)
    assert line["event"] == "invoke"
    assert TS.match(line["ts"])
    assert line["caller"] == "c"


def test_the_configured_redaction_applies(tmp_path: Path) -> None:
    path = tmp_path / "audit.jsonl"
    log = _file_log(path, redact_keys=["pin"], max_string=8)
    log.record("invoke", pin="1234", password="not-a-name-here", short="12345678")
    log.flush_now()
    (line,) = _lines(path)
    assert line["pin"] == "***"
    assert line["password"] == {"len": 15, "sha256": line["password"]["sha256"]}
    assert line["short"] == "12345678"


def test_non_string_keys_become_strings(tmp_path: Path) -> None:
    path = tmp_path / "audit.jsonl"
    log = _file_log(path)
    log.record("invoke", labels={(1, 2): "pair", 3: "three"})
    log.flush_now()
    (line,) = _lines(path)
    assert line["labels"] == {"(1, 2)": "pair", "3": "three"}


def test_stdout_sink(capsys: pytest.CaptureFixture[str]) -> None:
    log = AuditLog(AuditSettings(sink="stdout"))
    log.record("invoke", **INVOKE)
    log.flush_now()
    out = capsys.readouterr().out
    (line,) = [json.loads(text) for text in out.splitlines()]
    assert line["request_id"] == "r-1"
    assert "error_type" not in line


def test_both_sinks(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "audit.jsonl"
    log = AuditLog(AuditSettings(sink="both", file=str(path)))
    log.record("evict", agent_id="a1")
    log.flush_now()
    assert json.loads(capsys.readouterr().out)["agent_id"] == "a1"
    assert _lines(path)[0]["agent_id"] == "a1"


def test_none_sink_keeps_nothing(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "audit.jsonl"
    log = AuditLog(AuditSettings(sink="none", file=str(path)))
    assert not log.enabled
    log.record("invoke", **INVOKE)
    log.flush_now()
    assert log.pending == 0
    assert not path.exists()
    assert capsys.readouterr().out == ""


async def test_the_background_task_flushes_on_its_interval(tmp_path: Path) -> None:
    path = tmp_path / "audit.jsonl"
    log = _file_log(path, flush_interval_ms=10)
    log.record("before_start", n=0)  # buffered until the task runs
    await log.start()
    await log.start()  # idempotent
    log.record("invoke", **INVOKE)
    for _ in range(300):
        if path.exists() and len(path.read_text().splitlines()) == 2:
            break
        await asyncio.sleep(0.01)
    assert [line["event"] for line in _lines(path)] == ["before_start", "invoke"]
    await log.aclose()


async def test_aclose_flushes_what_is_left(tmp_path: Path) -> None:
    path = tmp_path / "audit.jsonl"
    log = _file_log(path, flush_interval_ms=60_000)
    await log.start()
    log.record("invoke", **INVOKE)
    await asyncio.sleep(0)
    assert not path.exists()
    await log.aclose()
    assert [line["event"] for line in _lines(path)] == ["invoke"]
    await log.aclose()  # twice is fine


async def test_async_context_manager(tmp_path: Path) -> None:
    path = tmp_path / "audit.jsonl"
    async with _file_log(path, flush_interval_ms=60_000) as log:
        log.record("invoke", **INVOKE)
    assert len(_lines(path)) == 1


def test_a_write_error_is_logged_once_and_the_records_kept(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("a file where a directory should be")
    path = blocker / "audit.jsonl"
    log = _file_log(path)
    caplog.set_level(logging.INFO, logger="reach.audit")

    log.record("invoke", n=1)
    log.flush_now()  # does not raise
    log.record("invoke", n=2)
    log.flush_now()
    errors = [r for r in caplog.records if r.levelno == logging.ERROR]
    assert len(errors) == 1
    assert "cannot write" in errors[0].getMessage()
    assert log.pending == 2

    blocker.unlink()  # the disk is fixed
    log.flush_now()
    assert [line["n"] for line in _lines(path)] == [1, 2]
    assert log.pending == 0
    assert any("writes again" in r.getMessage() for r in caplog.records)


def test_a_failing_file_sink_does_not_repeat_stdout_lines(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    blocker = tmp_path / "blocker"
    blocker.write_text("")
    path = blocker / "audit.jsonl"
    log = AuditLog(AuditSettings(sink="both", file=str(path)))
    log.record("invoke", n=1)
    log.flush_now()
    log.record("invoke", n=2)
    log.flush_now()
    blocker.unlink()
    log.flush_now()
    assert [json.loads(x)["n"] for x in capsys.readouterr().out.splitlines()] == [1, 2]
    assert [line["n"] for line in _lines(path)] == [1, 2]


def test_a_short_write_is_completed_not_repeated(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "audit.jsonl"
    log = _file_log(path)
    for n in range(3):
        log.record("invoke", n=n)
    real_write = os.write
    calls = 0

    def flaky_write(fd: int, data: Any) -> int:
        nonlocal calls
        calls += 1
        if calls == 1:
            return real_write(fd, bytes(data)[:70])  # stops inside the second line
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "write", flaky_write)
    log.flush_now()
    monkeypatch.setattr(os, "write", real_write)
    log.flush_now()
    assert [line["n"] for line in _lines(path)] == [0, 1, 2]


def test_pending_records_are_capped_oldest_dropped(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    blocker = tmp_path / "blocker"
    blocker.write_text("")
    log = AuditLog(AuditSettings(sink="file", file=str(blocker / "audit.jsonl")), max_pending=5)
    caplog.set_level(logging.WARNING, logger="reach.audit")
    for n in range(4):
        log.record("invoke", n=n)
    log.flush_now()
    for n in range(4, 12):
        log.record("invoke", n=n)  # the buffer itself holds 5: 4..6 are dropped here
    log.flush_now()
    assert log.pending == 5
    assert log.dropped == 7
    assert any("dropped" in r.getMessage() for r in caplog.records)
    blocker.unlink()
    log.flush_now()
    assert [line["n"] for line in _lines(blocker / "audit.jsonl")] == [7, 8, 9, 10, 11]


def test_a_closed_stdout_does_not_raise(caplog: pytest.LogCaptureFixture) -> None:
    stream = io.StringIO()
    stream.close()
    log = AuditLog(AuditSettings(sink="stdout"), stdout=stream)
    log.record("invoke", n=1)
    log.flush_now()
    assert log.pending == 1
    assert any(r.levelno == logging.ERROR for r in caplog.records)


def test_records_from_many_threads_while_flushing(tmp_path: Path) -> None:
    path = tmp_path / "audit.jsonl"
    log = _file_log(path)
    stop = threading.Event()

    def flusher() -> None:
        while not stop.is_set():
            log.flush_now()

    def writer(thread: int) -> None:
        for n in range(500):
            log.record("invoke", thread=thread, n=n)

    flushing = threading.Thread(target=flusher)
    flushing.start()
    writers = [threading.Thread(target=writer, args=(t,)) for t in range(4)]
    for w in writers:
        w.start()
    for w in writers:
        w.join()
    stop.set()
    flushing.join()
    log.flush_now()
    lines = _lines(path)
    assert len(lines) == 2000
    for t in range(4):
        assert [line["n"] for line in lines if line["thread"] == t] == list(range(500))
