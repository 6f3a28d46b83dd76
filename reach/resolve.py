"""From a capability name to the one instance an attempt goes to.

`Resolver.resolve` is the workflow's resolve step (an activity): the local registry view, the
payload limit every routable instance negotiated (R8), the breaker (R14), outlier ejection, the
routing strategy and, for an attempt that may run again after a crash, its pin.

`Resolver.first` is the same decision made at the door for attempt 1, so that a request's first
attempt is a single step (the call) in its workflow: the chosen endpoint travels in the workflow
input, where history keeps it. It never holds a request up: whatever it cannot decide at once
from what this process already holds (nothing routable, a breaker not closed, a policy view
or in-flight counts too old to use, a refusal) is left to the workflow's own resolve, which
waits for the store, decides durably and reports it. The door never waits for the store.
`Resolver.check_first` runs just before the call: a re-run of that first attempt (a crashed
gateway's workflow task, run again elsewhere) goes back to the instance chosen at the door
while it is alive, as a pinned attempt does.
"""

from __future__ import annotations

import logging
import math
import time
import uuid

from reach.errors import (
    CircuitOpen,
    NoInstance,
    PayloadTooLarge,
    ReachError,
    TransportError,
    Unavailable,
    UnknownCapability,
)
from reach.invocation import Endpoint, ResolveInput, pin_of
from reach.outcome import may_have_run
from reach.policy.engine import PolicyEngine
from reach.policy.state import Admission, CapabilityView
from reach.registry import OperationDeclaration, Registry
from reach.registry.view import CapabilitySnapshot, RegistryView, RouteEntry
from reach.routing import Route, Router

log = logging.getLogger("reach.activities")

# How long past a request's deadline its per-attempt pin is kept.
PIN_MARGIN_S = 60.0
CLOSED = Admission(allowed=True, status="closed")


class StaleRoute(Exception):
    """The instance chosen at the door is gone and nothing was sent (or the request may move):
    the workflow resolves attempt 1 again. Never reaches a caller. `pinned_before`: a re-run
    found the route pinned by another run (a lost task's, which may have sent it there)."""

    def __init__(self, message: str, *, pinned_before: bool = False) -> None:
        super().__init__(message)
        self.pinned_before = pinned_before


