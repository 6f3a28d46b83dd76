"""The A2A front's methods over one capability (`gateway_api.a2a_front` parses the JSON-RPC and
hands each call here). SendMessage and SendStreamingMessage go through the door, as
`POST /reach/invoke` does; the reads are the request reads the HTTP API makes (status,
timeline, listing); CancelTask is Temporal's workflow cancel (`Engine.cancel`).
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import time
from collections.abc import AsyncIterator
from datetime import UTC, datetime
from typing import Any

from a2a.types import (
    CancelTaskRequest,
    GetTaskRequest,
    ListTasksRequest,
    ListTasksResponse,
    SendMessageRequest,
    SendMessageResponse,
    StreamResponse,
    SubscribeToTaskRequest,
    Task,
    TaskArtifactUpdateEvent,
    TaskState,
    TaskStatusUpdateEvent,
)
from a2a.utils.errors import (
    InvalidParamsError,
    TaskNotCancelableError,
    UnsupportedOperationError,
)
from google.protobuf import json_format
from google.protobuf.message import Message as Proto
from temporalio.service import RPCError

from gateway_api import _a2a_cards as cards
from gateway_api import listing, timeline
from gateway_api._a2a_context import context_of, conversation
from gateway_api._a2a_tasks import (
    LIST_FILTERS,
    RpcError,
    a2a_error,
    payload_of,
    rpc_error_of,
    status_of,
    task_json,
    task_of,
    task_of_row,
)
from gateway_api.errors import reach_error_of_rpc
from gateway_api.front import Bytes
from gateway_api.gateway import Gateway
from gateway_api.steps.identify import AUTHORIZATION, CALLER, TRACEPARENT, Metadata
from gateway_api.steps.wait import SYNC_GRACE_S, LetGo
from reach import acceptance
from reach.errors import ReachError, Unavailable, UnknownCapability
from reach.listing import DEFAULT_LIMIT, MAX_LIMIT, UNDER_WAY
from reach.messages import REQUEST_ID_PATTERN, InvokeResponse, dumps, new_request_id
from reach.security.tokens import Principal
from reach.telemetry import tracing

log = logging.getLogger("reach.gateway")

# Message metadata an invoke takes (either spelling), beside `operation` / `skill`.
INVOKE_FIELDS = {
    "request_id": "request_id",
    "requestId": "request_id",
    "timeout_ms": "timeout_ms",
    "timeoutMs": "timeout_ms",
    "idempotency_key": "idempotency_key",
    "idempotencyKey": "idempotency_key",
    "routing_key": "routing_key",
    "routingKey": "routing_key",
}
OPERATION_KEYS = ("operation", "skill")
# How often a stream reads the request's timeline while it runs: at first, then less often
# (a long task's stream costs Temporal a history read every POLL_MAX_S).
POLL_S = 0.25
POLL_MAX_S = 2.0
# How long CancelTask waits for the cancelled request to end before it answers.
CANCEL_WAIT_S = 10.0
# Timeline events a stream does not repeat: the task itself says accepted, the end is final.
NOT_PROGRESS = frozenset({"accepted", "result", "timeout", "ended"})
_REQUEST_ID = re.compile(REQUEST_ID_PATTERN)
STOPPING = (
    "the gateway is stopping: the task goes on; follow it with SubscribeToTask or GetTask "
    "(through any gateway)"
)


def _json(message: Proto, **kw: Any) -> dict[str, Any]:
    return json_format.MessageToDict(message, **kw)


def sse(
    rpc_id: str | int | None, event: StreamResponse | None, error: RpcError | None = None
) -> str:
    if error is not None:
        return f"event: error\ndata: {json.dumps(error.body(rpc_id))}\n\n"
    assert event is not None
    body = {"jsonrpc": "2.0", "id": rpc_id, "result": _json(event)}
    return f"data: {json.dumps(body, separators=(',', ':'))}\n\n"


class _Front:
    """The door's front for one A2A call: it learns the RequestID (`named`) and when the
    request's workflow is durable (`started`), which streams wait for. A returnImmediately
    call lets the request go there (`let_go`): the door answers it `accepted` and holds
    nothing of it (no waiter, no room among the bytes in flight); GetTask reads its result
    from its workflow."""

    __slots__ = ("_started", "let_go", "request_id")

    def __init__(self, let_go: LetGo = None) -> None:
        self.request_id: str | None = None
        self.let_go = let_go
        self._started = asyncio.Event()

    async def named(self, request_id: str, caller: str) -> None:
        self.request_id = request_id

    async def started(self, request_id: str) -> LetGo:
        self._started.set()
        return self.let_go

    async def started_or_done(self, job: asyncio.Task[InvokeResponse]) -> None:
        waiter = asyncio.ensure_future(self._started.wait())
        try:
            await asyncio.wait({job, waiter}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            waiter.cancel()


class Call:
    """One JSON-RPC call to `/a2a/{capability}`."""

    def __init__(
        self, gateway: Gateway, capability: str, metadata: Metadata, jobs: set[asyncio.Task[Any]]
    ) -> None:
        self.gateway = gateway
        self.capability = capability
        self.metadata = metadata
        self.jobs = jobs
        self.request_id: str | None = None
        self.raw: dict[str, Any] = {}  # the params as sent (numbers as the caller wrote them)
        self.draining: asyncio.Event | None = None  # set when the server stops (http_limits)
        # Done once the caller went (a stream's response ended): the door lets its wait go.
        self.gone: asyncio.Future[None] | None = None

    # -- who reads ----------------------------------------------------------------------------

    def reader(self) -> Principal | None:
        """Any valid token (None when tokens are not required), as the HTTP reads ask."""
        guard = self.gateway.guard
        return guard.auth.anyone(self.metadata.get(AUTHORIZATION)) if guard else None

    def who(self, principal: Principal | None) -> str:
        if principal is not None:
            return principal.name
        return acceptance.caller_header(self.metadata.get(CALLER)) or "anonymous"

    # -- SendMessage --------------------------------------------------------------------------

    async def send(self, params: SendMessageRequest) -> dict[str, Any]:
        body = await self._invoke_body(params)
        context = body.get("context_id")
        immediately = params.configuration.return_immediately
        # returnImmediately: answered once durable, and nothing of it is held here after.
        response = await self._door(body, _Front(0.0 if immediately else self.gone), "SendMessage")
        if response.status == "accepted" and immediately and "callback" not in body:
            rid = response.request_id
            task = Task(id=rid, context_id=context or rid)
            task.status.CopyFrom(status_of(rid, _SUBMITTED, None, {}, context))
            return _json(SendMessageResponse(task=task))
        if response.status == "accepted" and not immediately:
            response = await self._outcome(response.request_id, body)  # blocking
        return {"task": task_json(response, context)}

    async def stream(
        self, rpc_id: str | int | None, params: SendMessageRequest
    ) -> AsyncIterator[str]:
        """The events of SendStreamingMessage: refusals are raised before the first."""
        body = await self._invoke_body(params)
        self.gone = asyncio.get_running_loop().create_future()
        job, front = await self._started(body, "SendStreamingMessage", self.gone)
        if job.done():
            job.result()  # a refusal: raised here, answered as a JSON-RPC error
        rid = front.request_id or job.result().request_id
        self.request_id = rid
        context = body.get("context_id") or rid
        status = status_of(rid, _SUBMITTED, None, {}, context)
        first = Task(id=rid, context_id=context, status=status)
        return self._events(rpc_id, rid, first, job, owned=False, body=body)

    async def subscribe(
        self, rpc_id: str | int | None, params: SubscribeToTaskRequest
    ) -> AsyncIterator[str]:
        rid = self.task_id_of(params.id)
        current, original = await self.gateway.requests.looked(rid, self.reader())
        if current.status not in UNDER_WAY:
            raise a2a_error(
                UnsupportedOperationError, f"task {rid} already ended ({current.status})"
            )
        handle = self.gateway.engine.handle(rid)
        final = asyncio.ensure_future(self.gateway.engine.outcome(handle))
        first = task_of(current, context_of(original))
        return self._events(rpc_id, rid, first, final, owned=True, body=None)

    async def _events(
        self,
        rpc_id: str | int | None,
        rid: str,
        first: Task,
        final: asyncio.Future[InvokeResponse],
        *,
        owned: bool,
        body: dict[str, Any] | None,
    ) -> AsyncIterator[str]:
        """The task, a working status per step of its timeline as it happens (routed, sent,
        attempts, backoffs), then its result as an artifact and its final status; or, when the
        server stops first, an `unavailable` error (the task goes on)."""
        yield sse(rpc_id, StreamResponse(task=first))
        context = first.context_id
        seen, every = 0, POLL_S
        draining = asyncio.ensure_future((self.draining or asyncio.Event()).wait())
        waits: set[asyncio.Future[Any]] = {final, draining}
        try:
            while not final.done():
                await asyncio.wait(waits, timeout=every)
                if draining.done() and not final.done():  # else the server waits for its end
                    yield sse(
                        rpc_id, None, rpc_error_of(Unavailable(STOPPING, retry_after_s=1), rid)
                    )
                    return
                every = min(every * 1.5, POLL_MAX_S)
                if (refused := self._revoked(rpc_id, rid)) is not None:
                    yield refused
                    return
                events, seen = await self._progress(rid, seen, context)
                for event in events:
                    yield sse(rpc_id, event)
            try:
                response = final.result()
                if response.status == "accepted":  # a callback request: wait for its end
                    response = await self._outcome(rid, body or {})
            except ReachError as exc:
                yield sse(rpc_id, None, rpc_error_of(exc, rid))
                return
            except RPCError as exc:  # Temporal unavailable: the task goes on, GetTask reads it
                yield sse(rpc_id, None, rpc_error_of(reach_error_of_rpc(exc), rid))
                return
            if (refused := self._revoked(rpc_id, rid)) is not None:
                yield refused
                return
            events, seen = await self._progress(rid, seen, context)
            for event in events:
                yield sse(rpc_id, event)
            task = task_of(response, context)
            for artifact in task.artifacts:
                update = TaskArtifactUpdateEvent(
                    task_id=rid, context_id=context, artifact=artifact, last_chunk=True
                )
                yield sse(rpc_id, StreamResponse(artifact_update=update))
            status = TaskStatusUpdateEvent(task_id=rid, context_id=context, status=task.status)
            status.metadata.CopyFrom(task.metadata)
            yield sse(rpc_id, StreamResponse(status_update=status))
        finally:
            draining.cancel()
            if owned and not final.done():
                final.cancel()

    def _revoked(self, rpc_id: str | int | None, rid: str) -> str | None:
        """The error event that ends a stream whose token is no longer valid (revoked or
        expired since the stream opened; the task goes on), else None. The token was checked
        once, at the stream's start: a caller revoked mid-task went on reading the task's
        updates and its result."""
        try:
            self.reader()
        except ReachError as exc:
            return sse(rpc_id, None, rpc_error_of(exc, rid))
        return None

    async def _progress(
        self, rid: str, seen: int, context: str
    ) -> tuple[list[StreamResponse], int]:
        """The timeline's steps after the first `seen`, as working status updates."""
        gateway = self.gateway
        try:
            story = await timeline.read_timeline(gateway.client, rid, None, gateway.rpc_timeout)
        except (RPCError, ReachError) as exc:  # progress is best effort; the end is not
            log.info("A2A stream of %s: no timeline now (%s)", rid, exc)
            return [], seen
        out = []
        for event in story.events[seen:]:
            if event.kind in NOT_PROGRESS or event.kind.startswith("callback"):
                continue
            detail = {"kind": event.kind, "atMs": event.at_ms, **event.detail}
            status = status_of(rid, _WORKING, event.summary, detail, context)
            update = TaskStatusUpdateEvent(task_id=rid, context_id=context, status=status)
            out.append(StreamResponse(status_update=update))
        return out, max(seen, len(story.events))

    async def _started(
        self, body: dict[str, Any], method: str, let_go: LetGo = None
    ) -> tuple[asyncio.Task[InvokeResponse], _Front]:
        """The door's invoke in the background, once its workflow is durable (or it ended):
        the door still waits for its verdict and accounts it, as for any invoke."""
        front = _Front(let_go)
        job = asyncio.create_task(self._door(body, front, method))
        self.jobs.add(job)
        job.add_done_callback(_finished(self.jobs))
        await front.started_or_done(job)
        return job, front

    async def _door(self, body: dict[str, Any], front: _Front, method: str) -> InvokeResponse:
        door, raw = self.gateway.door, Bytes(dumps(body))
        active = tracing.tracer
        try:
            if active is None:
                return await door.invoke(self.metadata, raw, front)
            attributes = {"rpc.system": "jsonrpc", "rpc.method": method, "reach.front": "a2a"}
            traceparent = self.metadata.get(TRACEPARENT)
            with tracing.server_span(active, f"A2A {method}", traceparent, attributes) as span:
                response = await door.invoke(self.metadata, raw, front)
                span.set_attribute("reach.request_id", response.request_id)
                return response
        finally:
            self.request_id = front.request_id

    async def _outcome(self, rid: str, body: dict[str, Any]) -> InvokeResponse:
        """A started request's end, waited for until its deadline (then its state now) or
        until its caller goes (`gone`: nobody to answer, the request goes on durably)."""
        engine, policy = self.gateway.engine, self.gateway.settings.policy
        timeout_s = float(body.get("timeout_ms") or policy.default_timeout_ms) / 1000 + SYNC_GRACE_S
        end = asyncio.ensure_future(engine.outcome(engine.handle(rid)))
        waits: set[asyncio.Future[Any]] = {end} if self.gone is None else {end, self.gone}
        try:
            await asyncio.wait(waits, timeout=timeout_s, return_when="FIRST_COMPLETED")
        finally:
            end.cancel()  # a no-op once it ended
        if end.done() and not end.cancelled():
            return end.result()
        if self.gone is not None and self.gone.done():
            return InvokeResponse(request_id=rid, status="accepted")
        return await self.gateway.requests.status(rid)

    async def _invoke_body(self, params: SendMessageRequest) -> dict[str, Any]:
        """The `POST /reach/invoke` body a message stands for (docs/a2a-front.md)."""
        message, sent = params.message, self.raw.get("message") or {}
        meta = {**(self.raw.get("metadata") or {}), **(sent.get("metadata") or {})}
        operation = next((meta[k] for k in OPERATION_KEYS if k in meta), None)
        payload = payload_of(sent)
        rid = next((meta[k] for k in ("request_id", "requestId") if k in meta), None)
        if rid is None:
            rid = meta["request_id"] = new_request_id()  # a new task, maybe a new context
        if message.task_id:
            self.task_id_of(message.task_id)
        if message.context_id and not _valid_id(message.context_id):
            raise a2a_error(
                InvalidParamsError,
                f"message.contextId {message.context_id[:140]!r}: not a context of Reach's "
                "(a task id); a new conversation is a message without one",
            )
        asked, payload, context = await conversation(
            self.gateway.requests, self.capability, self.reader(), message, payload, str(rid)
        )
        operation = operation or asked
        if operation is None:
            operation = await self._only_operation()
        if not isinstance(operation, str):
            raise a2a_error(InvalidParamsError, "message.metadata.operation: a string")
        body: dict[str, Any] = {
            "target": self.capability,
            "operation": operation,
            "payload": payload,
        }
        for key, field in INVOKE_FIELDS.items():
            if key in meta:
                body[field] = meta[key]
        if isinstance(context, str) and _valid_id(context):
            body["context_id"] = context
            body.setdefault("routing_key", context)  # one instance per context, when hashed
        push = params.configuration.task_push_notification_config
        if push.url:
            body["callback"] = push.url
        return body

    async def _only_operation(self) -> str:
        # What a capability serves is for token holders only, as its card is, and only what
        # their rules let them call: to a denied caller it serves nothing, known or not.
        allowed = cards.allowed_for(self.gateway.guard, self.who(self.reader()))
        registry = self.gateway.registry
        instances = await registry.instances(self.capability)
        if allowed is None and not instances and not await registry.known(self.capability):
            raise UnknownCapability(f"no agent has registered capability {self.capability!r}")
        operations = sorted(cards.operations_of(instances, self.capability, allowed))
        if len(operations) == 1:
            return operations[0]
        raise a2a_error(
            InvalidParamsError,
            f"capability {self.capability!r} serves {len(operations)} operations you may call "
            f"({', '.join(operations) or 'none'}): name the skill in the message's "
            "metadata, as `operation` (or `skill`)",
        )

    # -- reads --------------------------------------------------------------------------------

    def task_id_of(self, value: str) -> str:
        if not _valid_id(value):
            raise a2a_error(InvalidParamsError, f"id {value[:140]!r}: not a task id (a RequestID)")
        self.request_id = value
        return value

    async def get(self, params: GetTaskRequest) -> dict[str, Any]:
        rid = self.task_id_of(params.id)
        response, original = await self.gateway.requests.looked(rid, self.reader())
        return task_json(response, context_of(original))

    async def list(self, params: ListTasksRequest) -> dict[str, Any]:
        principal = self.reader()
        status = None
        if params.status:
            status = LIST_FILTERS.get(params.status)
            if status is None:
                raise a2a_error(
                    InvalidParamsError,
                    f"status {TaskState.Name(params.status)}: a filter is one of "
                    + ", ".join(TaskState.Name(s) for s in LIST_FILTERS),
                )
        since = None
        if params.HasField("status_timestamp_after"):
            since = datetime.now(UTC) - params.status_timestamp_after.ToDatetime(UTC)
        try:
            page = await listing.list_page(
                self.gateway.client,
                principal,
                page_size=min(params.page_size or DEFAULT_LIMIT, MAX_LIMIT),
                page_token=params.page_token,
                capability=self.capability,
                caller=self.who(principal),
                status=status,  # type: ignore[arg-type]
                since=since,
                rpc_timeout=self.gateway.rpc_timeout,
            )
        except ValueError as err:  # a page token this list did not hand out
            raise a2a_error(InvalidParamsError, str(err)) from err
        rows = page.rows
        if params.context_id:
            rows = [r for r in rows if (r.context_id or r.request_id) == params.context_id]
        tasks = [task_of_row(row) for row in rows]
        answer = ListTasksResponse(
            tasks=tasks,
            next_page_token=page.next_token,
            page_size=len(tasks),
            total_size=page.total,
        )
        return _json(answer, always_print_fields_with_no_presence=True)

    async def cancel(self, params: CancelTaskRequest) -> dict[str, Any]:
        rid = self.task_id_of(params.id)
        principal = self.reader()
        # Whatever it waits on (a timer, a call in flight, an A2A agent's task it follows, which
        # is asked to stop), the cancelled request ends `canceled` (workflows._failures).
        started = time.monotonic()
        asked, response = await self.gateway.requests.cancel(
            rid,
            principal,
            front="a2a",
            reason=f"CancelTask from {self.who(principal)} through the A2A front",
            wait_s=CANCEL_WAIT_S,
        )
        if not asked:
            raise a2a_error(TaskNotCancelableError, f"task {rid} already ended ({response.status})")
        log.info("A2A CancelTask %s: %s in %.2fs", rid, response.status, time.monotonic() - started)
        engine = self.gateway.engine
        return task_json(response, context_of(await engine.original(engine.handle(rid))))


_SUBMITTED = TaskState.TASK_STATE_SUBMITTED
_WORKING = TaskState.TASK_STATE_WORKING


def _valid_id(value: str) -> bool:
    return _REQUEST_ID.fullmatch(value) is not None


def _finished(jobs: set[asyncio.Task[Any]]) -> Any:
    def done(job: asyncio.Task[Any]) -> None:
        jobs.discard(job)
        if not job.cancelled() and job.exception() is not None:
            exc = job.exception()
            level = logging.INFO if isinstance(exc, ReachError | RpcError) else logging.ERROR
            log.log(level, "A2A background invoke ended without a verdict: %r", exc)

    return done
