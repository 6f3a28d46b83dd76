"""An MCP server behind Reach while the conformance suite runs (`make conformance`): it serves
`test_tool_with_progress`, which reports progress 0, 50 and 100 (50 ms apart) before its answer,
and `test_tool_with_logging`, which sends three info log messages 50 ms apart, as the suite's
scenarios ask. Registered by URL as capability `conformance-mcp`, so the suite's call goes
client -> Reach's MCP front -> a durable request -> this server, and its progress and log
messages come back through Reach (the connector's record, relayed by the front).

    python tests/conformance/mcp_progress_server.py PORT
"""

from __future__ import annotations

import asyncio
import sys
import warnings

import uvicorn
from mcp.server.mcpserver import Context, MCPServer

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


if __name__ == "__main__":
    app = server.streamable_http_app(stateless_http=True)
    uvicorn.run(app, host="127.0.0.1", port=int(sys.argv[1]), log_level="warning")
