"""What a request does after something on its way to an answer fails: every retry decision.

The workflow meets four kinds of failure, asks one of these functions what to do, and carries
out the answer (a durable timer, a route again, a report); it decides nothing itself:

- `after_failure`, after an attempt failed:
  - the instance chosen at the door left before anything was sent: route the same attempt
    again at once (`RouteAgain`);
  - the attempt was sent and the line or the worker broke before its answer (outcome unknown):
    deliver the same attempt again, to the same (pinned) instance, which answers a RequestID it
    already has from memory (`Redeliver`) — never to another one that would run it twice;
  - the policy store was away while routing (nothing was sent, so whatever the operation): wait
    it out on the same attempt (`WaitForStore`);
  - the registry no longer knows the capability (it was known when the request was accepted:
    a store restarted empty, its agents not yet joined again): wait for it the same way;
  - the deadline: report it (`timed_out`: a call that was, or may have been, sent may have
    run, whatever the operation, and the report says so);
  - an attempt an earlier run may have sent (its workflow task was lost with its worker) is
    remembered as one whose outcome is unknown, whatever this run met (no instance, the store
    away, a refused connection): every later report says it may have run;
  - anything else: `next_step`, the plan's retries on other instances (`Retry`), or report
    (`GiveUp`, with the failure the caller is told of);
- `after_store_failure`, after a quick store step (claim, token, release) failed: the same
  store backoff (`WaitForStore`) or report;
- `after_no_token`, when a queued request found no rate-limit token: when to look again
  (`WaitForToken`, always before the request's wait ends) or refuse.

All pure: the clock comes in as numbers. Two inputs come in as functions, asked only at the
point where they matter, because asking leaves a mark in the request's history that a replay
must meet in the same place: `follows(rule)` (whether this request follows a rule added after
it may have been accepted: the workflow answers from `workflow.patched`, which records a
marker) and `draw()` (the workflow's next random number, for jitter).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Literal

from reach.invocation import CallPlan
from reach.messages import ErrorInfo
from reach.outcome import may_have_run as may_have_run_advice

# A broken call is re-delivered to its instance at most this often, 0.5 s, 1 s, 2 s apart.
MAX_REDELIVERIES = 3
REDELIVER_FIRST_S = 0.5
# The store's backoff (routing, claims, tokens, releases): 0.5 s, 1 s, 2 s... at most 10 s.
STORE_RETRY_FIRST_S = 0.5
STORE_RETRY_MAX_S = 10.0
# A queued request checks for a token at most this far apart.
QUEUE_POLL_MAX_S = 60.0
# The shortest timer a queued request sets (a token due any moment is not looked for in a loop).
QUEUE_POLL_MIN_S = 0.01

# Rules added after requests were accepted that a request in flight may predate.
Rule = Literal[
    "redeliver", "store_wait", "known_capability", "queue_deadline", "not_sent", "lost_run"
]
REDELIVER: Rule = "redeliver"
STORE_WAIT: Rule = "store_wait"
# A capability the registry forgot after acceptance is waited for, not reported unknown.
KNOWN_CAPABILITY: Rule = "known_capability"
# A queued request never wakes at its wait's end (it could only time out there, never started).
QUEUE_DEADLINE: Rule = "queue_deadline"
# A call the activity refused before sending it (`not_sent`) is never re-delivered: the refusal
# would be the same (the send-once claim another run holds); a store that could not check it is
# waited for as at routing.
NOT_SENT: Rule = "not_sent"
# An attempt an earlier, lost run may have sent is remembered as an unknown outcome even when
# this run sent nothing (the reliability suite found a lost run's call that had run reported as
# a plain no_instance, unavailable-then-timeout, or a refused connect after a retry).
LOST_RUN: Rule = "lost_run"

NOT_IDEMPOTENT = "the operation is not idempotent and the request has no idempotency_key"


@dataclass(frozen=True)
class Failure:
    """What one attempt (or store step) met, as the workflow saw it."""

    error: ErrorInfo
    # The instance it was sent to, or was about to be: None when it failed before one was chosen.
    instance_id: str | None = None
    # The instance chosen at the door had left before the call: nothing was sent.
    stale_route: bool = False
    # The attempt's call was sent, or may have been: an earlier workflow task ran this attempt
    # and was lost with its worker (a local activity started and never reported).
    sent: bool = False
    # The activity refused the call before sending it (the send-once claim another run holds,
    # the store that could not check it, a follow-up of another caller's): this attempt sent
    # nothing, whatever `outcome_unknown` says of an earlier run's.
    not_sent: bool = False
    # An earlier run of this attempt (a workflow task lost with its worker) may have sent it,
    # and nothing this run learnt says it did not (the send-once claim it made itself does).
    lost_run: bool = False


@dataclass(frozen=True)
class Attempts:
    """Where a request's attempts stand; `after_failure` returns the next one."""

    number: int = 1  # the attempt being made (1-based)
    avoid: tuple[str, ...] = ()  # instances a later attempt must not go to (they failed)
    redeliveries: int = 0
    store_waits: int = 0
    rerouted: bool = False
    # The first attempt that was sent and whose outcome was never learnt, if any.
    unknown: Failure | None = None


