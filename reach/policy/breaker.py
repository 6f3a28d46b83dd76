"""When failures are the capability's, and so count for its circuit breaker (R14). Pure.

One failing instance is outlier ejection's to take out of routing; the capability's breaker
refuses every request, so it opens only when the capability is failing: `error_threshold`
failures (in a row, or among the last `window` outcomes) that come from most of the instances
routing serves from — more than half of them; a capability of one instance, that one. Until its
ejection, one bad instance among healthy ones cannot open it, however many calls fail on it at
once (a SIGSTOPped agent's timeouts, a killed agent's refused connections); once it is
ejected, its stragglers' outcomes are its own and the breaker does not count them.

`quorum` is asked for each outcome, from what routing sees then; `trips` is the rule both
policy-state backends apply (the Redis one in Lua, step for step).
"""

from __future__ import annotations

from collections.abc import Collection, Iterable

# quorum's answer for an outcome the breaker does not count.
IGNORED = 0


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


def trips(failures: int, failing: Iterable[str], threshold: int, need: int) -> bool:
    """Whether `failures` failures counted, from the instances `failing` (one entry per failure
    or per instance), open the breaker."""
    return failures >= threshold and len(set(failing)) >= need
