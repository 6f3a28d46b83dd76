"""Which rules of `reach.policy` a request follows: each was added with a patch, asked through
`workflow.patched` where the policy asks it, so a request accepted before a rule keeps the
behaviour it was recorded with (its history replays as it ran)."""

from __future__ import annotations

from temporalio import workflow

with workflow.unsafe.imports_passed_through():
    from reach.policy import (
        KNOWN_CAPABILITY,
        LOST_RUN,
        NOT_SENT,
        QUEUE_DEADLINE,
        REDELIVER,
        STORE_WAIT,
        Rule,
    )

# Requests accepted before a broken call was re-delivered to its instance retried elsewhere;
# those accepted before a store outage at routing was waited out gave up as they did then.
PATCH_REDELIVER = "redeliver-same-attempt"
PATCH_STORE_OUTAGE_WAIT = "store-outage-wait"
# Those accepted before a capability the registry forgot was waited for ended unknown_capability;
# queued ones accepted before their last look came before the wait's end could wake at its end.
PATCH_KNOWN_CAPABILITY = "known-capability-wait"
PATCH_QUEUE_DEADLINE = "queue-wake-before-deadline"
# Those accepted before a call refused unsent was told apart re-delivered it (refused again).
PATCH_NOT_SENT = "not-sent-not-redelivered"
# Those accepted before an attempt a lost run may have sent was remembered reported what the
# run after it met (a plain no_instance, a timeout after a store wait) as never sent.
PATCH_LOST_RUN = "lost-run-remembered"
PATCHES: dict[Rule, str] = {
    REDELIVER: PATCH_REDELIVER,
    STORE_WAIT: PATCH_STORE_OUTAGE_WAIT,
    KNOWN_CAPABILITY: PATCH_KNOWN_CAPABILITY,
    QUEUE_DEADLINE: PATCH_QUEUE_DEADLINE,
    NOT_SENT: PATCH_NOT_SENT,
    LOST_RUN: PATCH_LOST_RUN,
}


def follows(rule: Rule) -> bool:
    """Whether this request follows `rule` (it was accepted after the rule was added)."""
    return workflow.patched(PATCHES[rule])