@dataclass(frozen=True)
class RouteAgain:
    """The same attempt, routed again now (the door's choice is dropped)."""


@dataclass(frozen=True)
class Redeliver:
    """The same attempt, to the same instance, after `delay_s`."""

    delay_s: float


@dataclass(frozen=True)
class WaitForStore:
    """The same step again after `delay_s`: the store was away."""

    delay_s: float


@dataclass(frozen=True)
class WaitForToken:
    """Look for a rate-limit token again after `delay_s`."""

    delay_s: float


@dataclass(frozen=True)
class Retry:
    """The next attempt after `delay_s`, not on `avoid_instance`."""

    delay_s: float
    avoid_instance: str | None


@dataclass(frozen=True)
class GiveUp:
    """Stop and report `report` (None from `next_step`, which knows no failure)."""

    reason: str
    report: Failure | None = None


Step = RouteAgain | Redeliver | WaitForStore | Retry | GiveUp


def backoff_s(plan: CallPlan, attempt: int, rand: float = 0.0) -> float:
    """The wait after failed attempt `attempt` (1-based); `rand` in [0, 1) draws the jitter."""
    if plan.backoff_base_ms is None:  # a plan from before exponential settings
        listed = plan.backoff_s or [1.0]
        return listed[min(attempt - 1, len(listed) - 1)]
    grown = plan.backoff_base_ms * plan.backoff_multiplier ** min(attempt - 1, 64)
    delay_ms = min(float(plan.backoff_cap_ms), grown)
    return delay_ms * (1.0 - plan.jitter * rand) / 1000


def redeliver_delay_s(redeliveries: int) -> float:
    """The wait before re-delivery number `redeliveries` + 1."""
    return REDELIVER_FIRST_S * 2.0 ** min(redeliveries, 64)


def store_backoff_s(waits: int) -> float:
    """The wait after the store was found away `waits` + 1 times by one step."""
    return min(STORE_RETRY_MAX_S, STORE_RETRY_FIRST_S * 2.0 ** min(waits, 64))


def next_step(
    plan: CallPlan,
    *,
    attempt: int,
    retryable: bool,
    failed_instance: str | None,
    now_ms: int,
    deadline_ms: int,
    rand: float = 0.0,
) -> Retry | GiveUp:
    """After attempt number `attempt` (1-based) failed: try again, or give up and report."""
    if not retryable:
        return GiveUp("the error is not retryable")
    if attempt > plan.max_retries:
        if plan.max_retries == 0 and not plan.idempotent:
            return GiveUp(NOT_IDEMPOTENT)
        return GiveUp(f"{plan.max_retries} retries used")
    delay = backoff_s(plan, attempt, rand)
    if now_ms + delay * 1000 >= deadline_ms:
        return GiveUp("no time left before the deadline for another attempt")
    return Retry(delay_s=delay, avoid_instance=failed_instance)


