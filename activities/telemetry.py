"""What the activities add to traces and logs (`reach.telemetry`).

- `traced_call`: the connector call in a CLIENT span, child of Temporal's RunActivity span.
  The agent is sent that span's `traceparent` (instead of the caller's, which the gateway's
  server span already continues), so the agent's own span is its child: one tree from the
  caller to the agent's handler. Every connector sends `Header.traceparent` as its protocol
  carries metadata (HTTP header, gRPC metadata, WebSocket frame field, MQTT user property), so
  replacing it here serves them all, plug-ins included.
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
    with tracing.client_span(active, name, attributes) as span:
        sent = header.model_copy(update={"traceparent": tracing.current_traceparent()})
        message = inp.message.model_copy(update={"header": sent})
        try:
            reply = await run(connector.invoke(endpoint, message, inp.timeout_ms / 1000))
        except ReachError as err:
            span.set_attribute("reach.error_type", err.type)
            raise
        span.set_attribute("reach.reply", reply.status)
        return reply


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
