"""The A2A connector's JSON-RPC wire: what Reach's standard message becomes as a `SendMessage`,
and what an agent's `Message` or `Task` becomes as a `Reply` (docs/protocols/a2a.md).

Requests are written as ProtoJSON directly; answers are read with the a2a-sdk's protobuf types
(its `json_format`), so an answer the SDK could not read is refused here too. The one exception
is the common answer, a message whose only part is a data object: its fields are checked here
against their A2A types and it is read as it is (the protobuf round trip cost ~0.7 ms a call).

What an answer means:

    Message                     ok, its parts are the result
    Task completed              ok, its artifacts' parts are the result
    Task submitted / working    accepted, with a follow handle (task id, context id)
    Task input- / auth-required input_required: task id, context id, state and the agent's words
    Task canceled               canceled: task id, context id and the agent's words
    Task failed / rejected      agent_error carrying the agent's words (not retryable)
    JSON-RPC error              agent_error carrying the code's name and message
                                (internal error -32603 retryable, the others not)

Parts become a result by one rule: a single data part holding an object is the result itself
(what Reach sends, so an agent answering in kind round-trips); anything else is
`{"text": ..., "data": [...], "files": [...]}` with the keys that have something. A2A carries
numbers as doubles: whole numbers come back as integers.
"""

from __future__ import annotations

import base64
from typing import Any

from a2a.types import GetTaskRequest, Message, Part, SendMessageResponse, Task, TaskState
from google.protobuf import json_format
from google.protobuf.message import Message as ProtoMessage

from reach.acceptance import check_json
from reach.errors import AgentError, AgentFault, ReachError
from reach.invocation import Endpoint
from reach.messages import Message as ReachMessage
from reach.messages import Reply

A2A_VERSION = "1.0"
# The payload key a follow-up names an input-required task by (and that is not sent on).
CONTINUE_KEY = "_a2a"

JSONRPC_ERRORS: dict[int, str] = {
    -32700: "parse_error",
    -32600: "invalid_request",
    -32601: "method_not_found",
    -32602: "invalid_params",
    -32603: "internal_error",
    -32001: "task_not_found",
    -32002: "task_not_cancelable",
    -32003: "push_notification_not_supported",
    -32004: "unsupported_operation",
    -32005: "content_type_not_supported",
    -32006: "invalid_agent_response",
    -32007: "extended_agent_card_not_configured",
    -32008: "extension_support_required",
    -32009: "version_not_supported",
}
TASK_NOT_FOUND = -32001
PUSH_NOT_SUPPORTED = -32003
# The longest task or context id taken from an agent (A2A's are UUIDs: 36).
MAX_ID_CHARS = 1024

STATE_NAMES: dict[int, str] = {
    TaskState.TASK_STATE_SUBMITTED: "submitted",
    TaskState.TASK_STATE_WORKING: "working",
    TaskState.TASK_STATE_COMPLETED: "completed",
    TaskState.TASK_STATE_FAILED: "failed",
    TaskState.TASK_STATE_CANCELED: "canceled",
    TaskState.TASK_STATE_INPUT_REQUIRED: "input-required",
    TaskState.TASK_STATE_REJECTED: "rejected",
    TaskState.TASK_STATE_AUTH_REQUIRED: "auth-required",
}
PENDING = frozenset({TaskState.TASK_STATE_SUBMITTED, TaskState.TASK_STATE_WORKING})
INTERRUPTED = frozenset({TaskState.TASK_STATE_INPUT_REQUIRED, TaskState.TASK_STATE_AUTH_REQUIRED})


def message_id(request_id: str, attempt: int) -> str:
    """The A2A message id of an attempt: a resend of the same attempt is the same message."""
    return f"{request_id}:{attempt}"


def _plain(value: Any) -> Any:
    """JSON as Reach carries it: A2A's doubles that are whole become integers again."""
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    return value


def send_request(message: ReachMessage) -> dict[str, Any]:
    """The `SendMessage` params for a Reach message (ProtoJSON, written out: the payload is
    JSON Reach already checked): the payload as one data part, the Reach header in
    `metadata.reach`, a follow-up's task and context ids from the payload's `_a2a`, else the
    request's conversation (`Header.context_id`) as the context id."""
    header = message.header
    payload = message.payload
    follow_up = payload.get(CONTINUE_KEY) if CONTINUE_KEY in payload else None
    if follow_up is not None:
        payload = {k: v for k, v in payload.items() if k != CONTINUE_KEY}
    reach: dict[str, Any] = {
        "request_id": header.request_id,
        "caller": header.caller,
        "operation": header.operation,
        "attempt": header.attempt,
    }
    if header.deadline_ms is not None:
        reach["deadline_ms"] = header.deadline_ms
    if header.idempotency_key is not None:
        reach["idempotency_key"] = header.idempotency_key
    if header.context_id is not None:
        reach["context_id"] = header.context_id
    wire: dict[str, Any] = {
        "messageId": message_id(header.request_id, header.attempt),
        "role": "ROLE_USER",
        "parts": [{"data": payload}],
        "metadata": {"reach": reach},
    }
    if isinstance(follow_up, dict):
        if follow_up.get("task_id"):
            wire["taskId"] = str(follow_up["task_id"])
        if follow_up.get("context_id"):
            wire["contextId"] = str(follow_up["context_id"])
    # A Reach conversation is the agent's context too (an agent takes a client's contextId for
    # a new task), unless the follow-up names the agent's own task (its context is its own).
    if header.context_id and "contextId" not in wire and "taskId" not in wire:
        wire["contextId"] = header.context_id
    # returnImmediately: answer with the task as soon as there is one, so its id goes into the
    # request's history before the work is done and nothing after needs the message again.
    return {"message": wire, "configuration": {"returnImmediately": True}}


