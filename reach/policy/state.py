"""The policy engine's shared state: circuit breakers, outlier ejections, token buckets, claims.

One interface, two backends, like `reach.store`: `MemoryPolicyState` for one process and
`RedisPolicyState` for every gateway and worker of a deployment (each step one Lua script, so
it is atomic across processes and costs one round trip; a breaker about to open, two). Times
are the store's own clock (Redis `TIME`), so processes whose clocks disagree still agree on a
breaker.

- *Breaker* (per capability): `closed` → (failures reach the threshold, from most of the
  instances routing serves from now: `reach.policy.breaker`) → `open` until
  `open_duration_ms` has passed → `half_open`: up to `half_open_probes` requests are admitted as
  probes (a probe slot not reported within `open_duration_ms` is free again); every probe
  succeeding closes it, any failure re-opens it.
- *Outlier* (per instance): `consecutive_failures` failures in a row eject the instance for
  `base_ejection_ms` * 2^(ejections so far), capped at `max_ejection_ms`; a success ends the
  run of failures; the ejection count is forgotten only after a quiet spell (no failure for
  `max_ejection_ms` + 5 min), so an instance failing most of the time keeps doubling.
  Whether an ejection may take the *last* routable instance out is decided by the caller at
  routing time (never), not here.
- *Token buckets* (rate limits): `take` takes one token from every bucket or from none.
- *Claims*: set-if-absent with a TTL, for idempotency keys and per-attempt instance pins.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

from reach.config import CircuitBreakerSettings, OutlierSettings
from reach.policy.breaker import GONE, IGNORED, departed, trips

if TYPE_CHECKING:
    from reach.store import Store

BreakerStatus = Literal["closed", "open", "half_open"]


@dataclass(frozen=True)
class Bucket:
    """One token bucket: `per_minute` tokens a minute, holding at most `capacity`."""

    key: str
    per_minute: float
    capacity: int


@dataclass(frozen=True)
class BreakerView:
    status: BreakerStatus = "closed"
    failures: int = 0  # consecutive failures, or failures within the window
    retry_after_s: float = 0.0  # open: seconds until half-open


@dataclass(frozen=True)
class Admission:
    allowed: bool
    status: BreakerStatus  # the state met
    probe: bool = False  # admitted as a half-open probe
    retry_after_s: float = 0.0  # refused: seconds until the next probe could be admitted


@dataclass(frozen=True)
class CapabilityView:
    """Everything routing needs from the policy state, in one read."""

    breaker: BreakerView = field(default_factory=BreakerView)
    ejected: dict[str, float] = field(default_factory=dict)  # instance id -> seconds left
    failing: frozenset[str] = frozenset()  # instances with a run of failures not yet reset


class PolicyState(ABC):
    @abstractmethod
    async def view(self, capability: str, breaker: CircuitBreakerSettings) -> CapabilityView:
        """The capability's breaker and ejections as they are now."""

    @abstractmethod
    async def admit(self, capability: str, breaker: CircuitBreakerSettings) -> Admission:
        """Whether a request may go out now; in half-open, takes a probe slot if one is free."""

    @abstractmethod
    async def record(
        self,
        capability: str,
        instance_id: str,
        ok: bool,
        breaker: CircuitBreakerSettings,
        outlier: OutlierSettings,
        probe: bool = False,
        quorum: int = 1,
        serving: Collection[str] = (),
    ) -> CapabilityView:
        """Count one attempt's outcome for the breaker and the instance; returns the new view.
        `quorum` (`reach.policy.breaker.quorum`): the distinct instances whose failures open
        the breaker; `IGNORED` (0): the breaker does not count this outcome. `serving`
        (`reach.policy.breaker.serving`): the instances routing serves from now; only their
        failures make the quorum (none given: everyone's)."""

    @abstractmethod
    async def take(self, buckets: Sequence[Bucket]) -> float:
        """Take one token from every bucket, or none: 0.0 when taken, else the seconds until
        every bucket would have one."""

    @abstractmethod
    async def claim(self, key: str, value: str, ttl_s: float) -> str:
        """Set `key` to `value` unless it holds a value (TTL `ttl_s`); returns what it holds."""

    @abstractmethod
    async def release(self, key: str, value: str) -> bool:
        """Delete `key` if it still holds `value`."""

    @abstractmethod
    async def peek(self, key: str) -> str | None:
        """What `key` holds now, if anything."""

    @abstractmethod
    async def put(self, key: str, value: str, ttl_s: float) -> None:
        """Set `key` to `value` whatever it holds (TTL `ttl_s`): a record one writer keeps
        up to date (a call's progress, `reach.progress`), read with `peek`."""

    @abstractmethod
    async def buckets(self, keys: Sequence[str]) -> dict[str, float]:
        """Tokens now in each bucket that exists (for display)."""


