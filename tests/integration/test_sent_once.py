"""An attempt for an agent that would run it twice (an MCP server, an A2A agent) is sent once,
whichever run of the call activity sends it (`activities._sent`): the call activity run by two
"gateways" (two activity sets, each with its own connectors) over one shared policy state (this
process's memory, or Redis as gateways share it), against a real MCP server counting its calls.
The whole story through two gateway processes, one SIGKILLed mid-call, is the slow test below."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
from temporalio.exceptions import ApplicationError
from temporalio.testing import ActivityEnvironment

from activities import ReachActivities
from connectors import ConnectorSet, load
from reach.config import OperationSettings, PolicySettings, RegistrySettings, RoutingSettings
from reach.invocation import CallInput, Endpoint
from reach.policy.engine import PolicyEngine
from reach.policy.state import MemoryPolicyState, PolicyState, create_policy_state
from reach.registry import Registry
from reach.routing import Router
from reach.store import MemoryStore
from reach.store.redis import RedisStore
from tests.conftest import new_stack
from tests.helpers import CallbackReceiver, GatewayProcess, free_port, message, rid, wait_until
from tests.integration.test_connector_mcp import registered
from tests.mcp_servers import McpServerProcess

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
async def server(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[McpServerProcess]:
    running = McpServerProcess(tmp_path_factory.mktemp("sent-once"), "stateless").start()
    try:
        yield await running.ready()
    finally:
        running.stop()


@pytest.fixture(params=["memory", "redis"])
async def state(request: pytest.FixtureRequest, redis_url: str) -> AsyncIterator[PolicyState]:
    """The state two gateways share: one process's memory, or one Redis."""
    if request.param == "memory":
        yield MemoryPolicyState()
        return
    store = RedisStore.from_url(redis_url, prefix=request.getfixturevalue("redis_prefix"))
    try:
        yield create_policy_state(store)
    finally:
        await store.aclose()


class CountedState(MemoryPolicyState):
    """Memory state that counts its claims (the store round trips a call would make)."""

    def __init__(self) -> None:
        super().__init__()
        self.claims = 0

    async def claim(self, key: str, value: str, ttl_s: float) -> str:
        self.claims += 1
        return await super().claim(key, value, ttl_s)


Gateway = Callable[..., ReachActivities]


@pytest.fixture
async def gateway() -> AsyncIterator[Gateway]:
    """Build one gateway's activities (its own registry view, router and connectors) over a
    shared state; all closed when the test ends."""
    built: list[ReachActivities] = []

    def build(state: PolicyState, policy: PolicySettings | None = None) -> ReachActivities:
        acts = ReachActivities(
            Registry(MemoryStore(), RegistrySettings()),
            Router(lambda _capability: RoutingSettings()),
            ConnectorSet(),
            PolicyEngine(policy or PolicySettings(), state),
        )
        built.append(acts)
        return acts

    yield build
    for acts in built:
        await acts.connectors.aclose()
        await acts.aclose()


def tool_call(server: McpServerProcess, tag: str, **endpoint: Any) -> CallInput:
    return CallInput(
        endpoint=Endpoint(
            instance_id=f"mcp-{server.port}",
            capability="tools",
            protocol="mcp",
            address=server.url,
            **endpoint,
        ),
        message=message("count", {"tag": tag}, attempt=1, idempotency_key=None),
        timeout_ms=10_000,
    )


def runs(server: McpServerProcess, tag: str) -> int:
    return server.calls.read_text().splitlines().count(tag)


async def call(acts: ReachActivities, inp: CallInput) -> Any:
    return await ActivityEnvironment().run(acts.call, inp)


