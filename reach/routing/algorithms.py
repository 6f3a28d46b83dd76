"""The routing strategies' pure cores, before any store or registry is involved (R12, R17).

Each is a small in-process structure the strategies of the routing step build on:

- `SmoothWeighted`: nginx's smooth weighted round robin — over any window of `sum(weights)`
  picks each instance gets exactly its weight, spread out (5:1:1 picks a a b a c a a), never in
  bursts.
- `pick_least`: least request — a full scan over a few instances, otherwise the better of two
  random choices (Envoy's approach: near-best balance without reading every count).
- `HashRing`: consistent hashing with virtual nodes (scaled by weight) on a fast
  non-cryptographic hash (xxh3), and *bounded load* (Mirrokni, Thorup, Zadimoghaddam;
  Envoy's `hash_balance_factor`): a key goes to the first instance clockwise whose in-flight
  load is under `balance_factor` times the mean, so one hot key cannot sink an instance. Removing
  one of N instances remaps about 1/N of the keys.
"""

from __future__ import annotations

import bisect
import math
import random
from collections.abc import Callable, Mapping, Sequence

import xxhash

DEFAULT_VNODES = 160
DEFAULT_BALANCE_FACTOR = 1.25
FULL_SCAN_UP_TO = 8


def key_hash(value: str) -> int:
    """The ring's hash: 64-bit xxh3, stable across processes and Python versions."""
    return xxhash.xxh3_64_intdigest(value.encode())


class SmoothWeighted:
    """Smooth weighted round robin over a fixed set of (instance, weight)."""

    def __init__(self, weights: Mapping[str, int]) -> None:
        if not weights or any(w < 1 for w in weights.values()):
            raise ValueError("weights must be a non-empty mapping of positive integers")
        self._weights = dict(sorted(weights.items()))
        self._total = sum(self._weights.values())
        self._current = dict.fromkeys(self._weights, 0)

    def pick(self) -> str:
        best = ""
        for instance, weight in self._weights.items():
            self._current[instance] += weight
            if not best or self._current[instance] > self._current[best]:
                best = instance
        self._current[best] -= self._total
        return best


def pick_least(
    candidates: Sequence[str],
    inflight: Mapping[str, int],
    rng: Callable[[int], int] = random.randrange,
) -> str:
    """The instance with the fewest requests in flight: exact over a few, two choices beyond."""
    if not candidates:
        raise ValueError("no candidates")
    if len(candidates) <= FULL_SCAN_UP_TO:
        return min(candidates, key=lambda c: (inflight.get(c, 0), c))
    first = rng(len(candidates))
    second = rng(len(candidates) - 1)
    if second >= first:
        second += 1
    a, b = candidates[first], candidates[second]
    return a if inflight.get(a, 0) <= inflight.get(b, 0) else b


class HashRing:
    """Consistent hashing with virtual nodes and bounded load."""

    def __init__(self, weights: Mapping[str, int], vnodes: int = DEFAULT_VNODES) -> None:
        if not weights or any(w < 1 for w in weights.values()):
            raise ValueError("weights must be a non-empty mapping of positive integers")
        if vnodes < 1:
            raise ValueError("vnodes must be at least 1")
        mean = sum(weights.values()) / len(weights)
        points: list[tuple[int, str]] = []
        for instance, weight in weights.items():
            for i in range(max(1, round(vnodes * weight / mean))):
                points.append((key_hash(f"{instance}#{i}"), instance))
        points.sort()
        self._hashes = [h for h, _ in points]
        self._owners = [o for _, o in points]
        self.instances = frozenset(weights)

    def __len__(self) -> int:
        return len(self._hashes)

    def lookup(self, key: str) -> str:
        """The instance owning `key`, ignoring load."""
        return self._owners[self._start(key)]

    def lookup_bounded(
        self,
        key: str,
        load: Mapping[str, int],
        balance_factor: float = DEFAULT_BALANCE_FACTOR,
    ) -> str:
        """The first instance clockwise from `key` whose load, with this request, stays within
        `balance_factor` times the mean load (every instance passes when all are equally loaded)."""
        if balance_factor < 1.0:
            raise ValueError("balance_factor must be at least 1")
        total = sum(load.get(i, 0) for i in self.instances) + 1
        capacity = math.ceil(balance_factor * total / len(self.instances))
        start = self._start(key)
        seen: set[str] = set()
        for step in range(len(self._owners)):
            owner = self._owners[(start + step) % len(self._owners)]
            if owner in seen:
                continue
            if load.get(owner, 0) + 1 <= capacity:
                return owner
            seen.add(owner)
            if len(seen) == len(self.instances):
                break
        return self._owners[start]  # unreachable while capacity >= the mean; kept total

    def _start(self, key: str) -> int:
        return bisect.bisect(self._hashes, key_hash(key)) % len(self._hashes)
