"""The agent SDK when a real gateway refuses it: the agent's own log says what the gateway said,
once per change rather than at every retry, and a refused token says how to get one (issue 26).
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest

from agent_reach_sdk import AgentRuntime
from gateway_api.devserver import free_port
from reach.security.tokens import FileTokenStore, issue
from tests.conftest import new_stack
from tests.helpers import GatewayProcess, Stack, wait_until

pytestmark = pytest.mark.integration

SDK = "agent_reach_sdk"


def agent(url: str, capability: str, token: str | None = None) -> AgentRuntime:
    runtime = AgentRuntime(
        capability,
        reach_address=url,
        instance_id=f"{capability}-sdk",
        service_address="127.0.0.1:0",
        heartbeat_interval=0.2,
        token=token,
    )

    @runtime.operation("query")
    async def query(payload: dict[str, object]) -> dict[str, object]:
        return payload

    return runtime


def errors(caplog: pytest.LogCaptureFixture, *words: str) -> list[str]:
    """The SDK's ERROR lines that contain every one of `words`."""
    return [
        r.getMessage()
        for r in caplog.records
        if r.name.startswith(SDK)
        and r.levelno == logging.ERROR
        and all(w in r.getMessage() for w in words)
    ]


def still_refused(caplog: pytest.LogCaptureFixture) -> int:
    """Refusals heard again after the first (logged at DEBUG only)."""
    return sum("still refuses" in r.getMessage() for r in caplog.records)


@pytest.fixture
async def stack(temporal_server: str, tmp_path: Path) -> Stack:
    return new_stack(temporal_server, tmp_path)


async def test_a_join_refused_for_a_loopback_address_logs_the_gateways_message(
    temporal_server: str, tmp_path: Path, capability: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG, logger=SDK)
    # The seed's trap: a gateway whose allowlist leaves out loopback, agents on this machine.
    strict = new_stack(temporal_server, tmp_path, extra={"REACH_SECURITY__ALLOW_NETWORKS": "[]"})
    port = free_port()
    # Started before the gateway (as `reach up` starts its demo agents): it joins on retry.
    early = agent(f"http://127.0.0.1:{port}", capability)
    await early.astart()
    gw = await GatewayProcess(strict, "strict", port=port, worker=False).ready()
    try:
        said = ("refused the join", "422 invalid_request", "127.0.0.1 is a loopback address")

        async def logged() -> bool:
            return bool(errors(caplog, *said))

        await wait_until(logged, 15)
        assert "allow it in security.allow_networks" in errors(caplog, *said)[0]

        async def retried() -> bool:
            return still_refused(caplog) >= 3

        await wait_until(retried, 10)
        assert len(errors(caplog, "refused the join")) == 1  # once, not at every retry
        assert not early.wait_joined(0)

        # Refused at start: the start fails, and the log and the error both say why.
        late = agent(gw.url, f"{capability}-b")
        with pytest.raises(
            RuntimeError, match=r"refused the join of instance .*: 422 invalid_request"
        ) as exc:
            await late.astart()
        assert "is a loopback address; allow it in security.allow_networks" in str(exc.value)
        assert len(errors(caplog, "refused the join", f"{capability}-b-sdk")) == 1
    finally:
        await early.astop()
        gw.proc.stop()


@pytest.fixture
async def open_gateway(stack: Stack) -> AsyncIterator[GatewayProcess]:
    """No tokens yet (auth mode auto): the door is open on loopback until one is issued."""
    gw = await GatewayProcess(stack, "auto", worker=False).ready()
    try:
        yield gw
    finally:
        gw.proc.stop()


