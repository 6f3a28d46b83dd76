"""An intent classifier served over gRPC (reach.agent.v1.Agent/Invoke).
Run: python examples/grpc_agent.py  (gateway: $REACH_ADDRESS, default 127.0.0.1:7600).
"""

from typing import Any

from agent_reach_sdk import AgentRuntime

runtime = AgentRuntime("intent-classifier", protocol="grpc")


@runtime.operation("classify")
def classify(payload: dict[str, Any]) -> dict[str, Any]:
    text = str(payload.get("text", "")).lower()
    intent = "refund" if "refund" in text else "question" if "?" in text else "statement"
    return {"intent": intent}


if __name__ == "__main__":
    runtime.run()
