"""MCP connector: Reach calls MCP servers' tools over Streamable HTTP, both protocol generations.

An MCP server is registered by its endpoint URL (`registered_by_url`): `discover` lists its
tools (`tools/list`, every page) as operations, and `invoke` is `tools/call` with the payload
as the tool's arguments. What each answer means, what `_meta` carries and how the two
generations are negotiated is `docs/protocols/mcp.md`; the wire is `connectors._mcp_wire`, the
per-server state (negotiation, sessions) `connectors._mcp_client`.

Why a client of its own rather than the `mcp` package's `ClientSession`: one pooled httpx client
per server shared by every call (the SDK's session is a connection with its own task group and
memory streams per client, built for one caller), no task per request, the failure of each call
mapped where it happens (refused before the send, broken after it: an unknown outcome), and the
session renewed without losing the call that found it gone.

A call whose outcome is unknown (sent, then the connection broke) is never sent again by this
process unless its tool is declared idempotent: MCP servers do not deduplicate by RequestID, so
a re-delivery could run the tool twice.
"""

from __future__ import annotations

import asyncio
import logging
from collections import OrderedDict
from typing import Any

import httpx

from agent_reach_proto import wire
from connectors import _mcp_wire as w
from connectors._address import check_http_address, refuse
from connectors._guard import GuardedTransport
from connectors._mcp_client import McpServer, Sent
from connectors._mcp_client import Negotiated as Negotiated  # what tests set on a server
from connectors._pools import ConnectionStats, Pools
from connectors._tls import public_context
from connectors.base import PooledConnector
from connectors.http import map_httpx_exceptions
from reach import progress
from reach.config import SecuritySettings, TransportSettings
from reach.errors import AgentError, DeadlineExceeded, InvalidRequest, TransportError
from reach.invocation import Endpoint
from reach.messages import Header, Message, Reply
from reach.registry.models import Discovery
from reach.security.netguard import AddressGuard, host_port

log = logging.getLogger("connectors.mcp")

# The wire's rules (what each answer means), public for the tests that check them.
wire_rules = w

DISCOVER_TIMEOUT_S = 10.0
# Calls sent whose answer never came, remembered so that a re-delivery is not sent again.
MAX_REMEMBERED_UNKNOWN = 10_000
# One server's connections (httpcore's pool is cheapest small; more callers wait their turn).
MAX_CONNECTIONS_PER_SERVER = 16
# What a discovery's pools count under: the probe calls no capability's operation.
DISCOVERY = "discovery"
LOG_LEVEL_META = "io.modelcontextprotocol/logLevel"
LOG_LEVEL = "info"


def reach_meta(header: Header) -> dict[str, Any]:
    """The request's metadata as `_meta` carries it: the same lower-case names every protocol
    uses (`agent_reach_proto.wire`), the RequestID also as the progress token."""
    meta: dict[str, Any] = {
        wire.REQUEST_ID: header.request_id,
        wire.CALLER: header.caller,
        wire.ATTEMPT: header.attempt,
        "progressToken": header.request_id,
        # Log messages at LOG_LEVEL and above, for the request's timeline: a 2026-07-28 server
        # sends none unless asked per request (a session-based server sends what it likes).
        LOG_LEVEL_META: LOG_LEVEL,
    }
    if header.deadline_ms is not None:
        meta[wire.DEADLINE_MS] = header.deadline_ms
    if header.idempotency_key is not None:
        meta[wire.IDEMPOTENCY_KEY] = header.idempotency_key
    if header.traceparent is not None:
        meta[wire.TRACEPARENT] = header.traceparent
    return meta


