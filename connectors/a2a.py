"""A2A connector: Reach calls agents that speak the Agent2Agent protocol (v1.0, JSON-RPC binding).

An A2A agent does not Join: it is registered by its base URL (`registered_by_url`), described
by its agent card (`discover`: `GET {base}/.well-known/agent-card.json`, conditional on the
last ETag, skills as operations), and called by `SendMessage` on the card's JSON-RPC URL
(`invoke`). The mapping both ways is `connectors._a2a_wire` (and docs/protocols/a2a.md); the
card's checks, the forgery guard on its URLs included, are `connectors._a2a_card`.

Long tasks: `SendMessage` asks to be answered as soon as the agent has a task
(`returnImmediately`), so a task still submitted or working comes back at once as an accepted
`Reply` with a follow handle (task id, context id, JSON-RPC URL). The workflow keeps that handle
in its history and follows the task (`follow`: one `GetTask`) on durable timers until it ends
or the deadline passes, when it sends `CancelTask` (`cancel`). A restarted gateway or worker
goes on following the same task: the message is never sent again. When the card says the agent
pushes notifications (and Reach has a webhook key to sign with), the message carries a push
config pointing at the gateway's `POST /reach/a2a/push/{request_id}` with that request's token
(`reach.security.a2a_push`), and the handle says `push`: the workflow then looks when a
notification arrives, polling only as a slower fallback (`workflows._following`). Else, when
the card says the agent streams, the handle says `stream`: the workflow holds the task's
stream (`subscribe`, `SubscribeToTask`, `connectors._a2a_stream`; let go before CancelTask) and
looks when it says the task stopped going, polling only when the stream breaks first. An agent
refusing the push config (`PushNotificationNotSupportedError`) is sent the message again without.

Connections: one guarded httpx client (its own keep-alive pool, anyio's: TCP_NODELAY) per
instance, opened on first use, closed when idle past `transport.idle_timeout_s` or when the
instance leaves the registry; the address guard vets every new connection (the card's and the
JSON-RPC URL's alike).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import ssl
from typing import Any

import httpx

from agent_reach_proto import wire
from connectors._a2a_card import MAX_CARD_BYTES, card_url, discovery_of
from connectors._a2a_stream import HeldStreams, ended, held, read_until_end, sse_data
from connectors._a2a_wire import (
    A2A_VERSION,
    CONTINUE_KEY,
    PUSH_NOT_SUPPORTED,
    TASK_NOT_FOUND,
    get_task_request,
    reply_of_get,
    reply_of_send,
    reply_of_task,
    result_of,
    rpc_error,
    send_request,
)
from connectors._address import check_http_address, refuse
from connectors._answers import fault_of
from connectors._guard import GuardedTransport
from connectors._pools import ConnectionStats, Pools
from connectors._tls import public_context
from connectors.base import PooledConnector
from connectors.http import map_httpx_exceptions
from reach.config import SecuritySettings, TransportSettings
from reach.errors import (
    AgentError,
    InternalError,
    InvalidRequest,
    ReachError,
    TransportError,
    Unavailable,
)
from reach.invocation import Endpoint
from reach.messages import Message, Reply, dumps
from reach.registry.models import Discovery
from reach.security.a2a_push import push_token, push_url
from reach.security.netguard import DEFAULT_PORTS, AddressGuard, host_port

# The mapping's pure parts, public for whoever checks them (its tests), beside the connector.
__all__ = [
    "A2AConnector",
    "HeldStreams",
    "discovery_of",
    "ended",
    "held",
    "reply_of_get",
    "reply_of_send",
    "reply_of_task",
    "result_of",
    "rpc_error",
    "send_request",
    "sse_data",
]

log = logging.getLogger("reach.connectors.a2a")

MAX_ERROR_BODY_BYTES = 64 * 1024
CARD_TIMEOUT_S = 5.0
MAX_CONNECTIONS_PER_INSTANCE = 64


async def _read_bounded(response: httpx.Response, limit: int, what: str, where: str) -> bytes:
    declared = response.headers.get("content-length")
    if declared is not None and "content-encoding" not in response.headers:
        with contextlib.suppress(ValueError):
            if int(declared) > limit:
                raise AgentError(f"{where}: {what} of {declared} bytes; at most {limit}")
    chunks, size = [], 0
    async for chunk in response.aiter_bytes():
        size += len(chunk)
        if size > limit:
            raise AgentError(f"{where}: {what} of more than {limit} bytes", retryable=False)
        chunks.append(chunk)
    return b"".join(chunks)


class A2AConnector(PooledConnector):
    protocol = "a2a"
    deduplicates = False  # an A2A agent need not know a message sent again
    registered_by_url = True

    def __init__(
        self,
        transport: TransportSettings | None = None,
        *,
        stats: ConnectionStats | None = None,
        security: SecuritySettings | None = None,
    ) -> None:
        super().__init__(transport, stats=stats, security=security)
        # As the HTTP connector: built without security settings (tests), no guard.
        self.guard = AddressGuard(self.security.allow_networks) if security is not None else None
        expiry = self.transport.idle_timeout_s

        def make_client(_: str) -> httpx.AsyncClient:
            tls = self._verify()
            limits = httpx.Limits(
                max_connections=MAX_CONNECTIONS_PER_INSTANCE,
                max_keepalive_connections=MAX_CONNECTIONS_PER_INSTANCE,
                keepalive_expiry=expiry,
            )
            guarded = (
                None
                if self.guard is None
                else GuardedTransport(self.guard, verify=tls, limits=limits)
            )
            return httpx.AsyncClient(
                limits=limits,
                trust_env=False,
                verify=tls,
                follow_redirects=False,
                transport=guarded,
            )

        async def close(client: httpx.AsyncClient) -> None:
            await client.aclose()

        self._pools: Pools[httpx.AsyncClient] = self._new_pools(make_client, close)
        self._held = HeldStreams()
        self._cards: httpx.AsyncClient | None = None
        # address -> JSON-RPC URL, for instances whose details do not say (joined, not found
        # by URL): read from the card once.
        self._urls: dict[str, str] = {}
        self._gateway_url: str | None = None  # `reached_at`: where push notifications go
        self._mtls: ssl.SSLContext | None = None  # `_verify`, with security.tls

    def _verify(self) -> ssl.SSLContext:
        """The TLS context of every connection to A2A agents. Without `security.tls`, the one
        public context (`connectors._tls`). With it, mTLS by the agent's URL: Reach presents
        its certificate (`cert_file`, `key_file`) to any agent that asks for one, and verifies
        the agent's for its URL's host name against the public CAs and `ca_file` (an agent
        named by its URL proves that host, not a SPIFFE id of Reach's)."""
        tls = self.security.tls
        if not tls.enabled:
            return public_context()  # shared by every client
        if self._mtls is None:
            context = httpx.create_ssl_context(trust_env=False)
            try:
                context.load_verify_locations(cafile=tls.ca_file)
                context.load_cert_chain(tls.cert_file, tls.key_file)
            except (OSError, ssl.SSLError) as exc:
                # Reach's own configuration, not the agent's fault: not counted against it.
                raise InternalError(
                    f"mTLS to A2A agents is on but Reach's certificates cannot be loaded "
                    f"(security.tls: ca_file {tls.ca_file}, cert_file {tls.cert_file}, "
                    f"key_file {tls.key_file}): {exc}"
                ) from None
            self._mtls = context
        return self._mtls

    @classmethod
    def check_address(cls, address: str) -> str:
        """An A2A agent's base URL: http(s)://host[:port][/path] (its card is under it)."""
        if "://" not in address:
            raise refuse(address, "an A2A agent is named by its base URL: http(s)://host[:port]")
        return check_http_address(address)

    @classmethod
    def address_host_port(cls, address: str) -> tuple[str, int] | None:
        return host_port(address, DEFAULT_PORTS)

    def _card_client(self) -> httpx.AsyncClient:
        if self._cards is None:
            limits = httpx.Limits(max_connections=32, max_keepalive_connections=8)
            tls = self._verify()
            guarded = (
                None
                if self.guard is None
                else GuardedTransport(self.guard, verify=tls, limits=limits)
            )
            self._cards = httpx.AsyncClient(
                limits=limits,
                trust_env=False,
                verify=tls,
                follow_redirects=False,
                transport=guarded,
            )
        return self._cards

    async def discover(self, address: str, known: Discovery | None = None) -> Discovery:
        url = card_url(address)
        if self.guard is not None and known is None:
            # InvalidRequest naming the refusal, nothing sent; a probe's new connections are
            # vetted by the guarded transport, so it pays no lookup for this check.
            await self.guard.check_url(url)
        headers = {"Accept": "application/json", "A2A-Version": A2A_VERSION}
        if known is not None and known.etag:
            headers["If-None-Match"] = known.etag
        where = f"the agent card at {url[:120]}"
        try:
            with map_httpx_exceptions(url):
                async with asyncio.timeout(CARD_TIMEOUT_S):
                    request = self._card_client().build_request(
                        "GET", url, headers=headers, timeout=CARD_TIMEOUT_S
                    )
                    response = await self._card_client().send(request, stream=True)
                    try:
                        if response.status_code == 304 and known is not None:
                            return known
                        code = response.status_code
                        if code == 404:  # most often a URL that is not the base URL
                            raise InvalidRequest(
                                f"{where}: answered HTTP 404; register the agent's base URL, "
                                "the one its card is under (/.well-known/agent-card.json)"
                            )
                        if 400 <= code < 500 and code not in (408, 429):
                            raise InvalidRequest(f"{where}: answered HTTP {code}")
                        if code != 200:
                            raise Unavailable(f"{where}: answered HTTP {code}")
                        raw = await _read_bounded(response, MAX_CARD_BYTES, "a card", where)
                    finally:
                        await response.aclose()
        except AgentError as exc:  # too large: the card, not the agent's answer to a call
            raise InvalidRequest(exc.message) from None
        except TransportError as exc:
            raise Unavailable(exc.message) from None
        except ReachError as exc:
            if exc.type == "timeout":
                raise Unavailable(f"{where}: no answer within {CARD_TIMEOUT_S:.0f}s") from None
            raise
        found = await discovery_of(address, raw, response.headers.get("etag"), self.guard)
        self._urls[address] = found.details["url"]
        return found

    async def _rpc_url(self, endpoint: Endpoint) -> str:
        url = endpoint.details.get("url")
        if isinstance(url, str) and url:
            return url
        known = self._urls.get(endpoint.address)
        if known is None:
            try:
                known = (await self.discover(endpoint.address)).details["url"]
            except (InvalidRequest, Unavailable) as exc:
                # Nothing was sent: another attempt (or instance) may do better.
                raise TransportError(
                    f"agent {endpoint.instance_id}: {exc.message}", retryable=exc.retryable
                ) from None
        return known

    async def _call(
        self,
        endpoint: Endpoint,
        url: str,
        method: str,
        params: dict[str, Any],
        timeout_s: float,
        headers: dict[str, str] | None = None,
    ) -> Any:
        """One JSON-RPC call: its `result`, or the Reach error its answer or failure is."""
        limit = endpoint.max_message_bytes or self.transport.max_message_bytes
        where = f"agent {endpoint.instance_id}"
        body = dumps({"jsonrpc": "2.0", "id": 1, "method": method, "params": params})
        sent_headers = {
            "Content-Type": "application/json",
            "Accept": "application/json",
            "A2A-Version": A2A_VERSION,
            **(headers or {}),
        }
        pool = self._pools.acquire(
            f"{endpoint.instance_id} {endpoint.address}",
            endpoint.capability,
            endpoint.address,
            instance_id=endpoint.instance_id,
        )
        try:
            with map_httpx_exceptions(endpoint.address):
                async with asyncio.timeout(max(timeout_s, 0.001)):
                    http = pool.value
                    request = http.build_request(
                        "POST",
                        url,
                        content=body,
                        headers=sent_headers,
                        timeout=max(timeout_s, 0.001),
                    )
                    response = await http.send(request, stream=True)
                    try:
                        code = response.status_code
                        if code == 200:
                            # The envelope around a result of `limit` bytes stays well within.
                            raw = await _read_bounded(response, limit + 4096, "an answer", where)
                        else:
                            raw = b""
                            async for chunk in response.aiter_bytes():
                                raw += chunk
                                if len(raw) >= MAX_ERROR_BODY_BYTES:
                                    break
                    finally:
                        await response.aclose()
        except (httpx.ConnectError, TransportError):
            self.stats.count(endpoint.capability, self.protocol, "failed")
            raise
        finally:
            self._pools.release(pool)
        if code != 200:
            fault, final = fault_of(raw[:MAX_ERROR_BODY_BYTES], code)
            said = f": {fault.message[:200]}" if fault.message else ""
            retryable = (code >= 500 or code == 429) and not final
            raise AgentError(
                f"{where} answered HTTP {code}{said}", retryable=retryable, fault=fault
            )
        try:
            answer = json.loads(raw)
        except (UnicodeDecodeError, json.JSONDecodeError, RecursionError):
            raise AgentError(f"{where} answered {method} with no JSON", retryable=False) from None
        if not isinstance(answer, dict):
            raise AgentError(f"{where} answered {method} with no JSON-RPC object", retryable=False)
        if answer.get("error") is not None:
            raise rpc_error(answer["error"], f"{where} refused {method}")
        if "result" not in answer:
            raise AgentError(f"{where} answered {method} with no result", retryable=False)
        return answer["result"]

    def continues(self, message: Message) -> list[str]:
        follow_up = message.payload.get(CONTINUE_KEY)
        if not isinstance(follow_up, dict):
            return []
        return [str(follow_up[k]) for k in ("task_id", "context_id") if follow_up.get(k)]

    def conversations(self, reply: Reply) -> list[str]:
        named: dict[str, Any]
        if reply.follow is not None:
            named = reply.follow
        elif reply.status in ("input_required", "canceled") and reply.result is not None:
            named = reply.result
        elif reply.named is not None:  # a completed task's or a message's: the caller's too
            named = reply.named
        else:
            return []
        return [str(named[k]) for k in ("task_id", "context_id") if named.get(k)]

    async def invoke(self, endpoint: Endpoint, message: Message, timeout_s: float) -> Reply:
        limit = endpoint.max_message_bytes or self.transport.max_message_bytes
        url = await self._rpc_url(endpoint)
        headers = {}
        if message.header.traceparent:
            headers[wire.TRACEPARENT] = message.header.traceparent
        params = send_request(message)
        push = self._push_config(endpoint, message.header.request_id)
        if push is not None:
            params["configuration"]["taskPushNotificationConfig"] = push
        try:
            result = await self._call(endpoint, url, "SendMessage", params, timeout_s, headers)
        except AgentError as exc:
            if push is None or getattr(exc, "code", None) != PUSH_NOT_SUPPORTED:
                raise
            # The agent refused the message for its push config (its card said it pushes):
            # refused, so not taken; sent once more without it, the same message id.
            push = None
            del params["configuration"]["taskPushNotificationConfig"]
            result = await self._call(endpoint, url, "SendMessage", params, timeout_s, headers)
        reply = reply_of_send(result, endpoint, url, limit)
        if reply.follow is not None:
            if push is not None:
                reply.follow["push"] = True  # the workflow waits for the agent's notifications
            elif endpoint.details.get("streaming") is True:
                reply.follow["stream"] = True  # the workflow holds the task's stream
        return reply

    def reached_at(self, gateway_url: str) -> None:
        self._gateway_url = gateway_url

    def _push_config(self, endpoint: Endpoint, request_id: str) -> dict[str, Any] | None:
        """The push-notification config a message is sent with: when the agent's card says
        it pushes and Reach can sign (a webhook key, its gateway's URL), the gateway's push
        route for this request and its token (`reach.security.a2a_push`); else None (the
        task is followed by polling alone)."""
        key = self.security.webhook_key
        if endpoint.details.get("push_notifications") is not True or key is None:
            return None
        if self._gateway_url is None:
            return None
        return {
            "url": push_url(self._gateway_url, request_id),
            "token": push_token(key.get_secret_value(), request_id),
        }

    async def follow(self, endpoint: Endpoint, handle: dict[str, Any], timeout_s: float) -> Reply:
        """Where the task `handle` names stands now: its final Reply, an accepted Reply (still
        going), or the Reach error it ended in. A task the agent no longer knows is an
        agent_error whose outcome is unknown (it may have run)."""
        limit = endpoint.max_message_bytes or self.transport.max_message_bytes
        url = str(handle.get("url") or "") or await self._rpc_url(endpoint)
        task_id = str(handle.get("task_id") or "")
        try:
            result = await self._call(
                endpoint, url, "GetTask", get_task_request(task_id), timeout_s
            )
        except AgentError as exc:
            if getattr(exc, "code", None) == TASK_NOT_FOUND:
                exc.message = (
                    f"agent {endpoint.instance_id} no longer knows task {task_id} (it was "
                    "working when last seen): it may have run"
                )
                exc.outcome_unknown = True
            raise
        return reply_of_get(result, endpoint, url, limit, task_id)

    async def subscribe(
        self, endpoint: Endpoint, handle: dict[str, Any], window_s: float, timeout_s: float
    ) -> Reply:
        """Follow the task `handle` names by its stream (`SubscribeToTask`) for up to
        `window_s`, then look once (`follow`): when the stream says the task stopped going,
        or ended, broke or went quiet first (then the look may find it still going, and the
        workflow polls); asked besides now and then while the stream goes on (`held`: a stream
        that kept saying working after the task completed left the request to time out). The
        window passing first: the task as last seen, still going."""
        url = str(handle.get("url") or "") or await self._rpc_url(endpoint)
        task_id = str(handle.get("task_id") or "")
        try:
            async with asyncio.timeout(max(window_s, 0.001)):
                why = await held(
                    self._stream(endpoint, url, task_id, timeout_s),
                    lambda: self.follow(endpoint, handle, timeout_s),
                )
        except TimeoutError:
            kept = {k: v for k, v in handle.items() if k != "subscribe"}
            return Reply(status="accepted", follow=kept)
        if isinstance(why, Reply):  # asked while the stream said nothing of the end
            return why
        if why:
            log.info("A2A task %s of %s: %s; asking", task_id, endpoint.instance_id, why)
        return await self.follow(endpoint, handle, timeout_s)

    async def _stream(self, endpoint: Endpoint, url: str, task_id: str, timeout_s: float) -> str:
        """Read the task's stream until it says the task stopped going (""), or why not."""
        pool = self._pools.acquire(
            f"{endpoint.instance_id} {endpoint.address}",
            endpoint.capability,
            endpoint.address,
            instance_id=endpoint.instance_id,
        )
        try:
            with map_httpx_exceptions(endpoint.address):
                where = f"agent {endpoint.instance_id}"
                reading = read_until_end(pool.value, url, task_id, where, timeout_s)
                return await self._held.read(task_id, reading)
        except ReachError as exc:  # broke, went quiet, or told something that is no event
            return f"its stream failed ({exc.message[:200]})"
        finally:
            self._pools.release(pool)

    async def cancel(self, endpoint: Endpoint, handle: dict[str, Any], timeout_s: float) -> None:
        """Ask the agent to cancel the task `handle` names."""
        url = str(handle.get("url") or "") or await self._rpc_url(endpoint)
        task_id = str(handle.get("task_id") or "")

        async def ask(left_s: float) -> None:
            await self._call(endpoint, url, "CancelTask", {"id": task_id}, left_s)

        async def look(left_s: float) -> Reply:
            return await self.follow(endpoint, handle, left_s)

        await self._held.cancel(task_id, ask, look, timeout_s)

    async def aclose(self) -> None:
        await super().aclose()
        if self._cards is not None:
            await self._cards.aclose()
            self._cards = None
