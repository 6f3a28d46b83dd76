"""A summarizer served over HTTP.  Run: python examples/http_agent.py  (gateway: $REACH_ADDRESS,
default 127.0.0.1:7600). Then: curl -s localhost:7600/reach/invoke -d '{"target": "summarizer",
"operation": "summarize", "payload": {"text": "Reach is durable. It retries."}}'
"""

from typing import Any

from agent_reach_sdk import AgentRuntime

runtime = AgentRuntime("summarizer", protocol="http")


@runtime.operation("summarize")
def summarize(payload: dict[str, Any]) -> dict[str, Any]:
    text = str(payload.get("text", ""))
    return {"summary": text.split(". ")[0].rstrip(".") + "."}


if __name__ == "__main__":
    runtime.run()