class McpConnector(PooledConnector):
    protocol = "mcp"
    deduplicates = False  # an MCP server runs a tools/call sent twice twice
    registered_by_url = True
    reports_progress = True  # notifications/progress and /message, for the request's timeline

    def __init__(
        self,
        transport: TransportSettings | None = None,
        *,
        stats: ConnectionStats | None = None,
        security: SecuritySettings | None = None,
    ) -> None:
        super().__init__(transport, stats=stats, security=security)
        guard = AddressGuard(self.security.allow_networks) if security is not None else None
        expiry = self.transport.idle_timeout_s

        def make(url: str) -> McpServer:
            tls = public_context()  # shared by every client (`connectors._tls`)
            limits = httpx.Limits(
                max_connections=MAX_CONNECTIONS_PER_SERVER,
                max_keepalive_connections=MAX_CONNECTIONS_PER_SERVER,
                keepalive_expiry=expiry,
            )
            guarded = None if guard is None else GuardedTransport(guard, verify=tls, limits=limits)
            http = httpx.AsyncClient(
                limits=limits,
                trust_env=False,
                verify=tls,
                follow_redirects=False,
                # Each call's deadline bounds it whole (asyncio.timeout); a slow tool is not a
                # read timeout.
                timeout=httpx.Timeout(None, connect=DISCOVER_TIMEOUT_S),
                transport=guarded,
            )
            return McpServer(url, http, MAX_CONNECTIONS_PER_SERVER)

        self._pools: Pools[McpServer] = self._new_pools(make, _close)
        self._unknown: OrderedDict[str, None] = OrderedDict()
        self._cancels: set[asyncio.Task[None]] = set()
        self.progress_seen = 0  # progress notifications read (each to reach.progress.report)
        self.logs_seen = 0  # log messages read (each to reach.progress.report_log)

    @classmethod
    def check_address(cls, address: str) -> str:
        """An MCP server's Streamable HTTP endpoint: an http(s) URL, its path included."""
        normalized = check_http_address(address)
        if "://" not in normalized:
            raise refuse(address, "an MCP server is named by its endpoint URL: http(s)://host/mcp")
        if address.endswith("/") and normalized.count("/") > 2:
            normalized += "/"  # an endpoint mounted at /mcp/ is not the one at /mcp
        return normalized

    @classmethod
    def address_host_port(cls, address: str) -> tuple[str, int] | None:
        return host_port(address, {"http": 80, "https": 443})

    # -- discovery -------------------------------------------------------------------------------

    async def discover(self, address: str, known: Discovery | None = None) -> Discovery:
        entry = self._pools.acquire(address, DISCOVERY)
        server = entry.value
        try:
            with map_httpx_exceptions(address):
                async with asyncio.timeout(DISCOVER_TIMEOUT_S):
                    tools = await self._list_tools(server)
        except AgentError as exc:  # it answered, not as an MCP server answers tools/list
            raise InvalidRequest(exc.message) from exc
        except DeadlineExceeded as exc:
            raise TransportError(exc.message) from exc
        finally:
            self._pools.release(entry)
        self._listen(server)
        negotiated = server.negotiated
        details = negotiated.details() if negotiated is not None else {}
        return w.discovery(tools, details)

    async def _list_tools(self, server: McpServer) -> list[Any]:
        tools: list[Any] = []
        cursors: set[str] = set()
        cursor: str | None = None
        budget = w.Budget(w.MAX_DISCOVERY_BYTES)  # the pages together, not each
        for _ in range(w.MAX_PAGES):
            params = {} if cursor is None else {"cursor": cursor}
            result = await server.request(
                "tools/list", params, limit=w.MAX_LIST_BYTES, budget=budget
            )
            page = result.get("tools")
            if not isinstance(page, list):
                raise InvalidRequest(f"{server.where}: its tools/list result has no tools list")
            tools.extend(page)
            cursor = result.get("nextCursor")
            if not isinstance(cursor, str) or not cursor or len(tools) > 4 * w.MAX_TOOLS:
                return tools
            if cursor in cursors:
                raise InvalidRequest(f"{server.where}: its tools/list pages go round in a circle")
            cursors.add(cursor)
        return tools

    # -- invoke ----------------------------------------------------------------------------------

    async def invoke(self, endpoint: Endpoint, message: Message, timeout_s: float) -> Reply:
        header = message.header
        limit = endpoint.max_message_bytes or self.transport.max_message_bytes
        where = f"MCP server {endpoint.instance_id}"
        guarded = endpoint.declared_idempotent is not True
        if guarded and header.request_id in self._unknown:
            raise TransportError(
                f"{where} was sent this call before and its answer never came; an MCP server "
                "does not deduplicate by RequestID, so it is not sent again",
                retryable=False,
                outcome_unknown=True,
            )
        entry = self._pools.acquire(
            endpoint.address, endpoint.capability, instance_id=endpoint.instance_id
        )
        server = entry.value
        if server.negotiated is None and server.hint is None:
            hint = endpoint.details.get("protocol_version")
            server.hint = hint if isinstance(hint, str) else None
        sent: list[Sent] = []
        try:
            with map_httpx_exceptions(endpoint.address):
                async with asyncio.timeout(max(timeout_s, 0.001)):
                    result = await server.request(
                        "tools/call",
                        {"name": header.operation, "arguments": message.payload},
                        limit=w.read_limit(limit),
                        name=header.operation,
                        meta=reach_meta(header),
                        on_notification=lambda heard: self._heard(endpoint.address, heard),
                        sent=sent,
                        tasks=True,
                        ask_limit=limit,
                    )
        except DeadlineExceeded:
            if sent:
                self._cancel_later(server, sent[-1], "the request's deadline passed")
            raise
        except asyncio.CancelledError:
            if sent:
                self._cancel_later(server, sent[-1], "the request was cancelled")
            raise
        except TransportError as exc:
            if exc.outcome_unknown and not sent:  # it broke while negotiating: no call was sent
                raise TransportError(exc.message) from exc
            if exc.outcome_unknown:
                self.stats.count(endpoint.capability, self.protocol, "failed")
                if guarded:
                    self._remember(header.request_id)
            raise
        finally:
            self._pools.release(entry)
        # A task is followed only where the call declared the extension (2026-07-28).
        return w.tool_reply(result, where, limit, tasks=bool(sent) and sent[-1].negotiated.modern)

    # -- tasks (io.modelcontextprotocol/tasks) ---------------------------------------------------

    async def _task_request(
        self, endpoint: Endpoint, method: str, handle: dict[str, Any], timeout_s: float
    ) -> dict[str, Any]:
        task_id = str(handle.get("task_id") or "")
        limit = endpoint.max_message_bytes or self.transport.max_message_bytes
        entry = self._pools.acquire(
            endpoint.address, endpoint.capability, instance_id=endpoint.instance_id
        )
        server = entry.value
        if server.negotiated is None and server.hint is None:
            server.hint = w.MODERN  # only a 2026-07-28 server hands out tasks
        try:
            with map_httpx_exceptions(endpoint.address):
                async with asyncio.timeout(max(timeout_s, 0.001)):
                    # Mcp-Name carries the task id, for whatever routes by it to its holder.
                    return await server.request(
                        method,
                        {"taskId": task_id},
                        limit=w.read_limit(limit),
                        name=task_id,
                        tasks=True,
                    )
        finally:
            self._pools.release(entry)

    async def follow(self, endpoint: Endpoint, handle: dict[str, Any], timeout_s: float) -> Reply:
        """Where the task `handle` names stands (`tasks/get`). A task the server no longer
        knows (-32602) is an agent_error whose outcome is unknown: it may have run."""
        where = f"MCP server {endpoint.instance_id}"
        try:
            task = await self._task_request(endpoint, "tasks/get", handle, timeout_s)
        except AgentError as exc:
            if exc.fault is not None and exc.fault.status == w.INVALID_PARAMS:
                exc.message = (
                    f"{where} no longer knows task {handle.get('task_id')} (it was working when "
                    f"last seen): it may have run; it said: {exc.fault.message}"
                )
                exc.outcome_unknown = True
            raise
        return w.task_reply(
            task, where, endpoint.max_message_bytes or self.transport.max_message_bytes
        )

    async def cancel(self, endpoint: Endpoint, handle: dict[str, Any], timeout_s: float) -> None:
        """Ask the server to stop the task (`tasks/cancel`; cooperative: it may finish anyway)."""
        await self._task_request(endpoint, "tasks/cancel", handle, timeout_s)

    def _listen(self, server: McpServer) -> None:
        """Where a prober watches (a gateway), hold the server's GET stream: a list_changed
        it sends outside any call reaches the prober too (`connectors._mcp_listen`)."""
        if self.watched:
            server.listen(lambda: self.changed(server.url))

    def _heard(self, address: str, notification: dict[str, Any]) -> None:
        """A notification on a call's stream: progress and log messages go to the request's
        record (the activity's sink), a changed tool list to this process's prober
        (`Connector.watch`)."""
        method = notification.get("method")
        if method == "notifications/progress":
            self.progress_seen += 1
            progress.report(notification.get("params"))
        elif method == "notifications/message":
            self.logs_seen += 1
            progress.report_log(notification.get("params"))
        elif method == "notifications/tools/list_changed":
            log.info("MCP server at %s says its tools changed", address)
            self.changed(address)

    def _remember(self, request_id: str) -> None:
        self._unknown[request_id] = None
        self._unknown.move_to_end(request_id)
        while len(self._unknown) > MAX_REMEMBERED_UNKNOWN:
            self._unknown.popitem(last=False)

    def _cancel_later(self, server: McpServer, sent: Sent, reason: str) -> None:
        """`notifications/cancelled` off the caller's path (its deadline has passed)."""
        task = asyncio.get_running_loop().create_task(server.cancel(sent, reason))
        self._cancels.add(task)
        task.add_done_callback(self._cancels.discard)

    async def aclose(self) -> None:
        if self._cancels:
            await asyncio.gather(*self._cancels, return_exceptions=True)
        await super().aclose()


async def _close(server: McpServer) -> None:
    await server.aclose()
