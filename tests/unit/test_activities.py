"""The resolve activity's decisions, run in the SDK's ActivityEnvironment over the memory store,
and the same decision made at the door for attempt 1 (`Resolver.first`, `check_first`)."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
from temporalio.exceptions import ApplicationError
from temporalio.testing import ActivityEnvironment

from activities import ReachActivities
from connectors import ConnectorSet
from reach.config import (
    CircuitBreakerSettings,
    OutlierSettings,
    PolicySettings,
    RegistrySettings,
    RoutingSettings,
)
from reach.errors import TransportError
from reach.invocation import Endpoint, ResolveInput, pin_of
from reach.policy.engine import PolicyEngine
from reach.policy.state import MemoryPolicyState
from reach.registry import HealthReport, JoinRequest, Registry
from reach.resolve import StaleRoute
from reach.routing import Router
from reach.store import MemoryStore


@pytest.fixture
async def acts() -> ReachActivities:
    return await make_acts(refresh_s=0)


async def make_acts(refresh_s: float) -> ReachActivities:
    store = MemoryStore()
    registry = Registry(store, RegistrySettings())
    for name in ("a", "b"):
        await registry.join(
            JoinRequest(capability="cap", instance_id=name, service_address=f"{name}:1")
        )
    policy = PolicyEngine(
        PolicySettings(
            circuit_breaker=CircuitBreakerSettings(error_threshold=3, open_duration_ms=60_000),
            outlier=OutlierSettings(consecutive_failures=2),
        ),
        MemoryPolicyState(),
        refresh_s=refresh_s,
    )
    router = Router(lambda _capability: RoutingSettings(strategy="round_robin"))
    return ReachActivities(registry, router, ConnectorSet(), policy)


async def resolve(acts: ReachActivities, **kw: object) -> str:
    endpoint = await ActivityEnvironment().run(acts.resolve, ResolveInput(**kw))  # type: ignore[arg-type]
    return endpoint.instance_id


async def test_round_robin_then_exclusion_then_fallback(acts: ReachActivities) -> None:
    picks = [await resolve(acts, capability="cap") for _ in range(4)]
    assert picks in (["a", "b", "a", "b"], ["b", "a", "b", "a"])
    # A retry avoids the instance that failed...
    assert {await resolve(acts, capability="cap", exclude=["a"]) for _ in range(3)} == {"b"}
    # ...unless nothing else is left.
    assert await resolve(acts, capability="cap", exclude=["a", "b"]) in {"a", "b"}


async def test_unhealthy_instances_get_no_traffic(acts: ReachActivities) -> None:
    await acts.registry.heartbeat("a", HealthReport(status="unhealthy"))
    assert {await resolve(acts, capability="cap") for _ in range(4)} == {"b"}
    await acts.registry.heartbeat("b", HealthReport(status="degraded"))
    assert await resolve(acts, capability="cap") == "b"  # degraded still serves
    await acts.registry.heartbeat("b", HealthReport(status="unhealthy"))
    with pytest.raises(ApplicationError) as err:
        await resolve(acts, capability="cap")
    assert err.value.type == "no_instance"
    assert err.value.non_retryable  # the workflow, not Temporal, decides on retries
    assert err.value.details[0] == {"retryable": True}
    assert "2 registered, all unhealthy" in err.value.message


async def test_unknown_capability_is_not_retryable(acts: ReachActivities) -> None:
    with pytest.raises(ApplicationError) as err:
        await resolve(acts, capability="nobody")
    assert err.value.type == "unknown_capability"
    assert err.value.details[0] == {"retryable": False}


async def test_an_ejected_instance_is_skipped_but_never_the_last(acts: ReachActivities) -> None:
    for _ in range(2):
        await acts.policy.record("cap", "a", ok=False, probe=False)
    assert {await resolve(acts, capability="cap") for _ in range(4)} == {"b"}
    # With the only other instance excluded (a retry), the ejected one is still tried.
    assert await resolve(acts, capability="cap", exclude=["b"]) == "a"
    await acts.registry.heartbeat("b", HealthReport(status="unhealthy"))
    assert await resolve(acts, capability="cap") == "a"


async def test_an_open_breaker_refuses_before_routing(acts: ReachActivities) -> None:
    for instance in ("a", "b", "a"):
        await acts.policy.record("cap", instance, ok=False, probe=False)
    with pytest.raises(ApplicationError) as err:
        await resolve(acts, capability="cap")
    assert err.value.type == "circuit_open"
    assert err.value.details[0]["retry_after_s"] == 60
    assert "no agent was called" in err.value.message


async def test_a_re_run_attempt_goes_back_to_the_instance_it_was_pinned_to(
    acts: ReachActivities,
) -> None:
    first = await resolve(acts, capability="cap", request_id="r1", attempt=1, deadline_ms=2**42)
    # Round robin alone would alternate; the same attempt of the same request does not.
    again = [
        await resolve(acts, capability="cap", request_id="r1", attempt=1, deadline_ms=2**42)
        for _ in range(3)
    ]
    assert again == [first] * 3
    second = await resolve(
        acts, capability="cap", request_id="r1", attempt=2, deadline_ms=2**42, exclude=[first]
    )
    assert {first, second} == {"a", "b"}
    # A pinned instance that is gone is not waited for.
    await acts.registry.heartbeat(first, HealthReport(status="unhealthy"))
    assert (
        await resolve(acts, capability="cap", request_id="r1", attempt=1, deadline_ms=2**42)
        != first
    )


async def test_a_write_whose_pinned_instance_is_gone_is_not_sent_elsewhere(
    acts: ReachActivities,
) -> None:
    kw: dict[str, object] = {"capability": "cap", "request_id": "w1", "attempt": 1}
    first = await resolve(acts, deadline_ms=2**42, movable=False, **kw)
    await acts.registry.heartbeat(first, HealthReport(status="unhealthy"))
    with pytest.raises(ApplicationError) as err:
        await resolve(acts, deadline_ms=2**42, movable=False, **kw)
    assert err.value.type == "transport_error"
    assert err.value.details[0] == {"retryable": False, "outcome_unknown": True}
    assert "may have run it" in err.value.message
    # An idempotent (or keyed) one may go to another instance.
    assert await resolve(acts, deadline_ms=2**42, movable=True, **kw) != first


async def test_a_re_run_follows_the_agents_declarations_and_spots_a_restart(
    acts: ReachActivities,
) -> None:
    kw: dict[str, object] = {"capability": "cap", "operation": "query", "deadline_ms": 2**42}
    first = await resolve(acts, request_id="q1", attempt=1, movable=None, **kw)
    # The same instance id joins again: a new process, whose memory of RequestIDs is empty.
    await acts.registry.join(
        JoinRequest(capability="cap", instance_id=first, service_address=f"{first}:1")
    )
    with pytest.raises(ApplicationError) as err:
        await resolve(acts, request_id="q1", attempt=1, movable=None, **kw)
    assert err.value.details[0]["outcome_unknown"] is True
    # Once the agents declare the operation idempotent, the re-run may go anywhere.
    for name in ("a", "b"):
        await acts.registry.join(
            JoinRequest(
                capability="cap",
                instance_id=name,
                service_address=f"{name}:1",
                operations=[{"name": "query", "idempotent": True}],  # type: ignore[list-item]
            )
        )
    assert await resolve(acts, request_id="q1", attempt=1, movable=None, **kw) in {"a", "b"}


# -- attempt 1 routed at the door ---------------------------------------------------------------


@pytest.fixture
async def door_acts() -> AsyncIterator[ReachActivities]:
    """As a gateway runs: a started registry view, the policy view re-read every half second."""
    acts = await make_acts(refresh_s=0.5)
    await acts.view.start()
    await acts.policy.view("cap")
    yield acts
    await acts.view.aclose()


async def door(acts: ReachActivities, request_id: str) -> Endpoint:
    endpoint = acts.resolver.first(
        ResolveInput(capability="cap", request_id=request_id, attempt=1, deadline_ms=2**42),
        reserve=False,
    )
    assert endpoint is not None
    return endpoint


async def test_the_door_routes_like_resolve_and_leaves_what_it_cannot_to_the_workflow(
    door_acts: ReachActivities,
) -> None:
    acts = door_acts
    picks = {(await door(acts, f"d{i}")).instance_id for i in range(4)}
    assert picks == {"a", "b"}  # the same strategy (round robin) as the workflow's resolve
    endpoint = await door(acts, "d9")
    assert endpoint.joined_at is not None
    assert endpoint.strategy == "round_robin"
    # Nothing routable, or unknown: None, and the workflow resolves (and reports).
    await acts.registry.heartbeat("a", HealthReport(status="unhealthy"))
    await acts.registry.heartbeat("b", HealthReport(status="unhealthy"))
    assert acts.resolver.first(ResolveInput(capability="cap"), reserve=False) is None
    assert acts.resolver.first(ResolveInput(capability="nobody"), reserve=False) is None


async def test_a_call_routed_at_the_door_goes_on_while_its_instance_is_the_one_chosen(
    door_acts: ReachActivities,
) -> None:
    acts = door_acts
    endpoint = await door(acts, "c1")
    await acts.resolver.check_first(endpoint, "c1", movable=False, fresh=True)
    # A re-run (an earlier workflow task was lost) goes back to it as well.
    await acts.resolver.check_first(endpoint, "c1", movable=False, fresh=False)


async def test_an_instance_gone_before_the_call_is_routed_again_when_nothing_was_sent(
    door_acts: ReachActivities,
) -> None:
    acts = door_acts
    endpoint = await door(acts, "s1")
    await acts.registry.heartbeat(endpoint.instance_id, HealthReport(status="unhealthy"))
    # The first run of the attempt: nothing can have been sent, whatever the operation.
    with pytest.raises(StaleRoute):
        await acts.resolver.check_first(endpoint, "s1", movable=False, fresh=True)
    # A re-run of a call that may have been sent: only a movable request goes elsewhere.
    with pytest.raises(StaleRoute):
        await acts.resolver.check_first(endpoint, "s1", movable=True, fresh=False)
    with pytest.raises(TransportError) as err:
        await acts.resolver.check_first(endpoint, "s1", movable=False, fresh=False)
    assert err.value.outcome_unknown
    assert not err.value.retryable
    assert "may have run it" in err.value.message


async def test_a_restart_under_the_same_id_is_another_instance_for_a_re_run(
    door_acts: ReachActivities,
) -> None:
    acts = door_acts
    endpoint = await door(acts, "r1")
    await acts.registry.join(
        JoinRequest(
            capability="cap",
            instance_id=endpoint.instance_id,
            service_address=f"{endpoint.instance_id}:1",
        )
    )
    with pytest.raises(TransportError):
        await acts.resolver.check_first(endpoint, "r1", movable=False, fresh=False)
    with pytest.raises(StaleRoute):
        await acts.resolver.check_first(endpoint, "r1", movable=False, fresh=True)


async def test_the_door_leaves_a_breaker_that_is_not_closed_to_the_workflow(
    door_acts: ReachActivities,
) -> None:
    """A half-open probe slot is never taken at the door (the request may only attach)."""
    acts = door_acts
    for instance in ("a", "b", "a"):
        await acts.policy.record("cap", instance, ok=False, probe=False)
    view = await acts.policy.view("cap")
    assert view.breaker.status == "open"
    first = ResolveInput(capability="cap", request_id="h1", attempt=1, deadline_ms=2**42)
    assert acts.resolver.first(first, reserve=False) is None


async def test_a_redelivery_of_attempt_1_goes_back_to_the_door_s_choice(
    door_acts: ReachActivities,
) -> None:
    acts = door_acts
    endpoint = await door(acts, "p1")
    pin = pin_of(endpoint.instance_id, endpoint.joined_at)
    kw: dict[str, object] = {"capability": "cap", "request_id": "p1", "attempt": 1}
    # Round robin alone would alternate; the pin the workflow passes does not.
    assert [await resolve(acts, deadline_ms=2**42, pin=pin, **kw) for _ in range(3)] == [
        endpoint.instance_id
    ] * 3
    await acts.registry.heartbeat(endpoint.instance_id, HealthReport(status="unhealthy"))
    with pytest.raises(ApplicationError) as err:
        await resolve(acts, deadline_ms=2**42, pin=pin, movable=False, **kw)
    assert err.value.details[0]["outcome_unknown"] is True
