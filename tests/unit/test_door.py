"""The door's chain without Temporal: its order, and each step's refusal.

The engine, registry and policy state here are fakes of the few calls the steps make; the
chain and every step are the real ones (`gateway_api.door`, `gateway_api.steps`). Against a
real dev server the same door runs in tests/integration/test_invoke.py and test_door.py.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import pytest
from temporalio.service import RPCError, RPCStatusCode

from gateway_api.door import Door
from gateway_api.front import Bytes
from gateway_api.live import Live
from gateway_api.steps.account import Ledger
from gateway_api.steps.identify import identify
from gateway_api.steps.known import Capabilities
from gateway_api.steps.limits import Limiter
from gateway_api.steps.route import FirstRoute
from gateway_api.steps.wait import Verdicts
from reach.config import ReachSettings
from reach.errors import (
    Forbidden,
    InternalError,
    InvalidRequest,
    RateLimited,
    RequestConflict,
    Unavailable,
    UnknownCapability,
)
from reach.invocation import BucketPlan, InvokeInput
from reach.messages import InvokeResponse, dumps
from reach.security.rules import Decision, RuleBook

TRACE = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"


@dataclass
class Handle:
    id: str


@dataclass
class Engine:
    """What the steps ask of Temporal: start, exists, the first input, the outcome."""

    existing: dict[str, InvokeInput] = field(default_factory=dict)
    started: list[InvokeInput] = field(default_factory=list)
    exists_asked: list[str] = field(default_factory=list)
    # A start whose answer is lost: it raises this after starting (or not: `lost_before`).
    lost: RPCError | None = None
    lost_before: bool = False
    describe_fails: bool = False

    def handle(self, request_id: str) -> Handle:
        return Handle(request_id)

    async def start(self, inp: InvokeInput) -> tuple[Handle, bool]:
        if self.lost is not None and self.lost_before:
            raise self.lost
        if inp.request_id in self.existing:
            return Handle(inp.request_id), False
        self.started.append(inp)
        self.existing[inp.request_id] = inp
        if self.lost is not None:
            raise self.lost
        return Handle(inp.request_id), True

    async def exists(self, request_id: str) -> bool:
        self.exists_asked.append(request_id)
        if self.describe_fails:
            raise RPCError("connection refused", RPCStatusCode.UNAVAILABLE, b"")
        return request_id in self.existing

    async def original(self, handle: Handle) -> InvokeInput | None:
        return self.existing.get(handle.id)

    async def outcome(self, handle: Handle, rpc_timeout: Any = None) -> InvokeResponse:
        return InvokeResponse(request_id=handle.id, status="success", result={"ok": True})


class Registry:
    def __init__(self, *known: str) -> None:
        self.names = set(known)

    async def known(self, capability: str) -> bool:
        return capability in self.names

    def on_change(self, listener: object) -> None:
        pass

    async def instances(self, capability: str) -> list[SimpleNamespace]:
        return [SimpleNamespace(operations=["query"])] if capability in self.names else []


@dataclass
class State:
    held: dict[str, str] = field(default_factory=dict)

    async def peek(self, scope: str) -> str | None:
        return self.held.get(scope)


@dataclass
class Policy:
    """A limiter that gives `wait_s` for every bucket taken (0: a token)."""

    wait_s: float = 0.0
    taken: list[list[str]] = field(default_factory=list)
    state: State = field(default_factory=State)

    async def take(self, buckets: Sequence[BucketPlan]) -> float:
        self.taken.append([b.key for b in buckets])
        return self.wait_s


class Audit:
    def __init__(self) -> None:
        self.records: list[tuple[str, dict[str, Any]]] = []

    def record(self, event: str, /, **fields: Any) -> None:
        self.records.append((event, fields))


class Guard:
    """The guard's rules and audit (tokens are reach.security.auth's, tested on their own)."""

    def __init__(self, rules: list[dict[str, Any]]) -> None:
        from reach.config import RuleSettings
        from reach.security.refusals import DoorRefusals

        self.rules = RuleBook([RuleSettings.model_validate(r) for r in rules])
        self.audit = Audit()
        self.auth = None
        self.refusals = DoorRefusals()

    def decide(
        self, caller: str, capability: str, operation: str, request_id: str | None = None
    ) -> Decision:
        decision = self.rules.decide(caller, capability, operation)
        if not decision.allowed:
            self.audit.record("denied", request_id=request_id, caller=caller, rule=decision.rule)
            raise Forbidden(decision.reason)
        return decision


class Metrics:
    def __init__(self) -> None:
        self.invokes: list[tuple[str, str, str, str]] = []

    def invoke(self, capability: str, operation: str, status: str, error: str, s: float) -> None:
        self.invokes.append((capability, operation, status, error))

    def accepted(self, capability: str, seconds: float) -> None:
        pass

    def rate_limited(self, capability: str, outcome: str) -> None:
        pass


class Front:
    def __init__(self) -> None:
        self.named_as: list[tuple[str, str]] = []

    async def named(self, request_id: str, caller: str) -> None:
        self.named_as.append((request_id, caller))


@dataclass
class Stack:
    door: Door
    engine: Engine
    policy: Policy
    metrics: Metrics
    front: Front = field(default_factory=Front)

    async def invoke(self, body: dict[str, Any], **metadata: str) -> InvokeResponse:
        headers = {name.replace("_", "-"): value for name, value in metadata.items()}
        return await self.door.invoke(headers, Bytes(dumps(body)), self.front)


def stack(
    *known: str,
    guard: Guard | None = None,
    settings: ReachSettings | None = None,
    policy: Policy | None = None,
) -> Stack:
    engine, metrics, policy = Engine(), Metrics(), policy or Policy()
    capabilities = Capabilities(Registry(*known))  # type: ignore[arg-type]
    door = Door(
        Live(settings or ReachSettings()),
        engine,  # type: ignore[arg-type]
        capabilities,
        Limiter(policy, engine, metrics),  # type: ignore[arg-type]
        FirstRoute(None, calls_here=False),
        Verdicts(engine, None),  # type: ignore[arg-type]
        guard,  # type: ignore[arg-type]
        metrics,  # type: ignore[arg-type]
    )
    return Stack(door, engine, policy, metrics)


CALL = {"target": "search", "operation": "query", "payload": {"q": "x"}}


async def test_a_call_passes_every_step_and_starts_one_workflow() -> None:
    s = stack("search")
    response = await s.invoke(
        {**CALL, "request_id": "req-1"}, x_reach_caller="alice", traceparent=TRACE
    )
    assert response.status == "success"
    assert s.front.named_as == [("req-1", "alice")]
    [inp] = s.engine.started
    assert (inp.request_id, inp.caller, inp.traceparent) == ("req-1", "alice", TRACE)
    assert inp.deadline_ms - inp.accepted_at_ms == inp.plan.timeout_ms == 5000
    assert s.metrics.invokes == [("search", "query", "success", "")]


async def test_the_rules_decide_before_anything_is_looked_up() -> None:
    """A denied caller is told 403 even for a capability nobody registered: it learns
    nothing of what exists, and no store or engine is asked."""
    guard = Guard([{"caller": "bob", "target_capability": "*", "allowed_operations": ["read"]}])
    s = stack(guard=guard)
    with pytest.raises(Forbidden):
        await s.invoke(CALL, x_reach_caller="mallory")
    assert s.engine.exists_asked == []
    assert s.engine.started == []
    assert [event for event, _ in guard.audit.records] == ["denied"]  # not also an "invoke"


async def test_an_unknown_capability_is_404_unless_the_request_exists() -> None:
    s = stack()
    with pytest.raises(UnknownCapability):
        await s.invoke({**CALL, "request_id": "req-new"})
    assert s.engine.exists_asked == ["req-new"]
    assert s.engine.started == []
    assert s.metrics.invokes == [("_unknown", "_unknown", "error", "unknown_capability")]


async def test_a_repeat_attaches_and_one_that_asks_otherwise_is_409() -> None:
    s = stack("search")
    await s.invoke({**CALL, "request_id": "req-2"}, x_reach_caller="alice")
    again = await s.invoke({**CALL, "request_id": "req-2"}, x_reach_caller="alice")
    assert again.status == "success"
    assert len(s.engine.started) == 1
    with pytest.raises(RequestConflict, match="another body"):
        await s.invoke(
            {**CALL, "request_id": "req-2", "payload": {"q": "y"}}, x_reach_caller="alice"
        )
    # Another caller's RequestID: taken, and nothing more is said of it.
    with pytest.raises(RequestConflict, match="is taken") as taken:
        await s.invoke({**CALL, "request_id": "req-2"}, x_reach_caller="bob")
    assert "alice" not in taken.value.message


async def test_a_callback_to_a_forbidden_address_is_refused_before_the_start() -> None:
    s = stack("search")
    with pytest.raises(InvalidRequest, match=r"callback 'http://169\.254\.169\.254/cb'"):
        await s.invoke({**CALL, "callback": "http://169.254.169.254/cb"})
    assert s.engine.started == []


async def test_a_rate_limit_refuses_with_retry_after_but_never_a_repeat() -> None:
    settings = ReachSettings.model_validate(
        {"policy": {"rate_limit": {"per_caller": {"per_minute": 1}}}}
    )
    s = stack("search", settings=settings, policy=Policy(wait_s=2.5))
    with pytest.raises(RateLimited) as refused:
        await s.invoke({**CALL, "request_id": "req-3"})
    assert refused.value.retry_after_s == 3
    assert s.engine.started == []
    # The same request id, once it exists, calls no agent: the limit does not apply.
    s.engine.existing["req-3"] = await _input_of(s, "req-3")
    assert (await s.invoke({**CALL, "request_id": "req-3"})).status == "success"


async def test_a_rule_rate_limit_takes_its_own_bucket() -> None:
    guard = Guard(
        [
            {
                "name": "slow",
                "caller": "alice",
                "target_capability": "search",
                "allowed_operations": ["query"],
                "rate_limit_per_minute": 60,
            }
        ]
    )
    s = stack("search", guard=guard)
    await s.invoke(CALL, x_reach_caller="alice")
    assert s.policy.taken == [["rule:slow:search:alice"]]
    [(event, fields)] = guard.audit.records
    assert event == "invoke"
    assert fields["rule"] == "slow"
    assert fields["outcome"] == "success"


async def test_the_metadata_is_read_once_with_the_same_rules_for_every_front() -> None:
    assert identify({}, None).caller == "anonymous"
    found = identify({"x-reach-caller": "alice", "idempotency-key": "k-1"}, None)
    assert (found.caller, found.idempotency_key, found.traceparent) == ("alice", "k-1", None)
    with pytest.raises(InvalidRequest, match="traceparent"):
        identify({"traceparent": "not-one"}, None)
    with pytest.raises(InvalidRequest, match="X-Reach-Caller"):
        identify({"x-reach-caller": "two words"}, None)


async def test_a_refusal_inside_is_accounted_once() -> None:
    metrics = Metrics()
    request = (await _accepted("search")).model_copy()
    ledger = Ledger(request, "alice", None, metrics, Capabilities(Registry("search")))  # type: ignore[arg-type]
    await ledger.refused(InternalError("x"))
    await ledger.refused(RuntimeError("a bug"))  # the front's last resort counts nothing
    assert metrics.invokes == [("search", "query", "error", "internal")]


async def _accepted(target: str) -> Any:
    from gateway_api.steps.accept import accept

    request, _ = accept(
        dumps({**CALL, "target": target}), Live(ReachSettings()).limits, identify({}, None)
    )
    return request


async def _input_of(s: Stack, request_id: str) -> InvokeInput:
    """An existing request's input, as the door would have started it (limits off)."""
    other = stack("search")
    await other.invoke({**CALL, "request_id": request_id})
    return other.engine.started[0]


