"""When the background sweep has something to find, so that it runs the store only then.

`Registry.sweep` prunes every capability's index of the instances whose record expired (and
announces each eviction), then forgets the capabilities idle past their retention. Run every
second by every gateway, on Redis that was three scripts a second (list the capabilities, prune
the one capability, forget), nearly always finding nothing, on a box whose cores the answers
need. What it looks for can only turn up at times known in advance:

- no record a prune saw live can expire before the shortest TTL among them (a heartbeat pushes
  a record's expiry back, never forward), and a record written after the prune has a whole
  `heartbeat_timeout` to go: the capability is pruned again when the sooner of the two is due;
- a capability first listed since the last listing got its instances after it: listing every
  half `heartbeat_timeout` sees it (and prunes it at once) before any of them can expire;
- forgetting only frees storage (a capability past its retention already reads as unknown to
  `known` and `capabilities`), so it goes with the listing.

Each step still waits for the view's sweep tick (`RegistryView.sweep_s`), so an eviction is
seen as soon after the expiry as before, and often sooner. A store that cannot say when its
records expire (`Store.prune_group_soonest` answers None) has its capabilities pruned at every
tick, as before. The view's resync (`resync_s`) reads and prunes every capability besides.
"""

from __future__ import annotations

import math
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from reach.store.base import Store

Evicted = Callable[[str, Sequence[str]], Awaitable[None]]


class SweepPlan:
    """The steps of a background sweep not due yet (see the module docstring); without a
    `heartbeat_timeout`, every step is due every time (a sweep called by hand). `clock` is in
    seconds, the store's TTLs' pace (monotonic)."""

    def __init__(
        self, heartbeat_timeout: float | None = None, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.heartbeat_timeout = math.inf if heartbeat_timeout is None else heartbeat_timeout
        self._every_time = heartbeat_timeout is None
        self.pruned = 0  # capabilities pruned so far
        self._clock = clock
        self._listed: list[str] = []
        self._list_due = -math.inf
        self._prune_due: dict[str, float] = {}

    async def run(
        self, store: Store, capabilities: Callable[[], Awaitable[list[str]]], evicted: Evicted
    ) -> list[str]:
        """The steps due now; returns the capabilities forgotten."""
        now = self._clock()
        forgotten: list[str] = []
        if self._every_time or now >= self._list_due:
            self._listed = await capabilities()
            self._list_due = now + self.heartbeat_timeout / 2
            listed = set(self._listed)
            for capability in [c for c in self._prune_due if c not in listed]:
                del self._prune_due[capability]
            forgotten = await store.expire()
        for capability in self._listed:
            if self._clock() < self._prune_due.get(capability, -math.inf):
                continue
            started = self._clock()
            gone, soonest = await store.prune_group_soonest(capability)
            self.pruned += 1
            await evicted(capability, gone)
            if soonest is None or self._every_time:
                self._prune_due.pop(capability, None)  # not known: pruned at every tick
            else:
                self._prune_due[capability] = started + min(soonest, self.heartbeat_timeout)
        return forgotten
