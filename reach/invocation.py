"""The durable invoke's contracts: workflow input, activity inputs and outputs.

Plain pydantic models so that fields can be added later without breaking histories in flight.
Everything the workflow decides with is in its input (taken at acceptance), which keeps replays
deterministic even after the configuration changes.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any, Literal

from pydantic import BaseModel, Field

from reach.messages import InvokeResponse, Message

CapabilityMode = Literal["inline", "queue"]

# Activity and signal names: the workflow schedules by name, the activities register by name.
ACTIVITY_RESOLVE = "reach.resolve"
ACTIVITY_CALL = "reach.call"
ACTIVITY_DELIVER_CALLBACK = "reach.deliver_callback"
ACTIVITY_CLAIM_KEY = "reach.claim_key"
ACTIVITY_FOLLOW = "reach.follow"
ACTIVITY_TAKE_TOKEN = "reach.take_token"
ACTIVITY_RELEASE_KEY = "reach.release_key"
ACTIVITY_RELEASE_ROUTE = "reach.release_route"
# An agent's own long work (an A2A task) the call answered with a handle to follow: where it
# stands now, and asking it to stop at the deadline.
ACTIVITY_FOLLOW_TASK = "reach.follow_task"
ACTIVITY_CANCEL_TASK = "reach.cancel_task"
# Which instance attempt 1 was pinned to (naming a lost task's attempt that may have run);
# and any attempt's (`PinQuery`).
ACTIVITY_PINNED = "reach.pinned"
ACTIVITY_PINNED_ATTEMPT = "reach.pinned_attempt"
# Late answers arrive as an update (validated, refused without a trace once the result is final);
# the signal stays registered for requests accepted before the update existed.
UPDATE_LATE_ANSWER = "submit_late_answer"
SIGNAL_LATE_ANSWER = "late_answer"
WORKFLOW_INVOKE = "InvokeWorkflow"
# The call's failure type when the instance chosen at the door is gone before anything was sent
# (or the request may move): the workflow resolves the attempt again. Never shown to a caller.
STALE_ROUTE = "stale_route"
WORKFLOW_DELIVER_CALLBACK = "DeliverCallbackWorkflow"


def pin_of(instance_id: str, joined_at: float | None) -> str:
    """What pins an attempt to an instance: its id and join time (a restarted process, same id
    and empty memory, is another instance)."""
    return f"{instance_id} {joined_at!r}"


def delivery_workflow_id(request_id: str) -> str:
    """The callback delivery's own workflow id ('/' never appears in a RequestID)."""
    return f"{request_id}/callback"


class BucketPlan(BaseModel):
    key: str
    per_minute: float
    capacity: int


class QueuePlan(BaseModel):
    """A rate-limited request that waits for a token on durable timers (`on_limit: queue`)."""

    buckets: list[BucketPlan]
    wait_until_ms: int  # epoch ms: past this, the request ends with rate_limited


class CallPlan(BaseModel):
    """What policy decided for this request when it was accepted.

    Fields added after the first release default to what earlier requests meant, so a history
    recorded before them replays exactly (e.g. `idempotent_configured=True`: nothing learnt
    from the agents' declarations may change an old plan).
    """

    timeout_ms: int
    idempotent: bool
    max_retries: int
    backoff_s: list[float] = Field(default_factory=lambda: [1.0, 2.0, 4.0])
    mode: CapabilityMode = "inline"
    # Exponential backoff (R13); None: the `backoff_s` list of plans made before it existed.
    backoff_base_ms: int | None = None
    backoff_multiplier: float = 2.0
    backoff_cap_ms: int = 30_000
    jitter: float = 0.0
    # Whether configuration settled these, or the agents' declarations (read at resolve) may.
    idempotent_configured: bool = True
    timeout_configured: bool = True
    retries_if_idempotent: int = 0
    caller_timeout_ms: int | None = None
    queue: QueuePlan | None = None
    idempotency_ttl_s: float = 86_400.0
    judge_timeouts: bool = True


class CallbackPlan(BaseModel):
    """How the callback POST is retried; also the `callback:` section of reach.yaml."""

    attempt_timeout_s: float = Field(default=10.0, gt=0)
    retry_window_s: float = Field(default=3600.0, gt=0)
    initial_backoff_s: float = Field(default=1.0, gt=0)
    max_backoff_s: float = Field(default=60.0, gt=0)


