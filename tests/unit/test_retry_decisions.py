"""Every retry decision a request meets (`reach.policy.retry`), as properties and examples."""

from __future__ import annotations

import random
from dataclasses import replace
from typing import get_args

import pytest
from hypothesis import given
from hypothesis import strategies as st

from reach.errors import ErrorType
from reach.invocation import CallPlan
from reach.messages import ErrorInfo
from reach.policy import (
    KNOWN_CAPABILITY,
    LOST_RUN,
    NOT_SENT,
    QUEUE_DEADLINE,
    REDELIVER,
    STORE_WAIT,
    Attempts,
    Failure,
    GiveUp,
    Redeliver,
    Retry,
    RouteAgain,
    Rule,
    Step,
    WaitForStore,
    WaitForToken,
    after_failure,
    after_no_token,
    after_store_failure,
    backoff_s,
    timed_out,
)
from reach.policy.retry import (
    MAX_REDELIVERIES,
    QUEUE_POLL_MAX_S,
    QUEUE_POLL_MIN_S,
    STORE_RETRY_MAX_S,
    redeliver_delay_s,
    store_backoff_s,
)

SECOND = 1000


def error(
    kind: ErrorType = "transport_error", *, retryable: bool = True, unknown: bool | None = None
) -> ErrorInfo:
    return ErrorInfo(type=kind, message=kind, retryable=retryable, outcome_unknown=unknown)


def plan(**kw: object) -> CallPlan:
    fields: dict[str, object] = {
        "timeout_ms": 60 * SECOND,
        "idempotent": True,
        "max_retries": 2,
        "backoff_base_ms": 1000,
    }
    return CallPlan.model_validate({**fields, **kw})


def decide(
    p: CallPlan,
    tries: Attempts,
    failure: Failure,
    *,
    now_ms: int = 0,
    deadline_ms: int = 60 * SECOND,
    keyed: bool = False,
) -> tuple[Step, Attempts]:
    return after_failure(p, tries, failure, keyed=keyed, now_ms=now_ms, deadline_ms=deadline_ms)


# -- the four kinds of failure, one example each ------------------------------------------------


def test_an_instance_gone_before_the_call_is_routed_again_at_once_and_only_once() -> None:
    stale = Failure(error("no_instance"), stale_route=True)
    step, tries = decide(plan(), Attempts(), stale)
    assert step == RouteAgain()
    assert (tries.number, tries.rerouted) == (1, True)  # the same attempt, no timer
    # Anything after it is an ordinary failure before an instance was chosen: the plan's retry.
    again, _ = decide(plan(), tries, stale)
    assert again == Retry(delay_s=1.0, avoid_instance=None)


def test_a_broken_call_goes_back_to_its_instance_three_times_then_the_plan_decides() -> None:
    broken = Failure(error(unknown=True), "i1")
    tries = Attempts()
    delays = []
    for _ in range(MAX_REDELIVERIES):
        step, tries = decide(plan(), tries, broken)
        assert isinstance(step, Redeliver)
        delays.append(step.delay_s)
    assert delays == [0.5, 1.0, 2.0]
    assert tries.number == 1
    assert tries.unknown == broken
    step, tries = decide(plan(), tries, broken)
    assert step == Retry(delay_s=1.0, avoid_instance="i1")
    assert (tries.number, tries.avoid) == (2, ("i1",))


def test_a_call_refused_unsent_is_never_redelivered_and_keeps_its_unknown_outcome() -> None:
    # Another run sent this attempt (its claim holds): a re-delivery would be refused the same way.
    refused = Failure(error(retryable=False, unknown=True), "i1", not_sent=True)
    step, tries = decide(plan(idempotent=False, max_retries=0), Attempts(), refused)
    assert isinstance(step, GiveUp)
    assert step.report == refused
    assert tries == Attempts()  # no re-delivery, no attempt counted
    # Requests accepted before the rule re-delivered it (and were refused each time).
    before, _ = after_failure(
        plan(),
        Attempts(),
        refused,
        keyed=False,
        now_ms=0,
        deadline_ms=60 * SECOND,
        follows=lambda rule: rule != NOT_SENT,
    )
    assert isinstance(before, Redeliver)


