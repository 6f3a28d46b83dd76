"""An MCP server behind Reach while the conformance suite runs (`make conformance`): it serves
`test_tool_with_progress`, which reports progress 0, 50 and 100 (50 ms apart) before its answer,
`test_tool_with_logging`, which sends three info log messages 50 ms apart, and the tools that
ask their caller mid-call (`test_sampling`, `test_elicitation`,
`test_elicitation_sep1034_defaults`, `test_elicitation_sep1330_enums`), as the suite's scenarios
ask. Registered by URL as capability `conformance-mcp`, so the suite's call goes client ->
Reach's MCP front -> a durable request -> this server, and its progress, log messages and
questions come back through Reach (the connector's record, relayed by the front; a question's
answer goes back the same way). Session-based (2025-11-25): a server asks on a call's stream
only where a session carries the answer back to it, so this one refuses 2026-07-28 (as a
server of 2025 does) and Reach initializes a session.

    python tests/conformance/mcp_progress_server.py PORT
"""

from __future__ import annotations

import asyncio
import json
import sys
import warnings
from typing import Any

import uvicorn
from mcp.server.mcpserver import Context, MCPServer
from mcp_types import SamplingMessage, TextContent

server = MCPServer(name="reach-conformance-progress", version="1")


@server.tool(description="Reports progress 0, 50, 100, then answers.", structured_output=False)
async def test_tool_with_progress(ctx: Context) -> str:
    for step in (0, 50, 100):
        await ctx.report_progress(step, 100, f"step {step}")
        await asyncio.sleep(0.05)
    return "progress reported"


@server.tool(description="Sends three log messages, then answers.", structured_output=False)
async def test_tool_with_logging(ctx: Context) -> str:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # logging is deprecated from 2026-07-28 on
        for said in ("Tool execution started", "Tool processing data", "Tool execution completed"):
            await ctx.info(said)
            await asyncio.sleep(0.05)
    return "logged"


@server.tool(description="Asks the client's model the prompt.", structured_output=False)
async def test_sampling(prompt: str, ctx: Context) -> str:
    message = SamplingMessage(role="user", content=TextContent(type="text", text=prompt))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # sampling is deprecated from 2026-07-28 on
        got = await ctx.session.create_message(
            [message], max_tokens=100, related_request_id=ctx.request_id
        )
    text = got.content.text if isinstance(got.content, TextContent) else str(got.content)
    return f"LLM response: {text}"


async def _elicit(ctx: Context, message: str, schema: dict[str, Any]) -> str:
    got = await ctx.session.elicit_form(message, schema, related_request_id=ctx.request_id)
    return f"action={got.action}, content={got.content}"


@server.tool(description="Asks the user for a name and an email.", structured_output=False)
async def test_elicitation(message: str, ctx: Context) -> str:
    schema = {
        "type": "object",
        "properties": {
            "username": {"type": "string", "description": "User's response"},
            "email": {"type": "string", "description": "User's email address"},
        },
        "required": ["username", "email"],
    }
    return "User response: " + await _elicit(ctx, message, schema)


@server.tool(description="Asks the user, every field with a default.", structured_output=False)
async def test_elicitation_sep1034_defaults(ctx: Context) -> str:
    schema = {
        "type": "object",
        "properties": {
            "name": {"type": "string", "default": "John Doe"},
            "age": {"type": "integer", "default": 30},
            "score": {"type": "number", "default": 95.5},
            "status": {
                "type": "string",
                "enum": ["active", "inactive", "pending"],
                "default": "active",
            },
            "verified": {"type": "boolean", "default": True},
        },
    }
    return "Elicitation completed: " + await _elicit(ctx, "Your details, please", schema)


def _titled(*pairs: tuple[str, str]) -> list[dict[str, str]]:
    return [{"const": value, "title": title} for value, title in pairs]


@server.tool(description="Asks the user with every kind of enum.", structured_output=False)
async def test_elicitation_sep1330_enums(ctx: Context) -> str:
    options = ["option1", "option2", "option3"]
    schema = {
        "type": "object",
        "properties": {
            "untitledSingle": {"type": "string", "enum": options},
            "titledSingle": {
                "type": "string",
                "oneOf": _titled(("value1", "First Option"), ("value2", "Second Option")),
            },
            "legacyEnum": {
                "type": "string",
                "enum": ["opt1", "opt2", "opt3"],
                "enumNames": ["Option One", "Option Two", "Option Three"],
            },
            "untitledMulti": {"type": "array", "items": {"type": "string", "enum": options}},
            "titledMulti": {
                "type": "array",
                "items": {
                    "anyOf": _titled(("value1", "First Choice"), ("value2", "Second Choice"))
                },
            },
        },
    }
    return "Elicitation completed: " + await _elicit(ctx, "Pick some options", schema)


def session_only(app: Any) -> Any:
    """`app`, refusing a 2026-07-28 request with 400 as a 2025 server does."""

    async def wrapped(scope: Any, receive: Any, send: Any) -> None:
        said = dict(scope.get("headers") or []).get(b"mcp-protocol-version")
        if scope["type"] == "http" and said == b"2026-07-28":
            error = {"code": -32600, "message": "Bad Request: Unsupported protocol version"}
            body = json.dumps({"jsonrpc": "2.0", "id": None, "error": error}).encode()
            headers = [(b"content-type", b"application/json")]
            await send({"type": "http.response.start", "status": 400, "headers": headers})
            await send({"type": "http.response.body", "body": body})
            return
        await app(scope, receive, send)

    return wrapped


if __name__ == "__main__":
    app = session_only(server.streamable_http_app())
    uvicorn.run(app, host="127.0.0.1", port=int(sys.argv[1]), log_level="warning")
