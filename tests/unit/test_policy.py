from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from reach.config import (
    CapabilityPolicySettings,
    ConfigError,
    OperationSettings,
    PolicySettings,
    RetrySettings,
    load_settings,
)
from reach.invocation import CallPlan
from reach.policy import GiveUp, Retry, backoff_s, next_step, plan_call, refine_plan
from reach.policy.engine import PolicyEngine
from reach.policy.state import MemoryPolicyState

POLICY = PolicySettings(
    operations={
        "knowledge-retriever:query": OperationSettings(timeout_ms=3000, idempotent=True),
        "content-generator:generate": OperationSettings(timeout_ms=30000),
        "indexer:rebuild": OperationSettings(idempotent=True),
    },
    capabilities={
        "indexer": CapabilityPolicySettings(
            timeout_ms=9000, retry=RetrySettings(max_retries=4, backoff_base_ms=100)
        )
    },
)


def plan(
    capability: str, operation: str, key: str | None = None, timeout_ms: int | None = None
) -> CallPlan:
    return plan_call(
        POLICY,
        capability=capability,
        operation=operation,
        timeout_ms=timeout_ms,
        idempotency_key=key,
    )


def test_only_declared_idempotent_operations_retry_without_a_key() -> None:
    q = plan("knowledge-retriever", "query")
    assert (q.idempotent, q.max_retries) == (True, 2)
    # Nobody declared `query` idempotent for this capability: not retried.
    other = plan("c", "query")
    assert (other.idempotent, other.max_retries, other.idempotent_configured) == (False, 0, False)
    keyed = plan("c", "create", key="k")
    assert (keyed.idempotent, keyed.max_retries) == (False, 2)


def test_deadline_is_the_shorter_of_caller_and_operation() -> None:
    assert plan("knowledge-retriever", "query").timeout_ms == 3000
    assert plan("content-generator", "generate").timeout_ms == 30000
    assert plan("c", "other").timeout_ms == 5000
    assert plan("knowledge-retriever", "query", timeout_ms=1).timeout_ms == 1
    # A caller cannot stretch an operation past its configured timeout (R23).
    assert plan("knowledge-retriever", "query", timeout_ms=60_000).timeout_ms == 3000
    # Without an operation timeout, the caller's own stands, longer than the default too.
    assert plan("c", "other", timeout_ms=60_000).timeout_ms == 60_000


def test_operation_settings_over_capability_settings_over_defaults() -> None:
    rebuild = plan("indexer", "rebuild")
    assert (rebuild.idempotent, rebuild.timeout_ms, rebuild.max_retries) == (True, 9000, 4)
    assert rebuild.backoff_base_ms == 100


def test_backoff_is_1_2_4_seconds_then_gives_up() -> None:
    p = plan_call(
        PolicySettings(default_retry=3),
        capability="knowledge-retriever",
        operation="query",
        timeout_ms=60_000,
        idempotency_key="k",
    )
    delays = []
    for attempt in (1, 2, 3):
        step = next_step(
            p, attempt=attempt, retryable=True, failed_instance="i1", now_ms=0, deadline_ms=60_000
        )
        assert isinstance(step, Retry)
        assert step.avoid_instance == "i1"
        delays.append(step.delay_s)
    assert delays == [1.0, 2.0, 4.0]
    last = next_step(
        p, attempt=4, retryable=True, failed_instance="i1", now_ms=0, deadline_ms=60_000
    )
    assert isinstance(last, GiveUp)


def test_backoff_is_capped_and_jitter_only_shortens() -> None:
    p = CallPlan(
        timeout_ms=1,
        idempotent=True,
        max_retries=9,
        backoff_base_ms=1000,
        backoff_multiplier=3.0,
        backoff_cap_ms=5000,
        jitter=0.5,
    )
    assert [backoff_s(p, a) for a in (1, 2, 3, 4)] == [1.0, 3.0, 5.0, 5.0]
    assert backoff_s(p, 2, rand=0.999) == pytest.approx(1.5015)


