"""The gateway's and workers' logs (R25): the main log, and heartbeats kept apart and sampled.

- The main log (the root logger's one handler, standard error): every state change of the
  registry is there, always — join and re-join, leave, health changes (`degraded`,
  `unhealthy` and back), evictions — with the gateway's, workers' and workflows' own records.
- `reach.heartbeat`: each heartbeat and each Join handshake's negotiation, at INFO. It does not
  propagate to the main log; it has a handler of its own (standard error, or
  `telemetry.heartbeat_log_file`) and a filter that keeps `telemetry.heartbeat_log_sample` of
  the records (1 %, by default; all of them with `reach -v`).
- `telemetry.logs_format: json`: one JSON object a line with `ts`, `level`, `logger`,
  `message`, and where known `request_id` (the request being served: `current_request_id`,
  which the gateway's door and the activities set, else the workflow id of a Temporal
  workflow or activity record, else the SDK's record attribute) and `trace_id`/`span_id` of
  the span active when the record was made.
"""

from __future__ import annotations

import contextvars
import json
import logging
import random
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

from reach.config import TelemetrySettings
from reach.telemetry.tracing import current_ids

TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
HEARTBEAT_LOGGER = "reach.heartbeat"
# Marks the handlers installed here, so that configuring again replaces only them.
_OURS = "_reach_handler"

current_request_id: contextvars.ContextVar[str | None] = contextvars.ContextVar(
    "reach_request_id", default=None
)
"""The RequestID being served in this task (set at the gateway's door and in activities)."""


class SampleFilter(logging.Filter):
    """Keeps each record with probability `ratio` (0: none, 1: all)."""

    def __init__(self, ratio: float, rng: Callable[[], float] | None = None) -> None:
        super().__init__()
        if not 0.0 <= ratio <= 1.0:
            raise ValueError(f"a sample ratio is between 0 and 1, not {ratio}")
        self.ratio = ratio
        self._random = rng or random.random

    def filter(self, record: logging.LogRecord) -> bool:
        if self.ratio >= 1.0:
            return True
        return self.ratio > 0.0 and self._random() < self.ratio


def request_id_of(record: logging.LogRecord) -> str | None:
    """The RequestID a record was made for, if any is known."""
    found = current_request_id.get()
    if found:
        return found
    # Temporal's workflow and activity loggers put their context on the record; a workflow
    # id is a RequestID (a callback delivery's is `<request_id>/callback`).
    for attr in ("temporal_workflow", "temporal_activity"):
        info = getattr(record, attr, None)
        if isinstance(info, dict) and info.get("workflow_id"):
            return str(info["workflow_id"]).split("/", 1)[0]
    sdk = getattr(record, "request_id", None)  # agent_reach_sdk's factory: '-' outside one
    return sdk if isinstance(sdk, str) and sdk != "-" else None


class JsonFormatter(logging.Formatter):
    """One JSON object a line: ts (UTC, ISO 8601 with milliseconds), level, logger, message,
    and request_id, trace_id, span_id where known; exc (the traceback) with an exception."""

    def format(self, record: logging.LogRecord) -> str:
        ts = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
        out: dict[str, Any] = {
            "ts": f"{ts}.{int(record.msecs):03d}Z",
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        request_id = request_id_of(record)
        if request_id:
            out["request_id"] = request_id
        ids = current_ids()
        if ids is not None:
            out["trace_id"], out["span_id"] = ids
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        if record.stack_info:
            out["stack"] = self.formatStack(record.stack_info)
        return json.dumps(out, ensure_ascii=False, default=str)


def formatter_for(logs_format: str) -> logging.Formatter:
    return JsonFormatter() if logs_format == "json" else logging.Formatter(TEXT_FORMAT)


def _replace_handler(logger: logging.Logger, handler: logging.Handler) -> None:
    for old in [h for h in logger.handlers if getattr(h, _OURS, False)]:
        logger.removeHandler(old)
        old.close()
    setattr(handler, _OURS, True)
    logger.addHandler(handler)


def setup_logging(
    telemetry: TelemetrySettings | None = None,
    *,
    verbose: bool = False,
    stream: IO[str] | None = None,
    rng: Callable[[], float] | None = None,
) -> None:
    """Configure this process's main log and heartbeat log (see the module's docstring).
    Calling it again replaces what an earlier call installed (and nothing else)."""
    telemetry = telemetry or TelemetrySettings()
    formatter = formatter_for(telemetry.logs_format)
    main = logging.StreamHandler(stream or sys.stderr)
    main.setFormatter(formatter)
    root = logging.getLogger()
    _replace_handler(root, main)
    root.setLevel(logging.DEBUG if verbose else logging.INFO)
    logging.getLogger("httpx").setLevel(logging.WARNING)
    logging.getLogger("temporalio").setLevel(logging.WARNING)
    # ...but the workflow's own decisions (retry, give up, callback not delivered) are kept.
    logging.getLogger("temporalio.workflow").setLevel(logging.INFO)

    beats = logging.getLogger(HEARTBEAT_LOGGER)
    beats.propagate = False
    beats.setLevel(logging.DEBUG if verbose else logging.INFO)
    if telemetry.heartbeat_log_file:
        path = Path(telemetry.heartbeat_log_file)
        path.parent.mkdir(parents=True, exist_ok=True)
        apart: logging.Handler = logging.FileHandler(path, encoding="utf-8")
    else:
        apart = logging.StreamHandler(stream or sys.stderr)
    apart.setFormatter(formatter)
    _replace_handler(beats, apart)
    for old in [f for f in beats.filters if isinstance(f, SampleFilter)]:
        beats.removeFilter(old)
    beats.addFilter(SampleFilter(1.0 if verbose else telemetry.heartbeat_log_sample, rng))
