"""The `file` span exporter: finished spans as JSON lines (tests and offline debugging).

Imported only when `telemetry.traces: file` (or an agent's `file:PATH`) asks for it, so the
OpenTelemetry SDK loads only where tracing is on.
"""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import IO, Any

from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult


def span_record(span: ReadableSpan) -> dict[str, Any]:
    """One finished span as the file exporter writes it: ids in lower-case hex (trace 32,
    span 16 digits), `parent_id` null for a root, times in epoch nanoseconds."""
    ctx = span.get_span_context()
    parent = span.parent
    start, end = span.start_time or 0, span.end_time or 0
    record: dict[str, Any] = {
        "name": span.name,
        "kind": span.kind.name,
        "trace_id": format(ctx.trace_id, "032x") if ctx else None,
        "span_id": format(ctx.span_id, "016x") if ctx else None,
        "parent_id": format(parent.span_id, "016x") if parent else None,
        "parent_remote": bool(parent.is_remote) if parent else None,
        "start_ns": start,
        "end_ns": end,
        "duration_ms": round((end - start) / 1e6, 3),
        "status": span.status.status_code.name,
        "service": span.resource.attributes.get("service.name"),
        "attributes": dict(span.attributes or {}),
    }
    if span.status.description:
        record["status_message"] = span.status.description
    if span.events:
        record["events"] = [
            {"name": e.name, "attributes": dict(e.attributes or {})} for e in span.events
        ]
    return record


class JsonLinesSpanExporter(SpanExporter):
    """Appends each batch of finished spans to `path`, one JSON object a line, in one write
    to a file opened for appending (several processes may share the file)."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self._file: IO[str] | None = None
        self._lock = threading.Lock()

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        lines = "".join(
            json.dumps(span_record(span), default=str, separators=(",", ":")) + "\n"
            for span in spans
        )
        try:
            with self._lock:
                if self._file is None:
                    self.path.parent.mkdir(parents=True, exist_ok=True)
                    self._file = self.path.open("a", encoding="utf-8")
                self._file.write(lines)
                self._file.flush()
        except OSError:
            return SpanExportResult.FAILURE
        return SpanExportResult.SUCCESS

    def shutdown(self) -> None:
        with self._lock:
            if self._file is not None:
                self._file.close()
                self._file = None

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return True