def get_task_request(task_id: str) -> dict[str, Any]:
    return json_format.MessageToDict(GetTaskRequest(id=task_id, history_length=0))


def parse(data: Any, into: ProtoMessage, what: str, where: str) -> Any:
    """`data` read as the a2a-sdk type `into`, or an AgentError naming what is wrong."""
    if not isinstance(data, dict):
        raise AgentError(f"{where}: {what} is not a JSON object", retryable=False)
    try:
        return json_format.ParseDict(data, into, ignore_unknown_fields=True)
    except (json_format.ParseError, ValueError, TypeError) as exc:
        raise AgentError(f"{where}: {what} is not an A2A {what}: {exc}", retryable=False) from None


def rpc_error(error: Any, where: str) -> AgentError:
    """A JSON-RPC error object as the agent_error it is."""
    if not isinstance(error, dict):
        return AgentError(f"{where}: a JSON-RPC error that is not an object", retryable=False)
    code = error.get("code")
    name = JSONRPC_ERRORS.get(code, f"jsonrpc_{code}") if isinstance(code, int) else "jsonrpc"
    words = str(error.get("message") or "")
    fault = AgentFault(type=name, message=words)
    err = AgentError(f"{where}: {name}: {words}", retryable=code == -32603, fault=fault)
    err.code = code  # type: ignore[attr-defined]
    return err


def _words(message: Message | None) -> str:
    if message is None:
        return ""
    return "\n".join(part.text for part in message.parts if part.HasField("text"))


def result_of(parts: list[Part]) -> dict[str, Any]:
    """The rule: one data part holding an object is the result; else text, data and files."""
    if len(parts) == 1 and parts[0].HasField("data"):
        value = _plain(json_format.MessageToDict(parts[0].data))
        if isinstance(value, dict):
            return value
    texts: list[str] = []
    data: list[Any] = []
    files: list[dict[str, str]] = []
    for part in parts:
        if part.HasField("text"):
            texts.append(part.text)
        elif part.HasField("data"):
            data.append(_plain(json_format.MessageToDict(part.data)))
        elif part.HasField("url") or part.HasField("raw"):
            file = {"url": part.url} if part.HasField("url") else {}
            if part.HasField("raw"):
                file["raw"] = base64.b64encode(part.raw).decode()
            if part.filename:
                file["filename"] = part.filename
            if part.media_type:
                file["media_type"] = part.media_type
            files.append(file)
    result: dict[str, Any] = {}
    if texts:
        result["text"] = "\n".join(texts)
    if data:
        result["data"] = data
    if files:
        result["files"] = files
    return result


def handle_of(task: Task, url: str) -> dict[str, Any]:
    """What the workflow keeps (in history) to follow a task."""
    return {
        "task_id": task.id,
        "context_id": task.context_id,
        "url": url,
        "state": STATE_NAMES.get(task.status.state, "unknown"),
    }


def _checked(result: dict[str, Any], where: str, limit: int) -> dict[str, Any]:
    try:
        check_json(result, what="its result", limit=limit)
    except ReachError as exc:
        raise AgentError(f"{where}; {exc.message}", retryable=False) from exc
    return result


def _named(task_id: str, context_id: str) -> dict[str, str] | None:
    """The ids a final answer names, those not over `MAX_ID_CHARS` (a message's are not
    checked as a task's are: one too long is not noted, as nobody could name it back)."""
    named = {
        key: value
        for key, value in (("task_id", task_id), ("context_id", context_id))
        if value and len(value) <= MAX_ID_CHARS
    }
    return named or None


