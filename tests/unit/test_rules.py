"""Authorization per operation (R19): the decision, and the warnings about odd rules."""

from __future__ import annotations

from typing import Any

import pytest

from reach.config import RuleSettings
from reach.security.rules import Decision, RuleBook, validate_rules


def rule(caller: str, capability: str, **kwargs: Any) -> RuleSettings:
    return RuleSettings(caller=caller, target_capability=capability, **kwargs)


R19 = rule(
    "orchestrator",
    "knowledge-retriever",
    name="orchestrator-kr",
    allowed_operations=["query", "get_metadata"],
    denied_operations=["delete_index", "rebuild_index"],
    rate_limit_per_minute=600,
)


def test_no_rules_allow_everything() -> None:
    assert RuleBook([]).decide("anyone", "anything", "whatever") == Decision(
        allowed=True, rule=None, reason="no rules"
    )


def test_an_allowed_operation_passes_with_its_rate_limit() -> None:
    decision = RuleBook([R19]).decide("orchestrator", "knowledge-retriever", "query")
    assert decision.allowed
    assert decision.rule == "orchestrator-kr"
    assert decision.rate_limit_per_minute == 600


def test_a_denied_operation_names_the_rule() -> None:
    decision = RuleBook([R19]).decide("orchestrator", "knowledge-retriever", "delete_index")
    assert not decision.allowed
    assert decision.rule == "orchestrator-kr"
    assert decision.reason == (
        "operation 'delete_index' is denied to caller 'orchestrator' on 'knowledge-retriever' "
        "by rule 'orchestrator-kr'"
    )
    assert decision.rate_limit_per_minute is None


@pytest.mark.parametrize(
    ("caller", "capability", "operation"),
    [
        ("orchestrator", "knowledge-retriever", "export"),  # an unlisted operation
        ("someone-else", "knowledge-retriever", "query"),  # no rule for this caller
        ("orchestrator", "content-generator", "generate"),  # nor for this capability
    ],
)
def test_what_no_rule_allows_is_denied_once_rules_exist(
    caller: str, capability: str, operation: str
) -> None:
    decision = RuleBook([R19]).decide(caller, capability, operation)
    assert not decision.allowed
    assert decision.rule is None
    assert decision.reason == (
        f"no rule allows operation '{operation}' for caller '{caller}' on '{capability}' "
        "(rules exist, so what none allows is denied)"
    )


def test_the_label_of_an_unnamed_rule() -> None:
    book = RuleBook([rule("a", "b", denied_operations=["x"])])
    assert book.decide("a", "b", "x").rule == "a->b"


def test_deny_wins_across_rules() -> None:
    book = RuleBook(
        [
            rule("orchestrator", "knowledge-retriever", name="allow", allowed_operations=["*"]),
            rule("*", "*", name="never-drop", denied_operations=["drop"]),
        ]
    )
    assert book.decide("orchestrator", "knowledge-retriever", "query").allowed
    decision = book.decide("orchestrator", "knowledge-retriever", "drop")
    assert (decision.allowed, decision.rule) == (False, "never-drop")


def test_deny_wins_within_one_rule_and_star_denies_all() -> None:
    book = RuleBook(
        [
            rule("a", "b", name="both", allowed_operations=["x"], denied_operations=["x"]),
            rule("c", "d", name="closed", allowed_operations=["y"], denied_operations=["*"]),
        ]
    )
    assert not book.decide("a", "b", "x").allowed
    assert book.decide("c", "d", "y").rule == "closed"
    assert not book.decide("c", "d", "y").allowed


def test_wildcard_caller_and_capability() -> None:
    book = RuleBook(
        [
            rule("*", "health", name="anyone-health", allowed_operations=["ping"]),
            rule("admin", "*", name="admin-all", allowed_operations=["*"]),
        ]
    )
    assert book.decide("whoever", "health", "ping").rule == "anyone-health"
    assert not book.decide("whoever", "health", "reset").allowed
    assert book.decide("admin", "anything", "reset").rule == "admin-all"
    assert not book.decide("whoever", "anything", "reset").allowed


