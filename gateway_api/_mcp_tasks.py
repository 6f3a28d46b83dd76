"""The MCP tasks extension (`io.modelcontextprotocol/tasks`) on Reach's MCP front: a tool call
as a task whose id is its RequestID, read and cancelled from any gateway, after any restart.

A client of the stateless protocol (2026-07-28) that declares the extension in a request's
`clientCapabilities.extensions` gets, for a `tools/call` still running `TASK_AFTER_S` after
Reach made it durable, a `CreateTaskResult` (`resultType: "task"`, `taskId` = the RequestID)
instead of holding the stream open; a call that ends sooner is answered directly, as the
extension lets the server decide. Then:

    tasks/get      the task: working, or completed with the tool result it would have had
                   (an agent's failure is a completed task whose result has `isError`), or
                   cancelled; read from Temporal (`Requests.status`), so any gateway answers
    tasks/cancel   Temporal's cancel of the request (`Engine.cancel`), audited
    tasks/update   refused: Reach's agents never ask for input

The handshake protocol's own tasks (2025-11-25, before they became the extension) work the same
on a session at that version: Reach declares `capabilities.tasks` (cancel, tools/call), lists
every tool with `execution.taskSupport: "optional"`, and a `tools/call` with `params.task` is
answered at once, once durable, with `{"task": {...}}`; `tasks/get` is the task, `tasks/result`
waits for the tool result, `tasks/cancel` answers the task after the cancel.

Only the request's caller (or an admin) sees its task; anyone else is told it does not exist,
as `GET /reach/requests/{id}` does. A task is kept as long as its request: until Temporal's
retention after it closes (`ttlMs` is null: Reach sets no shorter life).
"""

from __future__ import annotations

import re
from datetime import UTC, datetime
from typing import Any, Final

from temporalio.service import RPCError

from gateway_api import _mcp_wire as wire
from gateway_api._mcp_tools import call_result, rpc_error_of
from gateway_api.engine import was_cancelled
from gateway_api.errors import reach_error_of_rpc
from gateway_api.gateway import Gateway
from reach.errors import ReachError
from reach.listing import UNDER_WAY
from reach.messages import REQUEST_ID_PATTERN
from reach.security.tokens import Principal

EXTENSION: Final = "io.modelcontextprotocol/tasks"
TASKS_2025: Final = "2025-11-25"  # the handshake version whose core protocol has tasks
RELATED_TASK_META: Final = "io.modelcontextprotocol/related-task"
# What a 2025-11-25 server says it can do with tasks (initialize's capabilities.tasks).
CAPABILITY_2025: Final[dict[str, Any]] = {"cancel": {}, "requests": {"tools": {"call": {}}}}
TASK_AFTER_S = 1.0
POLL_MS = 1000
CANCEL_WAIT_S = 2.0
_REQUEST_ID = re.compile(REQUEST_ID_PATTERN)  # a task id is a RequestID


def wanted(message: wire.Message) -> bool:
    """Whether the request's client declared the extension (the stateless protocol only:
    its capabilities travel with each request)."""
    capabilities = message.meta.get(wire.CAPABILITIES_META)
    if not isinstance(capabilities, dict):
        return False
    extensions = capabilities.get("extensions")
    return isinstance(extensions, dict) and EXTENSION in extensions


def _iso(moment: datetime | None) -> str:
    return (moment or datetime.now(UTC)).astimezone(UTC).isoformat().replace("+00:00", "Z")


def created(request_id: str) -> dict[str, Any]:
    """The `CreateTaskResult` of a call Reach made durable and is still running."""
    now = _iso(None)
    return {
        "resultType": "task",
        "taskId": request_id,
        "status": "working",
        "statusMessage": f"Reach request {request_id}: GET /reach/requests/{request_id}",
        "createdAt": now,
        "lastUpdatedAt": now,
        "ttlMs": None,
        "pollIntervalMs": POLL_MS,
        "_meta": {wire.REQUEST_ID_META: request_id},
    }


def created_2025(request_id: str) -> dict[str, Any]:
    """2025-11-25's `CreateTaskResult`: the task under `task`, its fields named as then."""
    task = created(request_id)
    return {
        "task": {
            "taskId": request_id,
            "status": "working",
            "statusMessage": task["statusMessage"],
            "createdAt": task["createdAt"],
            "lastUpdatedAt": task["lastUpdatedAt"],
            "ttl": None,
            "pollInterval": POLL_MS,
        },
        "_meta": task["_meta"],
    }


