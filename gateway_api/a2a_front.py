"""The A2A front: every capability Reach routes is an A2A agent (A2A 1.0, JSON-RPC binding),
beside `POST /reach/invoke` in the same app (docs/a2a-front.md).

    GET  /.well-known/agent-card.json                  the gateway's card: a skill per capability
    GET  /a2a/{capability}/.well-known/agent-card.json the capability's card: a skill per operation
    POST /a2a/{capability}                             JSON-RPC: SendMessage, SendStreamingMessage,
                                                       GetTask, ListTasks, CancelTask,
                                                       SubscribeToTask, push notification configs

**Thin.** A message is turned into the body `POST /reach/invoke` takes and handed to the door
(`Door.invoke`), with the HTTP headers for its metadata: the same tokens, rules, limits,
audit, traces and metrics, and no policy here. The task id is the RequestID, so a task is read
or cancelled through any gateway of the deployment, after restarts too: it is all in Temporal.
Push configs are `_a2a_push`, the cards `_a2a_cards`, the methods `_a2a_calls`.

**Parsing.** The JSON-RPC envelope is checked here (-32700, -32600, -32601), the params are
parsed into the a2a-sdk's own request types, strictly (an unknown field is -32602 naming it),
and their REQUIRED fields checked as the SDK checks them (`_a2a_required`). A request whose
`A2A-Version` header names another major version than 1 is refused (VersionNotSupported); no
header is read as 1.0.
Reach's errors become the JSON-RPC errors the A2A spec names (`_a2a_tasks.rpc_error_of`).
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import weakref
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from a2a.types import (
    CancelTaskRequest,
    DeleteTaskPushNotificationConfigRequest,
    GetExtendedAgentCardRequest,
    GetTaskPushNotificationConfigRequest,
    GetTaskRequest,
    ListTaskPushNotificationConfigsRequest,
    ListTasksRequest,
    SendMessageRequest,
    SubscribeToTaskRequest,
    TaskPushNotificationConfig,
)
from a2a.utils.constants import AGENT_CARD_WELL_KNOWN_PATH
from a2a.utils.errors import (
    InvalidParamsError,
    InvalidRequestError,
    MethodNotFoundError,
    UnsupportedOperationError,
    VersionNotSupportedError,
)
from fastapi import FastAPI
from google.protobuf import json_format
from google.protobuf.message import Message as Proto
from starlette.datastructures import State
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route
from starlette.types import Receive, Scope, Send
from temporalio.service import RPCError

from gateway_api import _a2a_cards as cards
from gateway_api import _a2a_push as push
from gateway_api._a2a_calls import POLL_MAX_S, Call
from gateway_api._a2a_cards import allowed_for, capability_card, gateway_card, operations_of
from gateway_api._a2a_pushed import PushPacer as PushPacer  # the push route's pacing (tests)
from gateway_api._a2a_pushed import pushed
from gateway_api._a2a_required import missing
from gateway_api._a2a_tasks import (
    BEARER_CHALLENGE,
    SERVER_ERROR,
    STATES,
    RpcError,
    a2a_error,
    parse_error,
    payload_of,
    rpc_error_of,
    state_of,
    task_json,
    task_of,
)
from gateway_api.errors import BodyLimit, CatchBugs, error_response, reach_error_of_rpc
from gateway_api.gateway import Gateway
from gateway_api.http_limits import DRAINING, disconnected
from gateway_api.steps.identify import AUTHORIZATION, CALLER, IDEMPOTENCY_KEY, TRACEPARENT
from reach import acceptance
from reach.errors import InvalidRequest, RateLimited, ReachError, UnknownCapability
from reach.security.a2a_push import PUSH_PATH

__all__ = [
    "MAX_STREAMS_PER_CALLER",
    "SERVER_ERROR",
    "STATES",
    "A2AFastPath",
    "A2AFront",
    "RpcError",
    "capability_card",
    "gateway_card",
    "install",
    "is_a2a_call",
    "missing",
    "operations_of",
    "parse_call",
    "payload_of",
    "rpc_error_of",
    "state_of",
    "task_json",
    "task_of",
]

log = logging.getLogger("reach.gateway")

VERSION_HEADER = "a2a-version"
_CAPABILITY = re.compile(r"^[a-z0-9][a-z0-9._-]{0,63}$")  # reach.messages.CapabilityName's
_HEADERS = (AUTHORIZATION, CALLER, TRACEPARENT, IDEMPOTENCY_KEY)
# Open streams one caller may hold on one gateway: each costs a Temporal history read every
# POLL_MAX_S and a long poll for its end (200 of them: ~14% of a core here). Past it, 429.
MAX_STREAMS_PER_CALLER = 64
MAX_STREAM_CALLERS = 1024  # callers with streams tracked before the empty ones are dropped

Handler = Callable[[Call, Any], Awaitable[dict[str, Any]]]
Streamer = Callable[[Call, str | int | None, Any], Awaitable[AsyncIterator[str]]]

# Method -> its params' type (the SDK's; both spellings where the spec's and SDK's differ).
PARAMS: dict[str, type[Proto]] = {
    "SendMessage": SendMessageRequest,
    "SendStreamingMessage": SendMessageRequest,
    "GetTask": GetTaskRequest,
    "ListTasks": ListTasksRequest,
    "CancelTask": CancelTaskRequest,
    "SubscribeToTask": SubscribeToTaskRequest,
    "CreateTaskPushNotificationConfig": TaskPushNotificationConfig,
    "SetTaskPushNotificationConfig": TaskPushNotificationConfig,
    "GetTaskPushNotificationConfig": GetTaskPushNotificationConfigRequest,
    "ListTaskPushNotificationConfigs": ListTaskPushNotificationConfigsRequest,
    "ListTaskPushNotificationConfig": ListTaskPushNotificationConfigsRequest,
    "DeleteTaskPushNotificationConfig": DeleteTaskPushNotificationConfigRequest,
    "GetExtendedAgentCard": GetExtendedAgentCardRequest,
}


async def _no_extended_card(call: Call, params: Any) -> dict[str, Any]:
    raise a2a_error(UnsupportedOperationError, "there is no extended card: the card is all")


HANDLERS: dict[str, Handler] = {
    "SendMessage": Call.send,
    "GetTask": Call.get,
    "ListTasks": Call.list,
    "CancelTask": Call.cancel,
    "CreateTaskPushNotificationConfig": push.set_push,
    "SetTaskPushNotificationConfig": push.set_push,
    "GetTaskPushNotificationConfig": push.get_push,
    "ListTaskPushNotificationConfigs": push.list_push,
    "ListTaskPushNotificationConfig": push.list_push,
    "DeleteTaskPushNotificationConfig": push.delete_push,
    "GetExtendedAgentCard": _no_extended_card,
}
STREAMERS: dict[str, Streamer] = {
    "SendStreamingMessage": Call.stream,
    "SubscribeToTask": Call.subscribe,
}
assert set(PARAMS) == set(HANDLERS) | set(STREAMERS)


def parse_call(raw: bytes) -> tuple[str | int | None, str, Proto, dict[str, Any]]:
    """The id, method and params of one JSON-RPC request (as the SDK's type, and as sent);
    `RpcError` (with `rpc_id` when the id could be read) names what is wrong."""
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise parse_error(str(exc)) from None
    except RecursionError:  # nested past Python's stack (within the body limit): not a bug
        raise parse_error("nested too deeply") from None
    if isinstance(body, list):
        raise a2a_error(InvalidRequestError, "batch requests are not supported: send one object")
    if not isinstance(body, dict):
        raise a2a_error(InvalidRequestError, "a JSON-RPC request is an object")
    rpc_id = body.get("id")
    if isinstance(rpc_id, bool) or not isinstance(rpc_id, str | int | None):
        raise a2a_error(InvalidRequestError, "id: a string, an integer or null")
    try:
        return rpc_id, *_method_and_params(body)
    except RpcError as exc:
        exc.rpc_id = rpc_id  # type: ignore[attr-defined]
        raise


def _method_and_params(body: dict[str, Any]) -> tuple[str, Proto, dict[str, Any]]:
    if body.get("jsonrpc") != "2.0":
        raise a2a_error(InvalidRequestError, 'jsonrpc: must be exactly "2.0"')
    method = body.get("method")
    if not isinstance(method, str) or not method:
        raise a2a_error(InvalidRequestError, "method: a non-empty string")
    kind = PARAMS.get(method)
    if kind is None:
        known = ", ".join(sorted(PARAMS))
        raise a2a_error(MethodNotFoundError, f"method {method[:80]!r} is not one of {known}")
    params = body.get("params", {})
    if not isinstance(params, dict):
        raise a2a_error(InvalidParamsError, f"params of {method}: an object")
    try:
        message = json_format.ParseDict(params, kind())
    except json_format.ParseError as exc:
        raise a2a_error(InvalidParamsError, f"params of {method}: {exc}") from None
    problems = missing(message)
    if problems:
        raise a2a_error(InvalidParamsError, f"params of {method}: {'; '.join(problems)}")
    return method, message, params


def _error(exc: RpcError, rpc_id: str | int | None) -> Response:
    return JSONResponse(exc.body(rpc_id), status_code=exc.http_status, headers=exc.headers)


class A2AFront:
    """The front's endpoints; the gateway is the app's (`app.state.gateway`)."""

    def __init__(self) -> None:
        # Invokes the door still waits on after their caller had its answer (returnImmediately,
        # streams): held here so that they run to their verdict and are accounted.
        self.jobs: set[asyncio.Task[Any]] = set()
        # Each caller's open streams (SendStreamingMessage, SubscribeToTask), by its name.
        self.streams: dict[str, weakref.WeakSet[object]] = {}

    def _streams_of(self, caller: str) -> weakref.WeakSet[object]:
        """The caller's open streams on this gateway, with room for one more (else 429)."""
        if len(self.streams) > MAX_STREAM_CALLERS:  # callers' names are the callers' choice
            self.streams = {name: held for name, held in self.streams.items() if held}
        held = self.streams.setdefault(caller, weakref.WeakSet())
        if len(held) >= MAX_STREAMS_PER_CALLER:
            raise RateLimited(
                f"caller {caller!r} holds {len(held)} open streams on this gateway, its most "
                f"(each reads its task's history every {POLL_MAX_S:g} s): nothing was started; "
                "close one, or follow tasks with GetTask",
                retry_after_s=1,
            )
        return held

    def routes(self) -> list[Route]:
        return [
            Route(AGENT_CARD_WELL_KNOWN_PATH, self.gateway_card, methods=["GET"]),
            Route(
                f"{cards.PREFIX}/{{capability}}{AGENT_CARD_WELL_KNOWN_PATH}",
                self.capability_card,
                methods=["GET"],
            ),
            Route(f"{cards.PREFIX}/{{capability}}", self.rpc, methods=["POST"]),
            # An A2A agent's push notifications about a task a request follows.
            Route(f"{PUSH_PATH}/{{request_id}}", pushed, methods=["POST"]),
        ]

    # -- cards --------------------------------------------------------------------------------

    async def gateway_card(self, request: Request) -> Response:
        gateway: Gateway = request.app.state.gateway
        try:
            allowed = allowed_for(gateway.guard, _reader(gateway, request))
            names = []
            for name in await gateway.registry.capabilities():
                instances = await gateway.registry.instances(name)
                if any(i.routable for i in instances) and (
                    allowed is None or operations_of(instances, name, allowed)
                ):
                    names.append(name)
        except ReachError as exc:
            return _refused(exc)
        card = gateway_card(gateway.settings.gateway_url, names, _tokens(gateway))
        return JSONResponse(json_format.MessageToDict(card))

    async def capability_card(self, request: Request) -> Response:
        gateway: Gateway = request.app.state.gateway
        capability = request.path_params["capability"]
        try:
            allowed = allowed_for(gateway.guard, _reader(gateway, request))
            instances = await gateway.registry.instances(_capability(capability))
            unknown = not instances and not await gateway.registry.known(capability)
            # A capability the caller may call nothing of is, to it, one that does not exist.
            if unknown or (
                allowed is not None and not operations_of(instances, capability, allowed)
            ):
                raise UnknownCapability(f"no agent has registered capability {capability!r}")
        except ReachError as exc:
            return _refused(exc)
        base = gateway.settings.gateway_url
        card = capability_card(base, capability, instances, _tokens(gateway), allowed)
        return JSONResponse(json_format.MessageToDict(card))

    # -- JSON-RPC -----------------------------------------------------------------------------

    async def rpc(self, request: Request) -> Response:
        """The route's endpoint (an app without `A2AFastPath`)."""
        gateway: Gateway = request.app.state.gateway
        return await self.answer(gateway, request, request.path_params["capability"])

    async def answer(self, gateway: Gateway, request: Request, capability: str) -> Response:
        headers = request.headers
        metadata = {name: headers[name] for name in _HEADERS if name in headers}
        call = Call(gateway, capability, metadata, self.jobs)
        call.draining = request.scope.get("state", {}).get(DRAINING)
        rpc_id: str | int | None = None
        try:
            raw = await request.body()
            rpc_id, method, params, call.raw = parse_call(raw)
            _check_version(headers.get(VERSION_HEADER))
            _capability(call.capability)
            streamer = STREAMERS.get(method)
            if streamer is not None:
                held = self._streams_of(call.who(call.reader()))
                # Counted before the first await: streams asked for at once all passed the
                # count while each read its task (192 held where 64 may be).
                slot = _Slot()
                held.add(slot)
                try:
                    events = await streamer(call, rpc_id, params)
                finally:
                    held.discard(slot)
                held.add(events)  # until the response lets go of it (ended, or disconnected)
                return _HeldStream(
                    held,
                    events,
                    call.gone,
                    media_type="text/event-stream",
                    headers={"Cache-Control": "no-store", "X-Accel-Buffering": "no"},
                )
            if method == "SendMessage":  # blocking: a caller gone lets the door's wait go
                call.gone = asyncio.ensure_future(disconnected(request.receive))
            try:
                result = await HANDLERS[method](call, params)
            finally:
                if call.gone is not None:
                    call.gone.cancel()
            return JSONResponse({"jsonrpc": "2.0", "id": rpc_id, "result": result})
        except ClientDisconnect:
            return Response(status_code=400)
        except RpcError as exc:
            return _error(exc, getattr(exc, "rpc_id", rpc_id))
        except ReachError as exc:
            log.info("A2A %s -> %s: %s", request.url.path, exc.type, exc.message)
            return _error(rpc_error_of(exc, call.request_id), rpc_id)
        except RPCError as exc:
            log.error("Temporal call failed on A2A %s: %s", request.url.path, exc)
            return _error(rpc_error_of(reach_error_of_rpc(exc), call.request_id), rpc_id)


class _Slot:
    """A stream's place in its caller's count while the stream is being opened."""


class _HeldStream(StreamingResponse):
    """A stream that gives its caller's slot back the moment it ends or its caller goes, not
    when the collector gets round to its generator (a traceback's cycle held one for over
    30 s on a loaded box); and lets the door's wait for its request go (`gone`), so a stream
    its caller left holds no room among the bytes in flight until its task ends."""

    def __init__(
        self,
        held: weakref.WeakSet[object],
        events: AsyncIterator[str],
        gone: asyncio.Future[None] | None,
        **kwargs: Any,
    ) -> None:
        super().__init__(events, **kwargs)
        self.held, self.events, self.gone = held, events, gone

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.held.discard(self.events)
            if self.gone is not None and not self.gone.done():
                self.gone.set_result(None)
            close = getattr(self.events, "aclose", None)
            if close is not None:
                await close()


def _check_version(version: str | None) -> None:
    if version is None or not version.strip():
        return
    major = version.strip().split(".", 1)[0]
    if major != "1":
        raise a2a_error(
            VersionNotSupportedError,
            f"A2A-Version {version[:20]!r}: this gateway speaks A2A 1.x (JSON-RPC binding)",
        )


def _capability(name: str) -> str:
    if not _CAPABILITY.match(name):
        raise InvalidRequest(f"{name[:80]!r} is not a capability name ({_CAPABILITY.pattern})")
    return name


def _reader(gateway: Gateway, request: Request) -> str:
    """The caller reading a card (any valid token, as `GET /reach/capabilities` asks), named
    as the door names it: the token's principal, else `X-Reach-Caller`."""
    guard, headers = gateway.guard, request.headers
    principal = guard.auth.anyone(headers.get(AUTHORIZATION)) if guard is not None else None
    if principal is not None:
        return principal.name
    return acceptance.caller_header(headers.get(CALLER)) or "anonymous"


def _tokens(gateway: Gateway) -> bool:
    return gateway.guard is not None and gateway.guard.auth.required


def _refused(exc: ReachError) -> Response:
    response = error_response(None, exc)
    if exc.type == "unauthorized":
        response.headers["WWW-Authenticate"] = BEARER_CHALLENGE
    return response


def is_a2a_call(scope: Scope) -> bool:
    """`POST /a2a/{capability}`: a JSON-RPC call `A2AFastPath` answers."""
    if scope["type"] != "http" or scope["method"] != "POST":
        return False
    path: str = scope["path"]
    return path.startswith(_CALL_PREFIX) and "/" not in path[len(_CALL_PREFIX) :]


_CALL_PREFIX = f"{cards.PREFIX}/"


class A2AFastPath:
    """`POST /a2a/{capability}` as an ASGI app of its own, answered ahead of FastAPI's
    middleware and router like `POST /reach/invoke` (`gateway_api.fast`): the same body limit
    and last-resort 500."""

    def __init__(self, state: State, front: A2AFront, limit: int) -> None:
        self.state = state
        self.front = front
        self.app = CatchBugs(BodyLimit(self._call, limit))

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await self.app(scope, receive, send)

    async def _call(self, scope: Scope, receive: Receive, send: Send) -> None:
        capability = scope["path"][len(_CALL_PREFIX) :]
        request = Request(scope, receive)
        response = await self.front.answer(self.state.gateway, request, capability)
        await response(scope, receive, send)


def install(app: FastAPI, limit: int) -> A2AFastPath:
    """The front's routes on the app (outside its OpenAPI document: they speak A2A), and its
    JSON-RPC calls' fast path, for the app to answer ahead of its middleware."""
    front = A2AFront()
    app.router.routes.extend(front.routes())
    return A2AFastPath(app.state, front, limit)
