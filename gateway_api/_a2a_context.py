"""The conversation an A2A message belongs to (docs/a2a-front.md, "Conversations").

A task's context is the RequestID of its conversation's first request (a message naming no
context starts one: its own task id). A message naming `contextId` (and `taskId`, to answer a
task asking for input) is a new request in that context: its invoke carries `context_id`, which
the door checks is the caller's own conversation with this capability
(`gateway_api.steps.conversation`), and the agent is sent (`x-reach-context-id`; an A2A agent
behind Reach gets it as its message's `contextId`, or its own task's ids from the asking task).
"""

from __future__ import annotations

from typing import Any

from a2a.types import Message
from a2a.utils.errors import InvalidParamsError, UnsupportedOperationError

from gateway_api._a2a_tasks import a2a_error
from gateway_api.services.requests import Requests
from reach.invocation import InvokeInput
from reach.security.tokens import Principal


def context_of(original: InvokeInput | None) -> str | None:
    """A task's context: the conversation its request belongs to (None: its own id)."""
    return original.context_id if original is not None else None


async def conversation(
    requests: Requests,
    capability: str,
    reader: Principal | None,
    message: Message,
    payload: dict[str, Any],
    request_id: str,
) -> tuple[str | None, dict[str, Any], str]:
    """The operation a follow-up asks again (None: not one), the payload it sends, and the
    context the new task `request_id` is in."""
    if not message.task_id:
        return None, payload, message.context_id or request_id
    rid = message.task_id
    prior, original = await requests.looked(rid, reader)
    if prior.status != "input_required":
        raise a2a_error(
            UnsupportedOperationError,
            f"message.taskId {rid!r} is {prior.status}: only a task that asks for input "
            "takes a follow-up; every other message is a new request (send it without "
            "taskId; with its contextId to stay in its context)",
        )
    if original is None or original.target != capability:
        raise a2a_error(InvalidParamsError, f"message.taskId {rid!r}: not a task of {capability!r}")
    context = context_of(original) or rid
    if message.context_id and message.context_id != context:
        raise a2a_error(
            InvalidParamsError,
            f"message.contextId {message.context_id[:140]!r}: task {rid!r} is of context "
            f"{context!r}",
        )
    ids = prior.result or {}
    handle = {key: ids[key] for key in ("task_id", "context_id") if ids.get(key)}
    return original.operation, {**payload, "_a2a": payload.get("_a2a") or handle}, context
