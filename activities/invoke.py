"""The invoke's side effects. Each failure leaves here as an `ApplicationError` whose `type` is
the Reach error type and whose details say whether it is retryable; the workflow, through
`reach.policy`, decides what happens next, so these are never retried by Temporal itself
(except the callback POST, which is always safe to repeat: the receiver dedupes on RequestID).
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Coroutine
from typing import Any

import httpx
from temporalio import activity
from temporalio.client import Client, WorkflowFailureError
from temporalio.exceptions import ApplicationError
from temporalio.service import RPCError, RPCStatusCode

from connectors import ConnectorSet
from reach.errors import (
    AgentError,
    CircuitOpen,
    DeadlineExceeded,
    InternalError,
    NoInstance,
    PayloadTooLarge,
    ReachError,
    TransportError,
    UnknownCapability,
)
from reach.invocation import (
    ACTIVITY_CALL,
    ACTIVITY_CLAIM_KEY,
    ACTIVITY_DELIVER_CALLBACK,
    ACTIVITY_FOLLOW,
    ACTIVITY_RELEASE_KEY,
    ACTIVITY_RESOLVE,
    ACTIVITY_TAKE_TOKEN,
    CallbackInput,
    CallInput,
    ClaimInput,
    ClaimOutcome,
    Endpoint,
    FollowInput,
    ResolveInput,
    TakeInput,
)
from reach.messages import InvokeResponse, Reply
from reach.policy.engine import PolicyEngine
from reach.registry import Registry
from reach.registry.view import CapabilitySnapshot, RegistryView, RouteEntry
from reach.routing import Router

log = logging.getLogger("reach.activities")

HEARTBEAT_EVERY_S = 2.0
# How long past a request's deadline its per-attempt pin is kept.
PIN_MARGIN_S = 60.0


def to_application_error(err: ReachError) -> ApplicationError:
    details: dict[str, Any] = {"retryable": err.retryable}
    if err.retry_after_s is not None:
        details["retry_after_s"] = err.retry_after_s
    if err.outcome_unknown:
        details["outcome_unknown"] = True
    if isinstance(err, AgentError) and err.fault is not None:
        details["agent"] = err.fault.model_dump(exclude_none=True)
    return ApplicationError(err.message, details, type=err.type, non_retryable=True)


def _internal(what: str, exc: Exception) -> ApplicationError:
    """A failure that is no Reach error is a bug here: typed, logged, never retried."""
    log.exception("%s failed unexpectedly", what)
    return to_application_error(InternalError(f"{what} failed inside Reach: {exc!r}"))


class ReachActivities:
    def __init__(
        self,
        registry: Registry,
        router: Router,
        connectors: ConnectorSet,
        policy: PolicyEngine,
        http: httpx.AsyncClient | None = None,
        view: RegistryView | None = None,
    ) -> None:
        self.registry = registry
        # A view that is not started (unit tests) reads the store on every resolve.
        self.view = view or RegistryView(registry)
        self.router = router
        self.connectors = connectors
        self.policy = policy
        self.client: Client | None = None  # set by the worker: following another request
        self._recording: set[asyncio.Task[None]] = set()
        self._http = http or httpx.AsyncClient(trust_env=False)

    async def aclose(self) -> None:
        await self._http.aclose()

    @activity.defn(name=ACTIVITY_RESOLVE)
    async def resolve(self, inp: ResolveInput) -> Endpoint:
        try:
            return await self._resolve(inp)
        except ReachError as err:
            raise to_application_error(err) from err
        except Exception as exc:
            raise _internal("resolve", exc) from exc

    async def _snapshot(self, capability: str) -> CapabilitySnapshot | None:
        """The capability from the local view; read from the store when the view has nothing
        routable (a join another process just saw), so 'no instance' is never a stale view's."""
        try:
            snap = await self.view.snapshot(capability)
        except ReachError as err:
            # Dirty records could not be re-read: route on what the view holds.
            log.warning("registry view not refreshed for %s: %s", capability, err.message)
            snap = self.view.cached(capability)
        if snap is None or not snap.routable:
            snap = await self.view.reload(capability)
        return snap

    async def _resolve(self, inp: ResolveInput) -> Endpoint:
        snap = await self._snapshot(inp.capability)
        if snap is None:
            if not await self.registry.known(inp.capability):
                raise UnknownCapability(
                    f"no agent has ever registered capability {inp.capability!r}"
                )
            raise NoInstance(f"capability {inp.capability!r} has no live instance")
        if not snap.routable:
            raise NoInstance(
                f"capability {inp.capability!r} has no healthy instance "
                f"({len(snap.entries)} registered, all unhealthy)"
            )
        # R8: what one routable instance negotiated, the capability can carry; refused before
        # anything is sent, whichever instance routing would have picked.
        smallest = snap.smallest
        if smallest is not None and inp.payload_bytes > smallest.max_message_bytes:
            raise PayloadTooLarge(
                f"the payload is {inp.payload_bytes} bytes; capability {inp.capability!r} "
                f"takes at most {smallest.max_message_bytes} (max_message_bytes negotiated by "
                f"instance {smallest.instance_id})"
            )
        # R14: an open breaker refuses before any agent is contacted.
        admission = await self.policy.admit(inp.capability)
        if not admission.allowed:
            wait = max(1, math.ceil(admission.retry_after_s))
            raise CircuitOpen(
                f"the circuit breaker of capability {inp.capability!r} is {admission.status} "
                f"after repeated failures; no agent was called (retry in {wait}s)",
                retry_after_s=wait,
            )
        view = await self.policy.view(inp.capability)
        ejected = self.policy.ejected(inp.capability, view)
        if self.router.reads_loads(snap):
            await self.router.inflight.fresh(inp.capability)
        route = self.router.route(
            snap,
            exclude=inp.exclude,
            ejected=ejected,
            key=inp.routing_key,
            # Inline, the call runs next in this process and takes the reservation over; in
            # queue mode another worker may run it, so nothing is reserved here.
            reserve=f"{inp.request_id}:{inp.attempt}" if inp.attempt and _runs_local() else None,
        )
        chosen = route.entry
        declared = snap.declared(inp.operation) if inp.operation else None
        if inp.attempt:
            # Unsettled by configuration and key: movable if the agents declare it idempotent.
            movable = (
                inp.movable if inp.movable is not None else bool(declared and declared.idempotent)
            )
            chosen = await self._pinned(inp, chosen, snap, movable)
        log.info(
            "routed request=%s capability=%s instance=%s of %d by %s%s%s%s",
            inp.request_id,
            inp.capability,
            chosen.instance_id,
            len(snap.routable),
            route.strategy,
            f" (breaker {admission.status})" if admission.status != "closed" else "",
            f", skipped ejected {route.skipped}" if route.skipped else "",
            f"; {route.note}" if route.note else "",
        )
        return Endpoint(
            instance_id=chosen.instance_id,
            capability=chosen.capability,
            protocol=chosen.protocol,
            address=chosen.address,
            max_message_bytes=chosen.max_message_bytes,
            breaker=admission.status,
            probe=admission.probe,
            declared_idempotent=declared.idempotent if declared else None,
            declared_timeout_ms=declared.timeout_ms if declared else None,
            skipped=route.skipped,
            strategy=route.strategy,
            route_note=route.note,
            bypassed=route.bypassed,
        )

    async def _pinned(
        self,
        inp: ResolveInput,
        chosen: RouteEntry,
        snap: CapabilitySnapshot,
        movable: bool,
    ) -> RouteEntry:
        """A re-run of the same attempt (a crashed gateway's workflow task, run again) goes
        back to the instance that got it first while it is alive: that instance answers a
        re-delivered RequestID from its memory instead of running it a second time."""
        ttl_s = max(1.0, (inp.deadline_ms - time.time() * 1000) / 1000) + PIN_MARGIN_S
        key = f"pin:{inp.request_id}:{inp.attempt}"
        # The join time tells a restarted process (same instance id, empty memory) apart.
        held = await self.policy.state.claim(key, _pin(chosen), ttl_s)
        if held == _pin(chosen):
            return chosen
        owner = held.partition(" ")[0]
        first = snap.by_id.get(owner)
        if first is not None and first.routable and _pin(first) == held:
            log.info(
                "request=%s attempt=%d goes back to %s, which got it first",
                inp.request_id,
                inp.attempt,
                owner,
            )
            return first
        if movable:
            return chosen
        # Not idempotent, no key, and the instance that got it is gone (or restarted): sending
        # it elsewhere could run it twice. Say what is known instead.
        raise TransportError(
            f"instance {owner}, which was sent this request before a Reach process stopped, "
            "is gone or restarted; it may have run it. The operation is not idempotent, so it "
            "is not sent again: repeat it with an idempotency_key to be safe",
            retryable=False,
            outcome_unknown=True,
        )

    @activity.defn(name=ACTIVITY_CLAIM_KEY)
    async def claim_key(self, inp: ClaimInput) -> ClaimOutcome:
        """Make this request the owner of its idempotency key, or name the one that is."""
        try:
            mine = f"{inp.request_id} {inp.fingerprint}"
            held = await self.policy.state.claim(inp.key, mine, inp.ttl_s)
        except ReachError as err:
            raise to_application_error(err) from err
        owner, _, fingerprint = held.partition(" ")
        return ClaimOutcome(owner=owner, same_request=fingerprint == inp.fingerprint)

    @activity.defn(name=ACTIVITY_RELEASE_KEY)
    async def release_key(self, inp: ClaimInput) -> bool:
        """Free a key whose request ended before any agent was called, so the caller can retry
        with it (nothing was executed, so there is no result to keep)."""
        try:
            return await self.policy.state.release(inp.key, f"{inp.request_id} {inp.fingerprint}")
        except ReachError as err:
            raise to_application_error(err) from err

    @activity.defn(name=ACTIVITY_FOLLOW)
    async def follow(self, inp: FollowInput) -> InvokeResponse:
        """The result of the request that owns the idempotency key (waits while it runs)."""
        if self.client is None:
            raise to_application_error(InternalError("no Temporal client to follow a request"))
        handle = self.client.get_workflow_handle(inp.request_id, result_type=InvokeResponse)
        try:
            first: InvokeResponse = await handle.result()
            return first
        except WorkflowFailureError as exc:
            raise to_application_error(
                InternalError(f"request {inp.request_id} ended without a result: {exc.cause}")
            ) from exc
        except RPCError as exc:
            if exc.status != RPCStatusCode.NOT_FOUND:
                raise
            # Kept shorter by Temporal than the key by Reach (idempotency_retention_s).
            raise to_application_error(
                InternalError(
                    f"request {inp.request_id}, which first used this idempotency_key, is no "
                    "longer kept by Temporal; keep idempotency_retention_s within its retention"
                )
            ) from exc

    @activity.defn(name=ACTIVITY_TAKE_TOKEN)
    async def take_token(self, inp: TakeInput) -> float:
        """0 when a token was taken from every bucket, else the seconds until one could be."""
        try:
            return await self.policy.take(inp.buckets)
        except ReachError as err:
            raise to_application_error(err) from err

    @activity.defn(name=ACTIVITY_CALL)
    async def call(self, inp: CallInput) -> Reply:
        endpoint, header = inp.endpoint, inp.message.header
        inflight = self.router.inflight.begin(
            endpoint.capability, endpoint.instance_id, f"{header.request_id}:{header.attempt}"
        )
        failed = False  # the agent's fault: its latency is then counted as high (routing)
        try:
            connector = self.connectors.get(endpoint.protocol)
            work = connector.invoke(endpoint, inp.message, inp.timeout_ms / 1000)
            if activity.info().is_local:
                reply = await work
            else:
                reply = await _heartbeating(work)
        except ReachError as err:
            if inp.judge_timeouts or not isinstance(err, DeadlineExceeded):
                failed = counts_as_failure(err)
                await self._record(inp.endpoint, ok=not failed)
            raise to_application_error(err) from err
        except Exception as exc:
            raise _internal(f"call to {inp.endpoint.instance_id}", exc) from exc
        finally:
            self.router.inflight.end(inflight, failed=failed)
        await self._record(inp.endpoint, ok=True)
        return reply

    async def _record(self, endpoint: Endpoint, ok: bool) -> None:
        """Count the outcome without holding up the answer: a slow store must not turn a
        success into a timeout (the task is kept until it ends)."""
        task = asyncio.create_task(
            self.policy.record(endpoint.capability, endpoint.instance_id, ok, endpoint.probe)
        )
        self._recording.add(task)
        task.add_done_callback(self._recording.discard)

    @activity.defn(name=ACTIVITY_DELIVER_CALLBACK)
    async def deliver_callback(self, inp: CallbackInput) -> int:
        """POST the envelope; return the attempt that was delivered (failures carry theirs)."""
        info = activity.info()
        response = inp.response
        try:
            # Streamed and never read: only the status matters, whatever the receiver sends.
            async with self._http.stream(
                "POST",
                inp.url,
                content=response.model_dump_json(exclude_none=True),
                headers={
                    "Content-Type": "application/json",
                    "X-Reach-Request-Id": response.request_id,
                    "X-Reach-Delivery-Attempt": str(info.attempt),
                },
                timeout=info.start_to_close_timeout.total_seconds()
                if info.start_to_close_timeout
                else 10.0,
            ) as r:
                pass
        except httpx.HTTPError as exc:
            raise ApplicationError(
                f"callback {inp.url} unreachable: {exc!r}",
                {"attempt": info.attempt},
                type="transport_error",
            ) from exc
        if r.is_success:
            return info.attempt
        permanent = 400 <= r.status_code < 500 and r.status_code not in (408, 425, 429)
        raise ApplicationError(
            f"callback {inp.url} answered HTTP {r.status_code}",
            {"attempt": info.attempt},
            type="callback_rejected" if permanent else "callback_failed",
            non_retryable=permanent,
        )


def _runs_local() -> bool:
    try:
        return activity.info().is_local
    except RuntimeError:  # called outside an activity (tests)
        return True


def _pin(instance: RouteEntry) -> str:
    return f"{instance.instance_id} {instance.joined_at!r}"


def counts_as_failure(err: ReachError) -> bool:
    """What breakers and outlier ejection count against an agent: it could not be reached,
    did not answer in time, or failed on its side (5xx, UNAVAILABLE). A 4xx is the request's
    fault, not the agent's."""
    if isinstance(err, TransportError | DeadlineExceeded):
        return True
    return isinstance(err, AgentError) and err.retryable


async def _heartbeating(work: Coroutine[Any, Any, Reply]) -> Reply:
    """Await a long call as a regular activity, heartbeating so a lost worker is noticed."""
    task = asyncio.ensure_future(work)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=HEARTBEAT_EVERY_S)
            if done:
                return task.result()
            activity.heartbeat()
    finally:
        task.cancel()