def test_plans_recorded_before_exponential_backoff_keep_their_list() -> None:
    old = CallPlan.model_validate(
        {"timeout_ms": 5000, "idempotent": True, "max_retries": 2, "backoff_s": [1, 5]}
    )
    assert [backoff_s(old, a) for a in (1, 2, 3)] == [1.0, 5.0, 5.0]
    # Nothing learnt from agents may change an old plan.
    assert refine_plan(
        old,
        declared_idempotent=False,
        declared_timeout_ms=10,
        accepted_at_ms=0,
        deadline_ms=5000,
    ) == (old, 5000)


def test_no_retry_for_permanent_errors_or_without_time() -> None:
    p = plan("knowledge-retriever", "query", timeout_ms=5000)
    assert isinstance(
        next_step(p, attempt=1, retryable=False, failed_instance=None, now_ms=0, deadline_ms=5000),
        GiveUp,
    )
    late = next_step(
        p, attempt=1, retryable=True, failed_instance=None, now_ms=4500, deadline_ms=5000
    )
    assert isinstance(late, GiveUp)
    assert "deadline" in late.reason
    unsafe = next_step(
        plan("c", "create"),
        attempt=1,
        retryable=True,
        failed_instance=None,
        now_ms=0,
        deadline_ms=5000,
    )
    assert isinstance(unsafe, GiveUp)
    assert "idempotency_key" in unsafe.reason


def test_declarations_fill_what_configuration_left_open() -> None:
    open_plan = plan("c", "query", timeout_ms=60_000)
    refined, deadline = refine_plan(
        open_plan,
        declared_idempotent=True,
        declared_timeout_ms=3000,
        accepted_at_ms=1000,
        deadline_ms=61_000,
    )
    assert (refined.idempotent, refined.max_retries, refined.timeout_ms) == (True, 2, 3000)
    assert deadline == 4000
    # Configuration wins over a declaration.
    configured = plan("knowledge-retriever", "query")
    again, deadline = refine_plan(
        configured,
        declared_idempotent=False,
        declared_timeout_ms=100,
        accepted_at_ms=0,
        deadline_ms=3000,
    )
    assert (again.idempotent, again.max_retries, deadline) == (True, 2, 3000)


def test_a_key_fingerprint_reads_payloads_as_json_does() -> None:
    from reach.invocation import payload_fingerprint as fp

    assert fp({"x": 1, "y": [2.0, {"z": 3}]}) == fp({"y": [2, {"z": 3.0}], "x": 1.0})
    assert fp({"x": 1}) != fp({"x": 1.5})
    assert fp({"x": 1}) != fp({"x": "1"})


def test_a_wrong_policy_field_is_a_start_up_error_naming_it(tmp_path: object) -> None:
    from pathlib import Path

    path = Path(str(tmp_path)) / "reach.yaml"
    path.write_text("reach:\n  policy:\n    circuit_breaker:\n      error_treshold: 3\n")
    with pytest.raises(ConfigError, match=r"policy\.circuit_breaker\.error_treshold"):
        load_settings(path)
    path.write_text("reach:\n  policy:\n    operations:\n      query: {timeout_ms: 5}\n")
    with pytest.raises(ConfigError, match="capability:operation"):
        load_settings(path)
    path.write_text(
        "reach:\n  policy:\n    capabilities:\n      c:\n        rate_limit:\n"
        "          on_limit: wait\n"
    )
    with pytest.raises(ConfigError, match=r"policy\.capabilities\.c\.rate_limit\.on_limit"):
        load_settings(path)
    for field, value in [
        ("idempotency_retention_s", ".inf"),
        ("idempotency_retention_s", "1e300"),
        ("default_timeout_ms", "99999999999999999999"),
    ]:
        path.write_text(f"reach:\n  policy:\n    {field}: {value}\n")
        with pytest.raises(ConfigError, match=rf"policy\.{field}"):
            load_settings(path)


