"""Authorization per operation (R19): which caller may invoke which operation of a capability.

A rule applies to a request when its `caller` is the caller or `*` and its `target_capability`
is the capability or `*`. Then, over every applicable rule:

1. No rules configured at all: allowed (the gateway's token check is the only guard).
2. Deny wins: an applicable rule listing the operation (or `*`) in `denied_operations` denies,
   whatever any other rule allows.
3. Otherwise an applicable rule listing the operation (or `*`) in `allowed_operations` allows; the
   most specific one is named and its `rate_limit_per_minute` applies. Most specific: exact caller
   and capability, then exact caller with `*` capability, then `*` caller with exact capability,
   then `*` for both (a caller's own grant is the deliberate one); within that, a rule naming the
   operation beats a rule allowing `*`; then the first in configuration order.
4. Otherwise denied: once rules exist, what none allows is denied.

`RuleBook.decide` is pure and runs per request: the rules are indexed once by (caller,
capability), so a decision looks at the applicable rules only, and decisions are memoised.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Final

from reach.config import RuleSettings

__all__ = ["Decision", "RuleBook", "validate_rules"]

WILDCARD: Final = "*"
_MEMO_SIZE: Final = 4096


@dataclass(frozen=True)
class Decision:
    allowed: bool
    rule: str | None
    reason: str
    rate_limit_per_minute: float | None = None


@dataclass(frozen=True)
class _Rule:
    label: str
    order: int
    allowed: frozenset[str]
    denied: frozenset[str]
    rate_limit_per_minute: float | None

    @classmethod
    def of(cls, rule: RuleSettings, order: int) -> _Rule:
        return cls(
            label=rule.label,
            order=order,
            allowed=frozenset(rule.allowed_operations),
            # Denials match in any case: `DELETE_INDEX` is denied with `delete_index`.
            denied=frozenset(op.casefold() for op in rule.denied_operations),
            rate_limit_per_minute=rule.rate_limit_per_minute,
        )


_NO_RULES: Final = Decision(allowed=True, rule=None, reason="no rules")


class RuleBook:
    """The configured rules, indexed; `decide()` answers one request."""

    def __init__(self, rules: Sequence[RuleSettings]) -> None:
        self.rules: tuple[RuleSettings, ...] = tuple(rules)
        self._index: dict[tuple[str, str], list[_Rule]] = {}
        for order, rule in enumerate(self.rules):
            key = (rule.caller, rule.target_capability)
            self._index.setdefault(key, []).append(_Rule.of(rule, order))
        self._memo: dict[tuple[str, str, str], Decision] = {}

    def __len__(self) -> int:
        return len(self.rules)

    def decide(self, caller: str, capability: str, operation: str) -> Decision:
        if not self.rules:
            return _NO_RULES
        key = (caller, capability, operation)
        decision = self._memo.get(key)
        if decision is None:
            decision = self._decide(caller, capability, operation)
            if len(self._memo) >= _MEMO_SIZE:
                self._memo.clear()  # names chosen by callers must not grow this forever
            self._memo[key] = decision
        return decision

    def _decide(self, caller: str, capability: str, operation: str) -> Decision:
        best: _Rule | None = None
        best_rank: tuple[int, int, int] | None = None
        # Most specific first: the tier is part of each allowing rule's rank.
        tiers = (
            (caller, capability),
            (caller, WILDCARD),
            (WILDCARD, capability),
            (WILDCARD, WILDCARD),
        )
        seen: set[tuple[str, str]] = set()
        for tier, pair in enumerate(tiers):
            if pair in seen:  # the caller or the capability is itself "*"
                continue
            seen.add(pair)
            for rule in self._index.get(pair, ()):
                if operation.casefold() in rule.denied or WILDCARD in rule.denied:
                    return Decision(
                        allowed=False,
                        rule=rule.label,
                        reason=f"operation '{operation}' is denied to caller '{caller}' on "
                        f"'{capability}' by rule '{rule.label}'",
                    )
                if operation in rule.allowed:
                    rank = (tier, 0, rule.order)
                elif WILDCARD in rule.allowed:
                    rank = (tier, 1, rule.order)
                else:
                    continue
                if best_rank is None or rank < best_rank:
                    best, best_rank = rule, rank
        if best is None:
            return Decision(
                allowed=False,
                rule=None,
                reason=f"no rule allows operation '{operation}' for caller '{caller}' on "
                f"'{capability}' (rules exist, so what none allows is denied)",
            )
        return Decision(
            allowed=True,
            rule=best.label,
            reason=f"operation '{operation}' is allowed to caller '{caller}' on '{capability}' "
            f"by rule '{best.label}'",
            rate_limit_per_minute=best.rate_limit_per_minute,
        )


def validate_rules(rules: Sequence[RuleSettings]) -> list[str]:
    """Warnings about rules that work but likely not as meant (none stops the gateway)."""
    problems: list[str] = []
    first_at: dict[str, int] = {}
    for number, rule in enumerate(rules, start=1):
        label = rule.label
        if label in first_at:
            problems.append(
                f"rules {first_at[label]} and {number} are both labelled '{label}': "
                "403s and audit records cannot tell them apart"
            )
        else:
            first_at[label] = number
        both = sorted(set(rule.allowed_operations) & set(rule.denied_operations))
        if both:
            names = ", ".join(f"'{op}'" for op in both)
            problems.append(f"rule '{label}' both allows and denies {names}: deny wins")
        if not rule.allowed_operations and not rule.denied_operations:
            problems.append(
                f"rule '{label}' lists no operations: it allows nothing (a rule with `*` in "
                "allowed_operations allows every operation)"
            )
    return problems
