"""What the routes call: start/attach invoke workflows, read their state, pass late answers.

Orchestration itself is never here (that is the workflow's job); this module only talks to
Temporal and the registry on behalf of one HTTP request.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

from temporalio.api.common.v1 import Payload
from temporalio.api.enums.v1 import PendingActivityState
from temporalio.client import (
    Client,
    WorkflowExecutionStatus,
    WorkflowFailureError,
    WorkflowHandle,
    WorkflowQueryFailedError,
    WorkflowQueryRejectedError,
    WorkflowUpdateFailedError,
    WorkflowUpdateRPCTimeoutOrCancelledError,
)
from temporalio.common import (
    SearchAttributePair,
    TypedSearchAttributes,
    WorkflowIDConflictPolicy,
    WorkflowIDReusePolicy,
)
from temporalio.exceptions import (
    ApplicationError,
    CancelledError,
    TerminatedError,
    WorkflowAlreadyStartedError,
)
from temporalio.exceptions import TimeoutError as TemporalTimeout
from temporalio.service import RPCError, RPCStatusCode

import connectors
from connectors import ConnectorSet
from connectors.base import Connector
from gateway_api.errors import reach_error_of_rpc
from gateway_api.finishes import Finish, Finishes
from reach.config import LimitSettings, ReachSettings, RoutingSettings
from reach.errors import (
    Forbidden,
    InvalidRequest,
    RateLimited,
    ReachError,
    RequestClosed,
    RequestConflict,
    Unavailable,
    UnknownCapability,
    UnknownRequest,
    http_status_for,
)
from reach.invocation import (
    BucketPlan,
    CallbackPlan,
    CallPlan,
    DeliveryOutcome,
    InvokeInput,
    LateAnswer,
    QueuePlan,
    ResolveInput,
    answer_key,
    delivery_workflow_id,
    idempotency_scope,
    payload_fingerprint,
    same_request,
)
from reach.limits import Limits
from reach.messages import (
    AttemptInfo,
    DeliveryState,
    ErrorInfo,
    InvokeRequest,
    InvokeResponse,
    new_request_id,
)
from reach.policy import plan_call
from reach.policy.engine import PolicyEngine, capability_bucket, limit_buckets
from reach.registry import Ack, HealthReport, InstanceRecord, JoinRequest, Registry
from reach.registry.view import RegistryView
from reach.resolve import Resolver
from reach.routing import Router, hash_key
from reach.security.auth import may_serve
from reach.security.door import Door
from reach.security.netguard import AddressGuard
from reach.security.redact import safe_url
from reach.security.rules import Decision
from reach.security.tokens import Principal
from reach.telemetry.metrics import UNKNOWN as UNKNOWN_LABEL
from reach.telemetry.metrics import ReachMetrics
from workflows.invoke import (
    SA_CALLER,
    SA_CAPABILITY,
    SA_INSTANCE,
    SA_OPERATION,
    SA_STATUS,
    InvokeWorkflow,
)

log = logging.getLogger("reach.gateway")

# How long past its deadline a synchronous caller waits for the workflow's own verdict.
SYNC_GRACE_S = 5.0
# How long a status look-up waits for a running request's worker to list its attempts.
QUERY_WAIT = timedelta(seconds=1)
# How long a readiness probe waits for Temporal before calling it down.
READY_CHECK_S = 2.0

InvokeHandle = WorkflowHandle[InvokeWorkflow, InvokeResponse]


@dataclass
class Gateway:
    settings: ReachSettings
    client: Client
    registry: Registry
    policy: PolicyEngine
    view: RegistryView | None = None  # the local registry view (else: the store each time)
    router: Router | None = None
    # Routes attempt 1 at the door (else each workflow resolves it); `calls_here`: this process
    # runs the invoke worker, so an inline call runs here next (eager start).
    resolver: Resolver | None = None
    calls_here: bool = False
    # Tokens, rules and audit (reach.security); None: a bare gateway (unit tests).
    door: Door | None = None
    # The live connectors (the Join-time mTLS identity probe); None: no probe.
    connectors: ConnectorSet | None = None
    metrics: ReachMetrics | None = None  # None: metrics.enabled is false (or a unit test)
    # Results recorded by this process's invoke worker, read without a long poll (finishes.py).
    finishes: Finishes | None = None
    limits: Limits = field(init=False)
    rpc_timeout: timedelta = field(init=False)
    _routing: dict[str, RoutingSettings] = field(init=False, default_factory=dict)
    _callback_plan: CallbackPlan = field(init=False)
    _guard: tuple[list[str], AddressGuard] | None = field(init=False, default=None, repr=False)

    def __post_init__(self) -> None:
        self._callback_plan = CallbackPlan(**self.settings.callback.model_dump())
        self.limits = Limits(max_message_bytes=self.settings.transport.max_message_bytes)
        self.rpc_timeout = timedelta(seconds=self.settings.temporal.rpc_timeout_s)

    def reconfigure(self, settings: ReachSettings) -> None:
        """A reloaded configuration (validated): the door's plans, limits and rules use it
        from the next request on. Connections, workers and the registry keep theirs until a
        restart (the reload says which sections that concerns)."""
        # `security` (allowed networks, mTLS, encryption) is the connectors' and workers' too:
        # it changes with a restart, everywhere at once, never for the door alone.
        self.settings = settings.model_copy(update={"security": self.settings.security})
        self._routing = {}
        self._callback_plan = CallbackPlan(**settings.callback.model_dump())

    def _routing_for(self, capability: str) -> RoutingSettings:
        found = self._routing.get(capability)
        if found is None:
            found = self._routing[capability] = self.settings.routing_for(capability)
        return found

    async def _known(self, capability: str) -> bool:
        if self.view is not None:
            return await self.view.known(capability)
        return await self.registry.known(capability)

    # -- agents and readiness (shared by the HTTP routes and the gRPC front) ------------------

    async def join(self, body: JoinRequest, principal: Principal | None = None) -> Ack:
        """Register an instance whose protocol has a connector and whose address it accepts.

        With tokens required, `principal` is the agent token's: it must be allowed to serve
        the capability, and an instance_id another principal holds is not taken over."""
        may_serve(principal, body.capability)
        known = connectors.available()
        if body.protocol not in known:
            raise InvalidRequest(
                f"protocol {body.protocol!r} has no connector; known: {', '.join(sorted(known))}"
            )
        connector = connectors.load(body.protocol)
        body.service_address = connector.check_address(body.service_address)
        await self._vet_address(connector, body.service_address)
        if self.connectors is not None and self.settings.security.tls.enabled:
            # mTLS: the agent must hold a certificate from the CA for this instance_id (403).
            live = self.connectors.get(body.protocol)
            await live.verify_identity(body.service_address, body.instance_id)
        owner = principal.name if principal is not None and principal.kind == "agent" else None
        ack = await self.registry.join(body, owner)
        if self.door is not None:
            self.door.audit.record(
                "join",
                principal=principal.name if principal else None,
                capability=body.capability,
                instance=body.instance_id,
                protocol=body.protocol,
                address=body.service_address,
            )
        return ack

    async def heartbeat(
        self, instance_id: str, report: HealthReport, principal: Principal | None = None
    ) -> InstanceRecord:
        if principal is not None and principal.kind == "agent":
            await self.registry.owned(instance_id, principal.name)
        record = await self.registry.heartbeat(instance_id, report)
        if self.metrics is not None:
            self.metrics.heartbeat(record.capability, record.status)
        return record

    async def leave(self, instance_id: str, principal: Principal | None = None) -> bool:
        if principal is not None and principal.kind == "agent":
            await self.registry.owned(instance_id, principal.name)
        left = await self.registry.leave(instance_id)
        if left and self.door is not None:
            self.door.audit.record(
                "leave", principal=principal.name if principal else None, instance=instance_id
            )
        return left

    # -- the address guard against request forgery (reach.security.netguard) ----------------

    def address_guard(self) -> AddressGuard:
        """The guard for the settings in force (built again when a reload changes them)."""
        networks = self.settings.security.allow_networks
        if self._guard is None or self._guard[0] is not networks:
            self._guard = (networks, AddressGuard(networks))
        return self._guard[1]

    async def _vet_address(self, connector: type[Connector], address: str) -> None:
        """Every address a joining agent's host resolves to must be allowed, else 422."""
        target = connector.address_host_port(address)
        if target is None:
            return
        try:
            await self.address_guard().resolve_checked(*target)
        except InvalidRequest as exc:
            raise InvalidRequest(f"service address {address!r}: {exc.message}") from None

    async def _vet_callback(self, url: str) -> None:
        """A callback URL must be http(s) and its host resolve to allowed addresses, else 422."""
        try:
            await self.address_guard().check_url(url)
        except InvalidRequest as exc:
            raise InvalidRequest(f"callback {safe_url(url)!r}: {exc.message}") from None

    async def readiness(self) -> dict[str, bool]:
        """Whether Temporal and the registry store answer, each bounded in time."""
        checks: dict[str, bool] = {}
        try:
            checks["temporal"] = await asyncio.wait_for(
                self.client.service_client.check_health(), READY_CHECK_S
            )
        except (RPCError, TimeoutError):
            checks["temporal"] = False
        # The store's own socket timeout bounds this one (registry.redis_timeout_s).
        checks["registry"] = await self.registry.store.ping()
        return checks

    async def policy_detail(self, capability: str) -> dict[str, Any]:
        """Breaker, ejections and limiter as the shared store holds them now."""
        view = await self.policy.view(capability, fresh=True)
        limits = self.settings.policy.rate_limit_for(capability)
        limiter: dict[str, float] = {}
        if limits is not None and limits.per_capability is not None:
            limiter = await self.policy.state.buckets([capability_bucket(capability)])
        return {
            "breaker": {
                "status": view.breaker.status,
                "failures": view.breaker.failures,
                "retry_after_s": round(view.breaker.retry_after_s, 3),
            },
            "ejected": {i: round(left, 3) for i, left in view.ejected.items()},
            "limiter": limiter,
        }

    async def routing_detail(self, capability: str) -> dict[str, Any]:
        """The capability's routing configuration and its calls in flight."""
        routing = self._routing_for(capability)
        inflight: dict[str, int] = {}
        if self.router is not None:
            tracker = self.router.inflight
            await tracker.refresh(capability)
            inflight = dict(sorted(tracker.counts(capability).items()))
        strategy = routing.strategy or "round_robin"
        return {
            "strategy": strategy,
            "fallback": routing.fallback if strategy == "consistent_hash" else None,
            "hash_on": (routing.hash_on or "routing_key")
            if strategy == "consistent_hash"
            else None,
            "max_inflight": routing.max_inflight,
            "inflight": inflight,
        }

    # -- invoke -------------------------------------------------------------------------------

    async def invoke(
        self,
        req: InvokeRequest,
        payload_json: bytes,
        caller: str,
        traceparent: str | None = None,
    ) -> InvokeResponse:
        """Start (or attach to) the request's workflow; sync: its verdict, async: accepted.

        `caller` is the principal the door authenticated (or the self-named caller when auth
        is off). The rules decide first (403 names the rule; nothing is started), and one
        audit record tells how the request left the door.

        A sync answer still `running` after the deadline (no worker took the request) comes
        back as such: the caller gets a 504 and can ask again by RequestID.

        Every answer, refusals included, is counted in the metrics (`reach_invokes_total`,
        `reach_invoke_duration_seconds`).
        """
        metrics = self.metrics
        if metrics is None:
            return await self._audited(req, payload_json, caller, traceparent)
        t0 = time.perf_counter()
        try:
            response = await self._audited(req, payload_json, caller, traceparent)
        except ReachError as exc:
            status = "timeout" if exc.type == "timeout" else "error"
            target, op = await self._labels(req)
            metrics.invoke(target, op, status, exc.type, time.perf_counter() - t0)
            raise
        except RPCError as exc:  # Temporal's trouble: answered as reach_error_of_rpc says
            rpc_error = reach_error_of_rpc(exc).type
            target, op = await self._labels(req)
            metrics.invoke(target, op, "error", rpc_error, time.perf_counter() - t0)
            raise
        error_type = response.error.type if response.error else ""
        seconds = time.perf_counter() - t0
        target, op = (
            (req.target, req.operation) if response.status == "success" else await self._labels(req)
        )
        metrics.invoke(target, op, response.status, error_type, seconds)
        return response

    async def _labels(self, req: InvokeRequest) -> tuple[str, str]:
        """Metric labels for a request that did not succeed: a capability nobody registered
        is the caller's to name (and to multiply), so it counts as `_unknown`."""
        if await self._known(req.target):
            return req.target, req.operation
        return UNKNOWN_LABEL, UNKNOWN_LABEL

    async def _audited(
        self, req: InvokeRequest, payload_json: bytes, caller: str, traceparent: str | None
    ) -> InvokeResponse:
        """`invoke` through the door: the rules, then one audit record."""
        door = self.door
        if door is None:
            return await self._invoke(req, payload_json, caller, traceparent, None)
        t0 = time.perf_counter()
        decision = door.decide(caller, req.target, req.operation)
        try:
            response = await self._invoke(req, payload_json, caller, traceparent, decision)
        except ReachError as exc:
            door.audit.record(
                "invoke",
                request_id=req.request_id,
                caller=caller,
                capability=req.target,
                operation=req.operation,
                duration_ms=round((time.perf_counter() - t0) * 1000, 3),
                status=exc.http_status,
                outcome="error",
                error_type=exc.type,
                rule=decision.rule,
            )
            raise
        door.audit.record(
            "invoke",
            request_id=response.request_id,
            caller=caller,
            capability=req.target,
            operation=req.operation,
            instance=response.instance_id,
            duration_ms=round((time.perf_counter() - t0) * 1000, 3),
            status=status_code_of(response, running=504),
            outcome=response.status,
            error_type=response.error.type if response.error else None,
            attempts=len(response.attempts) if response.attempts else None,
            rule=decision.rule,
        )
        return response

    async def _invoke(
        self,
        req: InvokeRequest,
        payload_json: bytes,
        caller: str,
        traceparent: str | None,
        decision: Decision | None,
    ) -> InvokeResponse:
        entered = time.perf_counter()
        request_id = req.request_id or new_request_id()
        if req.callback:  # request forgery: the callback's host must resolve to allowed IPs
            await self._vet_callback(str(req.callback))
        if not await self._known(req.target) and not await self._exists(request_id):
            raise UnknownCapability(f"no agent has registered capability {req.target!r}")
        plan = plan_call(
            self.settings.policy,
            capability=req.target,
            operation=req.operation,
            timeout_ms=req.timeout_ms,
            idempotency_key=req.idempotency_key,
            mode=self.settings.capability_mode(req.target),
        )
        plan.idempotency_ttl_s = self.settings.policy.idempotency_retention_s
        now_ms = int(time.time() * 1000)
        if decision is not None and decision.rate_limit_per_minute is not None:
            await self._rule_limit(req, caller, decision)
        await self._rate_limit(req, caller, plan, now_ms)
        routing_key = hash_key(self._routing_for(req.target), req.payload, req.routing_key)
        endpoint = None
        if self.resolver is not None and plan.queue is None:
            # Chosen here, attempt 1 is a single step in the workflow: the call.
            endpoint = self.resolver.first(
                ResolveInput(
                    capability=req.target,
                    routing_key=routing_key or req.routing_key,
                    request_id=request_id,
                    payload_bytes=len(payload_json),
                    operation=req.operation,
                    attempt=1,
                    deadline_ms=now_ms + plan.timeout_ms,
                ),
                reserve=self.calls_here and plan.mode == "inline",
            )
        inp = InvokeInput(
            request_id=request_id,
            caller=caller,
            target=req.target,
            operation=req.operation,
            payload=req.payload,
            accepted_at_ms=now_ms,
            deadline_ms=now_ms + plan.timeout_ms,
            callback=str(req.callback) if req.callback else None,
            callback_plan=self._callback_plan,
            idempotency_key=req.idempotency_key,
            routing_key=req.routing_key,
            hash_key=routing_key,
            traceparent=traceparent,
            plan=plan,
            payload_bytes=len(payload_json),
            endpoint=endpoint,
            # What nearly every such request ends as: then its end writes no search attribute.
            status_at_start="success"
            if endpoint is not None and plan.mode == "inline" and not req.callback
            else "running",
        )
        finishes = None if req.callback else self.finishes
        wait = finishes.expect(request_id) if finishes is not None else None
        try:
            return await self._answer(req, inp, entered, now_ms, wait)
        finally:
            if finishes is not None and wait is not None:
                finishes.done(wait)

    async def _answer(
        self,
        req: InvokeRequest,
        inp: InvokeInput,
        entered: float,
        now_ms: int,
        wait: Finish | None,
    ) -> InvokeResponse:
        """Start `inp`'s workflow (or attach to its earlier run) and wait for its verdict."""
        request_id, endpoint = inp.request_id, inp.endpoint
        handle, started = await self._start(inp)
        if started and self.metrics is not None:
            self.metrics.accepted(req.target, time.perf_counter() - entered)
        deadline_ms = inp.deadline_ms
        if not started and endpoint is not None and self.resolver is not None:
            self.resolver.release(request_id)
        if not started:
            # A repeat (rare): the first request's own input says what it was.
            first = await self._original(handle)
            if first is not None:
                check_repeat(request_id, first, inp)
                deadline_ms = first.deadline_ms
        if req.callback:
            return InvokeResponse(request_id=request_id, status="accepted")
        budget = max(0.0, deadline_ms / 1000 - time.time()) + SYNC_GRACE_S
        try:
            # A deadline on this task, not wait_for's task per request (one loop turn less).
            async with asyncio.timeout(budget):
                if wait is not None and started:
                    payload = await wait.result(handle)
                    if payload is not None:
                        if self.finishes is not None:
                            self.finishes.answered_here += 1
                        return await self._decode(payload)
                if self.finishes is not None:
                    self.finishes.long_polled += 1
                return await self._outcome(handle)
        except TimeoutError:
            return InvokeResponse(
                request_id=request_id,
                status="running",
                duration_ms=int(time.time() * 1000) - now_ms,
                error=ErrorInfo(
                    type="timeout",
                    message="no verdict by the deadline (is a worker running?); the request "
                    f"is still tracked: GET /reach/requests/{request_id}",
                    retryable=True,
                ),
            )

    async def _rule_limit(self, req: InvokeRequest, caller: str, decision: Decision) -> None:
        """The allowing rule's rate_limit_per_minute (R19), per caller and capability: 429."""
        per_minute = decision.rate_limit_per_minute or 0.0
        bucket = BucketPlan(
            key=f"rule:{decision.rule}:{req.target}:{caller}",
            per_minute=per_minute,
            capacity=LimitSettings(per_minute=per_minute).capacity,
        )
        wait_s = await self.policy.take([bucket])
        if wait_s > 0 and not await self._calls_no_agent(req, caller):
            if self.metrics is not None:
                self.metrics.rate_limited(req.target, "reject")
            raise RateLimited(
                f"rule {decision.rule!r} allows caller {caller!r} {per_minute:g} calls a minute "
                f"to {req.target!r}; a token frees in {wait_s:.1f}s",
                retry_after_s=max(1, math.ceil(wait_s)),
            )

    async def _rate_limit(
        self, req: InvokeRequest, caller: str, plan: CallPlan, now_ms: int
    ) -> None:
        """R15 at the door: take a token, or refuse (429), or plan a durable wait (queue)."""
        limits = self.settings.policy.rate_limit_for(req.target)
        if limits is None:
            return
        buckets = limit_buckets(limits, req.target, caller)
        wait_s = await self.policy.take(buckets)
        if wait_s <= 0 or await self._calls_no_agent(req, caller):
            return
        if self.metrics is not None:
            self.metrics.rate_limited(req.target, limits.on_limit)
        if limits.on_limit == "reject":
            raise RateLimited(
                f"rate limit of capability {req.target!r} for caller {caller!r} reached; "
                f"a token frees in {wait_s:.1f}s",
                retry_after_s=max(1, math.ceil(wait_s)),
            )
        # Queue: the request waits for a token inside its workflow, on durable timers; a
        # synchronous one until its deadline, one with a callback up to max_queue_wait_ms.
        until = now_ms + (limits.max_queue_wait_ms if req.callback else plan.timeout_ms)
        plan.queue = QueuePlan(buckets=buckets, wait_until_ms=until)

    async def _calls_no_agent(self, req: InvokeRequest, caller: str) -> bool:
        """Whether a request the limiter would refuse is a repeat that calls no agent: its
        request_id exists (it attaches), or its idempotency_key holds another request's result
        for the same payload (it is replayed). Asked only when the limit is reached."""
        if req.request_id and await self._exists(req.request_id):
            return True
        if not req.idempotency_key:
            return False
        scope = idempotency_scope(caller, req.target, req.operation, req.idempotency_key)
        held = await self.policy.state.peek(scope)
        return held is not None and held.partition(" ")[2] == payload_fingerprint(req.payload)

    async def _start(self, inp: InvokeInput) -> tuple[InvokeHandle, bool]:
        """The handle, and whether this call started the workflow (False: it attached)."""
        try:
            handle = await self.client.start_workflow(
                InvokeWorkflow.run,
                inp,
                id=inp.request_id,
                task_queue=self.settings.temporal.task_queue,
                id_reuse_policy=WorkflowIDReusePolicy.REJECT_DUPLICATE,
                id_conflict_policy=WorkflowIDConflictPolicy.USE_EXISTING,
                request_eager_start=True,
                rpc_timeout=self.rpc_timeout,
                # The Temporal UI's one line per request; the workflow adds the outcome.
                static_summary=f"{inp.target}.{inp.operation} from {inp.caller}",
                search_attributes=TypedSearchAttributes(
                    [
                        SearchAttributePair(SA_CALLER, inp.caller),
                        SearchAttributePair(SA_CAPABILITY, inp.target),
                        SearchAttributePair(SA_OPERATION, inp.operation),
                        SearchAttributePair(SA_STATUS, inp.status_at_start),
                    ]
                    + (
                        [SearchAttributePair(SA_INSTANCE, inp.endpoint.instance_id)]
                        if inp.endpoint is not None
                        else []
                    )
                ),
            )
        except WorkflowAlreadyStartedError:
            # Finished earlier: attach to it; a request id never runs twice.
            return self.client.get_workflow_handle_for(InvokeWorkflow.run, inp.request_id), False
        return handle, started_here(handle)

    # -- reading a request --------------------------------------------------------------------

    async def _outcome(
        self, handle: InvokeHandle, rpc_timeout: timedelta | None = None
    ) -> InvokeResponse:
        """The request's final envelope, also when its workflow ended without one.

        `rpc_timeout` for a workflow known to be closed; a caller waiting for a running one
        bounds the wait itself (the result is a long poll).
        """
        try:
            return await handle.result(rpc_timeout=rpc_timeout)
        except WorkflowFailureError as exc:
            return ended_without_result(handle.id, exc.cause)

    async def _decode(self, payload: Payload) -> InvokeResponse:
        """The final envelope from the result payload its workflow completed with."""
        (response,) = await self.client.data_converter.decode([payload], [InvokeResponse])
        if not isinstance(response, InvokeResponse):
            raise TypeError(f"the invoke workflow's result is a {type(response).__name__}")
        return response

    async def _exists(self, request_id: str) -> bool:
        try:
            await self.client.get_workflow_handle(request_id).describe(rpc_timeout=self.rpc_timeout)
        except RPCError as exc:
            if exc.status == RPCStatusCode.NOT_FOUND:
                return False
            raise
        return True

    async def _original(self, handle: InvokeHandle) -> InvokeInput | None:
        """The request as it was accepted: its workflow's input, from the first history event.

        Read only off the hot path (repeats and look-ups); a memo would carry the same on every
        start and measurably slows it.
        """
        async for event in handle.fetch_history_events(page_size=1, rpc_timeout=self.rpc_timeout):
            payloads = event.workflow_execution_started_event_attributes.input.payloads
            try:
                [inp] = await self.client.data_converter.decode(payloads, [InvokeInput])
            except Exception:  # an input nobody can decode: the request reads as failed
                return None
            return inp if isinstance(inp, InvokeInput) else None
        return None

    async def status(self, request_id: str, principal: Principal | None = None) -> InvokeResponse:
        """A request's state. With tokens required only its caller (or an admin) may read it;
        anyone else is told it does not exist (a 403 would confirm that it does)."""
        handle = self.client.get_workflow_handle_for(InvokeWorkflow.run, request_id)
        try:
            desc = await handle.describe(rpc_timeout=self.rpc_timeout)
        except RPCError as exc:
            if exc.status == RPCStatusCode.NOT_FOUND:
                raise UnknownRequest(f"no request with id {request_id!r}") from exc
            raise
        owner = desc.typed_search_attributes.get(SA_CALLER)
        if principal is not None and principal.kind != "admin" and owner != principal.name:
            raise UnknownRequest(f"no request with id {request_id!r}")
        if desc.status == WorkflowExecutionStatus.RUNNING:
            response = InvokeResponse(
                request_id=request_id,
                status="running",
                instance_id=desc.typed_search_attributes.get(SA_INSTANCE),
                # A query waits for the workflow task in progress (an inline call): skip it then.
                attempts=None
                if desc.raw_description.HasField("pending_workflow_task")
                else await self._attempts_so_far(handle),
            )
        else:
            response = await self._outcome(handle, self.rpc_timeout)
        original = await self._original(handle)
        if original is not None and original.callback:
            response.delivery = await self._delivery(request_id, original.callback, response.status)
        return response

    async def _attempts_so_far(self, handle: InvokeHandle) -> list[AttemptInfo] | None:
        """A running request's attempts, asked of its worker; none when no worker answers soon
        (a query needs one), which must not hold up the status itself."""
        try:
            attempts = await handle.query(InvokeWorkflow.attempts_so_far, rpc_timeout=QUERY_WAIT)
        except (RPCError, WorkflowQueryFailedError, WorkflowQueryRejectedError):
            return None
        return attempts or None

    async def _delivery(self, request_id: str, url: str, status: str) -> DeliveryState:
        """The callback delivery's state, from its own workflow."""
        handle = self.client.get_workflow_handle(
            delivery_workflow_id(request_id), result_type=DeliveryOutcome
        )
        try:
            desc = await handle.describe(rpc_timeout=self.rpc_timeout)
        except RPCError as exc:
            if exc.status != RPCStatusCode.NOT_FOUND:
                raise
            if status == "running":  # the result is not known yet
                return DeliveryState(url=url, status="pending")
            return DeliveryState(
                url=url,
                status="given_up",
                last_error=f"the request ended ({status}) before a worker could hand its "
                "result to delivery",
            )
        if desc.status == WorkflowExecutionStatus.RUNNING:
            attempts, last_error = 0, None
            for pending in desc.raw_description.pending_activities:
                waiting = pending.state == PendingActivityState.PENDING_ACTIVITY_STATE_SCHEDULED
                attempts = pending.attempt - 1 if waiting else pending.attempt
                last_error = pending.last_failure.message or None
            return DeliveryState(
                url=url, status="pending", attempts=attempts, last_error=last_error
            )
        try:
            outcome: DeliveryOutcome = await handle.result(rpc_timeout=self.rpc_timeout)
        except WorkflowFailureError as exc:
            return DeliveryState(url=url, status="given_up", last_error=str(exc.cause))
        return DeliveryState(url=url, **outcome.model_dump())

    # -- late answers -------------------------------------------------------------------------

    async def late_answer(
        self, request_id: str, answer: LateAnswer, principal: Principal | None = None
    ) -> str:
        """Hand an agent's late answer to its request: 'received' (also for a resend of it).

        The update's id is the answer's content, so a resend (after a 503, a lost reply) is the
        same update, never another one carrying the same payload again.
        """
        answer.principal = None
        if principal is not None and principal.kind == "agent":
            # Only the instance the request was sent to answers it: here, the principal must
            # hold that instance now; the workflow checks it sent the request to an instance
            # this principal registered.
            if answer.instance_id is None:
                raise InvalidRequest("instance_id: required in a late answer when tokens are on")
            if await self.registry.owned(answer.instance_id, principal.name) is None:
                raise Forbidden(
                    f"instance {answer.instance_id!r} is not registered; join again, then answer"
                )
            answer.principal = principal.name
        handle = self.client.get_workflow_handle_for(InvokeWorkflow.run, request_id)
        # Twice the RPC timeout: the update waits for a worker to run its validator.
        wait = 2 * self.rpc_timeout
        try:
            verdict = await handle.execute_update(
                InvokeWorkflow.submit_late_answer,
                answer,
                id=f"late-answer-{answer_key(answer)}",
                rpc_timeout=wait,
            )
        except WorkflowUpdateFailedError as exc:
            cause = exc.cause
            if isinstance(cause, ApplicationError) and cause.type == "duplicate":
                return "received"
            if isinstance(cause, ApplicationError) and cause.type == "forbidden":
                raise Forbidden(f"request {request_id!r}: {cause.message}") from exc
            reason = cause.message if isinstance(cause, ApplicationError) else str(exc)
            raise RequestClosed(f"request {request_id!r}: {reason}") from exc
        except WorkflowUpdateRPCTimeoutOrCancelledError:
            raise Unavailable(
                f"no worker took the answer for {request_id!r} within "
                f"{wait.total_seconds():.0f}s; send it again"
            ) from None
        except RPCError as exc:
            if exc.status != RPCStatusCode.NOT_FOUND:
                raise
            if not await self._exists(request_id):
                raise UnknownRequest(f"no request with id {request_id!r}") from exc
            return await self._answer_after_the_end(handle, answer)
        log.info("late answer request=%s status=%s", request_id, answer.status)
        return verdict

    async def _answer_after_the_end(self, handle: InvokeHandle, answer: LateAnswer) -> str:
        final = await self._outcome(handle, self.rpc_timeout)
        if made_the_result(answer, final):
            return "received"  # the answer that made the result, sent again
        raise RequestClosed(
            f"request {handle.id!r} already ended ({final.status}); its result is final"
        )