class Endpoint(BaseModel):
    instance_id: str
    capability: str
    protocol: str
    address: str
    max_message_bytes: int | None = Field(
        default=None, description="Negotiated at Join; the agent's reply may not exceed it."
    )
    joined_at: float | None = Field(
        default=None, description="When the instance joined (a restart is another instance)."
    )
    principal: str | None = Field(
        default=None, description="Whose agent token registered it: only it may answer late."
    )
    details: dict[str, Any] = Field(
        default_factory=dict,
        description="For an instance registered by URL: what its discovery found "
        "(`reach.registry.models.Discovery.details`), for its connector.",
    )
    # What resolve met and learnt, for the workflow's plan and the request's record.
    breaker: str = "closed"
    probe: bool = False
    declared_idempotent: bool | None = None
    declared_timeout_ms: int | None = None
    skipped: list[str] = Field(default_factory=list, description="ejected instances passed over")
    strategy: str | None = Field(default=None, description="the routing strategy that chose")
    route_note: str | None = Field(
        default=None, description="why routing chose as it did, when not plainly (a fallback)"
    )
    bypassed: list[str] = Field(
        default_factory=list, description="instances passed over at their max_inflight"
    )
    pinned_before: bool = Field(
        default=False,
        description="Another run had pinned this attempt first: a lost workflow task's, which "
        "may have sent it.",
    )


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
    hash_key: str | None = Field(
        default=None,
        description="What consistent hashing hashes: the payload field the capability names "
        "(routing.hash_on), else the routing_key; taken at acceptance.",
    )
    traceparent: str | None = None
    context_id: str | None = Field(
        default=None,
        description="The conversation's first RequestID (InvokeRequest.context_id, checked "
        "at the door: the caller's own), sent to the agent; None: no conversation.",
    )
    plan: CallPlan
    payload_bytes: int = 0
    endpoint: Endpoint | None = Field(
        default=None,
        description="Attempt 1's instance, chosen at the door from the local registry view "
        "(the start set ReachInstance to it); None: the workflow resolves it.",
    )
    status_at_start: str = Field(
        default="running",
        description="The ReachStatus the start set: the end updates it only when the outcome "
        "differs. An inline request routed at the door starts as 'success' (what almost all of "
        "them end as), so its end writes no search attribute at all.",
    )


class PinQuery(BaseModel):
    """Asks which instance attempt `attempt` of `request_id` was pinned to."""

    request_id: str
    attempt: int
    made: int = Field(
        default=0,
        description="How many claims of the attempt's pin the asking run made itself: only a "
        "claim another run made after them names an instance (`reach.resolve.pin_key`).",
    )


class ResolveInput(BaseModel):
    capability: str
    exclude: list[str] = Field(default_factory=list)
    routing_key: str | None = None
    request_id: str = ""
    payload_bytes: int = Field(
        default=0, description="The payload as sent; refused if an instance could not take it."
    )
    operation: str = ""
    attempt: int = Field(default=0, description="> 0: pin this attempt to the instance chosen")
    deadline_ms: int = 0
    movable: bool | None = Field(
        default=True,
        description="Whether a re-run of this attempt may go to another instance when the one "
        "that got it is gone (idempotent, or keyed); if not, its outcome is unknown. None: "
        "as the agents declare the operation.",
    )
    pin: str | None = Field(
        default=None,
        description="The instance (`pin_of`) that got this attempt first, when the workflow "
        "knows it (chosen at the door): a re-run goes back to it.",
    )
    token: str | None = Field(
        default=None,
        description="The token this resolve's pin claim carries (the workflow's: it tells "
        "this run's claims from a lost task's, `workflows._pins`); None: a random one.",
    )
    again: int = Field(
        default=0,
        description="How many times this run claimed the attempt's pin before (a resolve "
        "again after a wait, a re-delivery): its claim then goes on a key of its own "
        "(`reach.resolve.pin_key`), and only that key found taken is another run's.",
    )


class ClaimInput(BaseModel):
    key: str
    request_id: str
    fingerprint: str
    ttl_s: float


class ClaimOutcome(BaseModel):
    owner: str  # the request that owns the key (this one, when it won)
    same_request: bool  # whether the owner asked the same thing (else: 409)


class FollowInput(BaseModel):
    request_id: str


class FollowTaskInput(BaseModel):
    """One look at (or the cancel of) the work a call's `Reply.follow` handle names."""

    endpoint: Endpoint
    handle: dict[str, Any]
    timeout_ms: int = Field(description="What one question to the agent may take.")
    window_ms: int = Field(
        default=0, description="How long to keep asking while the work goes on (0: once)."
    )
    request_id: str = ""