def test_a_call_refused_unsent_because_the_store_was_away_waits_for_it_whatever_the_op() -> None:
    away = Failure(error("unavailable"), "i1", not_sent=True)
    step, tries = decide(plan(idempotent=False, max_retries=0), Attempts(), away)
    assert step == WaitForStore(store_backoff_s(0))
    assert (tries.number, tries.store_waits) == (1, 1)  # the same attempt: nothing was sent
    late, _ = decide(plan(idempotent=False, max_retries=0), Attempts(), away, now_ms=59_900)
    assert isinstance(late, GiveUp)


def test_a_store_outage_while_routing_is_waited_out_whatever_the_operation() -> None:
    away = Failure(error("unavailable"))
    tries = Attempts()
    delays = []
    for _ in range(7):
        step, tries = decide(plan(idempotent=False, max_retries=0), tries, away)
        assert isinstance(step, WaitForStore)
        delays.append(step.delay_s)
    assert delays == [0.5, 1.0, 2.0, 4.0, 8.0, 10.0, 10.0]
    assert tries.number == 1
    # Not when there is no time left for the wait: then the plan decides (no retries here).
    step, _ = decide(plan(idempotent=False, max_retries=0), tries, away, now_ms=55 * SECOND)
    assert isinstance(step, GiveUp)
    assert step.report == away


def test_the_plan_decides_the_rest_and_a_timeout_or_an_open_breaker_ends_the_request() -> None:
    refused = Failure(error(), "i1")
    step, tries = decide(plan(), Attempts(), refused)
    assert step == Retry(delay_s=1.0, avoid_instance="i1")
    step, tries = decide(plan(), tries, Failure(error(), "i2"))
    assert step == Retry(delay_s=2.0, avoid_instance="i2")
    step, _ = decide(plan(), tries, Failure(error(), "i3"))
    assert step == GiveUp("2 retries used", report=Failure(error(), "i3"))
    timeout = Failure(error("timeout", retryable=False), "i1")
    assert decide(plan(), Attempts(), timeout)[0] == GiveUp("deadline reached", report=timeout)
    # A breaker says when to come back: the caller's wait, not this request's.
    circuit = Failure(error("circuit_open"))
    assert isinstance(decide(plan(), Attempts(), circuit)[0], GiveUp)


def test_a_keyless_write_that_may_have_run_reports_that_attempt_not_the_last_one() -> None:
    write = plan(idempotent=False, max_retries=0)
    broken = Failure(error(unknown=True), "i1")
    tries = Attempts()
    for _ in range(MAX_REDELIVERIES):
        _, tries = decide(write, tries, broken)
    step, _ = decide(write, tries, Failure(error("no_instance")))
    assert isinstance(step, GiveUp)
    assert step.report is not None
    assert step.report.instance_id == "i1"
    assert (step.report.error.retryable, step.report.error.outcome_unknown) == (False, True)
    assert "idempotency_key" in step.report.error.message
    # With a key, the last failure is the report (repeating the request is safe, so it stays
    # retryable), and it still says the earlier attempt may have run, naming its instance.
    keyed, _ = decide(write, tries, Failure(error("no_instance")), keyed=True)
    assert isinstance(keyed, GiveUp)
    assert keyed.report is not None
    assert keyed.report.instance_id == "i1"
    assert keyed.report.error.type == "no_instance"
    assert (keyed.report.error.retryable, keyed.report.error.outcome_unknown) == (True, True)


# -- an attempt an earlier, lost run may have sent (its workflow task lost with its worker) ------


def lost(kind: ErrorType, instance_id: str | None = None) -> Failure:
    """What the run after a lost one met, the lost run's possible send noticed (sent=True)."""
    return Failure(error(kind), instance_id, sent=True, lost_run=True)


def test_a_lost_run_s_read_waited_for_the_store_then_timed_out_says_it_may_have_run() -> None:
    """The reliability suite: routed and sent, its gateway lost; the run after it found the
    store away until the deadline (`None:unavailable, None:timeout`): it ran once."""
    step, tries = decide(plan(), Attempts(), lost("unavailable"))
    assert isinstance(step, WaitForStore)
    assert tries.unknown is not None
    assert tries.unknown.lost_run
    step, _ = decide(plan(), tries, Failure(error("timeout", retryable=False)))
    assert isinstance(step, GiveUp)
    assert step.report is not None
    assert (step.report.error.type, step.report.error.outcome_unknown) == ("timeout", True)
    assert step.report.error.retryable is False


