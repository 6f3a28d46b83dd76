"""A failed answer from the agent (a 5xx: it ran) to a keyless write is reported `retryable:
false` (issue 25): the caller was told `true` though the agent had run it and Reach itself would
not retry it. An idempotent or keyed request keeps the flag (a repeat is harmless or replays),
and an agent's 429, a refusal, says it did not run. A keyless write whose connection broke
after it was sent is no longer told to add an idempotency_key (a new key lets it run twice)."""

from __future__ import annotations

from reach.errors import AgentFault
from reach.invocation import CallPlan
from reach.messages import ErrorInfo
from reach.policy import Attempts, Failure, GiveUp, after_failure


def plan(*, idempotent: bool) -> CallPlan:
    return CallPlan.model_validate(
        {
            "timeout_ms": 60_000,
            "idempotent": idempotent,
            "max_retries": 2 if idempotent else 0,
            "backoff_base_ms": 1000,
        }
    )


def answered(status: int | None) -> Failure:
    fault = AgentFault(type="boom", message="it broke", status=status)
    error = ErrorInfo(
        type="agent_error", message=f"agent kr-1 answered {status}", retryable=True, agent=fault
    )
    return Failure(error, "kr-1")


def report(p: CallPlan, failure: Failure, *, keyed: bool = False) -> ErrorInfo:
    step, _ = after_failure(
        p, Attempts(number=3), failure, keyed=keyed, now_ms=0, deadline_ms=60_000
    )
    assert isinstance(step, GiveUp), step
    assert step.report is not None, step
    return step.report.error


def test_a_keyless_write_the_agent_answered_5xx_is_not_retryable() -> None:
    for status in (500, 502, 503, None):
        error = report(plan(idempotent=False), answered(status))
        assert error.retryable is False, error
        assert "the agent answered, so it ran" in error.message, error
        assert "may run twice" in error.message, error
        assert error.agent is not None
        assert error.agent.type == "boom"


def test_an_idempotent_or_keyed_request_keeps_its_retryable_flag() -> None:
    assert report(plan(idempotent=True), answered(503)).retryable is True
    assert report(plan(idempotent=False), answered(503), keyed=True).retryable is True


def test_an_agent_s_429_refusal_says_it_did_not_run() -> None:
    assert report(plan(idempotent=False), answered(429)).retryable is True


def test_a_failure_before_the_agent_answered_keeps_its_flag() -> None:
    unsent = Failure(ErrorInfo(type="transport_error", message="refused", retryable=True), "kr-1")
    assert report(plan(idempotent=False), unsent).retryable is True


def test_a_keyless_write_whose_line_broke_is_not_told_to_add_a_key() -> None:
    broke = Failure(
        ErrorInfo(type="transport_error", message="reset", retryable=True, outcome_unknown=True),
        "kr-1",
    )
    # Past its re-deliveries (the deadline too close for another): the unknown is the report.
    step, _ = after_failure(
        plan(idempotent=False),
        Attempts(redeliveries=3),
        broke,
        keyed=False,
        now_ms=0,
        deadline_ms=60_000,
    )
    assert isinstance(step, GiveUp), step
    assert step.report is not None, step
    error = step.report.error
    assert (error.retryable, error.outcome_unknown) == (False, True), error
    assert "idempotency_key to be safe" not in error.message, error
    assert "agent kr-1 may have run it" in error.message, error
    assert "sent again, it may run twice" in error.message, error