class TakeInput(BaseModel):
    buckets: list[BucketPlan]


class CallInput(BaseModel):
    endpoint: Endpoint
    message: Message
    timeout_ms: int
    judge_timeouts: bool = Field(
        default=True,
        description="Whether a timeout counts against the agent (breaker, ejection): not when "
        "the caller's own deadline was shorter than the operation's.",
    )
    check_first: bool = Field(
        default=False,
        description="The endpoint was chosen at the door: check that its instance is still the "
        "one chosen before calling (a re-run after a crash goes back to it, or not at all).",
    )
    movable: bool = Field(
        default=False, description="With check_first: whether the request may go elsewhere."
    )
    first_run: bool = Field(
        default=False,
        description="With check_first: the workflow's first task is running it, so nothing "
        "can have been sent before (a re-run after a crash is a later task).",
    )
    pin_token: str | None = Field(
        default=None,
        description="With check_first: the token a pin of the door's route carries "
        "(`ResolveInput.token`); None: a random one.",
    )
    routed_here: bool = Field(
        default=False,
        description="Resolve routed this attempt in the workflow task that runs this call, "
        "found no other run's pin, and no earlier run of the attempt may have sent it: a "
        "send-once claim the store cannot check then means nothing was sent.",
    )


class CallbackInput(BaseModel):
    url: str
    response: InvokeResponse
    plan: CallbackPlan = Field(default_factory=CallbackPlan)
    caller: str | None = Field(
        default=None,
        description="Whose callback this is: its webhook signature uses the caller's secret "
        "(None in inputs recorded before signing: sent unsigned).",
    )
    target: str | None = Field(
        default=None,
        description="The request's capability, for its outcome's audit record (None in inputs "
        "recorded before: the record names none).",
    )
    operation: str | None = Field(default=None, description="The request's operation, as target.")


class DeliveryOutcome(BaseModel):
    """How a callback delivery ended: the result of DeliverCallbackWorkflow."""

    status: Literal["delivered", "given_up"]
    attempts: int = 0
    last_error: str | None = None


def same_request(first: InvokeInput, repeat: InvokeInput) -> bool:
    """Whether a repeat of a RequestID is the same request: the same caller asking the same
    thing under the same terms. The callback is judged apart (a repeat may drop it)."""
    return (
        first.caller == repeat.caller
        and first.target == repeat.target
        and first.operation == repeat.operation
        and first.payload == repeat.payload  # as JSON means it: key order does not matter
        and first.plan.timeout_ms == repeat.plan.timeout_ms
        and first.idempotency_key == repeat.idempotency_key
        and first.routing_key == repeat.routing_key
        and first.context_id == repeat.context_id
    )


def idempotency_scope(caller: str, target: str, operation: str, key: str) -> str:
    """The store key of an idempotency key: one per (caller, target, operation, key)."""
    parts = [caller, target, operation, key]
    return "idem:" + hashlib.sha256(json.dumps(parts).encode()).hexdigest()[:40]


def _same_numbers(value: Any) -> Any:
    """JSON has one number type: 1 and 1.0 are the same payload."""
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, dict):
        return {k: _same_numbers(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_same_numbers(v) for v in value]
    return value


def payload_fingerprint(payload: dict[str, Any]) -> str:
    """What must match for a reused idempotency key to be the same request: the payload."""
    canonical = json.dumps(
        _same_numbers(payload), sort_keys=True, separators=(",", ":"), ensure_ascii=False
    )
    return hashlib.sha256(canonical.encode()).hexdigest()[:40]


def answer_key(answer: LateAnswer) -> str:
    """One id per late answer's content, so a resend is the same update, not another one."""
    content = [answer.status, answer.result, answer.error_type, answer.error_message]
    return hashlib.sha256(json.dumps(content, sort_keys=True).encode()).hexdigest()[:32]


class LateAnswer(BaseModel):
    """An agent's asynchronous answer (R3), as the workflow receives it.

    `error_type` and `error_message` are the agent's own words: the caller sees them inside an
    `agent_error`, they never choose the caller's status. What the gateway accepts is narrower
    (`reach.acceptance.LateAnswerBody`); this stays as lenient as histories already recorded.
    """

    instance_id: str | None = None
    # Set by the gateway from the answering agent's token (never read from the body).
    principal: str | None = None
    status: Literal["success", "error"] = "success"
    result: dict[str, Any] | None = None
    error_type: str | None = None
    error_message: str | None = None