class Resolver:
    def __init__(
        self, registry: Registry, view: RegistryView, policy: PolicyEngine, router: Router
    ) -> None:
        self.registry = registry
        self.view = view
        self.policy = policy
        self.router = router

    async def _snapshot(self, capability: str) -> CapabilitySnapshot | None:
        """The capability from the local view; read from the store when the view has nothing
        routable (a join another process just saw), so 'no instance' is never a stale view's."""
        try:
            snap = await self.view.snapshot(capability)
        except ReachError as err:
            # Dirty records could not be re-read: route on what the view holds.
            log.warning("registry view not refreshed for %s: %s", capability, err.message)
            snap = self.view.cached(capability)
        if snap is None or not snap.routable_size:
            snap = await self.view.reload(capability)
        return snap

    async def resolve(self, inp: ResolveInput, *, reserve: bool = True) -> Endpoint:
        """The endpoint of attempt `inp.attempt` (0: no pin). `reserve`: the call runs next in
        this process and takes over the in-flight reservation (inline)."""
        snap = await self._snapshot(inp.capability)
        if snap is None:
            if not await self.registry.known(inp.capability):
                raise UnknownCapability(
                    f"no agent has ever registered capability {inp.capability!r}"
                )
            raise NoInstance(f"capability {inp.capability!r} has no live instance")
        return await self._route(inp, snap, reserve=reserve, pin=bool(inp.attempt))

    async def settle(self, capability: str, within_s: float) -> None:
        """Before `first`: wait (at most `within_s`) for the policy view `first` routes on,
        only for a capability this process can route (a name nobody registered is the
        caller's to make up: it must leave no view behind, nor a metric label)."""
        snap = self.view.cached(capability) if self.view.settled(capability) else None
        if snap is not None and snap.routable_size:
            await self.policy.settle(capability, within_s)

    def first(self, inp: ResolveInput, *, reserve: bool) -> Endpoint | None:
        """Attempt 1's endpoint, chosen at the door from what this process holds, without
        waiting for the store; None leaves it to the workflow. `reserve` counts the pick in
        flight (inline, called here next): `release` undoes it."""
        snap = self.view.cached(inp.capability) if self.view.settled(inp.capability) else None
        if snap is None or not snap.routable_size:
            return None
        view = self.policy.recent_view(inp.capability)
        # A breaker that is not closed (or a half-open probe) is the workflow's to meet: a
        # probe slot is never taken for a request that may only attach to a running one.
        if view is None or view.breaker.status != "closed":
            return None
        if self.router.reads_loads(snap) and (
            # Loads are only right when the pick is counted here until its call begins: a
            # door whose calls run elsewhere (no worker, queue mode) leaves it to the worker.
            not reserve or not self.router.inflight.recent(inp.capability)
        ):
            return None
        try:
            self._check(inp, snap)
            route, chosen, declared = self._choose(inp, snap, view, reserve=reserve)
        except ReachError as err:
            log.debug("request=%s: routed by its workflow (%s)", inp.request_id, err.message)
            return None
        return self._endpoint(inp, snap, route, chosen, declared, CLOSED, door=True)

    def release(self, request_id: str) -> None:
        """Attempt 1's door route will not be called (a repeat attached to a running request,
        or the request ended first): free the in-flight count it made."""
        self.router.inflight.cancel(f"{request_id}:1")

    async def check_first(
        self,
        endpoint: Endpoint,
        request_id: str,
        movable: bool,
        *,
        fresh: bool,
        deadline_ms: int | None = None,
        token: str | None = None,
    ) -> bool:
        """Before calling the endpoint chosen at the door: go on if its instance is still the
        one chosen (alive, routable, not restarted); else `StaleRoute` when nothing can have
        been sent (`fresh`: the first run of this attempt) or the request may move, or the
        unknown outcome when it may not. Not fresh (after a wait, or a re-run), the call is
        pinned in the store first, as resolve pins the attempts it routes: a task lost after
        it leaves no other trace (`workflows._failures.sent_by_lost_run` reads it). True when
        another run had pinned it first (a lost task's, which may have sent it), as
        `Endpoint.pinned_before` says of a resolved attempt."""
        try:
            snap = await self.view.snapshot(endpoint.capability)
        except ReachError:
            snap = self.view.cached(endpoint.capability)
        entry = snap.by_id.get(endpoint.instance_id) if snap is not None else None
        if entry is not None and entry.routable and _pin(entry) == endpoint_pin(endpoint):
            if not fresh:
                log.info(
                    "request=%s attempt 1 goes back to %s, chosen at the door",
                    request_id,
                    endpoint.instance_id,
                )
                return await self._pin_door_route(endpoint, request_id, deadline_ms, token)
            return False
        if fresh or movable:
            raise StaleRoute(
                f"instance {endpoint.instance_id} left before request {request_id} was sent",
                pinned_before=not fresh and await self._door_pinned(request_id),
            )
        raise _lost(endpoint.instance_id)

    def _check(self, inp: ResolveInput, snap: CapabilitySnapshot) -> None:
        if not snap.routable_size:
            raise NoInstance(
                f"capability {inp.capability!r} has no healthy instance "
                f"({snap.size} registered, all unhealthy)"
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

    async def _route(
        self, inp: ResolveInput, snap: CapabilitySnapshot, *, reserve: bool, pin: bool
    ) -> Endpoint:
        self._check(inp, snap)
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
        if self.router.reads_loads(snap):
            await self.router.inflight.fresh(inp.capability)
        route, chosen, declared = self._choose(inp, snap, view, reserve=reserve)
        before = False
        if pin:
            # Unsettled by configuration and key: movable if the agents declare it idempotent.
            movable = (
                inp.movable if inp.movable is not None else bool(declared and declared.idempotent)
            )
            chosen, before = await self._pinned(inp, chosen, snap, movable)
        endpoint = self._endpoint(inp, snap, route, chosen, declared, admission, door=False)
        endpoint.pinned_before = before
        return endpoint

    def _choose(
        self, inp: ResolveInput, snap: CapabilitySnapshot, view: CapabilityView, *, reserve: bool
    ) -> tuple[Route, RouteEntry, OperationDeclaration | None]:
        route = self.router.route(
            snap,
            exclude=inp.exclude,
            ejected=self.policy.ejected(inp.capability, view),
            key=inp.routing_key,
            # Inline, the call runs next in this process and takes the reservation over; in
            # queue mode another worker may run it, so nothing is reserved here.
            reserve=f"{inp.request_id}:{inp.attempt or 1}" if reserve else None,
        )
        declared = snap.declared(inp.operation) if inp.operation else None
        return route, route.entry, declared

    def _endpoint(
        self,
        inp: ResolveInput,
        snap: CapabilitySnapshot,
        route: Route,
        chosen: RouteEntry,
        declared: OperationDeclaration | None,
        admission: Admission,
        *,
        door: bool,
    ) -> Endpoint:
        # At the door, every request: its workflow input keeps the decision, and the log has
        # the ones worth a look (a fallback, a skip); DEBUG shows all.
        plain = not (route.note or route.skipped or route.bypassed) and admission.status == "closed"
        log.log(
            logging.DEBUG if door and plain else logging.INFO,
            "routed request=%s capability=%s instance=%s of %d by %s%s%s%s",
            inp.request_id,
            inp.capability,
            chosen.instance_id,
            snap.routable_size,
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
            joined_at=chosen.joined_at,
            principal=chosen.principal,
            details=dict(chosen.details),
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
    ) -> tuple[RouteEntry, bool]:
        """A re-run of the same attempt (a crashed gateway's workflow task, run again) goes
        back to the instance that got it first while it is alive: that instance answers a
        re-delivered RequestID from its memory instead of running it a second time. The
        workflow names that instance itself (`inp.pin`) when the door chose it. Also whether
        another run pinned it (each claim carries a token of its own, the workflow's: a run's
        claim again of the same attempt, `inp.again`, is checked on a key of its own, so that
        its own earlier claim never reads as another run's): that run was lost, and may have
        sent it."""
        ttl_s = max(1.0, (inp.deadline_ms - time.time() * 1000) / 1000) + PIN_MARGIN_S
        key = pin_key(inp.request_id, inp.attempt)
        # The join time tells a restarted process (same instance id, empty memory) apart.
        mine = f"{inp.pin or _pin(chosen)} {inp.token or uuid.uuid4().hex[:16]}"
        first = await self.policy.state.claim(key, mine, ttl_s)
        before = first != mine
        held = " ".join(first.split(" ")[:2])  # without its claim's token (none before them)
        taken = first
        if inp.again and inp.token:
            # This run claimed the attempt before (the first key holds its own claim, or one it
            # was told of then): only its claim number `again` found taken is another run's.
            again = f"{held} {inp.token}"
            key = pin_key(inp.request_id, inp.attempt, inp.again)
            taken = await self.policy.state.claim(key, again, ttl_s)
            before = taken != again
        if before:
            _refuse_if_superseded(inp, taken)
        if held == _pin(chosen):
            return chosen, before
        owner = held.partition(" ")[0]
        owned = snap.by_id.get(owner)
        if owned is not None and owned.routable and _pin(owned) == held:
            log.info(
                "request=%s attempt=%d goes back to %s, which got it first",
                inp.request_id,
                inp.attempt,
                owner,
            )
            return owned, before
        if movable:
            return chosen, before
        # Not idempotent, no key, and the instance that got it is gone (or restarted): sending
        # it elsewhere could run it twice. Say what is known instead.
        raise _lost(owner)

    async def _pin_door_route(
        self, endpoint: Endpoint, request_id: str, deadline_ms: int | None, token: str | None
    ) -> bool:
        left_s = ((deadline_ms or 0) - time.time() * 1000) / 1000
        # A token of this claim's own, as `_pinned`'s: a lost task that called this route
        # after the same wait pinned it first (the gateway killed with its agent: this run's
        # call then meets a refused connection, and only the pin says the lost one ran).
        mine = f"{endpoint_pin(endpoint)} {token or uuid.uuid4().hex[:16]}"
        try:
            held = await self.policy.state.claim(
                pin_key(request_id, 1), mine, max(1.0, left_s) + PIN_MARGIN_S
            )
        except ReachError as err:  # the call goes on: the store only keeps the evidence
            log.warning("request=%s: attempt 1 not pinned: %s", request_id, err.message)
            return False
        return held != mine

    async def _door_pinned(self, request_id: str) -> bool:
        """Whether a run pinned the door's route (not this one: it pins only a route it calls)."""
        try:
            return await self.policy.state.peek(pin_key(request_id, 1)) is not None
        except ReachError as err:
            log.warning("request=%s: attempt 1's pin not read: %s", request_id, err.message)
            return False


def _refuse_if_superseded(inp: ResolveInput, taken: str) -> None:
    """Send nothing when the claim found held was made by a later task of this same run (its
    token's history is longer): this task was lost, and is still running (its worker stalled
    past the workflow task timeout, then woke). The run that took it over pinned the attempt
    first and so found no other run's pin (`CallInput.routed_here`): it counts a send-once
    claim the store cannot check as nothing sent, which this task's send would make untrue.
    Nothing this task answers is recorded (its task was timed out)."""
    mine, theirs = (inp.token or "").split("."), taken.rpartition(" ")[2].split(".")
    if len(mine) != 4 or len(theirs) != 4 or mine[0] != theirs[0]:
        return  # not both tokens of one run (a request older than counted claims)
    if not (mine[1].isdigit() and theirs[1].isdigit()) or int(theirs[1]) <= int(mine[1]):
        return  # an earlier task's claim (a lost one's, or this run's own): `pinned_before`
    raise Unavailable(
        f"request {inp.request_id} attempt {inp.attempt} was taken over by another worker "
        "while this one was stalled; it is not sent from here"
    )


def pin_key(request_id: str, attempt: int, again: int = 0) -> str:
    """The policy-state claim naming the instance (and its join) an attempt was sent to; with
    `again` > 0, a run's claim number `again` of it (`ResolveInput.again`)."""
    return f"pin:{request_id}:{attempt}" + (f":{again}" if again else "")


async def pinned_instance(
    policy: PolicyEngine, request_id: str, attempt: int, made: int = 0
) -> str | None:
    """The instance attempt `attempt` was pinned to, if the store still has it; when the asking
    run made `made` claims of it itself, only one another run made after them (its number
    `made` taken) names one: the run knows where it sent the attempt itself."""
    held = await policy.state.peek(pin_key(request_id, attempt, made))
    return held.partition(" ")[0] if held else None


def _lost(instance_id: str) -> TransportError:
    return TransportError(
        f"instance {instance_id}, which was sent this request before a Reach process stopped, "
        "is gone or restarted. The operation is not idempotent and the request has no "
        "idempotency_key, so it is not sent again: "
        + may_have_run(f"agent {instance_id}", idempotent=False, keyed=False),
        retryable=False,
        outcome_unknown=True,
    )


def _pin(instance: RouteEntry) -> str:
    return pin_of(instance.instance_id, instance.joined_at)


def endpoint_pin(endpoint: Endpoint) -> str:
    return pin_of(endpoint.instance_id, endpoint.joined_at)
