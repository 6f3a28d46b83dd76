"""The MCP connector's pure parts: what each answer means, tools as operations, reading SSE."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest

from connectors.mcp import wire_rules as w
from reach.asks import refusal, unanswered
from reach.errors import AgentError, DeadlineExceeded, TransportError
from reach.registry.models import MAX_DESCRIPTION_CHARS

WHERE = "MCP server s1"


@pytest.mark.parametrize(
    ("code", "kind", "retryable", "name"),
    [
        (-32601, AgentError, False, "method_not_found"),
        (-32602, AgentError, False, "invalid_params"),
        (-32700, AgentError, False, "parse_error"),
        (-32603, AgentError, True, "internal_error"),
        (-32010, AgentError, True, "jsonrpc_error"),
        (-32042, AgentError, False, "url_elicitation_required"),
        (-32001, DeadlineExceeded, False, None),
        (12, AgentError, False, "jsonrpc_error"),
    ],
)
def test_a_json_rpc_error_is_one_of_reachs(
    code: int, kind: type[Exception], retryable: bool, name: str | None
) -> None:
    err = w.error_for({"code": code, "message": "the server's words"}, WHERE)
    assert type(err) is kind
    assert isinstance(err, AgentError | DeadlineExceeded)
    assert err.retryable is retryable
    if isinstance(err, AgentError):
        assert err.fault is not None
        assert (err.fault.type, err.fault.message, err.fault.status) == (
            name,
            "the server's words",
            code,
        )


@pytest.mark.parametrize("code", [-32603, -32000, -32601])
def test_a_tool_failed_on_reachs_unanswered_or_refused_question_is_not_retried(code: int) -> None:
    for said in (unanswered("sampling/createMessage", "the caller went away"), refusal("x", "no")):
        text = f"tool failed: {said['error']['message']}"
        err = w.error_for({"code": code, "message": text}, WHERE)
        assert isinstance(err, AgentError)
        assert err.retryable is False
    own = w.error_for({"code": -32603, "message": "boom"}, WHERE)  # the server's own trouble
    assert isinstance(own, AgentError)
    assert own.retryable is True


def test_a_refused_protocol_version_is_negotiated_again() -> None:
    assert isinstance(w.error_for({"code": -32022, "message": "no"}, WHERE), w.Unsupported)


def test_the_result_rule() -> None:
    limit = 1 << 20
    structured = {"structuredContent": {"a": 1}, "content": [{"type": "text", "text": "{}"}]}
    assert w.tool_reply(structured, WHERE, limit).result == {"a": 1}
    assert w.tool_reply({"structuredContent": [1, 2], "content": []}, WHERE, limit).result == {
        "value": [1, 2]
    }
    blocks = [
        {"type": "text", "text": "one"},
        {"type": "image", "data": "AA==", "mimeType": "image/png"},
        {"type": "text", "text": "two"},
    ]
    assert w.tool_reply({"content": blocks}, WHERE, limit).result == {
        "content": blocks,
        "text": "one\ntwo",
    }
    assert w.tool_reply({"content": blocks[1:2]}, WHERE, limit).result == {"content": blocks[1:2]}
    assert w.tool_reply({}, WHERE, limit).result == {"content": []}


def test_is_error_is_an_agent_error_in_the_servers_words() -> None:
    with pytest.raises(AgentError) as failed:
        w.tool_reply({"isError": True, "content": [{"type": "text", "text": "no"}]}, WHERE, 1000)
    assert not failed.value.retryable
    assert failed.value.fault is not None
    assert (failed.value.fault.type, failed.value.fault.message) == ("tool_error", "no")


def test_results_reach_cannot_carry_are_refused() -> None:
    with pytest.raises(AgentError, match="input_required"):
        w.tool_reply({"resultType": "input_required"}, WHERE, 1000)
    with pytest.raises(AgentError, match="limit is 100 bytes"):
        w.tool_reply({"structuredContent": {"x": "y" * 200}}, WHERE, 100)


def tool(name: str, **fields: Any) -> dict[str, Any]:
    return {"name": name, "inputSchema": {"type": "object"}, **fields}


def test_tools_become_operations_within_bounds() -> None:
    deep: dict[str, Any] = {"type": "object"}
    for _ in range(40):
        deep = {"type": "object", "properties": {"x": deep}}
    tools = [
        tool("read", annotations={"readOnlyHint": True}),
        tool("upsert", annotations={"idempotentHint": True, "readOnlyHint": False}),
        tool("send", annotations={"destructiveHint": True}),
        tool("plain"),
        tool("long", description="d" * (MAX_DESCRIPTION_CHARS + 10)),
        {"name": "deep", "inputSchema": deep},
        tool("a/b"),
        tool("x" * 65),
        tool("read"),
        "not a tool",
    ]
    found = w.discovery(tools, {"protocol_version": w.MODERN})
    ops = {op.name: op for op in found.operations}
    assert list(ops) == ["read", "upsert", "send", "plain", "long", "deep"]
    assert [ops[n].idempotent for n in ops] == [True, True, False, False, False, False]
    assert ops["long"].description is not None
    assert len(ops["long"].description) == MAX_DESCRIPTION_CHARS
    assert ops["deep"].input_schema is None  # too deep to keep, the tool kept
    assert ops["read"].input_schema == {"type": "object"}
    assert found.details["skipped_count"] == 4
    assert found.details["skipped_tools"][:2] == ["a/b", "x" * 65]
    assert w.discovery(list(tools), {}).version == found.version
    assert w.discovery(tools[:3], {}).version != found.version


def sse(*events: str) -> httpx.Response:
    return httpx.Response(
        200, headers={"content-type": "text/event-stream"}, content="".join(events).encode()
    )


def event(message: dict[str, Any], *, lines: bool = False) -> str:
    data = json.dumps(message, indent=1 if lines else None)
    return "event: message\r\n" + "".join(f"data: {line}\r\n" for line in data.split("\n")) + "\r\n"


async def test_an_sse_answer_is_read_past_what_comes_before_it() -> None:
    progress: list[dict[str, Any]] = []
    response = sse(
        "id: 1\ndata:\n\n",  # a priming event: an id, no message
        ": ping\n\n",
        event({"jsonrpc": "2.0", "method": "notifications/progress", "params": {"progress": 1}}),
        event({"jsonrpc": "2.0", "id": 99, "method": "ping"}),  # the server asks: not served
        event({"jsonrpc": "2.0", "id": 6, "result": {"other": True}}),
        event({"jsonrpc": "2.0", "id": 7, "result": {"ok": True}}, lines=True),
    )
    got = await w.read_answer(response, 7, 1 << 20, WHERE, progress.append)
    assert got == {"ok": True}
    assert [p["method"] for p in progress] == ["notifications/progress"]


async def test_an_answer_is_bounded_and_must_come() -> None:
    big = sse(event({"jsonrpc": "2.0", "id": 1, "result": {"x": "y" * 5000}}))
    with pytest.raises(AgentError, match="more than 1000 bytes"):
        await w.read_answer(big, 1, 1000, WHERE)
    cut = sse(event({"jsonrpc": "2.0", "method": "notifications/progress", "params": {}}))
    with pytest.raises(TransportError) as gone:
        await w.read_answer(cut, 1, 1000, WHERE)
    assert gone.value.outcome_unknown
    text = httpx.Response(200, headers={"content-type": "text/plain"}, content=b"hi")
    with pytest.raises(AgentError, match="content type"):
        await w.read_answer(text, 1, 1000, WHERE)


async def test_refusals_over_http() -> None:
    gone = httpx.Response(
        404, content=b'{"error": {"code": -32600, "message": "Session not found"}}'
    )
    assert isinstance(await w.http_refusal(gone, WHERE, had_session=True), w.SessionGone)
    no_endpoint = await w.http_refusal(httpx.Response(404), WHERE, had_session=False)
    assert isinstance(no_endpoint, AgentError)
    assert "no MCP endpoint" in no_endpoint.message
    assert "register the server's Streamable HTTP endpoint itself" in no_endpoint.message
    old = httpx.Response(
        400,
        content=b'{"error":{"code":-32600,"message":"Bad Request: Unsupported protocol version"}}',
    )
    assert isinstance(await w.http_refusal(old, WHERE, had_session=False), w.Unsupported)
    moved = httpx.Response(307, headers={"location": "http://h/mcp/"})
    redirect = await w.http_refusal(moved, WHERE, had_session=False)
    assert isinstance(redirect, AgentError)
    assert "register that URL" in redirect.message
    busy = await w.http_refusal(httpx.Response(503, content=b"later"), WHERE, had_session=False)
    assert isinstance(busy, AgentError)
    assert busy.retryable
    refused = await w.http_refusal(httpx.Response(401, content=b"who?"), WHERE, had_session=False)
    assert isinstance(refused, AgentError)
    assert not refused.retryable


def test_headers_of_each_generation() -> None:
    modern = w.request_headers(w.MODERN, None, "tools/call", "échec")
    assert modern["MCP-Protocol-Version"] == w.MODERN
    assert modern["Mcp-Method"] == "tools/call"
    assert modern["Mcp-Name"] == "=?base64?w6ljaGVj?="
    older = w.request_headers("2025-06-18", "s-1", "tools/call", "echo")
    assert older["Mcp-Session-Id"] == "s-1"
    assert "Mcp-Method" not in older
    assert w.header_value("echo") == "echo"


def test_a_task_is_followed_until_it_ends() -> None:
    created = {"resultType": "task", "taskId": "t-1", "status": "working", "pollIntervalMs": 50}
    accepted = w.tool_reply(created, WHERE, 1000, tasks=True)
    assert (accepted.status, accepted.follow) == ("accepted", {"task_id": "t-1", "poll_ms": 50})
    with pytest.raises(AgentError, match="'task' result"):  # not declared: not a valid answer
        w.tool_reply(created, WHERE, 1000)
    base = {"resultType": "complete", "taskId": "t-1"}
    assert w.task_reply({**base, "status": "working"}, WHERE, 1000).status == "accepted"
    done = {**base, "status": "completed", "result": {"content": [{"type": "text", "text": "ok"}]}}
    assert w.task_reply(done, WHERE, 1000).result == {
        "content": [{"type": "text", "text": "ok"}],
        "text": "ok",
    }
    failed = {**base, "status": "failed", "error": {"code": -32603, "message": "rate limit"}}
    with pytest.raises(AgentError) as err:
        w.task_reply(failed, WHERE, 1000)
    assert err.value.fault is not None
    assert err.value.fault.message == "rate limit"
    stopped = w.task_reply({**base, "status": "cancelled", "statusMessage": "by admin"}, WHERE, 9)
    assert (stopped.status, stopped.result) == (
        "canceled",
        {"task_id": "t-1", "state": "cancelled", "message": "by admin"},
    )
    asks = {**base, "status": "input_required", "inputRequests": {"name": {}}}
    waiting = w.task_reply(asks, WHERE, 1000)
    assert waiting.status == "input_required"
    assert waiting.result is not None
    assert waiting.result["input_requests"] == ["name"]
    with pytest.raises(AgentError, match="taskId"):
        w.task_reply({"status": "working", "taskId": "x" * 300}, WHERE, 1000)


async def test_progress_does_not_count_against_the_answer_s_size() -> None:
    tick = {"jsonrpc": "2.0", "method": "notifications/progress", "params": {"progress": 1}}
    answer = {"jsonrpc": "2.0", "id": 3, "result": {"x": "y" * 600}}
    response = sse(*[event(tick)] * 200, event(answer))  # 200 ticks: far more than the limit
    assert await w.read_answer(response, 3, 1000, WHERE) == {"x": "y" * 600}
    with pytest.raises(AgentError, match="more than 500 bytes"):
        await w.read_answer(sse(event(answer)), 3, 500, WHERE)