def asked_2025(message: wire.Message, version: str) -> bool:
    """Whether a 2025-11-25 tools/call asks to run as a task (`params.task`)."""
    return version == TASKS_2025 and isinstance(message.params.get("task"), dict)


class Tasks:
    def __init__(self, gateway: Gateway, *, modern: bool = True) -> None:
        self.gateway = gateway
        self.modern = modern  # False: 2025-11-25's tasks (ttl, pollInterval; tasks/result)

    def reader(self, headers: dict[str, str]) -> Principal | None:
        guard = self.gateway.guard
        return guard.auth.anyone(headers.get("authorization")) if guard is not None else None

    async def handle(self, message: wire.Message, headers: dict[str, str]) -> dict[str, Any]:
        task_id = message.params.get("taskId")
        if not isinstance(task_id, str) or not task_id:
            raise wire.RpcError(wire.INVALID_PARAMS, "params.taskId is the task's id (a string)")
        if _REQUEST_ID.fullmatch(task_id) is None:  # never sent on to Temporal (a 500 was)
            raise wire.RpcError(wire.INVALID_PARAMS, f"no task {task_id[:100]!r}")
        try:
            principal = self.reader(headers)
            if message.method == "tasks/get":
                return await self.get(task_id, principal)
            if message.method == "tasks/cancel":
                await self.cancel(task_id, principal)
                return {} if self.modern else await self.get(task_id, principal)
            if message.method == "tasks/result" and not self.modern:
                return await self.result(task_id, principal)
        except ReachError as exc:
            raise _task_error(exc, task_id) from None
        except RPCError as exc:
            raise _task_error(reach_error_of_rpc(exc), task_id) from None
        raise wire.RpcError(
            wire.INVALID_PARAMS, f"task {task_id[:100]!r} takes no input: Reach never asks for any"
        )

    async def get(self, task_id: str, principal: Principal | None) -> dict[str, Any]:
        response = await self.gateway.requests.status(task_id, principal)
        handle = self.gateway.engine.handle(task_id)
        desc = await handle.describe(rpc_timeout=self.gateway.rpc_timeout)
        task: dict[str, Any] = {
            "taskId": task_id,
            "createdAt": _iso(desc.start_time),
            "lastUpdatedAt": _iso(desc.close_time or desc.start_time),
        }
        if self.modern:
            task.update(resultType="complete", ttlMs=None, pollIntervalMs=POLL_MS)
        else:
            task.update(ttl=None, pollInterval=POLL_MS)
        if response.status in UNDER_WAY:
            task["status"] = "working"
        elif response.status == "canceled" or was_cancelled(response):
            task["status"] = "cancelled"
            if response.error is not None:
                task["statusMessage"] = response.error.message
        else:
            task["status"] = "completed"
            if self.modern:  # 2025-11-25 reads the result with tasks/result
                task["result"] = call_result(response, modern=True)
        return task

    async def result(self, task_id: str, principal: Principal | None) -> dict[str, Any]:
        """2025-11-25's tasks/result: the tool result once the request ended (waited for)."""
        await self.gateway.requests.status(task_id, principal)  # its caller's only
        engine = self.gateway.engine
        response = await engine.outcome(engine.handle(task_id))
        out = call_result(response, modern=False)
        out["_meta"][RELATED_TASK_META] = {"taskId": task_id}
        return out

    async def cancel(self, task_id: str, principal: Principal | None) -> None:
        who = principal.name if principal is not None else "anonymous"
        # Cooperative: the workflow stops at its next step; a moment is waited to say so.
        asked, current = await self.gateway.requests.cancel(
            task_id,
            principal,
            front="mcp",
            reason=f"tasks/cancel from {who} through the MCP front",
            wait_s=CANCEL_WAIT_S,
        )
        if not asked:
            raise wire.RpcError(
                wire.INVALID_PARAMS, f"task {task_id!r} already ended ({current.status})"
            )


def _task_error(exc: ReachError, task_id: str) -> wire.RpcError:
    if exc.type == "unknown_request":
        return wire.RpcError(wire.INVALID_PARAMS, f"no task {task_id[:100]!r}")
    return rpc_error_of(exc, task_id)
