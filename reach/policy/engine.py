"""The policy engine as the activities and the door use it: settings + shared state + a view.

Breaker and ejection state is shared through the store (`reach.policy.state`), but reading it
on every request would put a store round trip on the hot path. Each process keeps the last
view it read or wrote per capability and re-reads it when it is older than `refresh_s`, so:

- a closed breaker with no failures costs nothing to admit through, and a success against it
  costs nothing to record; failures, and anything while a breaker is not closed, are one
  round trip (the write returns the new view);
- a breaker opened by another gateway is seen here within `refresh_s`.

With `window` > 0 every outcome is recorded (the window needs them all): one round trip each.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass

from reach.config import PolicySettings, RateLimitSettings
from reach.errors import ReachError, Unavailable
from reach.invocation import BucketPlan
from reach.policy.breaker import quorum, serving
from reach.policy.state import Admission, Bucket, CapabilityView, PolicyState

log = logging.getLogger("reach.policy")

DEFAULT_REFRESH_S = 0.5


@dataclass
class _Cached:
    at: float
    view: CapabilityView


def capability_bucket(capability: str) -> str:
    """The key of a capability's own token bucket (shared by all its callers)."""
    return f"cap:{capability}"


def limit_buckets(limits: RateLimitSettings, capability: str, caller: str) -> list[BucketPlan]:
    """The token buckets one request must take from: per (caller, capability), per capability."""
    out: list[BucketPlan] = []
    if limits.per_caller is not None:
        out.append(
            BucketPlan(
                key=f"caller:{capability}:{caller}",
                per_minute=limits.per_caller.per_minute,
                capacity=limits.per_caller.capacity,
            )
        )
    if limits.per_capability is not None:
        out.append(
            BucketPlan(
                key=capability_bucket(capability),
                per_minute=limits.per_capability.per_minute,
                capacity=limits.per_capability.capacity,
            )
        )
    return out


