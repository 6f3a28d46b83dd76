"""The routing strategies' pure cores, before any store or registry is involved (R12, R17).

Each is a small in-process structure the strategies of the routing step build on:

- `SmoothWeighted`: nginx's smooth weighted round robin — over any window of `sum(weights)`
  picks each instance gets exactly its weight, spread out (5:1:1 picks a a b a c a a), never in
  bursts.
- `EdfWeighted`: the same shares for large sets, earliest deadline first on a heap.
- `HashRing`: consistent hashing with virtual nodes (scaled by weight) on a fast
  non-cryptographic hash (xxh3), and *bounded load* (Mirrokni, Thorup, Zadimoghaddam;
  Envoy's `hash_balance_factor`): a key goes to the first instance clockwise whose in-flight
  load is under `balance_factor` times the mean, so one hot key cannot sink an instance. Removing
  one of N instances remaps about 1/N of the keys.
"""

from __future__ import annotations

import bisect
import heapq
import math
from array import array
from collections.abc import Collection, Iterator, Mapping

import xxhash

DEFAULT_VNODES = 100
DEFAULT_BALANCE_FACTOR = 1.25


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


class EdfWeighted:
    """Weighted round robin as earliest-deadline-first over a heap: O(log n) a pick, for sets
    too large to scan each time. Instance i is due every 1/weight; the first turns are spread
    over the first period (half a period in), so no instance starts with a burst."""

    def __init__(self, weights: Mapping[str, int]) -> None:
        if not weights or any(w < 1 for w in weights.values()):
            raise ValueError("weights must be a non-empty mapping of positive integers")
        self._period = {i: 1.0 / w for i, w in weights.items()}
        self._heap = [(p / 2, n, i) for n, (i, p) in enumerate(sorted(self._period.items()))]
        heapq.heapify(self._heap)

    def pick(self) -> str:
        due, n, instance = self._heap[0]
        heapq.heapreplace(self._heap, (due + self._period[instance], n, instance))
        return instance


class HashRing:
    """Consistent hashing with virtual nodes and bounded load.

    Each instance has `vnodes * weight` points (so adding or removing one moves only its own
    share of keys). A point is a 64-bit hash whose low bits are replaced by the owner's index,
    kept sorted in one `array('Q')`: 8 bytes a point, and a lookup is one bisect in C."""

    def __init__(self, weights: Mapping[str, int], vnodes: int = DEFAULT_VNODES) -> None:
        if not weights or any(w < 1 for w in weights.values()):
            raise ValueError("weights must be a non-empty mapping of positive integers")
        if vnodes < 1:
            raise ValueError("vnodes must be at least 1")
        self.owners: list[str] = sorted(weights)
        bits = max(1, (len(self.owners) - 1).bit_length())
        self._mask = (1 << bits) - 1
        keep = ~self._mask & 0xFFFFFFFFFFFFFFFF
        hash64 = xxhash.xxh3_64_intdigest
        points = [
            (hash64(f"{instance}#{i}".encode()) & keep) | index
            for index, instance in enumerate(self.owners)
            for i in range(vnodes * weights[instance])
        ]
        points.sort()
        self._points = array("Q", points)
        self.instances = frozenset(self.owners)

    def __len__(self) -> int:
        return len(self._points)

    def start(self, key: str) -> int:
        """The position of the first point clockwise from `key`."""
        return bisect.bisect(self._points, key_hash(key)) % len(self._points)

    def owner_at(self, position: int) -> str:
        return self.owners[self._points[position % len(self._points)] & self._mask]

    def walk(self, key: str) -> Iterator[str]:
        """Each instance once, in the order met clockwise from `key`."""
        points, mask, owners = self._points, self._mask, self.owners
        start, size = self.start(key), len(points)
        seen: set[int] = set()
        for step in range(size):
            index = points[(start + step) % size] & mask
            if index in seen:
                continue
            seen.add(index)
            yield owners[index]
            if len(seen) == len(owners):
                return

    def lookup(self, key: str) -> str:
        """The instance owning `key`, ignoring load."""
        return self.owner_at(self.start(key))

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
        capacity = bounded_capacity(load, len(self.instances), balance_factor, self.instances)
        for owner in self.walk(key):
            if load.get(owner, 0) + 1 <= capacity:
                return owner
        return self.lookup(key)  # unreachable while capacity >= the mean; kept total


def bounded_capacity(
    load: Mapping[str, int],
    instances: int,
    balance_factor: float,
    members: Collection[str] | None = None,
) -> int:
    """The most requests one instance may hold, this one included: `balance_factor` times the
    mean (Mirrokni et al.), never below 1."""
    total = sum(n for i, n in load.items() if members is None or i in members) + 1
    return max(1, math.ceil(balance_factor * total / max(1, instances)))
