"""Step 11, account: one audit record (R20) and the metrics of every invoke that passed the
door's first two steps, whether it was answered or refused, with one clock.

The audit record says how the request left the door: its status code, outcome, instance,
error type and the rule that allowed it. A capability nobody registered counts in the
metrics as `_unknown` (the caller chose that name).
"""

from __future__ import annotations

import time

from temporalio.service import RPCError

from gateway_api.errors import reach_error_of_rpc, status_code_of
from gateway_api.steps.known import Capabilities
from gateway_api.steps.start import RequestIdTaken
from reach.errors import ReachError
from reach.messages import InvokeRequest, InvokeResponse
from reach.security.guard import Guard
from reach.security.rules import Decision
from reach.telemetry.metrics import ReachMetrics


class Ledger:
    """One request's account, opened as it enters and closed as it leaves."""

    __slots__ = ("caller", "capabilities", "decision", "guard", "metrics", "request", "t0")

    def __init__(
        self,
        request: InvokeRequest,
        caller: str,
        guard: Guard | None,
        metrics: ReachMetrics | None,
        capabilities: Capabilities,
    ) -> None:
        self.request = request
        self.caller = caller
        self.guard = guard
        self.metrics = metrics
        self.capabilities = capabilities
        self.decision: Decision | None = None  # set once the rules allowed it
        self.t0 = time.perf_counter()

    async def answered(self, response: InvokeResponse) -> None:
        seconds = time.perf_counter() - self.t0
        error_type = response.error.type if response.error else None
        if self.guard is not None and self.decision is not None:
            # A callback request's outcome is not known here: its `invoke` record is written
            # when it is (the delivery's first attempt); the door notes the acceptance.
            self._audit(
                "invoke_accepted" if response.status == "accepted" else "invoke",
                request_id=response.request_id,
                instance=response.instance_id,
                duration_ms=round(seconds * 1000, 3),
                status=status_code_of(response, running=504),
                outcome=response.status,
                error_type=error_type,
                attempts=len(response.attempts) if response.attempts else None,
            )
        if self.metrics is not None:
            request = self.request
            target, op = (
                (request.target, request.operation)
                if response.status == "success"
                else await self.capabilities.labels(request)
            )
            self.metrics.invoke(target, op, response.status, error_type or "", seconds)

    async def refused(self, exc: BaseException) -> None:
        """A refusal on the way: a Reach error, or Temporal's trouble as the front answers it
        (`reach_error_of_rpc`). Audited once the rules had allowed the request (a denial is
        the guard's own record)."""
        seconds = time.perf_counter() - self.t0
        err = reach_error_of_rpc(exc) if isinstance(exc, RPCError) else exc
        if not isinstance(err, ReachError):
            return  # a bug: the front's last resort answers and logs it
        if self.guard is not None and self.request.request_id is not None:
            # Read only if no request of this id exists (`reach trace` of a refused one).
            self.guard.refusals.note(
                self.request.request_id, self.caller, err.http_status, err.type, err.message
            )
        if self.guard is not None and self.decision is not None:
            # Another caller's RequestID: not an outcome of that request (which has its own
            # `invoke` record), a try at it.
            taken = isinstance(err, RequestIdTaken)
            self._audit(
                "request_id_taken" if taken else "invoke",
                request_id=self.request.request_id,
                duration_ms=round(seconds * 1000, 3),
                status=err.http_status,
                outcome="error",
                error_type=err.type,
                outcome_unknown=err.outcome_unknown,
            )
        if self.metrics is not None:
            target, op = await self.capabilities.labels(self.request)
            status = "timeout" if err.type == "timeout" else "error"
            self.metrics.invoke(target, op, status, err.type, seconds)

    def _audit(self, event: str, **fields: object) -> None:
        assert self.guard is not None
        assert self.decision is not None
        self.guard.audit.record(
            event,
            caller=self.caller,
            capability=self.request.target,
            operation=self.request.operation,
            rule=self.decision.rule,
            **fields,
        )