# -- properties ---------------------------------------------------------------------------------

plans = st.builds(
    CallPlan,
    timeout_ms=st.integers(1, 10**7),
    idempotent=st.booleans(),
    max_retries=st.integers(0, 10),
    backoff_base_ms=st.integers(1, 60_000),
    backoff_multiplier=st.floats(1.0, 10.0),
    backoff_cap_ms=st.integers(1, 600_000),
    jitter=st.floats(0.0, 1.0),
)


@given(
    policy_retry=st.integers(0, 10),
    configured=st.sampled_from([None, True, False]),
    declared=st.sampled_from([None, True, False]),
    attempt=st.integers(1, 12),
)
def test_no_plan_ever_retries_a_non_idempotent_keyless_request(
    policy_retry: int, configured: bool | None, declared: bool | None, attempt: int
) -> None:
    policy = PolicySettings(
        default_retry=policy_retry,
        operations={"c:op": OperationSettings(idempotent=configured)},
    )
    p = plan_call(policy, capability="c", operation="op", timeout_ms=None, idempotency_key=None)
    p, deadline = refine_plan(
        p,
        declared_idempotent=declared,
        declared_timeout_ms=None,
        accepted_at_ms=0,
        deadline_ms=10**9,
    )
    step = next_step(
        p, attempt=attempt, retryable=True, failed_instance=None, now_ms=0, deadline_ms=deadline
    )
    if not p.idempotent:
        assert isinstance(step, GiveUp)
    # Idempotent means configured so, or (configuration silent) declared so.
    assert p.idempotent == (configured if configured is not None else bool(declared))


@given(
    p=plans,
    attempt=st.integers(1, 12),
    now_ms=st.integers(0, 10**9),
    left_ms=st.integers(-1000, 10**8),
    rand=st.floats(0.0, 0.999999),
)
def test_a_retry_never_waits_past_the_deadline(
    p: CallPlan, attempt: int, now_ms: int, left_ms: int, rand: float
) -> None:
    step = next_step(
        p,
        attempt=attempt,
        retryable=True,
        failed_instance="i",
        now_ms=now_ms,
        deadline_ms=now_ms + left_ms,
        rand=rand,
    )
    if isinstance(step, Retry):
        assert attempt <= p.max_retries
        # Compared in seconds: a delay at the cap is cap / 1000, and * 1000 back can round up
        # (4001 / 1000 * 1000 == 4001.0000000000005).
        assert 0 < step.delay_s <= p.backoff_cap_ms / 1000
        assert now_ms + step.delay_s * 1000 < now_ms + left_ms


async def test_the_door_waits_for_a_view_gone_stale_in_a_quiet_spell() -> None:
    """A view older than twice refresh_s is not used to route at the door; `settle` waits for
    its re-read (started by `recent_view`), so a gateway called less than once a second still
    routes attempt 1 itself."""
    now = [100.0]
    engine = PolicyEngine(
        PolicySettings(), MemoryPolicyState(), refresh_s=0.5, clock=lambda: now[0]
    )
    assert engine.recent_view("cap") is None  # never read
    await engine.settle("cap", 1.0)
    assert engine.recent_view("cap") is not None
    now[0] += 1.5  # a quiet spell
    assert engine.recent_view("cap") is None
    await engine.settle("cap", 1.0)
    assert engine.recent_view("cap") is not None


async def test_settling_gives_up_on_a_store_that_does_not_answer() -> None:
    class Stalled(MemoryPolicyState):
        async def view(self, capability: str, breaker: Any) -> Any:
            await asyncio.Event().wait()

    engine = PolicyEngine(PolicySettings(), Stalled(), refresh_s=0.5)
    started = time.monotonic()
    await engine.settle("cap", 0.05)
    assert time.monotonic() - started < 5.0
    assert engine.recent_view("cap") is None  # left to the workflow, as before
