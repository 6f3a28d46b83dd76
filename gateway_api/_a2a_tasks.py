"""The A2A front's two translations (docs/a2a-front.md has both tables):

- a request, as Reach's envelope or a listing row tells it, as an A2A `Task` (its state, its
  result as an artifact, Reach's envelope in `metadata.reach`);
- a Reach error, and a malformed JSON-RPC request, as the JSON-RPC error the A2A spec names
  (codes and reasons are the SDK's own tables: `a2a.utils.errors`).

The task id is the RequestID and so is the context id: Reach keeps no conversation state, every
message is one request.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from a2a.types import Artifact, Message, Part, Role, Task, TaskState, TaskStatus
from a2a.utils.error_handlers import A2A_DOMAIN, ERROR_INFO_TYPE
from a2a.utils.errors import (
    A2A_ERROR_REASONS,
    JSON_RPC_ERROR_CODE_MAP,
    A2AError,
    ContentTypeNotSupportedError,
    InternalError,
    InvalidParamsError,
    InvalidRequestError,
    TaskNotFoundError,
)
from google.protobuf.struct_pb2 import Struct, Value
from google.protobuf.timestamp_pb2 import Timestamp

from gateway_api.engine import was_cancelled
from reach.errors import ReachError
from reach.listing import UNDER_WAY, RequestRow
from reach.messages import InvokeResponse

# Reach's request status -> the task's state. A cancelled request (`was_cancelled`) is canceled.
STATES: dict[str, TaskState] = {
    "accepted": TaskState.TASK_STATE_SUBMITTED,
    "running": TaskState.TASK_STATE_WORKING,
    "success": TaskState.TASK_STATE_COMPLETED,
    "error": TaskState.TASK_STATE_FAILED,
    "timeout": TaskState.TASK_STATE_FAILED,
    # An A2A agent's task behind the capability asked for input (or auth), or canceled itself:
    # final for Reach, `result` names the agent's task (docs/protocols/a2a.md).
    "input_required": TaskState.TASK_STATE_INPUT_REQUIRED,
    "canceled": TaskState.TASK_STATE_CANCELED,
}
# The statuses of a request still under way: the others are final, whatever A2A calls them.
AUTH_REQUIRED = "auth-required"  # the agent's state, in an input_required result
# A ListTasks status filter -> the listing's status.
LIST_FILTERS: dict[int, str] = {
    TaskState.TASK_STATE_WORKING: "running",
    TaskState.TASK_STATE_COMPLETED: "success",
    TaskState.TASK_STATE_FAILED: "error",
    TaskState.TASK_STATE_INPUT_REQUIRED: "input_required",
    TaskState.TASK_STATE_CANCELED: "canceled",
}
RESULT_ARTIFACT = "result"
JSON_MEDIA = "application/json"
_COMPLETED = TaskState.TASK_STATE_COMPLETED


def state_of(response: InvokeResponse) -> TaskState:
    if was_cancelled(response):
        return TaskState.TASK_STATE_CANCELED
    if response.status == "input_required" and (response.result or {}).get("state") == (
        AUTH_REQUIRED
    ):
        return TaskState.TASK_STATE_AUTH_REQUIRED
    return STATES.get(response.status, TaskState.TASK_STATE_WORKING)


def struct_of(fields: dict[str, Any]) -> Struct:
    out = Struct()
    out.update(fields)
    return out


def data_part(value: dict[str, Any]) -> Part:
    return Part(data=Value(struct_value=struct_of(value)), media_type=JSON_MEDIA)


def _now() -> Timestamp:
    stamp = Timestamp()
    stamp.GetCurrentTime()
    return stamp


def status_of(
    request_id: str,
    state: TaskState,
    text: str | None,
    detail: dict[str, Any],
    context_id: str | None = None,
) -> TaskStatus:
    """A task status at this moment; `text` (with `detail` as a data part) its message. A
    task's context is its conversation's first RequestID (`context_id`), else its own."""
    status = TaskStatus(state=state, timestamp=_now())
    if text is not None:
        parts = [Part(text=text)] + ([data_part(detail)] if detail else [])
        status.message.CopyFrom(
            Message(
                message_id=_message_id(request_id, state, text),
                role=Role.ROLE_AGENT,
                task_id=request_id,
                context_id=context_id or request_id,
                parts=parts,
            )
        )
    return status


def result_artifact(result: dict[str, Any]) -> Artifact:
    return Artifact(artifact_id=RESULT_ARTIFACT, name=RESULT_ARTIFACT, parts=[data_part(result)])


def _facts(
    response: InvokeResponse,
) -> tuple[TaskState, str | None, dict[str, Any], dict[str, Any] | None, dict[str, Any]]:
    """What a task says of a request: its state, its status message's words and data, its
    result (completed only) and Reach's envelope without the result."""
    state = state_of(response)
    error = response.error
    words = error.message if error is not None else None
    detail = error.model_dump(mode="json", exclude_none=True) if error is not None else {}
    if response.status not in UNDER_WAY and error is None and state != _COMPLETED:
        # input_required / canceled: the agent's words, and its task's ids to follow up with.
        detail = response.result or {}
        words = str(detail.get("message") or response.status)
    result = response.result if state == _COMPLETED else None
    envelope = response.model_dump(mode="json", exclude_none=True, exclude={"result"})
    return state, words, detail, result, envelope


