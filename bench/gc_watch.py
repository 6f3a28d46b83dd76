"""What Python's cyclic collector does during a benchmark: each collection's generation, wall
and CPU time, and (with `census`) what it had to walk.

    watch = GcWatch(census=False)
    watch.start()
    ...                      # the measured work; `watch.gc_ms` grows by each collection's time
    watch.stop()
    watch.report()           # prints a Markdown table

The timing costs two clock reads per collection. A census (`census=True`) lists, at the start
of each collection, the objects of the generations it collects and what they refer to: it
costs as much as the collection itself, so stalls measured with it on are not figures.
"""

from __future__ import annotations

import gc
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any


@dataclass
class Collection:
    generation: int
    wall_ms: float
    cpu_ms: float
    collected: int
    count: tuple[int, int, int]  # gc.get_count() as it started


@dataclass
class Census:
    """The objects one collection walked, by type: how many, and the references they hold
    (what its traversal visits)."""

    generation: int
    objects: int = 0
    refs: int = 0
    by_type: Counter[str] = field(default_factory=Counter)
    refs_by_type: Counter[str] = field(default_factory=Counter)


class GcWatch:
    def __init__(self, census: bool = False, census_limit: int = 40) -> None:
        self.census = census
        self.census_limit = census_limit
        self.collections: list[Collection] = []
        self.censuses: list[Census] = []
        self.gc_ms = 0.0  # wall time in collections so far (a ticker reads its growth)
        self._started: tuple[float, float, tuple[int, int, int]] | None = None
        self.tracked = [0, 0, 0]
        self.frozen = 0

    def start(self) -> None:
        gc.callbacks.append(self._callback)

    def stop(self) -> None:
        """Stop watching, and count what each generation tracks (and what is frozen) now."""
        if self._callback in gc.callbacks:
            gc.callbacks.remove(self._callback)
        self.tracked = [len(gc.get_objects(g)) for g in range(3)]
        self.frozen = gc.get_freeze_count()

    def _callback(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            if self.census and len(self.censuses) < self.census_limit:
                self.censuses.append(_census(info["generation"]))
            self._started = (time.perf_counter(), time.thread_time(), gc.get_count())
            return
        wall, cpu = time.perf_counter(), time.thread_time()
        if self._started is None:
            return
        t0, c0, count = self._started
        self._started = None
        ms = (wall - t0) * 1000
        self.gc_ms += ms
        self.collections.append(
            Collection(info["generation"], ms, (cpu - c0) * 1000, info["collected"], count)
        )

    def longest(self, generation: int | None = None) -> Collection | None:
        found = [c for c in self.collections if generation is None or c.generation == generation]
        return max(found, key=lambda c: c.wall_ms, default=None)

    def report(self, seconds: float) -> None:
        print(
            "\nThe cyclic collector meanwhile (gc.callbacks; 'tracked at the end': "
            f"len(gc.get_objects(g)) as it stopped; frozen: {self.frozen:,}):\n"
        )
        print(
            "| generation | collections | per s | longest ms (CPU) | mean ms | tracked at the end |"
        )
        print("|---|---:|---:|---:|---:|---:|")
        for g in range(3):
            mine = [c for c in self.collections if c.generation == g]
            worst = self.longest(g)
            mean = sum(c.wall_ms for c in mine) / len(mine) if mine else 0.0
            longest = f"{worst.wall_ms:.1f} ({worst.cpu_ms:.1f})" if worst else "-"
            print(
                f"| {g} | {len(mine)} | {len(mine) / seconds:.1f} | {longest} | {mean:.2f} | "
                f"{self.tracked[g]:,} |"
            )
        for census in _worst_censuses(self.censuses):
            top = ", ".join(
                f"{name} {census.by_type[name]:,} ({refs:,} refs)"
                for name, refs in census.refs_by_type.most_common(8)
            )
            print(
                f"\ncensus, the largest gen-{census.generation} collection: {census.objects:,} "
                f"objects, {census.refs:,} references; by references: {top}"
            )


def _census(generation: int) -> Census:
    census = Census(generation)
    for g in range(generation + 1):
        for obj in gc.get_objects(g):
            name = type(obj).__name__
            refs = len(gc.get_referents(obj))
            census.objects += 1
            census.refs += refs
            census.by_type[name] += 1
            census.refs_by_type[name] += refs
    return census


def _worst_censuses(censuses: list[Census]) -> list[Census]:
    worst: dict[int, Census] = {}
    for census in censuses:
        if census.generation not in worst or census.refs > worst[census.generation].refs:
            worst[census.generation] = census
    return [worst[g] for g in sorted(worst)]
