"""Step 8, route the first attempt: chosen here from the local registry view, attempt 1 is a
single step in the workflow (the call). None leaves it to the workflow (a queue-mode
capability, a view not settled yet, a breaker not closed, no resolver in this process)."""

from __future__ import annotations

from reach.config import RoutingSettings
from reach.invocation import CallPlan, Endpoint, ResolveInput
from reach.messages import InvokeRequest
from reach.resolve import Resolver
from reach.routing import hash_key

POLICY_WAIT_S = 0.01
"""How long the door waits for a policy view to be re-read: no longer than the workflow's own
routing would take."""


class FirstRoute:
    """`calls_here`: this process runs the invoke worker, so an inline call runs here next
    (eager start) and its pick is counted in flight at once."""

    def __init__(self, resolver: Resolver | None, *, calls_here: bool) -> None:
        self.resolver = resolver
        self.calls_here = calls_here

    async def ready(self, request: InvokeRequest, plan: CallPlan) -> None:
        """Before `pick`: after a quiet spell the policy view is too old for the door to route
        on, and waiting for its re-read (one store read, at most `POLICY_WAIT_S`) is cheaper
        than leaving attempt 1 to the workflow (a gateway called less than once a second
        routed none of its calls here: +7 ms a call on the bench's box)."""
        if self.resolver is not None and plan.queue is None:
            await self.resolver.settle(request.target, POLICY_WAIT_S)

    def key(self, routing: RoutingSettings, request: InvokeRequest) -> str | None:
        """What consistent hashing hashes for this request (None: nothing)."""
        return hash_key(routing, request.payload, request.routing_key)

    def pick(
        self,
        request: InvokeRequest,
        plan: CallPlan,
        routing_key: str | None,
        payload_bytes: int,
        now_ms: int,
    ) -> Endpoint | None:
        if self.resolver is None or plan.queue is not None:
            return None
        assert request.request_id is not None
        return self.resolver.first(
            ResolveInput(
                capability=request.target,
                routing_key=routing_key or request.routing_key,
                request_id=request.request_id,
                payload_bytes=payload_bytes,
                operation=request.operation,
                attempt=1,
                deadline_ms=now_ms + plan.timeout_ms,
            ),
            reserve=self.calls_here and plan.mode == "inline",
        )

    def unused(self, request_id: str) -> None:
        """The pick will not be called (the start attached to an earlier run)."""
        if self.resolver is not None:
            self.resolver.release(request_id)
