"""Hostile review of the MCP question relay (`reach.asks`, `gateway_api._mcp_ask`): a raw
client of Reach's front (httpx, the SSE stream read by hand) against a real gateway with tokens
and the `mcp` package's session-based server behind it: a client that goes away mid-question,
one that never answers, answers given twice or after the call ended."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest

from tests.integration.test_auth import bearer
from tests.integration.test_mcp_front_asks import CAPABILITY, reach  # noqa: F401

pytestmark = pytest.mark.integration

VERSION = "2025-06-18"
ACCEPT = "application/json, text/event-stream"
SAMPLED = {"role": "assistant", "content": {"type": "text", "text": "hi"}, "model": "m"}


async def session_of(http: httpx.AsyncClient, url: str, token: str) -> dict[str, str]:
    """The headers of a session whose client declared sampling and elicitation."""
    init = {
        "jsonrpc": "2.0",
        "id": 1,
        "method": "initialize",
        "params": {
            "protocolVersion": VERSION,
            "capabilities": {"sampling": {}, "elicitation": {}},
            "clientInfo": {"name": "hostile", "version": "0"},
        },
    }
    r = await http.post(url, json=init, headers={**bearer(token), "accept": ACCEPT})
    assert r.status_code == 200, r.text
    headers = {
        **bearer(token),
        "accept": ACCEPT,
        "mcp-session-id": r.headers["mcp-session-id"],
        "mcp-protocol-version": VERSION,
    }
    note = {"jsonrpc": "2.0", "method": "notifications/initialized"}
    assert (await http.post(url, json=note, headers=headers)).status_code == 202
    return headers


def call(tool: str, timeout_ms: int, rid: str | None = None) -> dict[str, Any]:
    meta: dict[str, Any] = {"reach/timeoutMs": timeout_ms}
    if rid is not None:
        meta["reach/requestId"] = rid
    return {
        "jsonrpc": "2.0",
        "id": 7,
        "method": "tools/call",
        "params": {
            "name": f"{CAPABILITY}.{tool}",
            "arguments": {"question": "why?"},
            "_meta": meta,
        },
    }


async def frames(response: httpx.Response) -> AsyncIterator[dict[str, Any]]:
    async for line in response.aiter_lines():
        if line.startswith("data: "):
            yield json.loads(line[6:])


async def ended(http: httpx.AsyncClient, url: str, headers: dict[str, str], rid: str) -> float:
    """Seconds until request `rid` has its outcome (the same call again attaches to it)."""
    started = time.monotonic()
    r = await http.post(url, json=call("ask_model", 60_000, rid), headers=headers, timeout=90)
    print("ATTACHED", r.status_code, r.text[:400])
    return time.monotonic() - started


async def test_a_client_gone_mid_question_does_not_hold_the_call_to_its_deadline(
    reach: dict[str, Any],  # noqa: F811
) -> None:
    """The client reads the question, then closes its stream: the question is given up soon
    (the stream's close), not at the call's deadline (60 s here)."""
    base = reach["gateway"].url
    async with httpx.AsyncClient(trust_env=False, timeout=30) as http:
        headers = await session_of(http, f"{base}/mcp", reach["alice"])
        rid = f"hostile-{time.time_ns()}"
        async with http.stream(
            "POST", f"{base}/mcp", json=call("ask_model", 60_000, rid), headers=headers
        ) as response:
            async for frame in frames(response):
                if frame.get("method") == "sampling/createMessage":
                    break
        # the stream is closed here, the question unanswered
        plain = {k: v for k, v in headers.items() if k != "mcp-session-id"}
        plain["accept"] = "application/json"
        took = await ended(http, f"{base}/mcp", {**headers, "accept": "application/json"}, rid)
        del plain
        assert took < 20, f"the call waited {took:.1f} s for a client that had gone"


async def test_a_client_that_never_answers(reach: dict[str, Any]) -> None:  # noqa: F811
    """The stream stays open, no answer: the call ends at its deadline as a timeout (not as
    the agent's error, which would count against its health)."""
    base = reach["gateway"].url
    async with httpx.AsyncClient(trust_env=False, timeout=60) as http:
        headers = await session_of(http, f"{base}/mcp", reach["alice"])
        started = time.monotonic()
        got: list[dict[str, Any]] = []
        async with http.stream(
            "POST", f"{base}/mcp", json=call("ask_model", 6_000), headers=headers
        ) as response:
            async for frame in frames(response):
                got.append(frame)
                if frame.get("id") == 7:
                    break
        took = time.monotonic() - started
        print("NEVER-ANSWERS", round(took, 2), json.dumps(got[-1])[:600])
        assert 5 < took < 20
        assert got[-1]["result"].get("isError"), got[-1]
        assert got[-1]["result"]["structuredContent"]["error"]["type"] == "timeout", got[-1]


async def test_answers_twice_and_after_the_end(reach: dict[str, Any]) -> None:  # noqa: F811
    """Two answers raced: one is taken, the other refused 409 (the same answer again is taken
    as already given: 202); another answer after the call ended is refused 409."""
    base = reach["gateway"].url
    async with httpx.AsyncClient(trust_env=False, timeout=60) as http:
        headers = await session_of(http, f"{base}/mcp", reach["alice"])
        said: list[tuple[str, int, str]] = []
        async with http.stream(
            "POST", f"{base}/mcp", json=call("ask_model", 20_000), headers=headers
        ) as response:
            async for frame in frames(response):
                if frame.get("method") == "sampling/createMessage":
                    key = frame["id"]
                    answer = {"jsonrpc": "2.0", "id": key, "result": SAMPLED}
                    other = {"jsonrpc": "2.0", "id": key, "result": {**SAMPLED, "model": "x"}}

                    async def post(what: str, body: dict[str, Any]) -> None:
                        r = await http.post(f"{base}/mcp", json=body, headers=headers)
                        said.append((what, r.status_code, r.text[:200]))

                    await asyncio.gather(post("first", answer), post("race", other))
                    await post("same again", answer)
                if frame.get("id") == 7:
                    final = frame
                    break
        assert "result" in final, final
        assert not final["result"].get("isError"), final
        late = {"jsonrpc": "2.0", "id": key, "error": {"code": -1, "message": "late"}}
        r = await http.post(f"{base}/mcp", json=late, headers=headers)
        said.append(("after the end", r.status_code, r.text[:200]))
        print("ANSWERS", json.dumps(said, indent=1))
        codes = sorted(code for _, code, _ in said[:2])
        assert codes == [202, 409], said
        assert said[2][1] in (202, 409), said
        assert said[3][1] == 409, said