BREAKER_IDLE_MS = 6 * 3_600_000
"""A breaker nobody touched for this long (after its open period) is forgotten: closed again."""
OUTLIER_MARGIN_MS = 300_000
"""An instance's failure record outlives its longest possible ejection by this much, so a
repeat offender's ejections keep doubling, yet a dead instance's record does not stay forever."""
MIN_RETRY_S = 0.001


def breaker_ttl_ms(breaker: CircuitBreakerSettings) -> int:
    return breaker.open_duration_ms + BREAKER_IDLE_MS


def outlier_forget_ms(outlier: OutlierSettings) -> int:
    return outlier.max_ejection_ms + OUTLIER_MARGIN_MS


def ejection_ms(outlier: OutlierSettings, ejections: int) -> int:
    return min(outlier.max_ejection_ms, outlier.base_ejection_ms << min(ejections, 62))


def create_policy_state(store: Store) -> PolicyState:
    """Policy state beside the registry: in its Redis when it has one, so every process that
    shares the registry shares the breakers, ejections and rate limits too."""
    redis = store.shared_redis()
    if redis is not None:
        from reach.policy.redis_state import RedisPolicyState

        return RedisPolicyState(redis.client, redis.prefix)
    return MemoryPolicyState()


@dataclass
class _Breaker:
    expires: float
    opened_until: float | None = None  # None: closed
    failures: int = 0  # consecutive (window 0)
    window: str = ""  # the last outcomes, oldest first: "1" a failure, "0" a success
    # Who failed: the instances of the run (window 0), or one per failure in the window.
    who: tuple[str, ...] = ()
    slots: list[float] = field(default_factory=list)  # half-open probe leases' ends
    successes: int = 0  # half-open probes that succeeded


@dataclass
class _Instance:
    forget_at: float
    run: int = 0
    ejections: int = 0
    ejected_until: float = 0.0


@dataclass
class _Tokens:
    tokens: float
    at: float
    per_s: float
    capacity: int

    @property
    def expires(self) -> float:
        """Full again from here on, so the bucket may as well not exist (a Redis key TTL)."""
        return self.at + (self.capacity - self.tokens) / self.per_s + 1.0

    def now(self, now: float, per_s: float | None = None, capacity: int | None = None) -> float:
        """Refilled until `now`, at the rate and size given (a changed limit applies at once)."""
        per_s = self.per_s if per_s is None else per_s
        capacity = self.capacity if capacity is None else capacity
        return min(capacity, self.tokens + max(0.0, now - self.at) * per_s)


