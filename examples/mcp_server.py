"""An MCP server that converts units, for Reach to call (it knows nothing of Reach).

    python examples/mcp_server.py --port 8931
    reach agents add mcp http://127.0.0.1:8931/mcp --capability units
    reach invoke units convert --payload '{"value": 5, "unit": "km"}'

Its one tool, `convert`, is read-only, so Reach retries it freely; its input schema and
description become the operation's (see docs/protocols/mcp.md).
"""

from __future__ import annotations

import argparse

from mcp.server.mcpserver import MCPServer
from mcp_types import ToolAnnotations

GRACE_S = 3  # how long SIGTERM waits for open streams (a gateway's listening one) to end
TO_METRES = {"m": 1.0, "km": 1000.0, "mi": 1609.344, "ft": 0.3048}

server = MCPServer(name="units", version="1.0.0")


@server.tool(
    description="Convert a length to metres and every other unit it knows.",
    annotations=ToolAnnotations(readOnlyHint=True),
)
def convert(value: float, unit: str) -> dict[str, float]:
    if unit not in TO_METRES:
        raise ValueError(f"unknown unit {unit!r}; known: {', '.join(TO_METRES)}")
    metres = value * TO_METRES[unit]
    return {name: round(metres / factor, 6) for name, factor in TO_METRES.items()}


if __name__ == "__main__":
    import uvicorn

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--port",
        type=int,
        default=8931,
        help="the port it listens on, on 127.0.0.1 (default: %(default)s)",
    )
    args = parser.parse_args()
    print(f"units MCP server at http://127.0.0.1:{args.port}/mcp", flush=True)
    # A client (a gateway) holds a listening stream open: without a bound, SIGTERM waits for it.
    uvicorn.run(
        server.streamable_http_app(),
        host="127.0.0.1",
        port=args.port,
        log_level="warning",
        timeout_graceful_shutdown=GRACE_S,
    )
