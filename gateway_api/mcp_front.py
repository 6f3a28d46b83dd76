"""The MCP front: Reach answers as an MCP server at `POST /mcp` (Streamable HTTP).

    initialize        the handshake (2025-11-25, 2025-06-18, ...): a version and a session id
    server/discover   the stateless protocol's (2026-07-28) versions and capabilities
    ping              {}
    tools/list        every routable capability.operation the caller's rules allow
    tools/call        one durable invoke through the door (`Door.invoke`), like POST /reach/invoke
    tasks/get|cancel  a long call as a task whose id is its RequestID: the tasks extension
                      (2026-07-28), 2025-11-25's own tasks (`gateway_api._mcp_tasks`)

Both protocol generations on one endpoint (`gateway_api._mcp_wire`): a request that carries
its version in `params._meta` is the stateless protocol, anything else the handshake one,
whose session ids are stateless tokens any gateway accepts. Nothing is kept per client.

**The door.** A tool call is the JSON body `POST /reach/invoke` takes (`target`, `operation`,
`payload` = the arguments; `_meta` may add `reach/requestId`, `reach/idempotencyKey` and
`reach/timeoutMs`), handed to `Door.invoke` with the HTTP headers as its metadata: the same
tokens, rules, limits, routing, audit, traces and metrics. The front adds no policy; the
envelope becomes the tool result (`gateway_api._mcp_tools`).

**Durable past the stream.** The result's `_meta` names the RequestID (`reach/requestId`). A
client that asks for `text/event-stream` and whose call is still running after `SSE_AFTER_S`
(at once when it gave a `progressToken`) gets an SSE stream instead (`gateway_api._mcp_sse`:
`X-Reach-Request-Id` in its headers, the agents' progress, keep-alives, the result last). A
stream that breaks loses nothing: the request carries on in Temporal,
`GET /reach/requests/{id}` reads its verdict from any gateway, and the same call repeated with
`_meta["reach/requestId"]` set to that id attaches to it.

**List changed.** `GET /mcp` (session-based generation) and `subscriptions/listen`
(2026-07-28): an SSE stream of `notifications/tools/list_changed` for the caller's tools
(`gateway_api._mcp_listen`).

**Auth.** Reach's bearer tokens. Without a valid one (when tokens are required) every request
is 401 with `WWW-Authenticate: Bearer resource_metadata="..."`, pointing at the RFC 9728
protected-resource metadata served at `/.well-known/oauth-protected-resource` (and `/mcp`
appended, the path-inserted form). A request with an `Origin` header that is neither loopback
nor the `Host` it was sent to is refused (403): a web page must not drive a local gateway
(the rules, DNS rebinding's included: `gateway_api._mcp_http.host_allowed`, `origin_allowed`).

**Errors.** Malformed JSON-RPC is -32700 or -32600 (400), a batch -32600 (400), an unknown method
-32601, bad params (an unknown tool, arguments that are not an object, deeper than 64 levels
or larger than the message limit) -32602, another Reach refusal (403, 409, 429, 503) -32000
with the error's type and status in `data`; a call that failed after Reach took it is a
result with `isError: true`. A body over `Limits.max_body_bytes` is 413.
"""

from __future__ import annotations

import asyncio
import logging
import re
from collections.abc import Awaitable, Callable
from typing import Any

from starlette.datastructures import State
from starlette.types import Receive, Scope, Send

import reach
from gateway_api import _mcp_ask as ask
from gateway_api import _mcp_http as http
from gateway_api import _mcp_logging as logs
from gateway_api import _mcp_sse as sse
from gateway_api import _mcp_tasks as tasks
from gateway_api import _mcp_wire as wire
from gateway_api._mcp_call import Call, consumed, named, outcome
from gateway_api._mcp_http import host_allowed, origin_allowed
from gateway_api._mcp_listen import MAX_STREAMS_PER_CALLER as MAX_STREAMS_PER_CALLER
from gateway_api._mcp_listen import Listeners, token_check
from gateway_api._mcp_sse import Relay as Relay  # what a streamed call relays (tests read it)
from gateway_api._mcp_tools import Catalog, rpc_error_of
from gateway_api.errors import CatchBugs
from gateway_api.front import Bytes
from gateway_api.gateway import Gateway
from gateway_api.http_limits import disconnected
from gateway_api.routes.invoke import metadata_of
from gateway_api.steps.identify import Identity, identify
from reach import asks as reach_asks
from reach.errors import ReachError
from reach.messages import InvokeResponse, dumps
from reach.telemetry import tracing