def test_a_lost_run_s_read_retried_elsewhere_then_timed_out_names_where_it_went() -> None:
    """Its re-run went back to its instance and could not connect (the agent SIGKILLed, no
    outcome_unknown from the connector): retried elsewhere (a read), then the deadline."""
    step, tries = decide(plan(), Attempts(), lost("transport_error", "i1"))
    assert isinstance(step, Retry)  # a plain retry: no re-delivery timers added
    step, tries = decide(plan(), tries, Failure(error("no_instance")))
    assert isinstance(step, Retry)
    step, _ = decide(plan(), tries, Failure(error("timeout", retryable=False)))
    assert isinstance(step, GiveUp)
    assert step.report is not None
    assert step.report.error.outcome_unknown is True
    assert step.report.instance_id == "i1"


@pytest.mark.parametrize("kind", ["no_instance", "transport_error", "unavailable"])
def test_a_lost_run_s_keyless_write_that_ends_unsent_here_says_it_may_have_run(
    kind: ErrorType,
) -> None:
    """No instance at the re-run's resolve, a refused connect on going back (a gRPC agent
    SIGKILLed mid-call), the store away: each was reported as never sent, and each had run."""
    write = plan(idempotent=False, max_retries=0)
    instance_id = "i1" if kind == "transport_error" else None
    step, _ = decide(write, Attempts(), lost(kind, instance_id), deadline_ms=0)
    assert isinstance(step, GiveUp)
    assert step.report is not None
    report = step.report
    assert (report.error.type, report.error.outcome_unknown) == (kind, True)
    assert report.error.retryable is False
    assert report.instance_id == instance_id
    assert report.lost_run  # the workflow names attempt 1's instance when none is known
    assert "may have run" in report.error.message
    # Keyed: its last failure, as retryable as it was, and saying so.
    keyed, _ = decide(write, Attempts(), lost(kind, instance_id), deadline_ms=0, keyed=True)
    assert isinstance(keyed, GiveUp)
    assert keyed.report is not None
    assert keyed.report.error.outcome_unknown is True


def test_a_lost_run_whose_instance_left_is_remembered_as_it_goes_elsewhere() -> None:
    """A keyed write's re-run finds the door's instance gone (StaleRoute, not its first run):
    routed again, another instance refuses it; the first may have run it."""
    gone = Failure(error("no_instance"), stale_route=True, lost_run=True)
    step, tries = decide(plan(idempotent=False), Attempts(), gone, keyed=True)
    assert isinstance(step, RouteAgain)
    assert tries.unknown is not None
    refused = Failure(error("agent_error", retryable=False), "i2", sent=True)
    step, _ = decide(plan(idempotent=False), tries, refused, keyed=True)
    assert isinstance(step, GiveUp)
    assert step.report is not None
    assert (step.report.error.type, step.report.error.outcome_unknown) == ("agent_error", True)


def test_a_lost_run_is_not_suspected_once_the_agent_answered_or_the_claim_proves_it() -> None:
    write = plan(idempotent=False, max_retries=0)
    # The re-run reached the agent, which answered: its answer is the outcome.
    step, tries = decide(write, Attempts(), lost("agent_error", "i1"))
    assert isinstance(step, GiveUp)
    assert step.report is not None
    assert tries.unknown is None
    assert not step.report.error.outcome_unknown
    # No lost run (the workflow clears it when this run made the send-once claim itself).
    plain = Failure(error("no_instance"), sent=True)
    step, tries = decide(write, Attempts(), plain)
    assert isinstance(step, GiveUp)
    assert step.report == plain
    assert tries.unknown is None
    # Requests accepted before the rule report what the run met, as they did.
    step, tries = after_failure(
        write,
        Attempts(),
        lost("no_instance"),
        keyed=False,
        now_ms=0,
        deadline_ms=SECOND,
        follows=lambda rule: rule != LOST_RUN,
    )
    assert isinstance(step, GiveUp)
    assert step.report is not None
    assert tries.unknown is None
    assert not step.report.error.outcome_unknown


