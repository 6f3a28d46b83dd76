"""The resolve activity's decisions, run in the SDK's ActivityEnvironment over the memory store."""

from __future__ import annotations

import pytest
from temporalio.exceptions import ApplicationError
from temporalio.testing import ActivityEnvironment

from activities import ReachActivities
from connectors import ConnectorSet
from reach.config import RegistrySettings
from reach.invocation import ResolveInput
from reach.registry import HealthReport, JoinRequest, Registry
from reach.routing import RoundRobin
from reach.store import MemoryStore


@pytest.fixture
async def acts() -> ReachActivities:
    store = MemoryStore()
    registry = Registry(store, RegistrySettings())
    for name in ("a", "b"):
        await registry.join(
            JoinRequest(capability="cap", instance_id=name, service_address=f"{name}:1")
        )
    return ReachActivities(registry, RoundRobin(store), ConnectorSet())


async def resolve(acts: ReachActivities, **kw: object) -> str:
    endpoint = await ActivityEnvironment().run(acts.resolve, ResolveInput(**kw))  # type: ignore[arg-type]
    return endpoint.instance_id


async def test_round_robin_then_exclusion_then_fallback(acts: ReachActivities) -> None:
    assert [await resolve(acts, capability="cap") for _ in range(4)] == ["a", "b", "a", "b"]
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