async def test_an_attempt_another_run_sent_is_not_sent_again(
    server: McpServerProcess, state: PolicyState, gateway: Gateway
) -> None:
    first, second = gateway(state), gateway(state)
    inp = tool_call(server, tag := rid())
    await call(first, inp)
    assert runs(server, tag) == 1
    # The run that sent it was lost (its process stopped): another gateway runs the attempt.
    with pytest.raises(ApplicationError) as refused:
        await call(second, inp)
    assert refused.value.type == "transport_error"
    assert refused.value.non_retryable
    # Marked not sent: the workflow reports it rather than re-delivering it to be refused again.
    assert refused.value.details[0] == {
        "retryable": False,
        "outcome_unknown": True,
        "not_sent": True,
    }
    assert f"attempt 1 was sent to mcp-{server.port}" in refused.value.message
    assert "An MCP server does not deduplicate by RequestID" in refused.value.message
    assert "'count' is not declared idempotent, so it is not sent again" in refused.value.message
    assert runs(server, tag) == 1
    # Nothing is counted against the instance for a call it was never sent.
    assert second.router.inflight.counts("tools") == {}
    # A later attempt is another send (the workflow decided to make it).
    header = inp.message.header.model_copy(update={"attempt": 2})
    await call(
        second,
        inp.model_copy(update={"message": inp.message.model_copy(update={"header": header})}),
    )
    assert runs(server, tag) == 2


async def test_an_idempotent_tool_is_sent_again_unclaimed(
    server: McpServerProcess, gateway: Gateway
) -> None:
    state = CountedState()
    declared = tool_call(server, tag := rid(), declared_idempotent=True)
    await call(gateway(state), declared)
    await call(gateway(state), declared)
    assert runs(server, tag) == 2
    # Configured idempotent (reach.yaml) over what the server declared.
    policy = PolicySettings(operations={"tools:count": OperationSettings(idempotent=True)})
    configured = tool_call(server, tag := rid(), declared_idempotent=False)
    await call(gateway(state, policy), configured)
    await call(gateway(state, policy), configured)
    assert runs(server, tag) == 2
    assert state.claims == 0
    assert await state.peek(f"sent:{declared.message.header.request_id}:1") is None


async def test_a_deduplicating_protocol_costs_no_store_round_trip(gateway: Gateway) -> None:
    state = CountedState()
    inp = CallInput(
        endpoint=Endpoint(
            instance_id="nobody",
            capability="cap",
            protocol="http",
            address=f"http://127.0.0.1:{free_port()}",
        ),
        message=message("op", attempt=1),
        timeout_ms=2_000,
    )
    with pytest.raises(ApplicationError) as unreachable:
        await call(gateway(state), inp)
    assert unreachable.value.type == "transport_error"
    assert state.claims == 0
    assert not load("mcp").deduplicates
    assert not load("a2a").deduplicates
    assert all(load(p).deduplicates for p in ("http", "grpc", "websocket", "mqtt"))


async def test_nothing_is_sent_when_the_claim_cannot_be_made(
    server: McpServerProcess, gateway: Gateway
) -> None:
    store = RedisStore.from_url(f"redis://127.0.0.1:{free_port()}/0", prefix="x", timeout_s=0.5)
    try:
        inp = tool_call(server, tag := rid())
        with pytest.raises(ApplicationError) as down:
            await call(gateway(create_policy_state(store)), inp)
    finally:
        await store.aclose()
    assert down.value.type == "unavailable"
    assert "whether an earlier run sent it could not be checked" in down.value.message
    assert not down.value.details[0].get("outcome_unknown")  # a regular activity: none ran
    assert runs(server, tag) == 0


async def test_a_local_re_run_that_cannot_check_the_claim_says_the_outcome_is_unknown(
    server: McpServerProcess, gateway: Gateway
) -> None:
    """A local activity is run again when its workflow task was lost: the first run may have
    sent the call. With the store down the re-run cannot tell, so it must not answer a plain
    `unavailable` (never sent): `make reliability` caught one for a tool the server had run."""
    tag = rid()
    inp = tool_call(server, tag)
    first = await call(gateway(MemoryPolicyState()), inp)  # the earlier run: sent, it ran
    assert first.status == "ok", first
    store = RedisStore.from_url(f"redis://127.0.0.1:{free_port()}/0", prefix="x", timeout_s=0.5)
    env = ActivityEnvironment()
    env.info = dataclasses.replace(env.info, is_local=True)
    try:
        with pytest.raises(ApplicationError) as down:
            await env.run(gateway(create_policy_state(store)).call, inp)
    finally:
        await store.aclose()
    assert down.value.type == "unavailable"
    assert down.value.details[0]["outcome_unknown"] is True
    assert down.value.details[0]["retryable"] is False
    assert "may have run it" in down.value.message
    assert runs(server, tag) == 1


