"""A translator reached through an MQTT 5 broker (request/response topics, correlation data).
Run: python examples/mqtt_agent.py  (broker 127.0.0.1:1883; gateway: $REACH_ADDRESS, default
127.0.0.1:7600, with the same broker reachable from the gateway's workers).
"""

from typing import Any

from agent_reach_sdk import AgentRuntime

runtime = AgentRuntime("translator", protocol="mqtt", service_address="127.0.0.1:1883")
WORDS = {"hello": "bonjour", "agent": "agent", "durable": "durable", "world": "monde"}


@runtime.operation("translate")
def translate(payload: dict[str, Any]) -> dict[str, Any]:
    words = str(payload.get("text", "")).lower().split()
    return {"text": " ".join(WORDS.get(w, w) for w in words), "to": "fr"}


if __name__ == "__main__":
    runtime.run()
