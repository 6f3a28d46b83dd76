"""When failures are the capability's, and so count for its circuit breaker (R14). Pure.

One failing instance is outlier ejection's to take out of routing; the capability's breaker
refuses every request, so it opens only when the capability is failing: `error_threshold`
failures (in a row, or among the last `window` outcomes) that come from most of the instances
routing serves from — more than half of them; a capability of one instance, that one. Until its
ejection, one bad instance among healthy ones cannot open it, however many calls fail on it at
once (a SIGSTOPped agent's timeouts, a killed agent's refused connections); once it is
ejected, its stragglers' outcomes are its own and the breaker does not count them.

The quorum is of instances routing serves from *now*, at the outcome that would open it: a
failure counted earlier for an instance that has since been ejected or has left (an agent
restarted under a fresh instance id: the SDK's default is new at every start) no longer speaks
for the capability. So one failing agent's run before its restart and its first failure after
are one instance's, not two (hostile review, tests/integration/test_breaker_hostile.py).

How the backends apply it, alike (the Redis one in Lua, step for step):

1. `quorum` is asked for each outcome, from what routing sees then (0: not counted), and
   `serving` is handed to the backend with it.
2. The outcome is counted as before: the failures, and who had them (`who`).
3. Only when `trips` says that count would open the breaker, the ids of `who` that are not
   `serving` now (`departed`) are dropped from it for good — in a window each becomes `GONE`,
   so the window's failures keep their places — and `trips` decides again. Their failures
   still count toward `error_threshold`; they no longer make the quorum.

Step 3 is rare (the breaker is about to open, and what it drops stays dropped), and it needs
the failing instances, not every serving one: the Redis backend's record script returns `who`
(at most the run's distinct instances, or `window` entries) in that case only, and a second
script re-reads the breaker, drops the departed ids Python named and decides (an outcome
another process records between the two is counted, as it would be after). No outcome sends
the serving ids to Redis, so a capability of 10,000 instances costs no more per failure than
one of three.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable

# quorum's answer for an outcome the breaker does not count.
IGNORED = 0
# In a window's `who`, a failure of an instance routing no longer serves from: it still counts
# toward `error_threshold` (it happened), not toward the quorum. Never an instance id (those
# begin with a letter or digit).
GONE = "-"


def serving(routable: Collection[str], ejected: Collection[str]) -> list[str]:
    """The instances routing serves from: the routable ones not ejected, or all the routable
    ones when every one is ejected (routing never skips the last one)."""
    return [i for i in routable if i not in ejected] or list(routable)


def quorum(instance_id: str, routable: Collection[str], ejected: Collection[str]) -> int:
    """How many distinct instances must be among the failures counted for the breaker to open,
    for an outcome of `instance_id`: a majority of those routing serves from. `IGNORED` when
    `instance_id` is not one of them (ejected, gone, unhealthy) while others serve: its outcome
    is its own. 1 when routing knows of no instance (the caller could not say): the breaker then
    counts failures whoever had them."""
    serves = serving(routable, ejected)
    if not serves:
        return 1
    if instance_id not in serves:
        return IGNORED
    return len(serves) // 2 + 1


def departed(failing: Iterable[str], serves: Collection[str]) -> list[str]:
    """Of the instances `failing`, the distinct ones routing does not serve from now (ejected,
    or gone: left, restarted under another id), sorted; none when `serves` is empty (routing
    knows of no instance: failures count whoever had them)."""
    if not serves:
        return []
    now = set(serves)
    return sorted({i for i in failing if i != GONE and i not in now})


def trips(failures: int, failing: Iterable[str], threshold: int, need: int) -> bool:
    """Whether `failures` failures counted, from the instances `failing` (one entry per failure
    or per instance; `GONE` is nobody's), open the breaker."""
    return failures >= threshold and len(set(failing) - {GONE}) >= need
