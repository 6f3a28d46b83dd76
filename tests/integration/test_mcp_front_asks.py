"""MCP both ways, questions included: an MCP server behind Reach (the `mcp` package's,
session-based, registered by URL) asks for sampling or elicitation mid-call, and the `mcp`
package's client that made the call through Reach's MCP front answers it (its
sampling_callback, elicitation_callback): the answer reaches the tool and the tool's result
comes back. A client that did not declare the capability is refused at once, as is a call that
did not come through the front (POST /reach/invoke); another caller cannot answer the question,
nor can anyone answer an id that is no question. A real gateway with tokens required, on the
real dev server."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any

import httpx
import httpx2
import pytest
from mcp import Client
from mcp.client.session import ClientRequestContext
from mcp.client.streamable_http import streamable_http_client
from mcp_types import (
    CreateMessageRequestParams,
    CreateMessageResult,
    ElicitRequestParams,
    ElicitResult,
    TextContent,
)

from tests.conftest import new_stack
from tests.helpers import GatewayProcess
from tests.integration.test_auth import bearer, issue_cli
from tests.mcp_servers import McpServerProcess

pytestmark = pytest.mark.integration

CAPABILITY = "asking"


@pytest.fixture(scope="module")
async def reach(
    temporal_server: str, tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[dict[str, Any]]:
    """A gateway with tokens (callers alice and bob), a session-based MCP server registered
    behind it by URL as `asking`."""
    tmp = tmp_path_factory.mktemp("asks")
    stack = new_stack(temporal_server, tmp / "stack")
    agent, _ = issue_cli(stack, "--principal", "srv", "--agent", "--capability", CAPABILITY)
    alice, _ = issue_cli(stack, "--principal", "alice")
    bob, _ = issue_cli(stack, "--principal", "bob")
    server = McpServerProcess(tmp, "session").start()
    try:
        async with GatewayProcess(stack, "mcp-asks") as gateway:
            await server.ready()
            async with httpx.AsyncClient(trust_env=False, timeout=30) as http:
                join = {"protocol": "mcp", "service_address": server.url, "capability": CAPABILITY}
                r = await http.post(f"{gateway.url}/reach/agents", json=join, headers=bearer(agent))
                assert r.status_code == 200, r.text
                yield {"gateway": gateway, "alice": alice, "bob": bob, "http": http}
    finally:
        server.stop()


@asynccontextmanager
async def client_of(reach: dict[str, Any], token: str, **callbacks: Any) -> AsyncIterator[Client]:
    """The `mcp` package's client of Reach's front (the handshake generation, which asks on a
    call's stream), with `token` and the callbacks given."""
    url = f"{reach['gateway'].url}/mcp"
    async with (
        httpx2.AsyncClient(trust_env=False, headers=bearer(token), timeout=60) as http,
        Client(streamable_http_client(url, http_client=http), mode="legacy", **callbacks) as c,
    ):
        yield c


def text_of(result: Any) -> str:
    return " ".join(b.text for b in result.content if isinstance(b, TextContent))


def model(answer: str, asked: list[Any]) -> Callable[..., Awaitable[CreateMessageResult]]:
    async def sample(
        context: ClientRequestContext, params: CreateMessageRequestParams
    ) -> CreateMessageResult:
        asked.append((context.request_id, params))
        content = TextContent(type="text", text=answer)
        return CreateMessageResult(role="assistant", content=content, model="test-model")

    return sample


async def test_the_callers_answers_reach_the_tool(reach: dict[str, Any]) -> None:
    sampled: list[Any] = []
    elicited: list[Any] = []

    async def user(context: ClientRequestContext, params: ElicitRequestParams) -> ElicitResult:
        elicited.append((context.request_id, params))
        return ElicitResult(action="accept", content={"answer": "yes please"})

    callbacks = {"sampling_callback": model("forty-two", sampled), "elicitation_callback": user}
    async with client_of(reach, reach["alice"], **callbacks) as client:
        result = await client.call_tool(f"{CAPABILITY}.ask_model", {"question": "why?"})
        assert not result.is_error, result
        assert "forty-two" in text_of(result)
        result = await client.call_tool(f"{CAPABILITY}.ask_user", {"question": "more?"})
        assert not result.is_error, result
        assert "accept: yes please" in text_of(result)
    [(rid, params)] = sampled
    assert str(rid).startswith("reach-ask-")  # the front's own id, not the server's
    assert params.messages[0].content.text == "why?"  # type: ignore[union-attr]
    [(_, asked)] = elicited
    assert asked.message == "more?"


async def test_a_client_that_did_not_declare_it_is_refused_at_once(reach: dict[str, Any]) -> None:
    """No callback at all: no question is relayed; sampling declared but not elicitation:
    the elicitation is refused. Both at once, and the tool fails saying why."""
    async with client_of(reach, reach["alice"]) as client:
        started = time.monotonic()
        result = await client.call_tool(f"{CAPABILITY}.ask_model", {"question": "why?"})
        assert result.is_error
        assert "did not relay 'sampling/createMessage'" in text_of(result)
        assert "no client that can answer waits on this call" in text_of(result)
        assert "operation not served" not in text_of(result)  # the tool was served; it failed
        assert time.monotonic() - started < 10
    async with client_of(reach, reach["alice"], sampling_callback=model("x", [])) as client:
        result = await client.call_tool(f"{CAPABILITY}.ask_user", {"question": "more?"})
        assert result.is_error
        assert "did not declare that capability" in text_of(result)


async def test_a_call_not_through_the_front_is_refused_at_once(reach: dict[str, Any]) -> None:
    http: httpx.AsyncClient = reach["http"]
    body = {"target": CAPABILITY, "operation": "ask_model", "payload": {"question": "why?"}}
    started = time.monotonic()
    r = await http.post(
        f"{reach['gateway'].url}/reach/invoke", json=body, headers=bearer(reach["alice"])
    )
    assert r.status_code == 502, r.text
    assert "did not relay" in r.json()["error"]["message"]
    assert time.monotonic() - started < 10


async def test_only_the_caller_answers_its_question(reach: dict[str, Any]) -> None:
    """While alice's client holds the question, bob answers it with its id: 403; an id that
    is no question of Reach's: 404. Alice's own answer is the one the tool gets."""
    http: httpx.AsyncClient = reach["http"]
    url = f"{reach['gateway'].url}/mcp"
    refused: list[httpx.Response] = []

    async def guarded(
        context: ClientRequestContext, params: CreateMessageRequestParams
    ) -> CreateMessageResult:
        theirs = {"role": "assistant", "content": {"type": "text", "text": "bob's"}, "model": "b"}
        for token, key in ((reach["bob"], context.request_id), (reach["alice"], "reach-ask-0")):
            answer = {"jsonrpc": "2.0", "id": key, "result": theirs}
            refused.append(await http.post(url, json=answer, headers=bearer(token)))
        return await model("alice's", [])(context, params)

    async with client_of(reach, reach["alice"], sampling_callback=guarded) as client:
        result = await client.call_tool(f"{CAPABILITY}.ask_model", {"question": "who?"})
    assert not result.is_error, result
    assert "alice's" in text_of(result)
    bobs, unknown = refused
    assert bobs.status_code == 403, bobs.text
    assert "another caller" in bobs.json()["error"]["message"]
    assert unknown.status_code == 404, unknown.text
    assert "no question of Reach's" in unknown.json()["error"]["message"]