class MemoryPolicyState(PolicyState):
    """One process only; the same rules, step for step, as `RedisPolicyState` (times in the
    injectable clock's seconds instead of Redis milliseconds). Atomic because no method awaits.
    Expired entries are dropped when met and by an occasional sweep, so memory stays bounded."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._breakers: dict[str, _Breaker] = {}
        self._instances: dict[str, dict[str, _Instance]] = {}
        self._tokens: dict[str, _Tokens] = {}
        self._claims: dict[str, tuple[str, float]] = {}
        self._writes = 0

    def _breaker(self, capability: str, now: float) -> _Breaker | None:
        state = self._breakers.get(capability)
        if state is not None and now >= state.expires:
            del self._breakers[capability]
            return None
        return state

    def _open(self, capability: str, breaker: CircuitBreakerSettings, now: float) -> None:
        self._breakers[capability] = _Breaker(
            expires=now + breaker_ttl_ms(breaker) / 1000,
            opened_until=now + breaker.open_duration_ms / 1000,
        )

    def _breaker_view(
        self, capability: str, breaker: CircuitBreakerSettings, now: float
    ) -> BreakerView:
        state = self._breaker(capability, now) if breaker.enabled else None
        if state is None:
            return BreakerView()
        if state.opened_until is not None:
            if now < state.opened_until:
                return BreakerView("open", retry_after_s=state.opened_until - now)
            return BreakerView("half_open")
        if breaker.window:
            return BreakerView(failures=state.window[-breaker.window :].count("1"))
        return BreakerView(failures=state.failures)

    def _outlier_view(self, capability: str, now: float) -> tuple[dict[str, float], frozenset[str]]:
        entries = self._instances.get(capability, {})
        for instance_id in [i for i, e in entries.items() if now >= e.forget_at]:
            del entries[instance_id]
        if not entries:
            self._instances.pop(capability, None)
        ejected = {
            i: e.ejected_until - now for i, e in sorted(entries.items()) if e.ejected_until > now
        }
        return ejected, frozenset(i for i, e in entries.items() if e.run > 0)

    def _view(self, capability: str, breaker: CircuitBreakerSettings, now: float) -> CapabilityView:
        ejected, failing = self._outlier_view(capability, now)
        return CapabilityView(self._breaker_view(capability, breaker, now), ejected, failing)

    async def view(self, capability: str, breaker: CircuitBreakerSettings) -> CapabilityView:
        return self._view(capability, breaker, self._clock())

    async def admit(self, capability: str, breaker: CircuitBreakerSettings) -> Admission:
        now = self._clock()
        state = self._breaker(capability, now) if breaker.enabled else None
        if state is None or state.opened_until is None:
            return Admission(True, "closed")
        if now < state.opened_until:
            return Admission(False, "open", retry_after_s=state.opened_until - now)
        state.slots = [end for end in state.slots if end > now]
        if len(state.slots) < breaker.half_open_probes:
            state.slots.append(now + breaker.open_duration_ms / 1000)
            state.expires = now + breaker_ttl_ms(breaker) / 1000
            return Admission(True, "half_open", probe=True)
        return Admission(False, "half_open", retry_after_s=max(MIN_RETRY_S, min(state.slots) - now))

    async def record(
        self,
        capability: str,
        instance_id: str,
        ok: bool,
        breaker: CircuitBreakerSettings,
        outlier: OutlierSettings,
        probe: bool = False,
        quorum: int = 1,
        serving: Collection[str] = (),
    ) -> CapabilityView:
        now = self._clock()
        if breaker.enabled and quorum != IGNORED:
            self._record_breaker(capability, instance_id, ok, probe, breaker, now, quorum, serving)
        if outlier.enabled:
            self._record_outlier(capability, instance_id, ok, outlier, now)
        return self._view(capability, breaker, now)

    def _record_breaker(
        self,
        capability: str,
        instance_id: str,
        ok: bool,
        probe: bool,
        breaker: CircuitBreakerSettings,
        now: float,
        quorum: int,
        serving: Collection[str],
    ) -> None:
        expires = now + breaker_ttl_ms(breaker) / 1000
        state = self._breaker(capability, now)
        if state is not None and state.opened_until is not None:
            if now < state.opened_until:
                return  # admitted before it opened: says nothing about the agent now
            if not ok:
                self._open(capability, breaker, now)
            elif probe:
                state.successes += 1
                if state.successes >= breaker.half_open_probes:
                    del self._breakers[capability]
                    return
                state.slots = sorted(end for end in state.slots if end > now)[1:]
                state.expires = expires
            return
        if state is None:
            state = _Breaker(expires=expires)
        if breaker.window:
            state.window = (state.window + ("0" if ok else "1"))[-breaker.window :]
            failures = state.window.count("1")
            who = state.who if ok else (*state.who, instance_id)
            state.who = who[max(0, len(who) - failures) :] if failures else ()
        elif ok:
            if state.failures:
                state.failures = 0
                state.who = ()
                state.expires = expires
            return
        else:
            state.failures = failures = state.failures + 1
            if instance_id not in state.who:
                state.who = (*state.who, instance_id)
        if trips(failures, state.who, breaker.error_threshold, quorum):
            # Would open: only the failures of instances routing serves from now make the
            # quorum; the others' are dropped from `who` for good (reach.policy.breaker).
            gone = departed(state.who, serving)
            if breaker.window:
                state.who = tuple(GONE if i in gone else i for i in state.who)
            else:
                state.who = tuple(i for i in state.who if i not in gone)
            if trips(failures, state.who, breaker.error_threshold, quorum):
                self._open(capability, breaker, now)
                return
        state.expires = expires
        self._breakers[capability] = state

    def _record_outlier(
        self, capability: str, instance_id: str, ok: bool, outlier: OutlierSettings, now: float
    ) -> None:
        entries = self._instances.setdefault(capability, {})
        entry = entries.get(instance_id)
        if entry is not None and now >= entry.forget_at:
            entry = None
        if ok:
            if entry is not None and (entry.ejections or entry.ejected_until > now):
                # The run of failures ends, but the ejection count stays until the record is
                # forgotten (a quiet spell): an instance failing three times in four keeps
                # doubling its ejections. A straggler's success does not end an ejection.
                entry.run = 0
            else:
                entries.pop(instance_id, None)
                if not entries:
                    del self._instances[capability]
            return
        if entry is None:
            entry = _Instance(forget_at=0.0)
        entry.run += 1
        if entry.run >= outlier.consecutive_failures:
            entry.ejected_until = now + ejection_ms(outlier, entry.ejections) / 1000
            entry.ejections += 1
            entry.run = 0
        entry.forget_at = now + outlier_forget_ms(outlier) / 1000
        entries[instance_id] = entry

    async def take(self, buckets: Sequence[Bucket]) -> float:
        now = self._clock()
        self._sweep(now)
        tokens: list[float] = []
        for bucket in buckets:
            found = self._bucket(bucket.key, now)
            per_s = bucket.per_minute / 60
            tokens.append(
                found.now(now, per_s, bucket.capacity) if found is not None else bucket.capacity
            )
        wait = max(
            ((1 - t) * 60 / b.per_minute for b, t in zip(buckets, tokens, strict=True) if t < 1),
            default=0.0,
        )
        if wait > 0:
            return wait
        for bucket, t in zip(buckets, tokens, strict=True):
            self._tokens[bucket.key] = _Tokens(t - 1, now, bucket.per_minute / 60, bucket.capacity)
        return 0.0

    def _bucket(self, key: str, now: float) -> _Tokens | None:
        found = self._tokens.get(key)
        if found is not None and now >= found.expires:
            del self._tokens[key]
            return None
        return found

    async def buckets(self, keys: Sequence[str]) -> dict[str, float]:
        now = self._clock()
        found = {key: self._bucket(key, now) for key in keys}
        return {key: b.now(now) for key, b in found.items() if b is not None}

    async def claim(self, key: str, value: str, ttl_s: float) -> str:
        now = self._clock()
        self._sweep(now)
        held = self._claims.get(key)
        if held is not None and now < held[1]:
            return held[0]
        self._claims[key] = (value, now + ttl_s)
        return value

    async def peek(self, key: str) -> str | None:
        held = self._claims.get(key)
        return held[0] if held is not None and self._clock() < held[1] else None

    async def put(self, key: str, value: str, ttl_s: float) -> None:
        now = self._clock()
        self._sweep(now)
        self._claims[key] = (value, now + ttl_s)

    async def release(self, key: str, value: str) -> bool:
        held = self._claims.get(key)
        if held is None or held[0] != value or self._clock() >= held[1]:
            return False
        del self._claims[key]
        return True

    def _sweep(self, now: float) -> None:
        """Drop expired buckets and claims nobody asks about again, in amortized O(1)."""
        self._writes += 1
        if self._writes < max(1024, len(self._tokens) + len(self._claims)):
            return
        self._writes = 0
        for key in [k for k, b in self._tokens.items() if now >= b.expires]:
            del self._tokens[key]
        for key in [k for k, (_, expires) in self._claims.items() if now >= expires]:
            del self._claims[key]