def status_code_of(response: InvokeResponse, *, running: int = 200) -> int:
    """The HTTP status of an envelope: only Reach's own error types decide it."""
    if response.status == "accepted":
        return 202
    if response.status == "running":
        return running
    if response.status == "timeout":
        return 504
    if response.status == "error" and response.error:
        return http_status_for(response.error.type)
    return 200


def check_repeat(request_id: str, first: InvokeInput, repeat: InvokeInput) -> None:
    """A repeated RequestID attaches only to the same request; it may drop the callback (and
    wait for the result instead) but never add or change one."""
    read_it = f"GET /reach/requests/{request_id} reads the first one"
    if not same_request(first, repeat):
        raise RequestConflict(
            f"request_id {request_id!r} was first used with another body or caller; repeat "
            f"the request exactly or use a new request_id ({read_it})"
        )
    if repeat.callback and repeat.callback != first.callback:
        was = f"with callback {first.callback}" if first.callback else "without a callback"
        raise RequestConflict(
            f"request {request_id!r} was accepted {was}; a repeat cannot change where its "
            f"result goes ({read_it})"
        )


def made_the_result(answer: LateAnswer, final: InvokeResponse) -> bool:
    """Whether `final` is what this late answer, taken first, made of the request."""
    if answer.status == "success":
        return final.status == "success" and final.result == (answer.result or {})
    fault = final.error.agent if final.error else None
    return (
        final.status == "error"
        and fault is not None
        and fault.type == (answer.error_type or "agent_error")
        and fault.message == (answer.error_message or "the agent reported a failure")
    )


def started_here(handle: WorkflowHandle[Any, Any]) -> bool:
    """Whether `start_workflow` started this workflow or attached to a running one.

    The server says so in its start response (`started`), which the SDK keeps on the handle;
    a unit test guards the attribute across SDK upgrades.
    """
    response = getattr(handle, "_start_workflow_response", None)
    return bool(getattr(response, "started", True))


def ended_without_result(request_id: str, cause: BaseException | None) -> InvokeResponse:
    """A typed, final envelope for a request whose workflow ended without producing one."""
    show = f"`temporal workflow show --workflow-id {request_id}` tells why"
    if isinstance(cause, TemporalTimeout):
        return InvokeResponse(
            request_id=request_id,
            status="timeout",
            error=ErrorInfo(
                type="timeout",
                message=f"the request's workflow was ended by a timeout set outside Reach; {show}",
            ),
        )
    if isinstance(cause, TerminatedError | CancelledError):
        what = "terminated" if isinstance(cause, TerminatedError) else "cancelled"
        message = f"the request was {what} by an operator: {cause.message or 'no reason given'}"
    else:
        message = f"the request failed inside Reach: {cause}; {show}"
    return InvokeResponse(
        request_id=request_id, status="error", error=ErrorInfo(type="internal", message=message)
    )