log = logging.getLogger("reach.gateway")

PATH = "/mcp"
METADATA_PATH = "/.well-known/oauth-protected-resource"
PATHS = frozenset({PATH, METADATA_PATH, METADATA_PATH + PATH})
SERVER_INFO = {"name": "agent-reach", "title": "Agent-Reach", "version": reach.__version__}
INSTRUCTIONS = (
    "Each tool is a capability.operation served by agents behind Reach; every call is a "
    "durable request whose RequestID is in the result's _meta (reach/requestId)."
)
# A tool call still running after this long is answered as an SSE stream (when accepted).
SSE_AFTER_S = 2.0
_HOST = re.compile(r"[A-Za-z0-9.-]{1,253}(:[0-9]{1,5})?|\[[0-9A-Fa-f:.]{2,45}\](:[0-9]{1,5})?")
# Logging: the log messages of MCP servers behind Reach, relayed at the level the client asks
# for (`_mcp_logging`); completions are declared so that clients may ask, and complete nothing
# (there are no prompts or resources). `tools.listChanged`: the GET stream says so (the
# handshake generation), and subscriptions/listen (2026-07-28).
CAPABILITIES: dict[str, Any] = {"tools": {"listChanged": True}, "logging": {}, "completions": {}}


def is_mcp(scope: Scope) -> bool:
    return bool(scope["type"] == "http" and scope["path"] in PATHS)


