"""A content generator served over one persistent WebSocket per gateway connection.
Run: python examples/websocket_agent.py  (gateway: $REACH_ADDRESS, default 127.0.0.1:7600).
"""

import asyncio
from typing import Any

from agent_reach_sdk import AgentRuntime

runtime = AgentRuntime("content-generator", protocol="websocket")


@runtime.operation("generate")
async def generate(payload: dict[str, Any]) -> dict[str, Any]:
    await asyncio.sleep(0.01)  # many requests share the connection while this one waits
    topic = str(payload.get("topic", "agents"))
    return {"text": f"A short note on {topic}: reach them by name, never by address."}


if __name__ == "__main__":
    runtime.run()