async def test_the_first_token_issued_makes_a_running_agent_say_its_token_is_refused(
    open_gateway: GatewayProcess, capability: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG, logger=SDK)
    runtime = agent(open_gateway.url, capability)
    async with runtime:
        assert runtime.wait_joined(0)
        # Issuing the first tokens closes the door: this agent has none.
        store = FileTokenStore(open_gateway.stack.tmp / "tokens.json")
        store.write(issue("orchestrator", "caller")[1])
        token, record = issue("kr", "agent", ["another-capability"])
        store.write(record)
        advice = ("refused the heartbeat", "401 unauthorized", "which has no token")

        async def told() -> bool:
            return bool(errors(caplog, *advice))

        await wait_until(told, 15)
        [line] = errors(caplog, *advice)
        assert "missing credentials" in line
        assert f"reach tokens issue --principal NAME --agent --capability {capability}" in line
        assert "pass token=... to AgentRuntime (or set $REACH_AGENT_TOKEN)" in line

        async def retried() -> bool:
            return still_refused(caplog) >= 3

        await wait_until(retried, 15)
        assert len(errors(caplog, "The gateway refused")) == 1  # once per change, not per beat

    # A token that may not serve the capability: refused at Join, with the gateway's reason.
    scoped = agent(open_gateway.url, f"{capability}-b", token=token)
    with pytest.raises(RuntimeError, match="refused the join") as exc:
        await scoped.astart()
    said = "403 forbidden: the token of 'kr' may serve another-capability"
    assert said in str(exc.value)
    assert "The gateway refused this agent's token: issue one" in str(exc.value)
    assert errors(caplog, said) == [str(exc.value)]  # the log says what the error says


def warnings(caplog: pytest.LogCaptureFixture, *words: str) -> list[str]:
    """The SDK's WARNING lines that contain every one of `words`."""
    return [
        r.getMessage()
        for r in caplog.records
        if r.name.startswith(SDK)
        and r.levelno == logging.WARNING
        and all(w in r.getMessage() for w in words)
    ]


async def test_a_leave_the_gateway_refuses_is_logged_as_refused_not_as_left(
    open_gateway: GatewayProcess, capability: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG, logger=SDK)
    runtime = agent(open_gateway.url, capability)
    async with runtime:
        assert runtime.wait_joined(0)
        FileTokenStore(open_gateway.stack.tmp / "tokens.json").write(
            issue("orchestrator", "caller")[1]
        )

        async def closed() -> bool:
            return bool(errors(caplog, "refused the heartbeat", "401"))

        await wait_until(closed, 15)
    # The leave is refused as the heartbeats were: said once more, for the leave, with advice.
    [line] = errors(caplog, "refused the leave", "401 unauthorized")
    assert "which has no token: issue one with `reach tokens issue" in line
    assert not [r for r in caplog.records if "left Reach" in r.getMessage()]


async def test_heartbeats_no_gateway_answers_are_a_warning_once_not_at_every_beat(
    open_gateway: GatewayProcess, capability: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG, logger=SDK)
    runtime = agent(open_gateway.url, capability)
    async with runtime:
        assert runtime.wait_joined(0)
        open_gateway.proc.stop()  # the gateway is gone: every heartbeat's connection is refused

        async def failing() -> bool:
            return sum("heartbeat failed" in r.getMessage() for r in caplog.records) >= 3

        await wait_until(failing, 15)
        [line] = warnings(caplog, "the heartbeat of instance", "failed")
        assert open_gateway.url in line
        assert "Reach evicts an instance after" in line
    # Leaving with no gateway to tell: said, and not as a leave that happened.
    assert warnings(caplog, "could not tell Reach that instance", "leaves")
    assert not [r for r in caplog.records if "left Reach" in r.getMessage()]


async def test_an_instance_id_another_principal_holds_is_said_so_not_blamed_on_the_token(
    open_gateway: GatewayProcess, capability: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Two agent tokens that may both serve the capability; the second joins the first's
    instance_id and is refused 403 for the id. Its error advised issuing a token."""
    caplog.set_level(logging.DEBUG, logger=SDK)
    store = FileTokenStore(open_gateway.stack.tmp / "tokens.json")
    first, record = issue("alice", "agent", [capability])
    store.write(record)
    second, record = issue("bob", "agent", [capability])
    store.write(record)

    async def required() -> bool:  # the gateway has read the tokens: alice's Join is hers
        async with httpx.AsyncClient(trust_env=False) as http:
            return (await http.get(f"{open_gateway.url}/reach/capabilities")).status_code == 401

    await wait_until(required, 15)
    holder = agent(open_gateway.url, capability, token=first)
    async with holder:
        assert holder.wait_joined(0)
        taker = agent(open_gateway.url, capability, token=second)  # the same instance_id
        with pytest.raises(RuntimeError, match="refused the join") as exc:
            await taker.astart()
    said = str(exc.value)
    assert f"403 forbidden: instance_id '{capability}-sdk' is held by another principal" in said
    assert f"The refusal is about instance_id '{capability}-sdk', not the token" in said
    assert "AgentRuntime(instance_id=...)" in said
    assert "reach tokens issue" not in said
    assert errors(caplog, "403 forbidden") == [said]  # the log says what the error says
