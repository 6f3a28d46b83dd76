"""The durable invoke's contracts: workflow input, activity inputs and outputs.

Plain pydantic models so that fields can be added later without breaking histories in flight.
Everything the workflow decides with is in its input (taken at acceptance), which keeps replays
deterministic even after the configuration changes.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, Field

from reach.messages import InvokeResponse, Message

CapabilityMode = Literal["inline", "queue"]

# Activity and signal names: the workflow schedules by name, the activities register by name.
ACTIVITY_RESOLVE = "reach.resolve"
ACTIVITY_CALL = "reach.call"
ACTIVITY_DELIVER_CALLBACK = "reach.deliver_callback"
SIGNAL_LATE_ANSWER = "late_answer"


class CallPlan(BaseModel):
    """What policy decided for this request when it was accepted."""

    timeout_ms: int
    idempotent: bool
    max_retries: int
    backoff_s: list[float] = Field(default_factory=lambda: [1.0, 2.0, 4.0])
    mode: CapabilityMode = "inline"


class CallbackPlan(BaseModel):
    """How the callback POST is retried; also the `callback:` section of reach.yaml."""

    attempt_timeout_s: float = Field(default=10.0, gt=0)
    retry_window_s: float = Field(default=3600.0, gt=0)
    initial_backoff_s: float = Field(default=1.0, gt=0)
    max_backoff_s: float = Field(default=60.0, gt=0)


class InvokeInput(BaseModel):
    request_id: str
    caller: str
    target: str
    operation: str
    payload: dict[str, Any] = Field(default_factory=dict)
    accepted_at_ms: int
    deadline_ms: int
    callback: str | None = None
    callback_plan: CallbackPlan = Field(default_factory=CallbackPlan)
    idempotency_key: str | None = None
    routing_key: str | None = None
    traceparent: str | None = None
    plan: CallPlan
    payload_bytes: int = 0


class Endpoint(BaseModel):
    instance_id: str
    capability: str
    protocol: str
    address: str


class ResolveInput(BaseModel):
    capability: str
    exclude: list[str] = Field(default_factory=list)
    routing_key: str | None = None
    request_id: str = ""


class CallInput(BaseModel):
    endpoint: Endpoint
    message: Message
    timeout_ms: int


class CallbackInput(BaseModel):
    url: str
    response: InvokeResponse


class LateAnswer(BaseModel):
    """An agent's asynchronous answer, delivered to the workflow by signal (R3)."""

    instance_id: str | None = None
    status: Literal["success", "error"] = "success"
    result: dict[str, Any] | None = None
    error_type: str | None = None
    error_message: str | None = None
