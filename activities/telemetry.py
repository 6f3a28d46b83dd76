"""What the activities add to traces and logs (`reach.telemetry`).

- `traced_call`: the connector call in a CLIENT span, child of the gateway's SERVER span,
  whose `traceparent` the workflow carries in the call's header (`gateway_api.steps.start`),
  to whichever worker runs the call. The agent is sent the CLIENT span's `traceparent`, so the
  agent's own span is its child: one tree from the caller to the agent's handler. Every
  connector sends `Header.traceparent` as its protocol carries metadata (HTTP header, gRPC
  metadata, WebSocket frame field, MQTT user property), so replacing it here serves them all,
  plug-ins included.
- `temporal_tracing`: Temporal's TracingInterceptor with its spans on the client only (the
  StartWorkflow span, and queries, signals and updates); on workers it only puts the start's
  context on the workflow's activations (its log lines name the trace). Its workflow and
  activity spans (RunWorkflow, StartActivity and CompleteWorkflow, each of no duration, and
  RunActivity around the connector's span) took most of what tracing added to an invoke
  (docs/benchmarks.md, "Fewer spans"), for no time of their own to show.
- `RequestIdInterceptor`: the RequestID of the activity's request on every log record it
  makes (`current_request_id`; the workflow id is the RequestID), for JSON logs.
"""

from __future__ import annotations

from collections.abc import Callable, Coroutine
from typing import TYPE_CHECKING, Any

from temporalio import activity, client, worker

from connectors.base import Connector
from reach.errors import ReachError
from reach.invocation import CallInput
from reach.messages import Reply
from reach.telemetry import tracing
from reach.telemetry.logs import current_request_id

if TYPE_CHECKING:
    from opentelemetry.trace import Tracer

Await = Callable[[Coroutine[Any, Any, Reply]], Coroutine[Any, Any, Reply]]


async def traced_call(active: Tracer, connector: Connector, inp: CallInput, run: Await) -> Reply:
    """`connector.invoke` for `inp` inside a client span (`run` awaits the call as the
    activity's kind wants it: directly, or heartbeating)."""
    endpoint, header = inp.endpoint, inp.message.header
    attributes = {
        "reach.protocol": endpoint.protocol,
        "reach.capability": endpoint.capability,
        "reach.operation": header.operation,
        "reach.instance_id": endpoint.instance_id,
        "reach.request_id": header.request_id,
        "reach.attempt": header.attempt,
    }
    name = f"connector.{endpoint.protocol} {header.operation}"
    with tracing.client_span(active, name, attributes, parent=header.traceparent) as span:
        sent = header.model_copy(update={"traceparent": tracing.current_traceparent()})
        message = inp.message.model_copy(update={"header": sent})
        try:
            reply = await run(connector.invoke(endpoint, message, inp.timeout_ms / 1000))
        except ReachError as err:
            span.set_attribute("reach.error_type", err.type)
            raise
        span.set_attribute("reach.reply", reply.status)
        return reply


def temporal_tracing(active: Tracer) -> client.Interceptor:
    """Temporal's TracingInterceptor, its spans on the client only (see the module's
    docstring). On workers it still puts the StartWorkflow span's context on the workflow's
    activations, so the workflow's log lines name the trace, but opens no span there (nor
    propagates one to activities) and none around activities."""
    from temporalio.contrib.opentelemetry import (
        TracingInterceptor,
        TracingWorkflowInboundInterceptor,
    )

    class NoWorkflowSpans(TracingWorkflowInboundInterceptor):
        def _completed_span(self, span_name: str, **_: Any) -> None:
            return None

    class ClientSpans(TracingInterceptor):
        def intercept_activity(
            self, next: worker.ActivityInboundInterceptor
        ) -> worker.ActivityInboundInterceptor:
            return next

        def workflow_interceptor_class(
            self, input: worker.WorkflowInterceptorClassInput
        ) -> type[TracingWorkflowInboundInterceptor]:
            super().workflow_interceptor_class(input)
            return NoWorkflowSpans

    return ClientSpans(active)


class RequestIdInterceptor(client.Interceptor, worker.Interceptor):
    """Sets `current_request_id` for each activity (installed with JSON logs; on the client,
    so every worker built on it has it)."""

    def intercept_activity(
        self, next: worker.ActivityInboundInterceptor
    ) -> worker.ActivityInboundInterceptor:
        return _RequestIdActivity(next)


class _RequestIdActivity(worker.ActivityInboundInterceptor):
    async def execute_activity(self, input: worker.ExecuteActivityInput) -> Any:
        workflow_id = activity.info().workflow_id
        # A callback delivery's workflow is `<request_id>/callback`.
        current_request_id.set(workflow_id.split("/", 1)[0] if workflow_id else None)
        return await self.next.execute_activity(input)
