"""The memory policy state on a clock the tests move: breaker, outliers, buckets, claims."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from reach.config import CircuitBreakerSettings, OutlierSettings
from reach.policy.breaker import GONE, IGNORED, departed, quorum, serving, trips
from reach.policy.state import (
    Admission,
    BreakerView,
    Bucket,
    CapabilityView,
    MemoryPolicyState,
    create_policy_state,
)
from reach.store import MemoryStore

BREAKER = CircuitBreakerSettings(error_threshold=3, open_duration_ms=10_000)
NO_OUTLIER = OutlierSettings(enabled=False)
OUTLIER = OutlierSettings(consecutive_failures=2, base_ejection_ms=1000, max_ejection_ms=3000)


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def state(clock: Clock) -> MemoryPolicyState:
    return MemoryPolicyState(clock)


async def fail(
    state: MemoryPolicyState,
    times: int,
    breaker: CircuitBreakerSettings = BREAKER,
    outlier: OutlierSettings = NO_OUTLIER,
    instance: str = "a",
    probe: bool = False,
) -> CapabilityView:
    view = CapabilityView()
    for _ in range(times):
        view = await state.record("cap", instance, False, breaker, outlier, probe=probe)
    return view


async def succeed(
    state: MemoryPolicyState,
    breaker: CircuitBreakerSettings = BREAKER,
    outlier: OutlierSettings = NO_OUTLIER,
    instance: str = "a",
    probe: bool = False,
) -> CapabilityView:
    return await state.record("cap", instance, True, breaker, outlier, probe=probe)


def test_factory_picks_memory_for_a_memory_store() -> None:
    assert type(create_policy_state(MemoryStore())) is MemoryPolicyState


async def test_consecutive_failures_open_it_and_a_success_resets_the_run(
    state: MemoryPolicyState, clock: Clock
) -> None:
    assert (await fail(state, 2)).breaker == BreakerView("closed", 2)
    assert (await succeed(state)).breaker == BreakerView("closed", 0)
    assert (await fail(state, 2)).breaker == BreakerView("closed", 2)
    assert (await fail(state, 1)).breaker == BreakerView("open", 0, 10.0)
    assert await state.admit("cap", BREAKER) == Admission(False, "open", retry_after_s=10.0)
    clock.advance(4)
    # Requests admitted before it opened still report; they change nothing.
    assert (await succeed(state)).breaker == BreakerView("open", 0, 6.0)
    assert (await fail(state, 5)).breaker == BreakerView("open", 0, 6.0)
    assert await state.admit("cap", BREAKER) == Admission(False, "open", retry_after_s=6.0)
    assert (await state.view("other", BREAKER)).breaker == BreakerView()


async def test_window_counts_failures_among_the_last_n_outcomes(state: MemoryPolicyState) -> None:
    windowed = CircuitBreakerSettings(error_threshold=2, window=4, open_duration_ms=10_000)
    outcomes = [False, True, True, True, True, False, True, False]
    failures = []
    for ok in outcomes:
        view = await state.record("cap", "a", ok, windowed, NO_OUTLIER)
        failures.append((view.breaker.status, view.breaker.failures))
    assert failures == [
        ("closed", 1),  # 1
        ("closed", 1),  # 10
        ("closed", 1),  # 100
        ("closed", 1),  # 1000
        ("closed", 0),  # 0000: the failure left the window
        ("closed", 1),  # 0001
        ("closed", 1),  # 0010
        ("open", 0),  # 0101: two failures among the last four
    ]


async def test_half_open_admits_probes_and_their_successes_close_it(
    state: MemoryPolicyState, clock: Clock
) -> None:
    probes = CircuitBreakerSettings(error_threshold=1, open_duration_ms=10_000, half_open_probes=2)
    await fail(state, 1, probes)
    clock.advance(10)
    assert (await state.view("cap", probes)).breaker == BreakerView("half_open")
    assert await state.admit("cap", probes) == Admission(True, "half_open", probe=True)
    clock.advance(1)
    assert await state.admit("cap", probes) == Admission(True, "half_open", probe=True)
    clock.advance(2)
    # Both slots taken: the next frees when the first lease (10 s from its admission) ends.
    assert await state.admit("cap", probes) == Admission(False, "half_open", retry_after_s=7.0)
    # A success that was not a probe was admitted before it opened: ignored.
    assert (await succeed(state, probes)).breaker == BreakerView("half_open")
    assert await state.admit("cap", probes) == Admission(False, "half_open", retry_after_s=7.0)
    assert (await succeed(state, probes, probe=True)).breaker == BreakerView("half_open")
    # The success freed a slot.
    assert await state.admit("cap", probes) == Admission(True, "half_open", probe=True)
    assert (await succeed(state, probes, probe=True)).breaker == BreakerView("closed", 0)
    assert await state.admit("cap", probes) == Admission(True, "closed")
    # The third probe reports after it closed: an ordinary outcome.
    assert (await fail(state, 1, probes, probe=True)).breaker == BreakerView("open", 0, 10.0)


@pytest.mark.parametrize("probe", [True, False])
async def test_any_failure_in_half_open_reopens_it(
    state: MemoryPolicyState, clock: Clock, probe: bool
) -> None:
    await fail(state, 3)
    clock.advance(10)
    assert (await state.admit("cap", BREAKER)).probe
    clock.advance(1)
    assert (await fail(state, 1, probe=probe)).breaker == BreakerView("open", 0, 10.0)
    clock.advance(10)
    # The old probe slot went with the re-opening: one probe may go again.
    assert await state.admit("cap", BREAKER) == Admission(True, "half_open", probe=True)


async def test_a_probe_never_reported_frees_its_slot_after_open_duration(
    state: MemoryPolicyState, clock: Clock
) -> None:
    await fail(state, 3)
    clock.advance(10)
    assert await state.admit("cap", BREAKER) == Admission(True, "half_open", probe=True)
    clock.advance(9.5)
    assert await state.admit("cap", BREAKER) == Admission(False, "half_open", retry_after_s=0.5)
    clock.advance(0.5)
    assert await state.admit("cap", BREAKER) == Admission(True, "half_open", probe=True)


async def test_a_disabled_breaker_admits_everything_but_outliers_still_count(
    state: MemoryPolicyState,
) -> None:
    off = CircuitBreakerSettings(enabled=False, error_threshold=1)
    view = await fail(state, 4, off, OUTLIER)
    assert view == CapabilityView(BreakerView(), {"a": 2.0}, frozenset())
    assert await state.admit("cap", off) == Admission(True, "closed")
    # Nothing was stored for it: switched on, it starts clean.
    assert (await state.view("cap", BREAKER)).breaker == BreakerView()


async def test_outlier_ejections_double_up_to_the_cap_and_successes_between_do_not_reset(
    state: MemoryPolicyState, clock: Clock
) -> None:
    off = CircuitBreakerSettings(enabled=False)
    assert (await fail(state, 1, off, OUTLIER)).failing == {"a"}
    assert (await fail(state, 1, off, OUTLIER)).ejected == {"a": 1.0}
    view = await fail(state, 1, off, OUTLIER, instance="b")
    assert (view.ejected, view.failing) == ({"a": 1.0}, frozenset("b"))
    clock.advance(1)
    assert (await state.view("cap", off)).ejected == {}
    assert (await fail(state, 2, off, OUTLIER)).ejected == {"a": 2.0}
    clock.advance(2)
    assert (await fail(state, 2, off, OUTLIER)).ejected == {"a": 3.0}  # 4 s, capped at 3
    clock.advance(1)
    # A straggler's success does not end the ejection in progress, nor its count: an instance
    # that fails most of the time keeps its long ejections.
    view = await succeed(state, off, OUTLIER)
    assert (view.ejected, view.failing) == ({"a": 2.0}, frozenset("b"))
    clock.advance(2)
    assert (await fail(state, 2, off, OUTLIER)).ejected == {"a": 3.0}
    assert (await succeed(state, off, OUTLIER, instance="b")).failing == frozenset()
    # Outlier detection off: outcomes leave the instances alone.
    assert (await fail(state, 5, off, NO_OUTLIER, instance="c")).failing == frozenset()


async def test_idle_state_is_forgotten(state: MemoryPolicyState, clock: Clock) -> None:
    assert (await fail(state, 3, outlier=OUTLIER)).breaker == BreakerView("open", 0, 10.0)
    assert (await fail(state, 1, outlier=OUTLIER, instance="b")).failing == {"a", "b"}
    clock.advance(3 + 300 - 0.001)
    assert (await state.view("cap", BREAKER)).failing == {"a", "b"}
    clock.advance(0.001)
    # max_ejection_ms + 5 min after its last outcome, an instance's record is gone.
    assert (await state.view("cap", BREAKER)).failing == frozenset()
    clock.advance(10 + 6 * 3600 - 303 - 0.001)
    assert (await state.view("cap", BREAKER)).breaker == BreakerView("half_open")
    clock.advance(0.001)
    # open_duration_ms + 6 h after its last change, a breaker is closed and clean again.
    assert (await state.view("cap", BREAKER)).breaker == BreakerView()
    assert await state.admit("cap", BREAKER) == Admission(True, "closed")


async def test_record_returns_what_view_would(state: MemoryPolicyState) -> None:
    for ok, instance in [(False, "a"), (False, "b"), (False, "a"), (True, "b")]:
        recorded = await state.record("cap", instance, ok, BREAKER, OUTLIER)
        assert recorded == await state.view("cap", BREAKER)


async def test_take_takes_one_from_every_bucket_or_from_none(
    state: MemoryPolicyState, clock: Clock
) -> None:
    caller = Bucket("caller", per_minute=60, capacity=2)  # one a second
    cap = Bucket("cap", per_minute=120, capacity=5)
    assert await state.buckets(["caller", "cap"]) == {}
    assert [await state.take([caller, cap]) for _ in range(3)] == [0.0, 0.0, 1.0]
    assert await state.buckets(["caller", "cap", "nope"]) == {"caller": 0.0, "cap": 3.0}
    clock.advance(0.25)
    assert await state.take([caller, cap]) == 0.75
    assert await state.buckets(["caller", "cap"]) == {"caller": 0.25, "cap": 3.5}
    clock.advance(0.75)
    assert await state.take([caller, cap]) == 0.0
    assert await state.take([cap]) == 0.0
    assert await state.buckets(["caller", "cap"]) == {"caller": 0.0, "cap": 3.0}
    clock.advance(60)
    assert await state.buckets(["caller", "cap"]) == {}  # full again: as good as absent
    assert await state.take([]) == 0.0


async def test_claims_are_set_if_absent_and_released_only_by_their_holder(
    state: MemoryPolicyState, clock: Clock
) -> None:
    assert await state.claim("k", "first", ttl_s=5) == "first"
    assert await state.claim("k", "second", ttl_s=5) == "first"
    assert not await state.release("k", "second")
    assert await state.release("k", "first")
    assert not await state.release("k", "first")
    assert await state.claim("k", "second", ttl_s=5) == "second"
    clock.advance(5)
    assert not await state.release("k", "second")
    assert await state.claim("k", "third", ttl_s=5) == "third"


@settings(max_examples=200, deadline=None)
@given(
    per_minute=st.floats(1, 6000),
    capacity=st.integers(1, 10),
    steps=st.lists(st.floats(0, 2), max_size=60),
)
async def test_take_never_lets_more_through_than_capacity_plus_refill(
    per_minute: float, capacity: int, steps: list[float]
) -> None:
    clock = Clock()
    state = MemoryPolicyState(clock)
    bucket = Bucket("b", per_minute, capacity)
    start, taken = clock.now, 0
    for step in steps:
        clock.advance(step)
        wait = await state.take([bucket])
        if wait == 0.0:
            taken += 1
            assert taken <= capacity + (clock.now - start) * per_minute / 60 + 1e-9
        else:
            # The wait it names is enough, and not much more than needed.
            clock.advance(wait * (1 + 1e-9))
            assert await state.take([bucket]) == 0.0
            taken += 1
    assert taken >= min(len(steps), capacity)


# -- the breaker counts the capability's failures, not one instance's (reach.policy.breaker) ----


async def test_one_instance_failing_among_three_never_opens_the_breaker(
    state: MemoryPolicyState,
) -> None:
    need = quorum("a", ["a", "b", "c"], ejected=[])
    assert need == 2
    for _ in range(10):  # a stopped agent's calls time out together: a run of one instance
        view = await state.record("cap", "a", False, BREAKER, NO_OUTLIER, quorum=need)
    assert view.breaker == BreakerView("closed", 10)
    # A second instance failing in the same run: most of the capability fails, it opens.
    view = await state.record("cap", "b", False, BREAKER, NO_OUTLIER, quorum=need)
    assert view.breaker.status == "open"


async def test_a_window_opens_only_on_failures_from_most_instances(
    state: MemoryPolicyState,
) -> None:
    windowed = CircuitBreakerSettings(error_threshold=3, window=5, open_duration_ms=10_000)
    for ok, instance in [(False, "a"), (True, "b"), (False, "a"), (False, "a"), (False, "a")]:
        view = await state.record("cap", instance, ok, windowed, NO_OUTLIER, quorum=2)
    assert view.breaker == BreakerView("closed", 4)
    # "b" fails: four of the last five failed, from two instances.
    view = await state.record("cap", "b", False, windowed, NO_OUTLIER, quorum=2)
    assert view.breaker.status == "open"


async def test_an_ejected_instance_s_outcomes_are_its_own(state: MemoryPolicyState) -> None:
    # Its ejection has taken it out of routing; its stragglers' failures say nothing of the rest.
    assert quorum("a", ["a", "b"], ejected=["a"]) == IGNORED
    for _ in range(5):
        view = await state.record("cap", "a", False, BREAKER, OUTLIER, quorum=IGNORED)
    assert view.breaker == BreakerView()
    assert "a" in view.ejected  # ejection still counts them


async def test_a_lone_instance_opens_it_as_before(state: MemoryPolicyState) -> None:
    for routable, ejected in ([["a"], []], [["a"], ["a"]], [[], []]):
        assert quorum("a", routable, ejected) == 1  # the last routable one is never skipped
    view = await fail(state, 3)
    assert view.breaker.status == "open"


def test_failures_of_instances_routing_no_longer_serves_from_leave_the_quorum() -> None:
    # f-00 failed 3 times (ejected), left, and came back under a fresh id, f-03, which fails.
    serves = serving(["f-01", "f-02", "f-03"], ejected=[])
    need = quorum("f-03", ["f-01", "f-02", "f-03"], ejected=[])
    who = ["f-00", "f-03"]
    assert trips(4, who, 3, need)  # the count alone: two instances' of three
    assert departed(who, serves) == ["f-00"]
    assert not trips(4, ["f-03"], 3, need)  # one agent's: the breaker stays closed
    assert trips(5, ["f-03", "f-01"], 3, need)  # a second one serving fails: it opens
    assert departed(["b", "x", "b", "a", GONE], ["b"]) == ["a", "x"]
    assert departed(who, []) == []  # routing could not say: everyone's failures count
    # In a window a departed instance's failure stays a failure, nobody's.
    assert trips(3, [GONE, GONE, "a"], 3, 1)
    assert not trips(3, [GONE, GONE, "a"], 3, 2)


@pytest.mark.parametrize("window", [0, 5])
async def test_one_agent_restarted_under_a_fresh_id_does_not_open_it(
    state: MemoryPolicyState, window: int
) -> None:
    breaker = CircuitBreakerSettings(error_threshold=3, window=window, open_duration_ms=10_000)
    before, after = ["f-00", "f-01", "f-02"], ["f-01", "f-02", "f-03"]
    for _ in range(3):
        view = await state.record(
            "cap", "f-00", False, breaker, NO_OUTLIER, quorum=2, serving=before
        )
    assert view.breaker == BreakerView("closed", 3)
    view = await state.record("cap", "f-03", False, breaker, NO_OUTLIER, quorum=2, serving=after)
    assert view.breaker == BreakerView("closed", 4)
    # f-00's failures still count toward the threshold; a second instance serving fails: open.
    view = await state.record("cap", "f-01", False, breaker, NO_OUTLIER, quorum=2, serving=after)
    assert view.breaker.status == "open"


@given(
    routable=st.lists(st.sampled_from("abcdef"), unique=True, max_size=6),
    ejected=st.lists(st.sampled_from("abcdef"), unique=True, max_size=6),
    instance=st.sampled_from("abcdef"),
)
def test_the_breaker_needs_most_of_the_instances_routing_serves_from(
    routable: list[str], ejected: list[str], instance: str
) -> None:
    need = quorum(instance, routable, ejected)
    serves = serving(routable, ejected)
    if not serves:
        assert need == 1
    elif instance not in serves:
        assert need == IGNORED
    else:
        # More than half of them, so one instance among two or more can never open it alone.
        assert len(serves) / 2 < need <= len(serves)
        assert not trips(100, [instance], 3, need) or len(serves) == 1


@settings(max_examples=200)
@given(
    outcomes=st.lists(
        st.tuples(st.sampled_from("abc"), st.booleans(), st.sampled_from(["", "abc", "ab", "bc"])),
        max_size=40,
    ),
    window=st.sampled_from([0, 3, 6]),
    need=st.integers(0, 3),
)
async def test_an_open_breaker_always_had_failures_from_enough_instances(
    outcomes: list[tuple[str, bool, str]], window: int, need: int
) -> None:
    state = MemoryPolicyState(Clock())
    breaker = CircuitBreakerSettings(error_threshold=min(3, window or 3), window=window)
    failed: list[str] = []
    for instance, ok, serves in outcomes:
        view = await state.record(
            "cap", instance, ok, breaker, NO_OUTLIER, quorum=need, serving=list(serves)
        )
        if need == IGNORED:
            assert view.breaker == BreakerView()
            continue
        failed = [] if ok and not window else failed + ([] if ok else [instance])
        if view.breaker.status == "open":
            # ... of instances routing served from when it opened ("": it could not say).
            assert len({i for i in failed if i in serves or not serves}) >= need
            break