TIMED_OUT = RPCError("deadline exceeded", RPCStatusCode.DEADLINE_EXCEEDED, b"")


async def test_a_start_whose_answer_was_lost_goes_on_when_the_request_exists() -> None:
    s = stack("search")
    s.engine.lost = TIMED_OUT
    response = await s.invoke({**CALL, "request_id": "req-lost"})
    assert response.status == "success"
    assert [i.request_id for i in s.engine.started] == ["req-lost"]


async def test_a_start_that_surely_did_not_happen_is_a_plain_503() -> None:
    s = stack("search")
    s.engine.lost, s.engine.lost_before = TIMED_OUT, True
    with pytest.raises(RPCError) as refused:
        await s.invoke({**CALL, "request_id": "req-never"})
    assert refused.value is TIMED_OUT  # the front answers it: 503 unavailable, retryable
    assert s.engine.exists_asked[-1] == "req-never"


async def test_a_start_nobody_can_confirm_says_the_outcome_is_unknown() -> None:
    guard = Guard([{"caller": "*", "target_capability": "*", "allowed_operations": ["*"]}])
    s = stack("search", guard=guard)
    s.engine.lost, s.engine.describe_fails = TIMED_OUT, True
    with pytest.raises(Unavailable) as refused:
        await s.invoke({**CALL, "request_id": "req-maybe"})
    assert refused.value.outcome_unknown is True
    assert "GET /reach/requests/req-maybe" in refused.value.message
    [(event, fields)] = guard.audit.records  # audited, as every refusal after the rules
    assert (event, fields["status"], fields["outcome_unknown"]) == ("invoke", 503, True)


