"""The agent side of Agent-Reach: join, heartbeat, serve operations, answer late (R8, R24)."""

from agent_reach_sdk.context import (
    Deferred,
    RequestContext,
    current_request_id,
    install_request_id_logging,
)
from agent_reach_sdk.runtime import AgentRuntime, OperationError

__all__ = [
    "AgentRuntime",
    "Deferred",
    "OperationError",
    "RequestContext",
    "current_request_id",
    "install_request_id_logging",
]