class McpFront:
    """`/mcp` and the protected-resource metadata as an ASGI app of their own (`is_mcp`),
    answered ahead of FastAPI's middleware like `POST /reach/invoke`."""

    def __init__(self, state: State, limit: int) -> None:
        self.state = state
        self.limit = limit
        self._catalog: tuple[Gateway, Catalog] | None = None
        self._calls: set[asyncio.Future[InvokeResponse]] = set()  # calls being streamed
        self.listeners = Listeners(self.catalog, lambda: self.gateway.registry)  # GET streams
        self._app = CatchBugs(self._serve)  # a bug is the 500 envelope, not a dropped connection

    @property
    def gateway(self) -> Gateway:
        gateway: Gateway = self.state.gateway
        return gateway

    def catalog(self) -> Catalog:
        gateway = self.gateway
        if self._catalog is None or self._catalog[0] is not gateway:
            self._catalog = (gateway, Catalog(gateway.registry))
        return self._catalog[1]

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await self._app(scope, receive, send)

    async def _serve(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            if scope["path"] != PATH:
                await self._metadata(scope, send)
            elif scope["method"] == "POST":
                await self._post(scope, receive, send)
            elif scope["method"] == "DELETE":  # nothing is kept per session: nothing to end
                self._identify(scope, metadata_of(scope))
                await http.respond(send, 204, b"", {})
            elif scope["method"] == "GET":  # the list-changed stream (`_mcp_listen`)
                headers = metadata_of(scope)
                caller = self._identify(scope, headers).caller
                await self.listeners.get(scope, headers, caller, self.gateway.guard, receive, send)
            else:
                await http.respond_json(send, 405, None, {"allow": "GET, POST, DELETE"})
        except http.Answer as answer:
            await http.respond_json(send, answer.status, answer.body, answer.headers)

    # -- the metadata document -------------------------------------------------------------

    async def _metadata(self, scope: Scope, send: Send) -> None:
        if scope["method"] not in ("GET", "HEAD"):
            await http.respond_json(send, 405, None, {"allow": "GET"})
            return
        self._check_host(metadata_of(scope))  # it names the Host: not any name's (cached)
        document = {
            "resource": self._base(scope) + PATH,
            "bearer_methods_supported": ["header"],
            "resource_name": "Agent-Reach",
            "resource_documentation": "https://agent-reach.dev/mcp-front/",
        }
        headers = {"access-control-allow-origin": "*", "cache-control": "max-age=300"}
        await http.respond_json(send, 200, document, headers)

    def _base(self, scope: Scope) -> str:
        public = self.gateway.settings.public_url
        if public:
            return public.rstrip("/")
        host = metadata_of(scope).get("host", "")
        if not _HOST.fullmatch(host):  # only a name and port are written into the answer
            host = self.gateway.settings.gateway_url.split("//")[1]
        return f"{scope.get('scheme', 'http')}://{host}"

    # -- POST /mcp ---------------------------------------------------------------------------

    def _check_host(self, headers: dict[str, str]) -> str | None:
        """The request's host name, or the 403 `Answer` when it is not this gateway's."""
        host = http.hostname(headers.get("host", ""))
        if not host_allowed(self.gateway.settings, host):
            said = f"Host {headers.get('host', '')[:100]!r} is not this gateway's name"
            raise http.Answer(403, http.refusal("forbidden", said), {})
        return host

    def _identify(self, scope: Scope, headers: dict[str, str]) -> Identity:
        host = self._check_host(headers)
        origin = headers.get("origin")
        guard = self.gateway.guard
        required = guard is not None and guard.auth.required
        if origin is not None and not origin_allowed(
            self.gateway.settings, http.hostname(origin, url=True), host, tokens=required
        ):
            said = f"Origin {origin[:100]!r} may not call this gateway"
            raise http.Answer(403, http.refusal("forbidden", said), {})
        try:
            return identify(headers, guard.auth if guard is not None else None)
        except ReachError as exc:
            if guard is not None:
                guard.audit.record(
                    "refused", status=exc.http_status, error_type=exc.type, reason=exc.message
                )
            extra = {}
            if exc.http_status == 401:
                value = f'Bearer resource_metadata="{self._base(scope)}{METADATA_PATH}{PATH}"'
                if headers.get("authorization"):
                    value += ', error="invalid_token"'
                extra["www-authenticate"] = value
            status = 400 if exc.http_status == 422 else exc.http_status
            raise http.Answer(status, http.refusal(exc.type, exc.message), extra) from None

    async def _post(self, scope: Scope, receive: Receive, send: Send) -> None:
        headers = metadata_of(scope)
        identity = self._identify(scope, headers)
        if "json" not in headers.get("content-type", "application/json"):
            raise http.Answer(
                415, http.refusal("invalid_request", "the body is JSON-RPC (JSON)"), {}
            )
        raw = await http.read(receive, self.limit)
        message: wire.Message | None = None
        modern = False
        try:
            message = wire.parse(raw)
            if not message.is_request:  # a notification, or an answer to a relayed question
                if message.is_response:
                    await ask.answer(self.gateway.views.policy.state, message, identity.caller)
                await http.respond(send, 202, b"", {})
                return
            modern = message.modern
            if modern:
                version = wire.check_modern(message, headers)
                if message.method == "subscriptions/listen":  # its answer is a stream
                    listeners, caller = self.listeners, identity.caller
                    guard = self.gateway.guard
                    await listeners.listen(scope, message, headers, caller, guard, receive, send)
                    return
            else:
                version = self._session(message, headers, identity)
            reply = await self._dispatch(message, headers, identity, version, modern, send, receive)
        except wire.RpcError as exc:
            key = message.id if message is not None else exc.key
            await http.respond_json(send, exc.status(modern), wire.error(key, exc), {})
            return
        if reply is not None:
            extra = reply.pop("_headers", {})
            await http.respond_json(send, 200, wire.result(message.id, reply), extra)

    def _session(self, message: wire.Message, headers: dict[str, str], identity: Identity) -> str:
        """The handshake protocol's version: the session's, else the header's."""
        if message.method == "initialize":
            return wire.negotiate(message.params.get("protocolVersion"))
        said = headers.get(wire.VERSION_HEADER)
        if said is not None and said not in wire.HANDSHAKE:
            raise wire.RpcError(
                wire.INVALID_REQUEST,
                f"unsupported MCP-Protocol-Version {said[:40]!r}",
                {"supported": [*wire.MODERN, *wire.HANDSHAKE], "requested": said[:40]},
            )
        session = headers.get(wire.SESSION_HEADER)
        if session is None:
            return said or wire.LATEST_HANDSHAKE
        version = wire.session_version(session, identity.caller)
        if version is None:
            raise wire.RpcError(
                wire.SESSION_NOT_FOUND, "no such session: initialize again", http_status=404
            )
        return version

    async def _dispatch(
        self,
        message: wire.Message,
        headers: dict[str, str],
        identity: Identity,
        version: str,
        modern: bool,
        send: Send,
        receive: Receive | None = None,
    ) -> dict[str, Any] | None:
        method = message.method
        if method == "tools/call":
            active = tracing.tracer
            if active is None:
                return await self._call(message, headers, identity.caller, version, send, receive)
            # Read leniently here: the door refuses an invalid traceparent, as over HTTP.
            said = message.meta.get("traceparent")
            traceparent = headers.get("traceparent") or (said if isinstance(said, str) else None)
            attributes = {"rpc.system": "jsonrpc", "rpc.method": method, "url.path": PATH}
            with tracing.server_span(active, "MCP tools/call", traceparent, attributes) as span:
                reply = await self._call(message, headers, identity.caller, version, send, receive)
                request_id = ((reply or {}).get("_meta") or {}).get(wire.REQUEST_ID_META)
                if request_id:
                    span.set_attribute("reach.request_id", request_id)
                return reply
        out: dict[str, Any]
        if method == "initialize" and not modern:
            said = CAPABILITIES
            caps = reach_asks.declared(message.params.get("capabilities"))  # relayed mid-call
            out = {
                "protocolVersion": version,
                "capabilities": {**said, "tasks": tasks.CAPABILITY_2025}
                if version == tasks.TASKS_2025
                else said,
                "serverInfo": SERVER_INFO,
                "instructions": INSTRUCTIONS,
                "_headers": {"mcp-session-id": wire.new_session(version, identity.caller, caps)},
            }
            return out
        if method == "ping":
            out = {}
        elif method == "logging/setLevel":  # the session's (`_mcp_logging`)
            session = None if modern else headers.get(wire.SESSION_HEADER)
            await logs.set_level(
                self.gateway.views.policy.state, session, message.params, identity.caller
            )
            out = {}
        elif method == "completion/complete":  # nothing to complete: no prompts, no resources
            out = {"completion": {"values": [], "hasMore": False}}
        elif method in ("tasks/get", "tasks/cancel", "tasks/update") and modern:
            out = await tasks.Tasks(self.gateway).handle(message, headers)
        elif method in ("tasks/get", "tasks/cancel", "tasks/result") and (
            version == tasks.TASKS_2025
        ):
            return await tasks.Tasks(self.gateway, modern=False).handle(message, headers)
        elif method == "server/discover":
            out = {
                "supportedVersions": [*wire.MODERN, *wire.HANDSHAKE],
                "capabilities": {**CAPABILITIES, "extensions": {tasks.EXTENSION: {}}},
                "serverInfo": SERVER_INFO,
                "instructions": INSTRUCTIONS,
                "cacheScope": "public",
                "ttlMs": 0,
            }
        elif method == "tools/list":
            try:
                tools = await self.catalog().listed_for(identity.caller, self.gateway.guard)
            except ReachError as exc:
                raise rpc_error_of(exc, None) from None
            out = {"tools": tools}
            if version == tasks.TASKS_2025:  # any tool may run as a task
                for tool in tools:
                    tool["execution"] = {"taskSupport": "optional"}
            if modern:
                out.update(cacheScope="private", ttlMs=0)
        else:
            raise wire.RpcError(wire.METHOD_NOT_FOUND, f"method {str(method)[:100]!r} not found")
        if modern:
            out["resultType"] = "complete"
            out["_meta"] = {wire.SERVER_INFO_META: SERVER_INFO}
        return out

    # -- tools/call --------------------------------------------------------------------------

    async def _call(
        self,
        message: wire.Message,
        headers: dict[str, str],
        caller: str,
        version: str,
        send: Send,
        receive: Receive | None = None,
    ) -> dict[str, Any] | None:
        modern = version in wire.MODERN
        params = message.params
        name = params.get("name")
        if not isinstance(name, str) or not name:
            raise wire.RpcError(wire.INVALID_PARAMS, "params.name is the tool's name (a string)")
        arguments = params.get("arguments")
        if arguments is None:
            arguments = {}
        if not isinstance(arguments, dict):
            raise wire.RpcError(wire.INVALID_PARAMS, "params.arguments is an object")
        try:
            capability, operation = await self.catalog().target(name, caller, self.gateway.guard)
        except ReachError as exc:
            raise rpc_error_of(exc, None) from None
        body: dict[str, Any] = {"target": capability, "operation": operation, "payload": arguments}
        meta = message.meta
        for key, field in (
            (wire.REQUEST_ID_META, "request_id"),
            (wire.IDEMPOTENCY_META, "idempotency_key"),
            (wire.TIMEOUT_META, "timeout_ms"),
        ):
            if key in meta:
                body[field] = meta[key]
        metadata = dict(headers)
        if "traceparent" not in metadata and isinstance(meta.get("traceparent"), str):
            metadata["traceparent"] = meta["traceparent"]
        try:
            raw = dumps(body)
        except (UnicodeEncodeError, ValueError) as exc:
            raise wire.RpcError(
                wire.INVALID_PARAMS, f"arguments are not standard JSON: {exc}"
            ) from None
        level = logs.asked(message) if modern else None
        as_task = modern and tasks.wanted(message)
        asked = tasks.asked_2025(message, version)
        streams = wire.accepts(headers, "text/event-stream")
        # A task: as soon as the request is durable (asked), or if it still runs
        # TASK_AFTER_S later; the door then answers `accepted` and holds nothing of it.
        let_go = 0.0 if asked else tasks.TASK_AFTER_S if as_task else None
        state = self.gateway.views.policy.state
        # A session whose client answers questions relays its agents' (`_mcp_ask`): streamed.
        caps = "" if modern else wire.session_caps(headers.get(wire.SESSION_HEADER), caller)
        offer = ask.Offer(state, caps) if caps and streams and let_go is None else None
        # A client gone mid-call lets the door's wait go, as the HTTP front's does (it held its
        # room among the bytes in flight to the verdict), and releases its offer: its
        # questions are not held to the deadline.
        gone = None
        if let_go is None and receive is not None:
            watch = offer.watch(receive) if offer is not None else disconnected(receive)
            gone = asyncio.ensure_future(watch)
        front = Call(let_go, offer, gone)
        invoke = self.gateway.door.invoke(metadata, Bytes(raw), front)
        if let_go is not None:
            return await self._task(invoke, front, modern, asked)
        try:
            if not streams:  # awaited here: no timer, no task
                return await outcome(invoke, front, modern)
            task = asyncio.ensure_future(invoke)
            session = headers.get(wire.SESSION_HEADER)
            check = token_check(self.gateway.guard, headers)
            return await self._streamed(task, message, front, send, level, session, check)
        finally:
            if gone is not None:
                gone.cancel()
            if offer is not None:
                await offer.close()

    async def _streamed(
        self,
        task: asyncio.Future[InvokeResponse],
        message: wire.Message,
        front: Call,
        send: Send,
        level: str | None,
        session: str | None,
        check: Callable[[], object] | None = None,
    ) -> dict[str, Any] | None:
        """A call whose client takes a stream: answered as one when it runs long, or at once
        when the client wants its progress, log messages or questions; `check`: its caller's
        token, checked again while it streams."""
        modern = message.modern
        state = self.gateway.views.policy.state
        if not modern:  # read beside the call, which has started
            level = await logs.session_level(state, session)
        offer = front.offer if front.offer is not None and front.offer.open else None
        if sse.progress_token(message) is not None or level is not None or offer is not None:
            await self._durable(task, front)
            done: set[Any] = {task} if task.done() else set()
        else:
            done, _ = await asyncio.wait({task}, timeout=SSE_AFTER_S)
        if not done and front.request_id is not None:
            self._keep(task)
            rid = front.request_id
            said = lambda ended: outcome(ended, named(rid), modern)  # noqa: E731
            await sse.stream(send, message, task, rid, said, state, level, offer, check)
            return None
        return await outcome(task, front, modern)

    async def _durable(self, task: asyncio.Future[InvokeResponse], front: Call) -> None:
        """Until the call is durable, or ended (refused, or answered) before it said so."""
        durable = asyncio.ensure_future(front.durable.wait())
        try:
            either: set[asyncio.Future[Any]] = {task, durable}
            await asyncio.wait(either, return_when=asyncio.FIRST_COMPLETED)
        finally:
            durable.cancel()

    async def _task(
        self, invoke: Awaitable[InvokeResponse], front: Call, modern: bool, asked: bool
    ) -> dict[str, Any]:
        """A call as a task: its result if the door had it before letting it go, its
        refusal, or the task (its id the RequestID)."""
        ended = asyncio.ensure_future(invoke)
        await asyncio.wait({ended})
        if ended.exception() is None and ended.result().status == "accepted":
            rid = ended.result().request_id
            return tasks.created_2025(rid) if asked else tasks.created(rid)
        return await outcome(ended, front, modern)

    def _keep(self, task: asyncio.Future[InvokeResponse]) -> None:
        """Hold a call nobody awaits any more until it ends (its outcome is the task's)."""
        self._calls.add(task)
        task.add_done_callback(self._calls.discard)
        task.add_done_callback(consumed)
