from __future__ import annotations

from reach.config import OperationSettings, PolicySettings
from reach.policy import GiveUp, Retry, next_step, plan_call


def plan(operation: str, key: str | None = None, timeout_ms: int | None = None) -> object:
    policy = PolicySettings(
        operations={
            "knowledge-retriever:query": OperationSettings(timeout_ms=3000),
            "content-generator:generate": OperationSettings(timeout_ms=30000),
            "indexer:rebuild": OperationSettings(idempotent=True),
        }
    )
    capability = {"query": "knowledge-retriever", "generate": "content-generator"}.get(
        operation, "indexer"
    )
    return plan_call(
        policy,
        capability=capability,
        operation=operation,
        timeout_ms=timeout_ms,
        idempotency_key=key,
    )


def test_idempotent_operations_retry_twice_others_never() -> None:
    q = plan_call(
        PolicySettings(), capability="c", operation="query", timeout_ms=None, idempotency_key=None
    )
    assert (q.idempotent, q.max_retries) == (True, 2)
    w = plan_call(
        PolicySettings(), capability="c", operation="create", timeout_ms=None, idempotency_key=None
    )
    assert (w.idempotent, w.max_retries) == (False, 0)
    keyed = plan_call(
        PolicySettings(), capability="c", operation="create", timeout_ms=None, idempotency_key="k"
    )
    assert keyed.max_retries == 2


def test_per_operation_timeouts_and_declared_idempotency() -> None:
    assert plan("query").timeout_ms == 3000  # type: ignore[attr-defined]
    assert plan("generate").timeout_ms == 30000  # type: ignore[attr-defined]
    assert plan("other").timeout_ms == 5000  # type: ignore[attr-defined]
    assert plan("query", timeout_ms=1).timeout_ms == 1  # type: ignore[attr-defined]
    assert plan("rebuild").idempotent is True  # type: ignore[attr-defined]


def test_backoff_is_1_2_4_seconds_then_gives_up() -> None:
    p = plan_call(
        PolicySettings(default_retry=3),
        capability="c",
        operation="query",
        timeout_ms=60_000,
        idempotency_key=None,
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


def test_no_retry_for_permanent_errors_or_without_time() -> None:
    p = plan_call(
        PolicySettings(), capability="c", operation="query", timeout_ms=5000, idempotency_key=None
    )
    assert isinstance(
        next_step(p, attempt=1, retryable=False, failed_instance=None, now_ms=0, deadline_ms=5000),
        GiveUp,
    )
    late = next_step(
        p, attempt=1, retryable=True, failed_instance=None, now_ms=4500, deadline_ms=5000
    )
    assert isinstance(late, GiveUp)
    assert "deadline" in late.reason
