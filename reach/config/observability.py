"""The `telemetry:` and `metrics:` sections: traces, log format, Prometheus (R25)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from reach.config.base import Section


class TelemetrySettings(Section):
    """Traces (OpenTelemetry) and the log format, for the gateway and workers (R25). Read at
    start-up: a change takes effect after a restart."""

    traces: Literal["none", "console", "otlp", "file"] = Field(
        default="none",
        description="Where finished spans go: none (no tracing, no cost), console (stdout), "
        "otlp (an OpenTelemetry collector over gRPC), file (JSON lines, one span a line).",
    )
    otlp_endpoint: str | None = Field(
        default=None,
        max_length=512,
        description="traces: otlp; default: $OTEL_EXPORTER_OTLP_ENDPOINT, else "
        "http://localhost:4317.",
    )
    file: str | None = Field(
        default=None,
        max_length=4096,
        description="traces: file; the JSON-lines file spans are appended to (tests, offline "
        "debugging). Default: .reach/spans.jsonl.",
    )
    service_name: str = Field(
        default="agent-reach",
        min_length=1,
        max_length=128,
        description="The service.name of the gateway's and workers' spans.",
    )
    sample_ratio: float = Field(
        default=1.0,
        ge=0.0,
        le=1.0,
        description="Share of new traces recorded; a caller's traceparent decides for its own.",
    )
    logs_format: Literal["text", "json"] = Field(
        default="text",
        description="json: one object a line (ts, level, logger, message, request_id, "
        "trace_id, span_id).",
    )
    heartbeat_log_sample: float = Field(
        default=0.01,
        ge=0.0,
        le=1.0,
        description="Share of heartbeat and handshake records logged (logger reach.heartbeat, "
        "kept apart from the main log); joins, leaves, health changes and evictions are "
        "always logged in the main log.",
    )
    heartbeat_log_file: str | None = Field(
        default=None,
        max_length=4096,
        description="Where the sampled heartbeat records go; default: standard error, beside "
        "(but not through) the main log.",
    )


class MetricsSettings(Section):
    """Prometheus metrics (`GET /metrics` on the gateway; workers on `worker_port`). Read at
    start-up: a change takes effect after a restart."""

    enabled: bool = Field(
        default=True, description="false: nothing is recorded and /metrics is not served."
    )
    worker_port: int | None = Field(
        default=None,
        ge=0,
        le=65535,
        description="`worker.py` processes serve GET /metrics on this port (0: any free one; "
        "none: not served). The gateway serves its own on its API port.",
    )
    worker_host: str = Field(
        default="127.0.0.1",
        min_length=1,
        max_length=255,
        description="The address a worker's metrics port binds (keep it internal: the port "
        "has no authentication).",
    )