class PolicyEngine:
    def __init__(
        self,
        settings: PolicySettings,
        state: PolicyState,
        *,
        refresh_s: float = DEFAULT_REFRESH_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.settings = settings
        self.state = state
        self._refresh_s = refresh_s
        self._clock = clock
        self._views: dict[str, _Cached] = {}
        self._refreshing: dict[str, asyncio.Task[None]] = {}

    def _keep(self, capability: str, view: CapabilityView) -> CapabilityView:
        self._views[capability] = _Cached(self._clock(), view)
        return view

    async def view(self, capability: str, *, fresh: bool = False) -> CapabilityView:
        cached = self._views.get(capability)
        if not fresh and cached is not None and self._clock() - cached.at < self._refresh_s:
            return cached.view
        breaker = self.settings.breaker_for(capability)
        return self._keep(capability, await self.state.view(capability, breaker))

    def recent_view(self, capability: str) -> CapabilityView | None:
        """The view without waiting for the store: the one held, if it is at most twice
        `refresh_s` old (one older than `refresh_s` is re-read in the background); None when
        there is none that recent (the caller then reads it with `view`)."""
        breaker = self.settings.breaker_for(capability)
        if not breaker.enabled and not self.settings.outlier_for(capability).enabled:
            return CapabilityView()  # nothing to read: no breaker, no ejections
        cached = self._views.get(capability)
        age = self._clock() - cached.at if cached is not None else None
        if (age is None or age >= self._refresh_s) and capability not in self._refreshing:
            task = asyncio.get_running_loop().create_task(self._refresh(capability))
            self._refreshing[capability] = task
        if cached is None or age is None or age >= 2 * self._refresh_s:
            return None
        return cached.view

    async def settle(self, capability: str, within_s: float) -> None:
        """Wait up to `within_s` for a view `recent_view` will use (the door, after a quiet
        spell longer than twice `refresh_s`: one store read, where leaving the route to the
        workflow costs a routing step of its own and its store reads). Gives up silently: a
        slow or absent store leaves the route to the workflow, as before."""
        if self.recent_view(capability) is not None:
            return
        refreshing = self._refreshing.get(capability)
        if refreshing is None:
            return
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(within_s):
                await asyncio.shield(refreshing)

    def held_views(self) -> dict[str, CapabilityView]:
        """capability -> the view this process holds, however old, by name (a copy: for
        readers such as the metrics, which must not wait for the store)."""
        return {capability: cached.view for capability, cached in sorted(self._views.items())}

    async def _refresh(self, capability: str) -> None:
        try:
            await self.view(capability, fresh=True)
        except ReachError as exc:
            log.debug("policy view of %s not refreshed: %s", capability, exc)
        finally:
            self._refreshing.pop(capability, None)

    def ejected(self, capability: str, view: CapabilityView) -> set[str]:
        """Instances ejected now, by the view (its countdowns run from when it was read)."""
        cached = self._views.get(capability)
        age = self._clock() - cached.at if cached is not None else 0.0
        return {i for i, left in view.ejected.items() if left > age}

    async def admit(self, capability: str) -> Admission:
        breaker = self.settings.breaker_for(capability)
        if not breaker.enabled:
            return Admission(allowed=True, status="closed")
        view = await self.view(capability)
        if view.breaker.status == "closed":
            return Admission(allowed=True, status="closed")
        cached = self._views[capability]
        left = view.breaker.retry_after_s - (self._clock() - cached.at)
        if view.breaker.status == "open" and left > 0:
            return Admission(allowed=False, status="open", retry_after_s=left)
        # Half-open (or due to be): a probe slot is taken atomically in the store.
        admission = await self.state.admit(capability, breaker)
        if not admission.allowed:
            await self.view(capability, fresh=True)
        return admission

    async def record(
        self,
        capability: str,
        instance_id: str,
        ok: bool,
        probe: bool,
        routable: Collection[str] = (),
    ) -> None:
        """Count an attempt's outcome; never fails the request (a store outage is logged).
        `routable`: the capability's routable instances as routing sees them now, so the
        breaker counts failures only as the capability's (`reach.policy.breaker`); none
        given, every failure counts."""
        breaker = self.settings.breaker_for(capability)
        outlier = self.settings.outlier_for(capability)
        if not breaker.enabled and not outlier.enabled:
            return
        cached = self._views.get(capability)
        if ok and not probe and cached is not None and not breaker.window:
            view = cached.view
            clean = view.breaker.status == "closed" and view.breaker.failures == 0
            if clean and instance_id not in view.failing:
                return  # nothing to reset: the common case costs no round trip
        ejected = self.ejected(capability, cached.view) if cached is not None else set()
        need = quorum(instance_id, routable, ejected)
        serves = serving(routable, ejected)  # only theirs make the quorum (reach.policy.breaker)
        try:
            view = await self.state.record(
                capability, instance_id, ok, breaker, outlier, probe, quorum=need, serving=serves
            )
        except Unavailable as exc:
            log.warning("could not record an outcome for %s: %s", capability, exc)
            return
        before = cached.view if cached is not None else CapabilityView()
        self._keep(capability, view)
        if view.breaker.status != before.breaker.status:
            log.warning(
                "circuit breaker %s: %s -> %s (instance %s %s)",
                capability,
                before.breaker.status,
                view.breaker.status,
                instance_id,
                "succeeded" if ok else "failed",
            )
        for newly in set(view.ejected) - set(before.ejected):
            log.warning(
                "instance %s of %s ejected for %.1fs after consecutive failures",
                newly,
                capability,
                view.ejected[newly],
            )

    async def take(self, buckets: Sequence[BucketPlan]) -> float:
        if not buckets:
            return 0.0
        return await self.state.take(
            [Bucket(key=b.key, per_minute=b.per_minute, capacity=b.capacity) for b in buckets]
        )
