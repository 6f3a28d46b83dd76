"""OpenTelemetry traces: one tree from the caller's `traceparent` to the agent's handler.

    the caller's span (its traceparent)
      └ gateway SERVER span: POST /reach/invoke, or reach.v1.Reach/Invoke on the gRPC front
        ├ StartWorkflow (Temporal's TracingInterceptor, on the client only)
        └ connector CLIENT span (activities/invoke.py; its traceparent is what the agent gets)
          └ agent SERVER span (agent_reach_sdk, around the operation's handler)

The workflow carries the gateway span's traceparent to the call (`InvokeInput.traceparent`),
in whichever worker runs it; Temporal's workflow and activity spans are not made (see
`activities.telemetry.client_tracing`).

`configure(settings.telemetry)` builds the process's tracer provider once (a batch span
processor and the exporter `traces` names) and sets `tracer`. With `traces: none` (the
default) nothing is built: `tracer` stays None, OpenTelemetry's SDK is not even imported, and
each place that would open a span checks that one attribute first.

The `file` exporter (`reach.telemetry.spanfile`) writes one JSON object per finished span and
line: the form tests and offline debugging read (`read_spans`).
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import threading
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SpanExporter
    from opentelemetry.trace import Span, Tracer

    from reach.config import TelemetrySettings

TRACEPARENT = "traceparent"
DEFAULT_FILE = ".reach/spans.jsonl"
# A file is read by tests and people while the process runs: written within half a second.
FILE_EXPORT_DELAY_MS = 500
SHUTDOWN_TIMEOUT_S = 3.0

tracer: Tracer | None = None
"""The process's tracer; None when traces are off (then nothing opens a span)."""
provider: TracerProvider | None = None
_lock = threading.Lock()


def configure(settings: TelemetrySettings) -> Tracer | None:
    """Build this process's tracer provider from `telemetry` (once; later calls return the
    tracer already built). None when `traces` is "none"."""
    global tracer, provider
    with _lock:
        if tracer is not None or settings.traces == "none":
            return tracer
        exporter = exporter_for(
            settings.traces, file=settings.file, otlp_endpoint=settings.otlp_endpoint
        )
        provider = build_provider(
            exporter,
            service_name=settings.service_name,
            sample_ratio=settings.sample_ratio,
            delay_ms=FILE_EXPORT_DELAY_MS if settings.traces == "file" else None,
        )
        tracer = provider.get_tracer("agent-reach")
        return tracer


def exporter_for(
    kind: str, *, file: str | None = None, otlp_endpoint: str | None = None
) -> SpanExporter:
    """The span exporter for `kind`: console, otlp or file (ValueError for anything else)."""
    if kind == "console":
        from opentelemetry.sdk.trace.export import ConsoleSpanExporter

        return ConsoleSpanExporter()
    if kind == "otlp":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

        return OTLPSpanExporter(endpoint=otlp_endpoint) if otlp_endpoint else OTLPSpanExporter()
    if kind == "file":
        from reach.telemetry.spanfile import JsonLinesSpanExporter

        return JsonLinesSpanExporter(file or DEFAULT_FILE)
    raise ValueError(f"unknown trace exporter {kind!r}: none, console, otlp or file")


def build_provider(
    exporter: SpanExporter,
    *,
    service_name: str,
    sample_ratio: float = 1.0,
    delay_ms: int | None = None,
) -> TracerProvider:
    """A provider that batches finished spans to `exporter`. New traces are sampled at
    `sample_ratio`; a trace that came with a parent (a caller's traceparent) follows the
    parent's decision."""
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor
    from opentelemetry.sdk.trace.sampling import ALWAYS_ON, ParentBased, TraceIdRatioBased

    # Every trace at 1.0 (the default): the same decisions as the ratio's, without its sums.
    root = ALWAYS_ON if sample_ratio >= 1.0 else TraceIdRatioBased(sample_ratio)
    result = TracerProvider(
        resource=Resource.create({"service.name": service_name}),
        sampler=ParentBased(root),
        # Flushed by `shutdown` (reach.process.exit_now leaves without the interpreter's atexit).
        shutdown_on_exit=True,
    )
    result.add_span_processor(BatchSpanProcessor(exporter, schedule_delay_millis=delay_ms))
    return result


def shutdown(timeout_s: float = SHUTDOWN_TIMEOUT_S) -> None:
    """Export the spans still buffered and stop (before the process exits)."""
    global tracer, provider
    with _lock:
        if provider is not None:
            provider.force_flush(int(timeout_s * 1000))
            provider.shutdown()
        tracer = provider = None


# -- spans at Reach's edges ------------------------------------------------------------------


def _propagator() -> Any:
    """The W3C trace-context propagator, made once (a call makes it two or three times)."""
    global _PROPAGATOR
    if _PROPAGATOR is None:
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        _PROPAGATOR = TraceContextTextMapPropagator()
    return _PROPAGATOR


_PROPAGATOR: Any = None


def context_of(traceparent: str | None) -> Any:
    """The OpenTelemetry context a W3C `traceparent` names (None: none, or not valid)."""
    if not traceparent:
        return None
    from opentelemetry.trace import get_current_span

    context = _propagator().extract({TRACEPARENT: traceparent})
    return context if get_current_span(context).get_span_context().is_valid else None


@contextlib.contextmanager
def server_span(
    active: Tracer, name: str, traceparent: str | None, attributes: Mapping[str, Any]
) -> Iterator[Span]:
    """A SERVER span, current while the block runs, continuing the caller's `traceparent`
    (a new trace without one)."""
    from opentelemetry.trace import SpanKind

    with active.start_as_current_span(
        name, context=context_of(traceparent), kind=SpanKind.SERVER, attributes=attributes
    ) as span:
        yield span


@contextlib.contextmanager
def client_span(
    active: Tracer, name: str, attributes: Mapping[str, Any], parent: str | None = None
) -> Iterator[Span]:
    """A CLIENT span, current while the block runs: child of the current span, or when none
    is current, of the `parent` traceparent (the gateway's span, carried by the workflow)."""
    from opentelemetry.trace import SpanKind, get_current_span

    context = None
    if parent is not None and not get_current_span().get_span_context().is_valid:
        context = context_of(parent)
    with active.start_as_current_span(
        name, context=context, kind=SpanKind.CLIENT, attributes=attributes
    ) as span:
        yield span


def current_traceparent() -> str | None:
    """The W3C traceparent of the current span (what the next hop continues), or None."""
    carrier: dict[str, str] = {}
    _propagator().inject(carrier)
    return carrier.get(TRACEPARENT)


def current_ids() -> tuple[str, str] | None:
    """(trace_id, span_id) in hex of the span active here, if any; costs nothing where
    OpenTelemetry was never imported."""
    api = sys.modules.get("opentelemetry.trace")
    if api is None:
        return None
    ctx = api.get_current_span().get_span_context()
    if not ctx.is_valid:
        return None
    return format(ctx.trace_id, "032x"), format(ctx.span_id, "016x")


# -- the file exporter's lines -------------------------------------------------------------


def read_spans(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """The spans a file exporter wrote (a line still being written is skipped)."""
    found = []
    with contextlib.suppress(FileNotFoundError):
        for line in Path(path).read_text(encoding="utf-8").splitlines():
            with contextlib.suppress(ValueError):
                found.append(json.loads(line))
    return found
