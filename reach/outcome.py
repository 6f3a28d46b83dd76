"""How a request that ended in error or timeout shows in Temporal: as a failed workflow.

Its workflow ends by raising an `ApplicationError` of type `FAILED_OUTCOME` whose one detail is
the final envelope (the same `InvokeResponse` a completed workflow returns, through the same
payload codec), so the Temporal UI, `temporal workflow list` and `temporal workflow show` call
it Failed, with a one-line message, while every reader of the result (the door, GET
/reach/requests/{id}, a repeat, an idempotency key's follower, the timeline, late answers)
reads that envelope as before. A success (and anything that is not an error or a timeout)
completes the workflow as it always did. Requests accepted before this rule (no
`PATCH_FAILED_OUTCOME` marker in their history) keep completing, so their histories replay.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from reach.messages import InvokeResponse

# The ApplicationError type of a failed workflow that carries its request's envelope.
FAILED_OUTCOME = "ReachFailedOutcome"
# The workflow.patched id of the rule (requests accepted earlier complete, for replay).
PATCH_FAILED_OUTCOME = "failed-outcome-fails-workflow"
# The statuses that end a request's workflow as failed.
FAILING = frozenset({"error", "timeout"})
# How long the failure's message may be (the envelope in its detail holds the whole error).
MESSAGE_MAX = 300


def may_have_run(who: str, *, idempotent: bool, keyed: bool) -> str:
    """What a request that timed out after it was (or may have been) sent tells its caller, in
    words that agree with its `retryable: false`: it may have run, so Reach does not invite a
    repeat. Said before: "the operation is idempotent or the request keyed, so repeating it is
    safe" beside `retryable: false`; and to a keyless write, "repeat it with an
    idempotency_key", whose new key would let it run a second time."""
    said = f"{who} may have run it, so it is not retryable"
    if keyed:
        # Its key keeps the timeout (workflows.invoke `_frees_key`): a repeat runs nothing.
        return (
            f"{said}; sent again with the same idempotency_key it is not run again and gets "
            "this answer back"
        )
    if idempotent:
        return (
            f"{said}; the operation is declared idempotent, so a second run does no harm if "
            "that holds: yours to judge before sending it again"
        )
    return (
        f"{said}: sent again, it may run twice. Find out whether it ran first; a request "
        "sent with an idempotency_key runs at most once, however often it is sent with that key"
    )


def fails(response: InvokeResponse) -> bool:
    return response.status in FAILING


def failure_message(response: InvokeResponse) -> str:
    """The failed workflow's message, what the Temporal UI shows first: the status, the error's
    type and message (with encryption on, the failure converter encodes it like a payload)."""
    error = response.error
    line = response.status if error is None else f"{response.status} {error.type}: {error.message}"
    return line if len(line) <= MESSAGE_MAX else line[: MESSAGE_MAX - 3] + "..."


def carried(failure_type: str | None, details: Sequence[Any]) -> InvokeResponse | None:
    """The envelope a failed workflow carries (its ApplicationError's type and details), or
    None when it is another failure (a bug, a terminate, a timeout set outside Reach)."""
    if failure_type != FAILED_OUTCOME or len(details) != 1:
        return None
    detail = details[0]
    if isinstance(detail, InvokeResponse):
        return detail
    try:
        return InvokeResponse.model_validate(detail)
    except ValueError:
        return None