def test_a_store_step_waits_on_the_store_backoff_until_its_time_is_up() -> None:
    away = Failure(error("unavailable"))
    assert after_store_failure(0, away, now_ms=0, until_ms=SECOND) == WaitForStore(0.5)
    assert after_store_failure(3, away, now_ms=0, until_ms=60 * SECOND) == WaitForStore(4.0)
    assert isinstance(after_store_failure(1, away, now_ms=0, until_ms=SECOND), GiveUp)
    refused = Failure(error("invalid_request", retryable=False))
    step = after_store_failure(0, refused, now_ms=0, until_ms=60 * SECOND)
    assert step == GiveUp("the store refused the step", report=refused)


def test_a_queued_request_looks_again_spread_out_and_never_past_its_wait() -> None:
    # The one draw is spent as `Random.uniform(1.0, 1.5)` spent it: the same timers as before.
    mine, theirs = random.Random(7), random.Random(7)
    for miss in range(1, 12):
        step = after_no_token(0.2, miss=miss, now_ms=0, until_ms=600 * SECOND, draw=mine.random)
        expected = 0.2 * theirs.uniform(1.0, 1.5) * min(8.0, 1.25**miss)
        assert step == WaitForToken(expected)
    assert after_no_token(9.0, miss=1, now_ms=0, until_ms=5 * SECOND, draw=mine.random) == GiveUp(
        "no token frees before the request may no longer wait"
    )
    # A spread that reaches the wait's end looks when the token frees instead: a wake at the
    # end could only time the request out, never started (it is refused rate_limited).
    near = after_no_token(1.0, miss=1, now_ms=0, until_ms=1200, draw=lambda: 0.999)
    assert near == WaitForToken(1.0)
    # A request accepted before that rule woke at the end of its wait.
    old = after_no_token(
        1.0, miss=1, now_ms=0, until_ms=1200, draw=lambda: 0.999, follows=lambda rule: False
    )
    assert old == WaitForToken(1.2)


def test_a_deadline_reports_a_call_that_may_have_run_with_its_instance() -> None:
    write = plan(idempotent=False, max_retries=0)
    late = error("timeout", retryable=False)
    # Not sent (no worker took it in time, or a first task's resolve ran out of time): a plain
    # timeout, whatever the operation.
    assert decide(write, Attempts(), Failure(late))[0] == GiveUp(
        "deadline reached", report=Failure(late)
    )
    # Sent by this task, or by an earlier one lost with its worker (a local activity started
    # and never reported): it may have run.
    for lost in (Failure(late, "i1", sent=True), Failure(late, None, sent=True)):
        step, _ = decide(write, Attempts(), lost)
        assert isinstance(step, GiveUp)
        assert step.report == Failure(
            error("timeout", retryable=False, unknown=True), lost.instance_id, sent=True
        )
    # The deadline met while re-delivering a broken call names the instance it went to.
    broken = Failure(error(unknown=True), "i1")
    _, tries = decide(write, Attempts(), broken)
    step, _ = decide(write, tries, Failure(late))
    assert isinstance(step, GiveUp)
    assert step.report is not None
    assert (step.report.instance_id, step.report.error.outcome_unknown) == ("i1", True)
    # Idempotent or keyed: running it again is safe, yet whether it ran is just as unknown,
    # and the report says so (the flag is what Reach knows, `retryable` whether to repeat it).
    unknown_late = error("timeout", retryable=False, unknown=True)
    for p, keyed, tried in ((plan(), False, Attempts()), (write, True, tries)):
        report = timed_out(p, tried, Failure(late, "i1", sent=True), keyed=keyed)
        assert report == Failure(unknown_late, "i1", sent=True)
    # Nothing sent (refused before the call, or no instance): nothing to say, whatever the plan.
    assert timed_out(plan(), Attempts(), Failure(late), keyed=True) == Failure(late)


def test_a_capability_the_registry_forgot_is_waited_for_until_the_deadline() -> None:
    forgot = Failure(error("unknown_capability", retryable=False))
    write = plan(idempotent=False, max_retries=0)
    tries = Attempts()
    delays = []
    for _ in range(4):
        step, tries = decide(write, tries, forgot)
        assert isinstance(step, WaitForStore)
        delays.append(step.delay_s)
    assert delays == [0.5, 1.0, 2.0, 4.0]  # the store's backoff
    # No time left: the capability exists, none of its instances came back.
    step, _ = decide(write, tries, forgot, now_ms=55 * SECOND)
    assert isinstance(step, GiveUp)
    assert step.report is not None
    assert (step.report.error.type, step.report.error.retryable) == ("no_instance", True)
    # A request accepted before that rule ends as it did.
    old, _ = after_failure(
        write,
        Attempts(),
        forgot,
        keyed=False,
        now_ms=0,
        deadline_ms=60 * SECOND,
        follows=lambda rule: rule != KNOWN_CAPABILITY,
    )
    assert old == GiveUp("the error is not retryable", report=forgot)