async def test_temporal_trouble_is_audited_as_the_front_answers_it() -> None:
    guard = Guard([{"caller": "*", "target_capability": "*", "allowed_operations": ["*"]}])
    s = stack("search", guard=guard)
    s.engine.lost, s.engine.lost_before = TIMED_OUT, True
    with pytest.raises(RPCError):
        await s.invoke(CALL)
    [(event, fields)] = guard.audit.records
    assert (event, fields["error_type"], fields["status"]) == ("invoke", "unavailable", 503)


async def test_a_refusal_before_the_request_has_an_id_is_audited() -> None:
    """A body that is not JSON (422), one past the limit (413), no room in flight (503):
    refused before the RequestID, each with an audit line naming the caller."""
    from gateway_api.steps.admit import IN_FLIGHT

    guard = Guard([{"caller": "*", "target_capability": "*", "allowed_operations": ["*"]}])
    s = stack("search", guard=guard)
    with pytest.raises(InvalidRequest):
        await s.door.invoke({"x-reach-caller": "alice"}, Bytes(b"{not json"), s.front)
    settings = s.door.live.settings
    held = (IN_FLIGHT.bytes, IN_FLIGHT.requests)
    IN_FLIGHT.bytes, IN_FLIGHT.requests = settings.transport.max_inflight_bytes, 1
    try:
        with pytest.raises(Unavailable, match="max_inflight_bytes"):
            await s.invoke(CALL, x_reach_caller="alice")
    finally:
        IN_FLIGHT.bytes, IN_FLIGHT.requests = held
    refused = [fields for event, fields in guard.audit.records if event == "refused"]
    assert [(r["caller"], r["status"]) for r in refused] == [("alice", 422), ("alice", 503)]
    assert s.engine.started == []


def test_a_grpc_refusal_asks_for_the_wait_http_would() -> None:
    from gateway_api.grpc_wire import PUSHBACK_KEY, Refusal

    refusal = Refusal.of_error(Unavailable("breaker", retry_after_s=10), "req-1")
    _, trailing = refusal.trailers()
    assert dict(trailing)[PUSHBACK_KEY] == "10000"
    _, plain = Refusal.of_error(Unavailable("busy"), "req-2").trailers()
    assert dict(plain)[PUSHBACK_KEY] == "1000"