def _always(rule: Rule) -> bool:
    return True


def _no_draw() -> float:
    return 0.0


def after_failure(
    plan: CallPlan,
    tries: Attempts,
    failure: Failure,
    *,
    keyed: bool,
    now_ms: int,
    deadline_ms: int,
    follows: Callable[[Rule], bool] = _always,
    draw: Callable[[], float] = _no_draw,
) -> tuple[Step, Attempts]:
    """After attempt `tries.number` failed with `failure`: the next step, and where the
    attempts then stand. `keyed`: the request has an idempotency key."""
    if may_have_run(failure) and tries.unknown is None and follows(LOST_RUN):
        # Before anything else: a lost run's send is remembered whatever this run does next
        # (a re-run whose instance left is routed elsewhere: the lost run may have sent it there).
        tries = replace(tries, unknown=lost_attempt(failure))
    if failure.stale_route and not tries.rerouted:
        # Nothing was sent: no timer, and it is still the same attempt. Only the door's choice
        # can be stale, so this happens once; anything after it is an ordinary failure.
        return RouteAgain(), replace(tries, rerouted=True)
    if failure.error.type == "timeout":
        return GiveUp(
            "deadline reached", report=timed_out(plan, tries, failure, keyed=keyed)
        ), tries
    if failure.not_sent and failure.error.outcome_unknown and follows(NOT_SENT):
        # Another run sent this attempt and was lost: re-delivering it would only be refused
        # again. Its unknown outcome is the report.
        return GiveUp("refused before sending: an earlier run sent it", report=failure), tries
    if failure.not_sent and failure.error.type == "unavailable" and follows(NOT_SENT):
        delay_s = store_backoff_s(tries.store_waits)
        if now_ms + delay_s * 1000 < deadline_ms:  # nothing was sent: wait for the store
            return WaitForStore(delay_s), replace(tries, store_waits=tries.store_waits + 1)
    if failure.error.outcome_unknown and failure.instance_id is not None:
        if tries.unknown is None:
            tries = replace(tries, unknown=failure)
        delay_s = redeliver_delay_s(tries.redeliveries)
        if (
            tries.redeliveries < MAX_REDELIVERIES
            and now_ms + delay_s * 1000 < deadline_ms
            and follows(REDELIVER)
        ):
            return Redeliver(delay_s), replace(tries, redeliveries=tries.redeliveries + 1)
    if failure.instance_id is None and failure.error.type == "unavailable" and follows(STORE_WAIT):
        delay_s = store_backoff_s(tries.store_waits)
        if now_ms + delay_s * 1000 < deadline_ms:
            return WaitForStore(delay_s), replace(tries, store_waits=tries.store_waits + 1)
    if (
        failure.instance_id is None
        and failure.error.type == "unknown_capability"
        and follows(KNOWN_CAPABILITY)
    ):
        # The door accepts only a capability the registry knows, so the registry forgot it
        # since (a store restarted empty): its agents join again at their next heartbeat.
        delay_s = store_backoff_s(tries.store_waits)
        if now_ms + delay_s * 1000 < deadline_ms:
            return WaitForStore(delay_s), replace(tries, store_waits=tries.store_waits + 1)
        gone = Failure(
            ErrorInfo(
                type="no_instance",
                message=f"{failure.error.message}; it was known when the request was accepted "
                "and no instance of it joined again before the deadline",
                retryable=True,
            )
        )
        return GiveUp(
            "no instance came back", report=reported(plan, tries, gone, keyed=keyed)
        ), tries
    step = next_step(
        plan,
        attempt=tries.number,
        # An open breaker says when to come back (retry_after_s): the caller's to wait, not ours.
        retryable=failure.error.retryable and failure.error.type != "circuit_open",
        failed_instance=failure.instance_id,
        now_ms=now_ms,
        deadline_ms=deadline_ms,
        rand=draw() if plan.jitter else 0.0,
    )
    sent = failure.instance_id is not None
    if isinstance(step, Retry) and sent and not (plan.idempotent or keyed):
        # Plans never allow this (`plan_call` gives such a request no retries); kept here too,
        # so that no plan, however it was made, can run a call twice on two instances.
        step = GiveUp(NOT_IDEMPOTENT)
    if isinstance(step, GiveUp):
        return replace(step, report=reported(plan, tries, failure, keyed=keyed)), tries
    avoid = (*tries.avoid, step.avoid_instance) if step.avoid_instance else tries.avoid
    return step, replace(tries, number=tries.number + 1, avoid=avoid)


