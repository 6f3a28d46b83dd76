"""The A2A connector against a real a2a-sdk agent in its own process: discovery, SendMessage,
following a task to each of its ends, and cards that are refused (tests/a2a_agents.py)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from agent_reach_sdk.wire import Answer, Inbound
from connectors.a2a import A2AConnector
from reach.config import SecuritySettings
from reach.errors import AgentError, InvalidRequest, Unavailable
from reach.invocation import Endpoint
from reach.messages import Reply
from tests.a2a_agents import A2AAgentProcess, card
from tests.helpers import TRACEPARENT, message, path_server, wait_until

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
async def agent(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[A2AAgentProcess]:
    proc = A2AAgentProcess(tmp_path_factory.mktemp("a2a"), "direct")
    try:
        yield await proc.ready()
    finally:
        proc.proc.stop()


@pytest.fixture
async def connector() -> AsyncIterator[A2AConnector]:
    # The guard as a gateway on loopback has it: loopback allowed, the rest global only.
    async with A2AConnector(security=SecuritySettings(allow_networks=["127.0.0.0/8"])) as c:
        yield c


def endpoint(agent: A2AAgentProcess, details: dict[str, Any] | None = None) -> Endpoint:
    return Endpoint(
        instance_id="a2a-1",
        capability="cap",
        protocol="a2a",
        address=agent.url,
        details=details or {},
    )


async def followed(connector: A2AConnector, ep: Endpoint, reply: Reply) -> Reply:
    """Follow an accepted reply's task until it ends (as the workflow does, without timers)."""
    seen: list[Reply] = [reply]

    async def ended() -> bool:
        handle = seen[-1].follow
        assert handle is not None
        seen.append(await connector.follow(ep, handle, 5))
        return seen[-1].status != "accepted"

    await wait_until(ended, 15, every_s=0.05)
    return seen[-1]


async def test_discover_takes_skills_as_operations_and_asks_conditionally(
    agent: A2AAgentProcess, connector: A2AConnector
) -> None:
    found = await connector.discover(agent.url)
    assert [op.name for op in found.operations] == ["echo", "slow", "ask", "fail", "cancel"]
    assert found.operations[0].description == "Answers at once with what it was sent."
    assert found.details == {
        "url": f"{agent.url}/",
        "name": "direct",
        "protocol_version": "1.0",
        "streaming": True,
        "push_notifications": False,
    }
    assert found.etag
    assert found.version
    # Unchanged: the agent answers 304 and the last discovery is returned as it is.
    assert await connector.discover(agent.url, found) is found


async def test_an_immediate_answer_is_the_result_and_the_message_carries_reach_s_header(
    agent: A2AAgentProcess, connector: A2AConnector
) -> None:
    msg = message("echo", {"q": "x", "n": 3}, attempt=1)
    reply = await connector.invoke(endpoint(agent), msg, 5)
    # One data part holding an object is the result; A2A's doubles come back whole.
    assert reply.model_dump(exclude={"named"}) == Reply(
        status="ok", result={"echo": {"q": "x", "n": 3}}
    ).model_dump(exclude={"named"})
    # The context it was answered in is named, for the owner check (not in the result).
    assert reply.named is not None
    assert reply.named["context_id"]
    seen = await agent.counts()
    assert f"{msg.header.request_id}:1" in seen["message_ids"]


async def test_a_long_task_is_accepted_with_a_handle_and_followed_to_its_artifacts(
    agent: A2AAgentProcess, connector: A2AConnector
) -> None:
    ep = endpoint(agent)
    reply = await connector.invoke(ep, message("slow", {"seconds": 0.3}), 5)
    assert reply.status == "accepted"
    assert reply.follow is not None
    assert reply.follow["task_id"]
    assert reply.follow["context_id"]
    assert reply.follow["url"] == f"{agent.url}/"
    final = await followed(connector, ep, reply)
    # Two artifacts (a data part and a text part): the general form.
    assert final.status == "ok"
    assert final.result == {"text": "all done", "data": [{"done": True, "seconds": 0.3}]}
    assert final.named == {
        "task_id": reply.follow["task_id"],
        "context_id": reply.follow["context_id"],
    }


async def test_input_required_ends_with_the_task_and_a_follow_up_continues_it(
    agent: A2AAgentProcess, connector: A2AConnector
) -> None:
    ep = endpoint(agent)
    asked = await followed(connector, ep, await connector.invoke(ep, message("ask", {}), 5))
    assert asked.status == "input_required"
    assert asked.result is not None
    assert asked.result["state"] == "input-required"
    assert asked.result["message"] == "What is your name?"
    ids = {"task_id": asked.result["task_id"], "context_id": asked.result["context_id"]}
    answer = message("ask", {"name": "Ada", "_a2a": ids})
    done = await followed(connector, ep, await connector.invoke(ep, answer, 5))
    assert done.status == "ok"
    assert done.result == {"hello": "Ada"}
    assert done.named == ids  # the same task, in the same context