# -- properties ---------------------------------------------------------------------------------

plans = st.one_of(
    st.builds(
        CallPlan,
        timeout_ms=st.integers(1, 10**7),
        idempotent=st.booleans(),
        max_retries=st.integers(0, 10),
        backoff_base_ms=st.integers(1, 60_000),
        backoff_multiplier=st.floats(1.0, 10.0),
        backoff_cap_ms=st.integers(1, 600_000),
        jitter=st.floats(0.0, 1.0),
    ),
    # Plans recorded before exponential backoff: a list of waits.
    st.builds(
        CallPlan,
        timeout_ms=st.integers(1, 10**7),
        idempotent=st.booleans(),
        max_retries=st.integers(0, 10),
        backoff_s=st.lists(st.floats(0.001, 600.0), min_size=1, max_size=4),
    ),
)
errors = st.builds(
    ErrorInfo,
    type=st.sampled_from(get_args(ErrorType)),
    message=st.just("it failed"),
    retryable=st.booleans(),
    outcome_unknown=st.sampled_from([None, False, True]),
)
failures = st.builds(
    Failure,
    error=errors,
    instance_id=st.sampled_from([None, "i1", "i2"]),
    stale_route=st.booleans(),
    sent=st.booleans(),
    lost_run=st.booleans(),
)
states = st.builds(
    Attempts,
    number=st.integers(1, 12),
    avoid=st.lists(st.sampled_from(["i1", "i2", "i3"]), max_size=3).map(tuple),
    redeliveries=st.integers(0, 5),
    store_waits=st.integers(0, 40),
    rerouted=st.booleans(),
    unknown=st.one_of(st.none(), st.builds(Failure, error=errors, instance_id=st.just("i0"))),
)
rules = st.frozensets(
    st.sampled_from([REDELIVER, STORE_WAIT, KNOWN_CAPABILITY, QUEUE_DEADLINE, NOT_SENT, LOST_RUN])
)
draws = st.floats(0.0, 0.999999)


def delay_of(step: Step) -> float | None:
    return step.delay_s if isinstance(step, Redeliver | WaitForStore | Retry) else None


@given(
    p=plans,
    tries=states,
    failure=failures,
    keyed=st.booleans(),
    now_ms=st.integers(0, 10**9),
    left_ms=st.integers(-1000, 10**8),
    followed=rules,
    rand=draws,
)
def test_no_step_waits_past_the_deadline_and_every_retry_counts(
    p: CallPlan,
    tries: Attempts,
    failure: Failure,
    keyed: bool,
    now_ms: int,
    left_ms: int,
    followed: frozenset[Rule],
    rand: float,
) -> None:
    step, after = after_failure(
        p,
        tries,
        failure,
        keyed=keyed,
        now_ms=now_ms,
        deadline_ms=now_ms + left_ms,
        follows=followed.__contains__,
        draw=lambda: rand,
    )
    delay = delay_of(step)
    if delay is not None:
        assert delay > 0
        assert now_ms + delay * 1000 < now_ms + left_ms
    if isinstance(step, Retry):
        assert tries.number <= p.max_retries
        assert after.number == tries.number + 1
    else:  # every other step stays on the same attempt
        assert after.number == tries.number
    if isinstance(step, Redeliver):
        assert after.redeliveries == tries.redeliveries + 1 <= MAX_REDELIVERIES
    if isinstance(step, GiveUp):
        assert step.report is not None
    # A rule a request predates is never applied to it.
    assert not isinstance(step, Redeliver) or REDELIVER in followed
    if isinstance(step, WaitForStore):
        rule = KNOWN_CAPABILITY if failure.error.type == "unknown_capability" else STORE_WAIT
        assert rule in followed