def may_have_run(failure: Failure) -> bool:
    """Whether a failure comes after an earlier, lost run of its attempt that may have sent it,
    and this run did not hear from the agent (whose answer would be the outcome) nor learn of
    that run's unknown outcome otherwise (`outcome_unknown` is kept as the failure says)."""
    error = failure.error
    return (
        failure.lost_run
        and not error.outcome_unknown
        and error.type not in ("agent_error", "timeout")
    )


# What a keyless write's failed answer adds to its message (`ran_and_failed`).
RAN = (
    "the agent answered, so it ran and may have done some of its work: it is not retryable, "
    "as the operation is not idempotent and the request has no idempotency_key (sent again, "
    "it may run twice; find out what it did first)"
)
# The agent's statuses that say it refused the request before running it.
REFUSED_UNRUN = frozenset({429})


def ran_and_failed(failure: Failure) -> bool:
    """Whether an attempt's failure is the agent's own answer, one that another attempt may
    help (a 5xx: `connectors._answers`), after the agent ran it. Such an answer is 'retryable'
    for Reach's retries, which only an idempotent or keyed request gets (a repeat is then
    harmless or replays); for a keyless write it is not: it ran, and may have had effects. Only
    an agent's 429, a refusal, says it did not run it."""
    error = failure.error
    if error.type != "agent_error" or not error.retryable or failure.instance_id is None:
        return False
    return error.agent is None or error.agent.status not in REFUSED_UNRUN


def lost_attempt(failure: Failure) -> Failure:
    """What is remembered of an attempt an earlier, lost run may have sent."""
    error = failure.error.model_copy(
        update={
            "outcome_unknown": True,
            "message": f"{failure.error.message}; an earlier run of this attempt, lost with its "
            "Reach process, may have sent it",
        }
    )
    return replace(failure, error=error)


def _earlier(unknown: Failure) -> str:
    to = f" to {unknown.instance_id}" if unknown.instance_id else ""
    if unknown.lost_run:
        return f"an earlier run of the attempt{to}, lost with its Reach process, may have sent it"
    return f"an earlier attempt{to} was sent and its answer never came"


def reported(plan: CallPlan, tries: Attempts, failure: Failure, *, keyed: bool) -> Failure:
    """What a request that gives up reports. If an attempt was sent and never answered, it may
    have run, whatever the operation, and the report says so (`outcome_unknown`, with the
    instance when the last failure names none). A request that is neither idempotent nor keyed
    reports that attempt and is no longer 'retryable', whatever the re-deliveries after it met;
    an idempotent or keyed one reports its last failure, still as retryable as it was. An
    agent's failed answer to a keyless write is not 'retryable' either (`ran_and_failed`)."""
    unknown = tries.unknown
    if unknown is None:
        if not (plan.idempotent or keyed) and ran_and_failed(failure):
            error = failure.error.model_copy(
                update={"retryable": False, "message": f"{failure.error.message}; {RAN}"}
            )
            return replace(failure, error=error)
        return failure
    if plan.idempotent or keyed:
        if failure.error.outcome_unknown:
            return failure
        error = failure.error.model_copy(
            update={
                "outcome_unknown": True,
                "message": f"{failure.error.message}; {_earlier(unknown)}, so it may have run",
            }
        )
        return replace(failure, error=error, instance_id=failure.instance_id or unknown.instance_id)
    # Not "repeat it with an idempotency_key to be safe": a new key lets it run a second time.
    who = f"agent {unknown.instance_id}" if unknown.instance_id else "the agent it was sent to"
    said = may_have_run_advice(who, idempotent=False, keyed=False)
    if not unknown.lost_run:
        said = f"it was sent and its answer never came: {said}"
    error = unknown.error.model_copy(
        update={
            "retryable": False,
            "outcome_unknown": True,
            "message": f"{unknown.error.message}; {said}",
        }
    )
    return Failure(error, unknown.instance_id, lost_run=unknown.lost_run)