async def test_a_failed_task_is_an_agent_error_in_the_agent_s_words_and_canceled_is_final(
    agent: A2AAgentProcess, connector: A2AConnector
) -> None:
    ep = endpoint(agent)
    with pytest.raises(AgentError) as failed:
        await followed(connector, ep, await connector.invoke(ep, message("fail", {}), 5))
    assert failed.value.fault is not None
    assert failed.value.fault.type == "task_failed"
    assert failed.value.fault.message == "I cannot do fail"
    assert not failed.value.retryable
    canceled = await followed(connector, ep, await connector.invoke(ep, message("cancel", {}), 5))
    assert canceled.status == "canceled"
    assert canceled.result is not None
    assert canceled.result["message"] == "I changed my mind"


async def test_a_task_the_agent_does_not_know_has_an_unknown_outcome(
    agent: A2AAgentProcess, connector: A2AConnector
) -> None:
    handle = {"task_id": "no-such-task", "url": f"{agent.url}/"}
    with pytest.raises(AgentError) as lost:
        await connector.follow(endpoint(agent), handle, 5)
    assert lost.value.outcome_unknown
    assert "no longer knows task no-such-task" in lost.value.message


async def test_cancel_reaches_the_agent(agent: A2AAgentProcess, connector: A2AConnector) -> None:
    ep = endpoint(agent, {"url": f"{agent.url}/"})
    reply = await connector.invoke(ep, message("slow", {"seconds": 30}, traceparent=TRACEPARENT), 5)
    assert reply.follow is not None
    before = (await agent.counts())["counts"].get("canceled", 0)
    await connector.cancel(ep, reply.follow, 5)
    after = await followed(connector, ep, Reply(status="accepted", follow=reply.follow))
    assert after.status == "canceled"
    assert (await agent.counts())["counts"]["canceled"] == before + 1


def _card_dict(url: str, **changes: Any) -> dict[str, Any]:
    from google.protobuf import json_format

    data: dict[str, Any] = json_format.MessageToDict(card("forged", url))
    data.update(changes)
    return data


@pytest.mark.parametrize(
    ("changes", "says"),
    [
        ({"skills": "nope"}, "is not an A2A AgentCard"),
        ({"name": 7}, "is not an A2A AgentCard"),
        ({"name": ""}, "has no name"),
        ({"description": "x" * 300_000}, "at most 262144"),
        ({"supportedInterfaces": []}, "names no JSON-RPC interface"),
        (
            {
                "supportedInterfaces": [
                    {"url": "http://169.254.169.254/", "protocolBinding": "JSONRPC"}
                ]
            },
            "the link-local cloud metadata address",
        ),
        (
            {"supportedInterfaces": [{"url": "http://10.1.2.3:80/", "protocolBinding": "JSONRPC"}]},
            "10.1.2.3 is a private address",
        ),
        (
            {"supportedInterfaces": [{"url": "file:///etc/passwd", "protocolBinding": "JSONRPC"}]},
            "scheme 'file' is not http or https",
        ),
        (
            {
                "supportedInterfaces": [
                    {
                        "url": "http://127.0.0.1:1/",
                        "protocolBinding": "JSONRPC",
                        "protocolVersion": "0.3",
                    }
                ]
            },
            "speaks A2A 0.3",
        ),
        ({"skills": [{"id": "has space", "name": "x"}]}, "cannot be an operation name"),
        ({"skills": [{"id": "a", "name": "x"}, {"id": "a", "name": "y"}]}, "appears twice"),
    ],
)
async def test_malformed_cards_are_refused_naming_what_is_wrong(
    connector: A2AConnector, changes: dict[str, Any], says: str
) -> None:
    served: list[dict[str, Any]] = []

    async def serve(request: Inbound) -> Answer:
        return Answer(200, served[0])

    server = path_server(serve, max_body_bytes=1 << 20)
    await server.start()
    try:
        base = f"http://127.0.0.1:{server.port}"
        served.append(_card_dict(f"{base}/", **changes))
        with pytest.raises(InvalidRequest) as refused:
            await connector.discover(base)
        assert says in refused.value.message
        assert "agent card at" in refused.value.message
    finally:
        await server.close()


async def test_the_card_url_itself_passes_the_guard_first(tmp_path: Path) -> None:
    async with A2AConnector(security=SecuritySettings(allow_networks=[])) as strict:
        with pytest.raises(InvalidRequest) as refused:
            await strict.discover("http://127.0.0.1:9")
    assert "127.0.0.1 is a loopback address" in refused.value.message
    with pytest.raises(InvalidRequest):
        A2AConnector.check_address("127.0.0.1:9")  # a base URL, not host:port
    assert A2AConnector.check_address("HTTP://Agent.Example:8080/a2a/") == (
        "http://agent.example:8080/a2a"
    )
    assert A2AConnector.address_host_port("https://agent.example/a2a") == ("agent.example", 443)


async def test_no_card_at_the_url_is_refused_and_nobody_there_is_unavailable(
    connector: A2AConnector,
) -> None:
    async def serve(request: Inbound) -> Answer:
        return Answer(404, {"error": "no such page"})

    server = path_server(serve)
    await server.start()
    try:
        with pytest.raises(InvalidRequest, match="answered HTTP 404") as refused:
            await connector.discover(f"http://127.0.0.1:{server.port}/mcp")  # not its base URL
        assert "register the agent's base URL" in refused.value.message
    finally:
        await server.close()
    with pytest.raises(Unavailable, match="cannot reach"):
        await connector.discover(f"http://127.0.0.1:{server.port}")  # closed now
