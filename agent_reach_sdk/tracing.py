"""Traces in an agent: each request's handler in a SERVER span that continues the
`traceparent` Reach sent with it, on every protocol (HTTP header, gRPC metadata, WebSocket
frame field, MQTT user property all arrive as `Inbound.headers["traceparent"]`).

On when the agent process has an OpenTelemetry tracer provider:

    AgentRuntime(..., tracing="file:/tmp/agent-spans.jsonl")   # or "console", "otlp",
                                                               # "otlp:http://collector:4317"
    REACH_AGENT_TRACES=file:/tmp/agent-spans.jsonl             # the same, from the environment
    AgentRuntime(..., tracing=my_tracer_provider)              # a provider of the agent's own

or when the agent configured OpenTelemetry's global tracer provider itself. Otherwise off: no
OpenTelemetry import, one attribute check per request. `tracing="none"` turns it off even
where a global provider exists. The service name is $OTEL_SERVICE_NAME, else the capability.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

from agent_reach_sdk import wire
from agent_reach_sdk.wire import Answer, Inbound
from reach.telemetry import tracing as reach_tracing

if TYPE_CHECKING:
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.trace import Tracer

ENV = "REACH_AGENT_TRACES"
DEFAULT_FILE = ".reach/agent-spans.jsonl"
OFF = ("", "none", "off", "false", "0")


def agent_tracer(
    tracing: str | Any | None, service_name: str
) -> tuple[Tracer | None, TracerProvider | None]:
    """The tracer an agent's spans go to, and the provider built for it here (to flush at
    stop; None when the agent's own provider is used). (None, None): tracing is off."""
    spec = tracing if tracing is not None else os.environ.get(ENV)
    if isinstance(spec, str):
        kind, _, where = spec.strip().partition(":")
        kind = kind.lower()
        if kind in OFF:
            return None, None
        if kind not in ("file", "console", "otlp"):
            raise ValueError(
                f"tracing {spec!r}: expected file:PATH, console, otlp or otlp:ENDPOINT (or none)"
            )
        exporter = reach_tracing.exporter_for(
            kind, file=where or DEFAULT_FILE, otlp_endpoint=where or None
        )
        provider = reach_tracing.build_provider(
            exporter,
            service_name=os.environ.get("OTEL_SERVICE_NAME") or service_name,
            delay_ms=reach_tracing.FILE_EXPORT_DELAY_MS if kind == "file" else None,
        )
        return provider.get_tracer("agent_reach_sdk"), provider
    if spec is not None:  # a TracerProvider of the agent's own
        return spec.get_tracer("agent_reach_sdk"), None
    api = sys.modules.get("opentelemetry.trace")  # never imported: nobody configured it
    if api is None:
        return None, None
    current = api.get_tracer_provider()
    if isinstance(current, api.ProxyTracerProvider | api.NoOpTracerProvider):
        return None, None
    return current.get_tracer("agent_reach_sdk"), None


async def traced_dispatch(
    tracer: Tracer,
    request: Inbound,
    dispatch: Callable[[Inbound], Awaitable[Answer]],
    attributes: dict[str, Any],
) -> Answer:
    """`dispatch(request)` in a SERVER span continuing the request's traceparent; the span is
    current in the handler (its own spans are children)."""
    from opentelemetry.trace import SpanKind, Status, StatusCode

    headers = request.headers
    attributes = {
        **attributes,
        "reach.operation": request.operation,
        "reach.request_id": headers.get(wire.REQUEST_ID, ""),
        "reach.caller": headers.get(wire.CALLER, "anonymous"),
        "reach.attempt": headers.get(wire.ATTEMPT, "1"),
    }
    with tracer.start_as_current_span(
        f"reach.agent {request.operation}",
        context=reach_tracing.context_of(headers.get(wire.TRACEPARENT)),
        kind=SpanKind.SERVER,
        attributes=attributes,
    ) as span:
        answer = await dispatch(request)
        span.set_attribute("reach.answer_status", answer.status)
        if answer.status >= 500:
            span.set_status(Status(StatusCode.ERROR, str(answer.error.get("type", ""))))
        return answer