def task_of(response: InvokeResponse, context_id: str | None = None) -> Task:
    """The task a request's envelope tells: its state; its error's words (and the error) as
    the status message; its result as the one artifact `result`; the envelope without its
    result in `metadata.reach`; its context `context_id` (None: its own id)."""
    rid = response.request_id
    state, words, detail, result, envelope = _facts(response)
    context = context_id or rid
    task = Task(id=rid, context_id=context, status=status_of(rid, state, words, detail, context))
    if result is not None:
        task.artifacts.append(result_artifact(result))
    task.metadata.update({"reach": envelope})
    return task


def task_json(response: InvokeResponse, context_id: str | None = None) -> dict[str, Any]:
    """`task_of` as its ProtoJSON, written directly: the answer's hot path (building the
    protobuf and encoding it with `json_format` costs ~0.25 ms a call). Numbers stay as the
    agent sent them (ProtoJSON of a Struct would make every one a double)."""
    rid = response.request_id
    context = context_id or rid
    state, words, detail, result, envelope = _facts(response)
    status: dict[str, Any] = {"state": TaskState.Name(state), "timestamp": _now_text()}
    if words is not None:
        parts: list[dict[str, Any]] = [{"text": words}]
        if detail:
            parts.append({"data": detail, "mediaType": JSON_MEDIA})
        status["message"] = {
            "messageId": _message_id(rid, state, words),
            "contextId": context,
            "taskId": rid,
            "role": "ROLE_AGENT",
            "parts": parts,
        }
    task: dict[str, Any] = {"id": rid, "contextId": context, "status": status}
    if result is not None:
        task["artifacts"] = [
            {
                "artifactId": RESULT_ARTIFACT,
                "name": RESULT_ARTIFACT,
                "parts": [{"data": result, "mediaType": JSON_MEDIA}],
            }
        ]
    task["metadata"] = {"reach": envelope}
    return task


def _now_text() -> str:
    return datetime.now(UTC).isoformat(timespec="microseconds").replace("+00:00", "Z")


def _message_id(request_id: str, state: TaskState, text: str) -> str:
    return f"{request_id}-{TaskState.Name(state).lower()}-{len(text)}"


def task_of_row(row: RequestRow) -> Task:
    """A listed request as a task: its state and times (a listing holds no result; GetTask
    reads it)."""
    state = STATES.get(row.status, TaskState.TASK_STATE_WORKING)
    stamp = Timestamp()
    stamp.FromDatetime(row.closed_at or row.started_at)
    task = Task(
        id=row.request_id,
        context_id=row.context_id or row.request_id,
        status=TaskStatus(state=state, timestamp=stamp),
    )
    task.metadata.update({"reach": row.model_dump(mode="json", exclude_none=True)})
    return task