@given(
    p=plans,
    tries=states,
    failure=failures,
    now_ms=st.integers(0, 10**9),
    left_ms=st.integers(-1000, 10**8),
    rand=draws,
)
def test_a_keyless_call_that_is_not_idempotent_never_runs_on_a_second_instance(
    p: CallPlan, tries: Attempts, failure: Failure, now_ms: int, left_ms: int, rand: float
) -> None:
    p = p.model_copy(update={"idempotent": False})  # whatever its retries say
    step, _ = after_failure(
        p, tries, failure, keyed=False, now_ms=now_ms, deadline_ms=now_ms + left_ms
    )
    if failure.instance_id is not None:  # it was (or may have been) sent
        # A re-delivery goes to the same instance, which answers a RequestID it has from memory.
        assert not isinstance(step, Retry)
    report = step.report if isinstance(step, GiveUp) else None
    if tries.unknown is not None and report is not None and report.error.type != "timeout":
        # It gave up after a sent attempt went unanswered: the caller learns it may have run.
        assert report.error.outcome_unknown is True
        assert report.error.retryable is False


@given(
    p=plans,
    tries=states,
    failure=failures,
    keyed=st.booleans(),
    now_ms=st.integers(0, 10**9),
    left_ms=st.integers(-1000, 10**8),
    followed=rules,
)
def test_rules_and_draws_are_asked_for_only_where_they_apply(
    p: CallPlan,
    tries: Attempts,
    failure: Failure,
    keyed: bool,
    now_ms: int,
    left_ms: int,
    followed: frozenset[Rule],
) -> None:
    """Asking leaves a mark in history (a patch marker, the next random number): a replay of a
    request recorded before this module existed must meet each in the same place."""
    asked: list[Rule] = []
    drawn: list[float] = []

    def follows(rule: Rule) -> bool:
        asked.append(rule)
        return rule in followed

    def draw() -> float:
        drawn.append(0.5)
        return 0.5

    step, _ = after_failure(
        p,
        tries,
        failure,
        keyed=keyed,
        now_ms=now_ms,
        deadline_ms=now_ms + left_ms,
        follows=follows,
        draw=draw,
    )
    assert len(asked) == len(set(asked))
    early = (failure.stale_route and not tries.rerouted) or failure.error.type == "timeout"
    if REDELIVER in asked:
        assert not early
        assert failure.error.outcome_unknown
        assert failure.instance_id is not None
        assert tries.redeliveries < MAX_REDELIVERIES
        assert now_ms + redeliver_delay_s(tries.redeliveries) * 1000 < now_ms + left_ms
    if STORE_WAIT in asked:
        assert not early
        assert failure.instance_id is None
        assert failure.error.type == "unavailable"
    if KNOWN_CAPABILITY in asked:
        assert not early
        assert failure.instance_id is None
        assert failure.error.type == "unknown_capability"
    assert QUEUE_DEADLINE not in asked
    if LOST_RUN in asked:  # only for a lost run's failure, the first one remembered
        assert failure.error.type != "timeout"
        assert failure.lost_run
        assert not failure.error.outcome_unknown
        assert tries.unknown is None
    # The jitter draw is taken once the plan decides (retry or not), and only with jitter.
    forgotten = KNOWN_CAPABILITY in asked and KNOWN_CAPABILITY in followed
    planned = not early and not forgotten and not isinstance(step, Redeliver | WaitForStore)
    assert len(drawn) == (1 if planned and p.jitter else 0)


@given(p=plans, attempt=st.integers(1, 70), rand=draws)
def test_backoff_is_bounded_and_grows_with_each_attempt(
    p: CallPlan, attempt: int, rand: float
) -> None:
    this, following = backoff_s(p, attempt), backoff_s(p, attempt + 1)
    if p.backoff_base_ms is not None:
        assert 0 < this <= following <= p.backoff_cap_ms / 1000
        # Jitter only shortens a wait, by at most its fraction.
        assert this * (1 - p.jitter) - 1e-9 <= backoff_s(p, attempt, rand) <= this
    else:
        assert this in p.backoff_s
        assert following in p.backoff_s


@given(n=st.integers(0, 200))
def test_the_store_and_redelivery_backoffs_are_bounded_and_grow(n: int) -> None:
    assert 0 < store_backoff_s(n) <= store_backoff_s(n + 1) <= STORE_RETRY_MAX_S
    assert 0 < redeliver_delay_s(n) <= redeliver_delay_s(n + 1)


