"""Traces (issue 11), piece by piece: the exporters, the connector span and the traceparent the
agent is sent, the SDK's server span. The whole tree across processes is
tests/integration/test_tracing.py."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode, get_current_span

from activities.telemetry import traced_call
from agent_reach_sdk import AgentRuntime
from agent_reach_sdk.tracing import agent_tracer
from agent_reach_sdk.wire import Inbound
from connectors.base import Connector
from reach.config import TelemetrySettings
from reach.errors import TransportError
from reach.invocation import CallInput, Endpoint
from reach.messages import Header, Message, Reply
from reach.telemetry import tracing
from reach.telemetry.spanfile import JsonLinesSpanExporter
from reach.telemetry.tracing import build_provider, context_of, read_spans

CALLER_TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
CALLER_SPAN = "00f067aa0ba902b7"
CALLER = f"00-{CALLER_TRACE}-{CALLER_SPAN}-01"


def memory_tracer() -> tuple[Any, InMemorySpanExporter]:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    return provider.get_tracer("test"), exporter


def test_traces_none_builds_nothing() -> None:
    assert tracing.configure(TelemetrySettings()) is None
    assert tracing.tracer is None
    assert tracing.provider is None


def test_an_unknown_exporter_is_refused() -> None:
    with pytest.raises(ValueError, match="none, console, otlp or file"):
        tracing.exporter_for("jaeger")


def test_context_of_a_traceparent() -> None:
    assert context_of(None) is None
    assert context_of("not-a-traceparent") is None
    ctx = get_current_span(context_of(CALLER)).get_span_context()
    assert format(ctx.trace_id, "032x") == CALLER_TRACE
    assert ctx.is_remote


def test_the_file_exporter_writes_one_json_line_per_span(tmp_path: Path) -> None:
    path = tmp_path / "spans" / "out.jsonl"
    provider = build_provider(JsonLinesSpanExporter(path), service_name="svc", delay_ms=10)
    tracer = provider.get_tracer("test")
    with (
        tracing.server_span(tracer, "entrance", CALLER, {"a": 1}) as outer,
        tracing.client_span(tracer, "call", {"b": "x"}),
    ):
        sent = tracing.current_traceparent()
    provider.force_flush()
    provider.shutdown()
    spans = {s["name"]: s for s in read_spans(path)}
    assert set(spans) == {"entrance", "call"}
    entrance, call = spans["entrance"], spans["call"]
    assert entrance["trace_id"] == CALLER_TRACE == call["trace_id"]
    assert entrance["parent_id"] == CALLER_SPAN
    assert entrance["parent_remote"] is True
    assert entrance["kind"] == "SERVER"
    assert call["kind"] == "CLIENT"
    outer_id = format(outer.get_span_context().span_id, "016x")
    assert call["parent_id"] == entrance["span_id"] == outer_id
    assert entrance["service"] == "svc"
    assert entrance["attributes"] == {"a": 1}
    assert sent == f"00-{CALLER_TRACE}-{call['span_id']}-01"


def test_a_sampled_out_caller_is_followed(tmp_path: Path) -> None:
    path = tmp_path / "out.jsonl"
    provider = build_provider(JsonLinesSpanExporter(path), service_name="svc", delay_ms=10)
    unsampled = f"00-{CALLER_TRACE}-{CALLER_SPAN}-00"
    with tracing.server_span(provider.get_tracer("t"), "entrance", unsampled, {}):
        assert tracing.current_traceparent() is not None  # still propagated, flag 00
        assert tracing.current_traceparent().endswith("-00")  # type: ignore[union-attr]
    provider.force_flush()
    assert read_spans(path) == []


class Recording(Connector):
    protocol = "rec"

    def __init__(self, fail: bool = False) -> None:
        super().__init__()
        self.sent: list[Message] = []
        self.fail = fail

    async def invoke(self, endpoint: Endpoint, message: Message, timeout_s: float) -> Reply:
        self.sent.append(message)
        if self.fail:
            raise TransportError("connection refused")
        return Reply(status="ok", result={})


def call_input() -> CallInput:
    header = Header(
        request_id="req-1", caller="c", target="cap", operation="query", traceparent=CALLER
    )
    endpoint = Endpoint(instance_id="cap-01", capability="cap", protocol="rec", address="x")
    return CallInput(endpoint=endpoint, message=Message(header=header), timeout_ms=1000)


async def awaited(work: Any) -> Reply:
    reply: Reply = await work
    return reply


async def test_the_agent_is_sent_the_connector_spans_traceparent() -> None:
    tracer, exporter = memory_tracer()
    connector = Recording()
    inp = call_input()
    with tracing.server_span(tracer, "RunActivity", CALLER, {}) as activity_span:
        reply = await traced_call(tracer, connector, inp, awaited)
    assert reply.status == "ok"
    (span,) = [s for s in exporter.get_finished_spans() if s.name == "connector.rec query"]
    assert span.kind == SpanKind.CLIENT
    assert span.parent is not None
    assert span.parent.span_id == activity_span.get_span_context().span_id
    (message,) = connector.sent
    ctx = span.get_span_context()
    assert message.header.traceparent == f"00-{ctx.trace_id:032x}-{ctx.span_id:016x}-01"
    assert inp.message.header.traceparent == CALLER  # the activity's input is left as it was
    assert span.attributes is not None
    assert span.attributes["reach.request_id"] == "req-1"
    assert span.attributes["reach.reply"] == "ok"


async def test_with_no_span_current_the_connector_span_continues_the_headers_trace() -> None:
    """The workflow carries the gateway's span in the call's header: with no span current in
    the activity (Temporal's activity spans are not made), the connector's span is its child."""
    tracer, exporter = memory_tracer()
    connector = Recording()
    await traced_call(tracer, connector, call_input(), awaited)
    (span,) = exporter.get_finished_spans()
    assert span.parent is not None
    assert span.parent.is_remote
    assert f"00-{span.context.trace_id:032x}-{span.parent.span_id:016x}-01" == CALLER
    (message,) = connector.sent
    ctx = span.get_span_context()
    assert message.header.traceparent == f"00-{ctx.trace_id:032x}-{ctx.span_id:016x}-01"


async def test_a_failed_call_is_an_error_span_with_its_type() -> None:
    tracer, exporter = memory_tracer()
    with pytest.raises(TransportError):
        await traced_call(tracer, Recording(fail=True), call_input(), awaited)
    (span,) = exporter.get_finished_spans()
    assert span.status.status_code == StatusCode.ERROR
    assert span.attributes is not None
    assert span.attributes["reach.error_type"] == "transport_error"


# -- the SDK ---------------------------------------------------------------------------------


def test_agent_tracing_specs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("REACH_AGENT_TRACES", raising=False)
    assert agent_tracer(None, "cap") == (None, None)  # nothing configured: off
    assert agent_tracer("none", "cap") == (None, None)
    with pytest.raises(ValueError, match="file:PATH"):
        agent_tracer("zipkin", "cap")
    monkeypatch.setenv("REACH_AGENT_TRACES", f"file:{tmp_path / 'a.jsonl'}")
    tracer, provider = agent_tracer(None, "cap")
    assert tracer is not None
    assert provider is not None
    with tracer.start_as_current_span("x"):
        pass
    provider.force_flush()
    provider.shutdown()
    (span,) = read_spans(tmp_path / "a.jsonl")
    assert span["service"] == "cap"
    own = TracerProvider()
    assert agent_tracer(own, "cap")[1] is None  # the agent's own provider: not ours to flush


async def test_the_sdk_continues_the_traceparent_around_the_handler() -> None:
    tracer, exporter = memory_tracer()
    runtime = AgentRuntime("cap", instance_id="cap-01")
    seen: list[Any] = []

    @runtime.operation("query")
    async def query(payload: dict[str, Any]) -> dict[str, Any]:
        seen.append(get_current_span().get_span_context())
        return {"ok": True}

    runtime._tracer = tracer  # what astart decides from `tracing=` or the environment
    headers = {"traceparent": CALLER, "x-reach-request-id": "req-9", "x-reach-attempt": "2"}
    answer = await runtime.dispatch(Inbound("query", headers, b"{}"))
    assert answer.status == 200
    (span,) = exporter.get_finished_spans()
    assert span.name == "reach.agent query"
    assert span.kind == SpanKind.SERVER
    assert span.parent is not None
    assert format(span.parent.span_id, "016x") == CALLER_SPAN
    assert format(span.get_span_context().trace_id, "032x") == CALLER_TRACE
    assert seen == [span.get_span_context()]  # current inside the handler
    assert span.attributes is not None
    assert span.attributes["reach.request_id"] == "req-9"
    assert span.attributes["reach.answer_status"] == 200


async def test_without_tracing_the_sdk_opens_no_span() -> None:
    runtime = AgentRuntime("cap", instance_id="cap-01", tracing="none")
    assert runtime._tracer is None

    @runtime.operation("query")
    async def query(payload: dict[str, Any]) -> dict[str, Any]:
        return {"valid": get_current_span().get_span_context().is_valid}

    answer = await runtime.dispatch(Inbound("query", {"traceparent": CALLER}, b"{}"))
    assert answer.body == {"valid": False}