class RpcError(Exception):
    """A JSON-RPC error response, and the HTTP status and headers it travels with."""

    def __init__(
        self,
        code: int,
        message: str,
        reason: str,
        *,
        http_status: int = 200,
        headers: dict[str, str] | None = None,
        metadata: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.reason = reason
        self.http_status = http_status
        self.headers = headers or {}
        self.metadata = metadata or {}

    def body(self, rpc_id: str | int | None) -> dict[str, Any]:
        info = {
            "@type": ERROR_INFO_TYPE,
            "reason": self.reason,
            "domain": A2A_DOMAIN if self.code != SERVER_ERROR else REACH_DOMAIN,
            "metadata": self.metadata,
        }
        error = {"code": self.code, "message": self.message, "data": [info]}
        return {"jsonrpc": "2.0", "id": rpc_id, "error": error}


# JSON-RPC's own code for implementation-defined server errors, below the range A2A reserves
# (-32001 to -32099): Reach's errors that no A2A error names.
SERVER_ERROR = -32000
REACH_DOMAIN = "agent-reach"
PARSE_ERROR = -32700


def a2a_error(
    kind: type[A2AError], message: str, metadata: dict[str, str] | None = None
) -> RpcError:
    """One of the errors the A2A spec names, with its code and reason from the SDK."""
    reason = A2A_ERROR_REASONS.get(kind, "PARSE_ERROR")
    return RpcError(JSON_RPC_ERROR_CODE_MAP[kind], message, reason, metadata=metadata)


def parse_error(message: str) -> RpcError:
    return RpcError(PARSE_ERROR, f"Invalid JSON payload: {message}", "PARSE_ERROR")


# Reach's error type -> the A2A error that names it; the rest are SERVER_ERROR (-32000), with
# Reach's type as the reason (`REACH_` + its name) and in `metadata.reachError`.
NAMED: dict[str, type[A2AError]] = {
    "invalid_request": InvalidParamsError,
    "payload_too_large": InvalidRequestError,
    "unknown_request": TaskNotFoundError,
    "internal": InternalError,
}
# Authentication and authorization are HTTP's (the A2A spec's 401 and 403); every other error
# travels in an HTTP 200, as JSON-RPC's do.
HTTP_STATUS = {"unauthorized": 401, "forbidden": 403}
BEARER_CHALLENGE = 'Bearer realm="agent-reach"'


def rpc_error_of(exc: ReachError, request_id: str | None = None) -> RpcError:
    """The JSON-RPC error of a Reach error (its type decides, as it decides HTTP's status)."""
    metadata: dict[str, str] = {"reachError": exc.type}
    if request_id:
        metadata["requestId"] = request_id
    headers: dict[str, str] = {}
    if exc.retry_after_s is not None or exc.http_status in (429, 503):
        retry = str(max(1, exc.retry_after_s or 1))
        metadata["retryAfterS"] = headers["Retry-After"] = retry
    if exc.type == "unauthorized":
        headers["WWW-Authenticate"] = BEARER_CHALLENGE
    named = NAMED.get(exc.type)
    if named is not None:
        error = a2a_error(named, exc.message, metadata)
        error.headers = headers
        return error
    return RpcError(
        SERVER_ERROR,
        exc.message,
        f"REACH_{exc.type.upper()}",
        http_status=HTTP_STATUS.get(exc.type, 200),
        headers=headers,
        metadata=metadata,
    )


def payload_of(message: dict[str, Any]) -> dict[str, Any]:
    """The invoke's payload from a message as sent (ProtoJSON, already parsed into the SDK's
    type, so its shape is right): the first data part (an object), else the text parts joined
    as {"text": ...}, else {}."""
    texts: list[str] = []
    for index, part in enumerate(message.get("parts") or []):
        if "data" in part:
            value = part["data"]
            if not isinstance(value, dict):
                raise a2a_error(
                    InvalidParamsError,
                    f"message.parts[{index}].data: the payload is a JSON object, not a "
                    f"{type(value).__name__}",
                )
            return value
        if "text" in part:
            texts.append(str(part["text"]))
        elif "raw" in part or "url" in part:
            kind = "raw" if "raw" in part else "url"
            raise a2a_error(
                ContentTypeNotSupportedError,
                f"message.parts[{index}]: a {kind} (file) part; Reach carries JSON: send a "
                "data part (an object) or text parts",
            )
    return {"text": "\n".join(texts)} if texts else {}