@given(
    wait_s=st.floats(0.0001, 10**5),
    miss=st.integers(1, 10**4),
    now_ms=st.integers(0, 10**9),
    left_ms=st.integers(-1000, 10**8),
    rand=draws,
)
def test_a_queued_request_never_waits_longer_than_it_may(
    wait_s: float, miss: int, now_ms: int, left_ms: int, rand: float
) -> None:
    asked: list[Rule] = []

    def follows(rule: Rule) -> bool:
        asked.append(rule)
        return True

    step = after_no_token(
        wait_s,
        miss=miss,
        now_ms=now_ms,
        until_ms=now_ms + left_ms,
        draw=lambda: rand,
        follows=follows,
    )
    if isinstance(step, WaitForToken):
        assert wait_s * 1000 < left_ms  # a token frees while it may still wait
        assert QUEUE_POLL_MIN_S <= step.delay_s <= QUEUE_POLL_MAX_S
        # It wakes before its wait ends, where a token is still of use (not at the end, to
        # time out never started).
        assert step.delay_s * 1000 < left_ms
    # The rule is asked only where it changes the wait: the spread reaches the wait's end.
    spread = wait_s * (1.0 + 0.5 * rand) * min(8.0, 1.25 ** min(miss, 64))
    wake_s = max(QUEUE_POLL_MIN_S, min(spread, QUEUE_POLL_MAX_S))
    reaches = wait_s * 1000 < left_ms and wake_s * 1000 >= left_ms
    assert asked == ([QUEUE_DEADLINE] if reaches else [])


@given(
    p=plans,
    tries=states,
    failure=failures,
    keyed=st.booleans(),
)
def test_a_deadline_says_may_have_run_exactly_when_the_call_was_or_may_have_been_sent(
    p: CallPlan, tries: Attempts, failure: Failure, keyed: bool
) -> None:
    late = replace(failure, error=error("timeout", retryable=False))
    report = timed_out(p, tries, late, keyed=keyed)
    sent = late.sent or tries.unknown is not None
    # Whatever the operation's idempotency or key: the flag says what Reach knows.
    assert bool(report.error.outcome_unknown) == sent
    if sent:
        assert report.error.retryable is False
        # The instance is named whenever anyone recorded one.
        if late.instance_id is not None or tries.unknown is not None:
            assert report.instance_id is not None
    else:
        assert report == late


@given(
    p=plans,
    keyed=st.booleans(),
    span_ms=st.integers(0, 10 * 60 * SECOND),
    data=st.data(),
)
def test_a_request_ends_within_a_bounded_number_of_steps(
    p: CallPlan, keyed: bool, span_ms: int, data: st.DataObject
) -> None:
    """Whatever fails, however often: attempts, re-deliveries and reroutes are counted, and
    each store wait spends at least half a second of a finite deadline."""
    bound = (p.max_retries + 1) + MAX_REDELIVERIES + 1 + span_ms // 500 + 1
    tries, now = Attempts(), 0
    counts: dict[type, int] = {}
    for _ in range(bound + 1):
        failure = data.draw(failures)
        step, tries = after_failure(
            p,
            tries,
            failure,
            keyed=keyed,
            now_ms=now,
            deadline_ms=span_ms,
            draw=lambda: data.draw(draws),
        )
        counts[type(step)] = counts.get(type(step), 0) + 1
        if isinstance(step, GiveUp):
            break
        # The step's wait, and the next attempt's own time (none, at worst).
        now += int((delay_of(step) or 0) * 1000) + data.draw(st.integers(0, 5 * SECOND))
    else:
        pytest.fail(f"no end after {bound} steps: {counts}")
    assert counts.get(Retry, 0) <= p.max_retries
    assert counts.get(Redeliver, 0) <= MAX_REDELIVERIES
    assert counts.get(RouteAgain, 0) <= 1
    assert tries.number <= p.max_retries + 1


@given(p=plans, tries=states, failure=failures, keyed=st.booleans(), now_ms=st.integers(0, 10**6))
def test_a_decision_depends_on_its_inputs_alone(
    p: CallPlan, tries: Attempts, failure: Failure, keyed: bool, now_ms: int
) -> None:
    first = after_failure(p, tries, failure, keyed=keyed, now_ms=now_ms, deadline_ms=10**7)
    again = after_failure(p, tries, failure, keyed=keyed, now_ms=now_ms, deadline_ms=10**7)
    assert first == again