def timed_out(plan: CallPlan, tries: Attempts, failure: Failure, *, keyed: bool) -> Failure:
    """What a request that reached its deadline reports. A call that was sent and never
    answered — this attempt's, one an earlier (lost) workflow task may have sent, or an
    earlier re-delivered one — may have run: the report says so (`outcome_unknown`), whatever
    the operation's idempotency or key (the flag says what Reach knows; whether repeating it
    is safe is the caller's to tell from the operation and its key), and names the instance it
    went to (None when nobody recorded it). A deadline met before anything was sent says
    nothing of the kind: it never ran."""
    del plan, keyed  # what the deadline says does not depend on them
    sent = failure.sent or tries.unknown is not None
    if not sent:
        return failure
    instance_id = failure.instance_id
    if instance_id is None and tries.unknown is not None:
        instance_id = tries.unknown.instance_id
    error = failure.error.model_copy(update={"retryable": False, "outcome_unknown": True})
    return Failure(error, instance_id, sent=True)


def after_store_failure(
    waits: int, failure: Failure, *, now_ms: int, until_ms: int
) -> WaitForStore | GiveUp:
    """A quick store step failed for the `waits` + 1st time: wait for the store (an accepted
    request outlives a Redis restart) until `until_ms`, unless the failure is for good."""
    delay_s = store_backoff_s(waits)
    if not failure.error.retryable:
        return GiveUp("the store refused the step", report=failure)
    if now_ms + delay_s * 1000 >= until_ms:
        return GiveUp("no time left to wait for the store", report=failure)
    return WaitForStore(delay_s)


def after_no_token(
    wait_s: float,
    *,
    miss: int,
    now_ms: int,
    until_ms: int,
    draw: Callable[[], float],
    follows: Callable[[Rule], bool] = _always,
) -> WaitForToken | GiveUp:
    """A queued request found no token for the `miss`-th time (1-based); the buckets say one
    frees in `wait_s`. Waiters wake spread out, not all at once for the one token that frees,
    and less often the longer they wait (a long wait stays a short history); always before
    `until_ms`, the time they may wait: a wake there could only end the request as a timeout
    that never reached an agent, where the answer is `rate_limited`. `draw` is asked only for a
    wait, `follows(QUEUE_DEADLINE)` only when the spread would reach `until_ms`."""
    if now_ms + wait_s * 1000 >= until_ms:
        return GiveUp("no token frees before the request may no longer wait")
    # uniform(1.0, 1.5) as `random.Random.uniform` computes it, from the one draw.
    spread = wait_s * (1.0 + 0.5 * draw()) * min(8.0, 1.25 ** min(miss, 64))
    left_s = (until_ms - now_ms) / 1000
    delay_s = max(QUEUE_POLL_MIN_S, min(spread, QUEUE_POLL_MAX_S))
    if delay_s >= left_s:
        if not follows(QUEUE_DEADLINE):  # accepted before: it woke at the end of its wait
            return WaitForToken(max(QUEUE_POLL_MIN_S, left_s))
        # The last useful look is when the token frees, before the wait ends.
        delay_s = max(QUEUE_POLL_MIN_S, wait_s)
        if delay_s >= left_s:
            return GiveUp("no token frees early enough to look for it before the wait ends")
    return WaitForToken(delay_s)