async def test_a_regular_activity_retried_by_temporal_may_follow_a_send(
    server: McpServerProcess, gateway: Gateway
) -> None:
    """Temporal retries a regular activity (attempt > 1) only when the one before timed out
    without reporting: it may have sent the call, so a claim the store cannot check is an
    unknown outcome there too, not a plain `unavailable`."""
    inp = tool_call(server, tag := rid())
    store = RedisStore.from_url(f"redis://127.0.0.1:{free_port()}/0", prefix="x", timeout_s=0.5)
    env = ActivityEnvironment()
    env.info = dataclasses.replace(env.info, is_local=False, attempt=2)
    try:
        with pytest.raises(ApplicationError) as down:
            await env.run(gateway(create_policy_state(store)).call, inp)
    finally:
        await store.aclose()
    assert down.value.type == "unavailable"
    assert down.value.details[0]["outcome_unknown"] is True
    assert runs(server, tag) == 0


async def test_a_call_that_made_its_own_send_claim_says_so_when_it_fails(
    gateway: Gateway,
) -> None:
    """This run claimed the attempt's send itself, so no earlier run sent it: its failure says
    `claimed`, and the workflow suspects no lost run behind it (reach.policy.retry)."""
    dead = f"http://127.0.0.1:{free_port()}/mcp"
    inp = CallInput(
        endpoint=Endpoint(instance_id="gone", capability="tools", protocol="mcp", address=dead),
        message=message("count", {"tag": rid()}, attempt=1, idempotency_key=None),
        timeout_ms=5_000,
    )
    env = ActivityEnvironment()
    env.info = dataclasses.replace(env.info, is_local=True)
    with pytest.raises(ApplicationError) as refused:
        await env.run(gateway(MemoryPolicyState()).call, inp)
    assert refused.value.type == "transport_error"
    assert refused.value.details[0].get("claimed") is True
    assert not refused.value.details[0].get("outcome_unknown")


@pytest.mark.slow  # ~30 s: Temporal's wait before the other gateway takes the request over
async def test_a_gateway_sigkilled_mid_call_never_runs_a_tool_twice(
    temporal_server: str, tmp_path: Path, redis_prefix: str, http: httpx.AsyncClient
) -> None:
    """Two gateways on one Redis and one task queue; the one running a non-idempotent tool
    call is SIGKILLed mid-call; the other replays the request and does not call it again."""
    stacks = [
        new_stack(
            temporal_server,
            tmp_path,
            registry="redis",
            key_prefix=redis_prefix,
            heartbeat_interval=0.5,
            heartbeat_timeout=3.0,
        )
        for _ in range(2)
    ]
    stacks[1].task_queue = stacks[0].task_queue
    doomed, survivor = GatewayProcess(stacks[0], "doomed"), GatewayProcess(stacks[1], "survivor")
    server = McpServerProcess(tmp_path, "stateless").start()
    await asyncio.gather(doomed.ready(), survivor.ready(), server.ready())
    try:
        async with registered(http, doomed, server, "mcp-once"), CallbackReceiver() as receiver:
            r = await http.post(
                f"{doomed.url}/reach/invoke",
                json={
                    "request_id": rid(),
                    "target": "mcp-once",
                    "operation": "count",
                    "payload": {"tag": "once", "sleep_s": 40},
                    "timeout_ms": 120_000,
                    "callback": receiver.url,
                },
            )
            assert r.status_code == 202, r.text
            await wait_until(lambda: server.count() == 1, 15, every_s=0.02)
            doomed.proc.kill()
            await receiver.wait(1, timeout_s=90)
            _, body = receiver.received[0]
            assert body["status"] == "error", body
            assert body["error"]["type"] == "transport_error"
            assert body["error"]["outcome_unknown"] is True
            assert server.count() == 1, survivor.proc.own_output()[-3000:]
    finally:
        doomed.proc.stop()
        survivor.proc.stop()
        server.stop()
