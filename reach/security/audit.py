"""The audit log (R20): one redacted JSON line per invoke, Join, eviction, token change, denial.

`AuditLog.record(event, **fields)` is on the gateway's hot path, so it only builds the record,
redacts it, serialises it and appends the line to an in-memory buffer. A background task
(`start()`) writes the buffer every `flush_interval_ms` from a worker thread, one `fsync` per
batch, so the event loop never waits on the disk; `aclose()` writes what is left; `flush_now()`
does the same synchronously for command-line use. Records made before `start()`, or with no event
loop at all, wait in the buffer for the next flush.

A record is `{"ts": "2025-01-31T12:00:00.123Z", "event": <event>, **fields}` with `None` fields
left out and every field redacted (`reach.security.redact`: values under secret keys masked, long
text reduced to its length and SHA-256, with `settings.redact_keys` and `settings.max_string`).
The fields the gateway passes:

    request_id   the request's id                    caller       the authenticated caller
    capability   the target capability               operation    the operation invoked
    instance     the agent instance that answered    duration_ms  time spent in the gateway
    status       the HTTP status code (int)           outcome      the request status string
    error_type   the error vocabulary's type          attempts     calls made to agents
    rule         the authorization rule that decided  principal    the token's principal

plus per-event extras (an agent id on `join`/`evict`, a token id on `token_*`, ...). `ts` and
`event` are the log's own: fields of those names are ignored.

Sinks (`settings.sink`): `file` appends to `settings.file` (parent directories created; the file
created with mode 0o600), `stdout` writes to `sys.stdout`, `both`, or `none` (nothing is kept).
A sink that fails to write (disk full, permission, a closed stream) never raises into the caller:
the first failure of each kind is logged on the `reach.audit` logger, the lines stay pending for
the next flush, and pending lines are capped at `max_pending` per sink, oldest dropped and
counted in a warning.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import sys
import threading
import time
from collections import deque
from pathlib import Path
from typing import Any, Final, TextIO

from reach.config import AuditSettings
from reach.security.redact import Redactor

__all__ = ["AuditLog"]

logger = logging.getLogger("reach.audit")

DEFAULT_MAX_PENDING: Final = 100_000
_RESERVED: Final = frozenset({"ts", "event"})


class _Clock:
    """ISO-8601 UTC timestamps with milliseconds; the formatted second is reused."""

    __slots__ = ("_cached",)

    def __init__(self) -> None:
        # One tuple, swapped whole, so threads calling now() never pair a second with another
        # second's text.
        self._cached: tuple[int, str] = (-1, "")

    def now(self) -> str:
        second, ms = divmod(time.time_ns() // 1_000_000, 1000)
        cached_second, prefix = self._cached
        if second != cached_second:
            prefix = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(second))
            self._cached = (second, prefix)
        return f"{prefix}.{ms:03d}Z"


class _Sink:
    """One destination with its own pending lines, so a failure of one sink never makes another
    write a line twice."""

    name: str = "sink"

    def __init__(self, max_pending: int) -> None:
        self.pending: deque[str] = deque()
        self.max_pending = max_pending
        self.dropped = 0
        self._failures: set[tuple[str, int | None]] = set()
        self._failed_attempts = 0

    def take(self, lines: list[str]) -> None:
        self.pending.extend(lines)
        excess = len(self.pending) - self.max_pending
        if excess > 0:
            self._drop_oldest(excess)
            self.dropped += excess
            logger.warning(
                "audit sink %s: %d record(s) dropped, oldest first (%d pending is the cap; "
                "%d dropped in all)",
                self.name,
                excess,
                self.max_pending,
                self.dropped,
            )

    def _drop_oldest(self, count: int) -> None:
        for _ in range(count):
            self.pending.popleft()

    def flush(self) -> None:
        if not self.pending:
            return
        try:
            self.write()
        except Exception as exc:  # anything: the gateway must keep serving
            self._failed_attempts += 1
            kind = (type(exc).__name__, getattr(exc, "errno", None))
            if kind not in self._failures:
                self._failures.add(kind)
                logger.error(
                    "audit sink %s cannot write (%s: %s); %d record(s) kept for the next try",
                    self.name,
                    type(exc).__name__,
                    exc,
                    len(self.pending),
                )
            return
        if self._failures:
            logger.warning(
                "audit sink %s writes again after %d failed attempt(s)",
                self.name,
                self._failed_attempts,
            )
            self._failures.clear()
            self._failed_attempts = 0

    def write(self) -> None:
        raise NotImplementedError


class _FileSink(_Sink):
    name = "file"

    def __init__(self, path: str, max_pending: int) -> None:
        super().__init__(max_pending)
        self.path = Path(path)
        # Bytes of the first pending line already in the file (a short write), so a retry
        # completes that line instead of writing it twice.
        self._offset = 0

    def _drop_oldest(self, count: int) -> None:
        # A line half in the file is kept: dropping it would leave a broken line behind.
        head = self.pending.popleft() if self._offset else None
        for _ in range(count):
            if not self.pending:
                break
            self.pending.popleft()
        if head is not None:
            self.pending.appendleft(head)

    def write(self) -> None:
        # Opened per batch (a few µs every flush): a rotated or removed file is simply created
        # again, and no descriptor is held between flushes.
        self.path.parent.mkdir(parents=True, exist_ok=True)
        flags = os.O_WRONLY | os.O_APPEND | os.O_CREAT | getattr(os, "O_CLOEXEC", 0)
        fd = os.open(self.path, flags, 0o600)
        try:
            lines = list(self.pending)
            blob = "".join(lines).encode("utf-8")[self._offset :]
            view = memoryview(blob)
            written = 0
            try:
                while written < len(blob):
                    written += os.write(fd, view[written:])
            finally:
                self._consume(lines, written)
            os.fsync(fd)
        finally:
            os.close(fd)

    def _consume(self, lines: list[str], written: int) -> None:
        done = self._offset + written
        for line in lines:
            size = len(line.encode("utf-8"))
            if done < size:
                break
            done -= size
            self.pending.popleft()
        self._offset = done


class _StreamSink(_Sink):
    name = "stdout"

    def __init__(self, stream: TextIO | None, max_pending: int) -> None:
        super().__init__(max_pending)
        self._stream = stream

    def write(self) -> None:
        stream = self._stream if self._stream is not None else sys.stdout  # as of now (capsys)
        stream.write("".join(self.pending))
        stream.flush()
        self.pending.clear()


class AuditLog:
    """A buffered, redacting audit log; see the module docstring."""

    def __init__(
        self,
        settings: AuditSettings,
        *,
        stdout: TextIO | None = None,
        max_pending: int = DEFAULT_MAX_PENDING,
    ) -> None:
        """`stdout`: the stream the stdout sink writes to (default: `sys.stdout` at each flush).
        `max_pending`: the most lines kept per sink while it cannot write."""
        self.settings = settings
        self._redactor = _redactor_of(settings)
        self._clock = _Clock()
        self._sinks: list[_Sink] = []
        if settings.sink in ("file", "both"):
            self._sinks.append(_FileSink(settings.file, max_pending))
        if settings.sink in ("stdout", "both"):
            self._sinks.append(_StreamSink(stdout, max_pending))
        self._enabled = bool(self._sinks)
        self._max_pending = max_pending
        self._buffer: deque[str] = deque()
        self._lock = threading.Lock()  # the buffer: record() may come from any thread
        self._flush_lock = threading.Lock()  # one flush at a time: the sinks' pending lines
        self._dropped = 0
        self._unrecordable: set[str] = set()
        self._task: asyncio.Task[None] | None = None
        self._stop: asyncio.Event | None = None

    def redact_as(self, settings: AuditSettings) -> None:
        """A reload's redaction (keys, max_string), from the next record on; where records go
        (sink, file) changes only with a restart."""
        self.settings = self.settings.model_copy(
            update={"redact_keys": settings.redact_keys, "max_string": settings.max_string}
        )
        self._redactor = _redactor_of(self.settings)

    @property
    def enabled(self) -> bool:
        return self._enabled

    @property
    def pending(self) -> int:
        """Lines not yet written by every sink (buffered, or kept after a failed write)."""
        with self._lock:
            buffered = len(self._buffer)
        return buffered + max((len(s.pending) for s in self._sinks), default=0)

    @property
    def dropped(self) -> int:
        """Records lost to the caps so far (the buffer's, plus the most any sink dropped)."""
        return self._dropped + max((s.dropped for s in self._sinks), default=0)

    def record(self, event: str, /, **fields: Any) -> None:
        """Buffer one record. Never raises, never blocks on I/O."""
        if not self._enabled:
            return
        try:
            body = self._redactor.fields(fields, skip=_RESERVED)
            line = json.dumps(
                {"ts": self._clock.now(), "event": str(event), **body},
                separators=(",", ":"),
            )
        except Exception as exc:
            kind = type(exc).__name__
            if kind not in self._unrecordable:
                self._unrecordable.add(kind)
                logger.error("audit record %r could not be serialised (%s)", event, kind)
            return
        with self._lock:
            if len(self._buffer) >= self._max_pending:
                self._buffer.popleft()
                self._dropped += 1
                if self._dropped == 1 or self._dropped % 10_000 == 0:
                    logger.warning(
                        "audit buffer full (%d): %d record(s) dropped so far, oldest first",
                        self._max_pending,
                        self._dropped,
                    )
            self._buffer.append(line + "\n")

    def flush_now(self) -> None:
        """Write everything buffered, synchronously (for the CLI; the server uses the task)."""
        with self._flush_lock:
            with self._lock:
                batch = list(self._buffer)
                self._buffer.clear()
            for sink in self._sinks:
                if batch:
                    sink.take(batch)
                sink.flush()

    async def start(self) -> None:
        """Start the background flusher on the running loop (idempotent)."""
        if not self._enabled or (self._task is not None and not self._task.done()):
            return
        self._stop = asyncio.Event()
        self._task = asyncio.create_task(self._run(self._stop), name="reach-audit-flush")

    async def aclose(self) -> None:
        """Stop the flusher and write everything left (a failing sink keeps its lines)."""
        task, stop = self._task, self._stop
        self._task = self._stop = None
        if task is not None and stop is not None:
            stop.set()
            # wait() rather than `await task`: cancelling aclose() must not cancel a flush.
            await asyncio.wait({task})
        if self._enabled:
            await asyncio.to_thread(self.flush_now)

    async def __aenter__(self) -> AuditLog:
        await self.start()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    def _has_work(self) -> bool:
        return bool(self._buffer) or any(s.pending for s in self._sinks)

    async def _run(self, stop: asyncio.Event) -> None:
        interval = self.settings.flush_interval_ms / 1000
        while not stop.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), interval)
            if stop.is_set():
                return  # aclose() writes what is left
            if self._has_work():
                try:
                    await asyncio.to_thread(self.flush_now)
                except Exception:  # flush_now's sinks catch their own; this is a last guard
                    logger.exception("audit flush failed")


def _redactor_of(settings: AuditSettings) -> Redactor:
    return Redactor(settings.redact_keys, max_string=settings.max_string, str_keys=True)
