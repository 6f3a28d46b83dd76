"""What a timed-out request that may have run tells its caller agrees with its `retryable:
false`: it said "repeating it is safe" beside that flag, and advised a keyless write to be
repeated with an idempotency_key (a new key lets it run a second time)."""

from __future__ import annotations

import itertools

from reach.outcome import may_have_run


def test_no_advice_calls_a_repeat_safe_beside_retryable_false() -> None:
    for idempotent, keyed in itertools.product((False, True), repeat=2):
        said = may_have_run("agent kr-1", idempotent=idempotent, keyed=keyed)
        assert said.startswith("agent kr-1 may have run it, so it is not retryable"), said
        assert "safe" not in said, said
        assert "repeat it with an idempotency_key" not in said, said


def test_a_keyed_request_is_told_its_key_keeps_this_answer() -> None:
    for idempotent in (False, True):
        said = may_have_run("agent kr-1", idempotent=idempotent, keyed=True)
        assert "sent again with the same idempotency_key it is not run again" in said


def test_a_keyless_write_is_told_it_may_run_twice() -> None:
    said = may_have_run("the agent it was sent to", idempotent=False, keyed=False)
    assert "sent again, it may run twice" in said
    assert "Find out whether it ran first" in said


def test_an_idempotent_read_is_left_to_its_caller_to_judge() -> None:
    said = may_have_run("agent kr-1", idempotent=True, keyed=False)
    assert "declared idempotent" in said
    assert "yours to judge before sending it again" in said
