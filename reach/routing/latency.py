"""Each instance's recent call latency, as this process saw it (the least-latency strategies)."""

from __future__ import annotations

import math
from collections.abc import Container

LATENCY_TAU_S = 10.0


class Latency:
    """Each instance's recent call latency (peak EWMA, Finagle's): a slower call raises it at
    once, faster ones lower it over `tau_s`; unread, it drifts back to the capability's
    typical latency, so an instance avoided for being slow is tried again now and then."""

    __slots__ = ("_by_instance", "_typical", "tau_s")

    def __init__(self, tau_s: float = LATENCY_TAU_S) -> None:
        self.tau_s = tau_s
        self._by_instance: dict[str, tuple[float, float]] = {}  # id -> (ms, when)
        self._typical: tuple[float, float] | None = None

    def typical(self) -> float:
        return self._typical[0] if self._typical else 1.0

    def observe(self, instance_id: str, ms: float, now: float) -> None:
        ms = max(ms, 0.001)
        if self._typical is None:
            self._typical = (ms, now)
        else:
            value, when = self._typical
            w = math.exp(-max(0.0, now - when) / self.tau_s)
            self._typical = (value * w + ms * (1 - w), now)
        current = self.of(instance_id, now)
        if instance_id not in self._by_instance or ms > current:
            self._by_instance[instance_id] = (ms, now)
            return
        w = math.exp(-max(0.0, now - self._by_instance[instance_id][1]) / self.tau_s)
        self._by_instance[instance_id] = (current * w + ms * (1 - w), now)

    def of(self, instance_id: str, now: float) -> float:
        """The instance's latency now (ms); the typical one when it has none."""
        typical = self.typical()
        seen = self._by_instance.get(instance_id)
        if seen is None:
            return typical
        value, when = seen
        return typical + (value - typical) * math.exp(-max(0.0, now - when) / self.tau_s)

    def __len__(self) -> int:
        return len(self._by_instance)

    def forget(self, keep: Container[str]) -> None:
        for instance_id in [i for i in self._by_instance if i not in keep]:
            del self._by_instance[instance_id]

    def drop(self, instance_id: str) -> None:
        self._by_instance.pop(instance_id, None)