def reply_of_task(task: Task, endpoint: Endpoint, url: str, limit: int) -> Reply:
    """The Reply a task stands for (its state decides), or the agent_error it is."""
    where = f"agent {endpoint.instance_id}"
    if not task.id:
        raise AgentError(f"{where} answered a task without an id", retryable=False)
    if len(task.id) > MAX_ID_CHARS or len(task.context_id) > MAX_ID_CHARS:
        # The follow handle holding them is in every look's input in the request's history.
        raise AgentError(
            f"{where} answered a task whose id or context id is over {MAX_ID_CHARS} characters",
            retryable=False,
        )
    state = task.status.state
    name = STATE_NAMES.get(state, "unspecified")
    words = _words(task.status.message if task.status.HasField("message") else None)
    if state in PENDING:
        return Reply(status="accepted", follow=handle_of(task, url))
    if state == TaskState.TASK_STATE_COMPLETED:
        parts = [part for artifact in task.artifacts for part in artifact.parts]
        if not parts and task.status.HasField("message"):
            parts = list(task.status.message.parts)
        result = _checked(result_of(parts), where, limit)
        return Reply(status="ok", result=result, named=_named(task.id, task.context_id))
    if state in INTERRUPTED or state == TaskState.TASK_STATE_CANCELED:
        result = {"task_id": task.id, "context_id": task.context_id, "state": name}
        if words:
            result["message"] = words
        status = "canceled" if state == TaskState.TASK_STATE_CANCELED else "input_required"
        return Reply(status=status, result=_checked(result, where, limit))
    if state in (TaskState.TASK_STATE_FAILED, TaskState.TASK_STATE_REJECTED):
        fault = AgentFault(type=f"task_{name}", message=words)
        said = f": {words}" if words else ""
        raise AgentError(f"{where}: task {task.id} {name}{said}", retryable=False, fault=fault)
    raise AgentError(f"{where} answered task {task.id} in state {name}", retryable=False)


_PART_EXTRAS = frozenset({"mediaType", "metadata", "filename"})
_MESSAGE_FIELDS = frozenset(
    {
        "messageId",
        "contextId",
        "taskId",
        "role",
        "parts",
        "metadata",
        "extensions",
        "referenceTaskIds",
    }
)


def _one_data_object(result: Any) -> dict[str, Any] | None:
    """The object of a `{"message": ...}` result whose only part is one data part holding an
    object, when every field around it has the type A2A gives it; else None (the SDK's types
    then read it, and refuse what they cannot)."""
    if not isinstance(result, dict) or result.keys() != {"message"}:
        return None
    message = result["message"]
    if not isinstance(message, dict) or not message.keys() <= _MESSAGE_FIELDS:
        return None
    parts = message.get("parts")
    if not isinstance(parts, list) or len(parts) != 1 or not isinstance(parts[0], dict):
        return None
    part = parts[0]
    data = part.get("data")
    if not isinstance(data, dict) or not part.keys() - {"data"} <= _PART_EXTRAS:
        return None
    strings = ("messageId", "contextId", "taskId", "role")
    if not all(isinstance(message.get(k, ""), str) for k in strings):
        return None
    if message.get("role", "ROLE_AGENT") not in ("ROLE_AGENT", "ROLE_USER", "ROLE_UNSPECIFIED"):
        return None
    for key in ("mediaType", "filename"):
        if not isinstance(part.get(key, ""), str):
            return None
    for holder in (message, part):
        if not isinstance(holder.get("metadata", {}), dict):
            return None
    for key in ("extensions", "referenceTaskIds"):
        listed = message.get(key, [])
        if not isinstance(listed, list) or not all(isinstance(v, str) for v in listed):
            return None
    return data


def reply_of_send(result: Any, endpoint: Endpoint, url: str, limit: int) -> Reply:
    """The Reply of a `SendMessage` result: a message or a task."""
    where = f"agent {endpoint.instance_id}"
    data = _one_data_object(result)
    if data is not None:  # the common answer, read without the protobuf round trip
        message = result["message"]
        named = _named(message.get("taskId", ""), message.get("contextId", ""))
        return Reply(status="ok", result=_checked(_plain(data), where, limit), named=named)
    response = parse(result, SendMessageResponse(), "SendMessage result", where)
    if response.HasField("message"):
        return Reply(
            status="ok",
            result=_checked(result_of(list(response.message.parts)), where, limit),
            named=_named(response.message.task_id, response.message.context_id),
        )
    if response.HasField("task"):
        return reply_of_task(response.task, endpoint, url, limit)
    raise AgentError(
        f"{where} answered SendMessage with neither a message nor a task", retryable=False
    )


def reply_of_get(
    result: Any, endpoint: Endpoint, url: str, limit: int, task_id: str | None = None
) -> Reply:
    """The Reply of a `GetTask` result about `task_id`: an answer about another task (whose
    id the follow handle would then take, and whose result would be this request's) is an
    agent_error, its outcome unknown (the task asked about may have run)."""
    where = f"agent {endpoint.instance_id}"
    task = parse(result, Task(), "task", where)
    if task_id is not None and task.id != task_id:
        exc = AgentError(
            f"{where} answered GetTask {task_id[:100]} about another task, "
            f"{task.id[:100]!r}; task {task_id[:100]} may have run",
            retryable=False,
        )
        exc.outcome_unknown = True
        raise exc
    return reply_of_task(task, endpoint, url, limit)
