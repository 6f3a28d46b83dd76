"""An MCP server behind Reach while the conformance suite runs (`make conformance`): it serves
`test_tool_with_progress`, which reports progress 0, 50 and 100 (50 ms apart) before its answer,
as the suite's scenario asks. Registered by URL as capability `conformance-mcp`, so the suite's
call goes client -> Reach's MCP front -> a durable request -> this server, and its progress
comes back through Reach (the connector's record, relayed by the front).

    python tests/conformance/mcp_progress_server.py PORT
"""

from __future__ import annotations

import asyncio
import sys

import uvicorn
from mcp.server.mcpserver import Context, MCPServer

server = MCPServer(name="reach-conformance-progress", version="1")


@server.tool(description="Reports progress 0, 50, 100, then answers.", structured_output=False)
async def test_tool_with_progress(ctx: Context) -> str:
    for step in (0, 50, 100):
        await ctx.report_progress(step, 100, f"step {step}")
        await asyncio.sleep(0.05)
    return "progress reported"


if __name__ == "__main__":
    app = server.streamable_http_app(stateless_http=True)
    uvicorn.run(app, host="127.0.0.1", port=int(sys.argv[1]), log_level="warning")