@pytest.mark.parametrize(
    ("caller", "capability", "expected_rule", "expected_limit"),
    [
        ("orchestrator", "kr", "exact", 600),
        ("orchestrator", "other", "caller-any", 300),
        ("someone", "kr", "any-kr", 60),
        ("someone", "other", "any-any", 6),
    ],
)
def test_the_most_specific_rule_sets_the_rate_limit(
    caller: str, capability: str, expected_rule: str, expected_limit: float
) -> None:
    # Listed least specific first: the order of the configuration does not decide.
    book = RuleBook(
        [
            rule("*", "*", name="any-any", allowed_operations=["query"], rate_limit_per_minute=6),
            rule("*", "kr", name="any-kr", allowed_operations=["query"], rate_limit_per_minute=60),
            rule(
                "orchestrator",
                "*",
                name="caller-any",
                allowed_operations=["query"],
                rate_limit_per_minute=300,
            ),
            rule(
                "orchestrator",
                "kr",
                name="exact",
                allowed_operations=["query"],
                rate_limit_per_minute=600,
            ),
        ]
    )
    decision = book.decide(caller, capability, "query")
    assert decision.allowed
    assert (decision.rule, decision.rate_limit_per_minute) == (expected_rule, expected_limit)


def test_a_named_operation_beats_a_star_at_the_same_specificity() -> None:
    book = RuleBook(
        [
            rule("a", "b", name="star", allowed_operations=["*"], rate_limit_per_minute=10),
            rule("a", "b", name="named", allowed_operations=["q"], rate_limit_per_minute=1),
        ]
    )
    assert book.decide("a", "b", "q").rule == "named"
    assert book.decide("a", "b", "other").rule == "star"


def test_the_first_rule_wins_a_tie() -> None:
    book = RuleBook(
        [
            rule("a", "b", name="first", allowed_operations=["q"]),
            rule("a", "b", name="second", allowed_operations=["q"]),
        ]
    )
    assert book.decide("a", "b", "q").rule == "first"


def test_decisions_are_memoised_and_bounded() -> None:
    book = RuleBook([R19])
    assert book.decide("orchestrator", "knowledge-retriever", "query") is book.decide(
        "orchestrator", "knowledge-retriever", "query"
    )
    for i in range(10_000):
        book.decide("orchestrator", "knowledge-retriever", f"op{i}")
    assert len(book._memo) <= 4096
    assert len(book) == 1


def test_validate_rules() -> None:
    problems = validate_rules(
        [
            rule("a", "b", name="dup", allowed_operations=["x"]),
            rule("c", "d", name="dup", allowed_operations=["x", "y"], denied_operations=["y"]),
            rule("e", "f"),
            rule("e", "f", allowed_operations=["z"]),
        ]
    )
    assert problems == [
        "rules 1 and 2 are both labelled 'dup': 403s and audit records cannot tell them apart",
        "rule 'dup' both allows and denies 'y': deny wins",
        "rule 'e->f' lists no operations: it allows nothing (a rule with `*` in "
        "allowed_operations allows every operation)",
        "rules 3 and 4 are both labelled 'e->f': 403s and audit records cannot tell them apart",
    ]
    assert validate_rules([R19]) == []


def test_a_denial_matches_in_any_case() -> None:
    book = RuleBook(
        [
            RuleSettings(
                caller="orchestrator",
                target_capability="kr",
                allowed_operations=["*"],
                denied_operations=["delete_index"],
            )
        ]
    )
    for op in ("delete_index", "DELETE_INDEX", "Delete_Index"):
        assert not book.decide("orchestrator", "kr", op).allowed
    assert book.decide("orchestrator", "kr", "query").allowed
