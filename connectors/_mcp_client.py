"""One MCP server as `connectors.mcp` holds it: its pooled httpx client, the protocol generation
negotiated with it, and (session-based generations) its session.

Negotiation, once per server and process (and again when the server stops accepting what was
negotiated): `server/discover` at 2026-07-28; a server that answers it with that version among
its `supportedVersions` is spoken to statelessly. Any other answer (an HTTP 400/404/405, a
JSON-RPC error, a list without it) means a session-based server: `initialize` offering
2025-11-25, the version it answers with (2025-11-25, 2025-06-18 or 2025-03-26), its
`Mcp-Session-Id` if it gives one, then `notifications/initialized`. What discovery found
(`Endpoint.details["protocol_version"]`) lets a process without this cache skip the probe.

A 404 to a request carrying the session id means the server forgot the session (it expired, the
server restarted): nothing ran, so the session is initialized again, once, and the request
resent. A refused protocol version likewise negotiates again and resends once.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import httpx

from connectors import _mcp_wire as w
from connectors._mcp_listen import listen
from reach import asks
from reach.errors import AgentError, TransportError
from reach.messages import dumps

log = logging.getLogger("connectors.mcp")

# Answers to requests a server sends mid-call (sampling, elicitation) in flight at once: the
# immediate ones (refusals, pings), and apart from them the questions relayed to their callers,
# which may wait until their calls' deadlines (past MAX_RELAYED a question is refused at once,
# so that callers slow to answer never leave another caller's question unanswered).
MAX_ANSWERS = 64
MAX_RELAYED = 64
# Ids of the JSON-RPC requests this process sends (each server sees them unique per session).
_IDS = itertools.count(1)


def next_id() -> int:
    return next(_IDS)


@dataclass
class Negotiated:
    version: str
    session: str | None = None
    server: dict[str, Any] = field(default_factory=dict)

    @property
    def modern(self) -> bool:
        return self.version == w.MODERN

    def details(self) -> dict[str, Any]:
        info: dict[str, Any] = {
            "protocol_version": self.version,
            "sessions": self.session is not None,
        }
        if self.server:
            info["server"] = self.server
        return info


def _server_info(value: Any) -> dict[str, Any]:
    if not isinstance(value, dict):
        return {}
    return {k: str(value[k])[:128] for k in ("name", "version", "title") if value.get(k)}


@dataclass
class Sent:
    """A request on the wire: its id and the session it went in (for a cancellation)."""

    rpc_id: int
    negotiated: Negotiated


class McpServer:
    """The server at one Streamable HTTP endpoint URL."""

    def __init__(self, url: str, http: httpx.AsyncClient, connections: int) -> None:
        self.url = url
        self._parsed_url = httpx.URL(url)  # parsed once, not on every request
        self.http = http
        self.hint: str | None = None  # the version discovery found, from Endpoint.details
        self.negotiated: Negotiated | None = None
        self._lock = asyncio.Lock()
        # Callers past the pool's connections wait here, not in httpcore's pool, whose work
        # grows with waiting requests times connections (connectors/http.py measured it).
        self._slots = asyncio.Semaphore(connections)
        self._answers: set[asyncio.Task[None]] = set()  # refusals of requests sent mid-call
        self._relays: set[asyncio.Task[None]] = set()  # questions relayed to their callers
        self._listener: asyncio.Task[None] | None = None  # its listen stream (`_mcp_listen`)

    @staticmethod
    def next_id() -> int:
        return next_id()

    @property
    def where(self) -> str:
        return f"MCP server at {self.url}"

    async def _post(
        self,
        negotiated: Negotiated | None,
        method: str,
        params: dict[str, Any],
        *,
        rpc_id: int | None,
        limit: int,
        name: str | None = None,
        on_notification: Callable[[dict[str, Any]], None] | None = None,
        on_send: Callable[[], None] | None = None,
        budget: w.Budget | None = None,
        ask_limit: int | None = None,
    ) -> tuple[dict[str, Any], httpx.Headers]:
        """One POST; the result of request `rpc_id` (a notification: {}), and the headers.
        `budget`: what its response may read in all (else each message is bounded by `limit`
        and the stream by the caller's deadline). `ask_limit`: the bytes of a question the
        server asks mid-call that may be relayed to the caller, and of its answer (None:
        none is: discovery, tasks)."""
        version = negotiated.version if negotiated is not None else None
        session = negotiated.session if negotiated is not None else None
        if method == "initialize":
            version = None  # the handshake names its version in the body
        elif method == "server/discover":
            version = w.MODERN
        headers = w.request_headers(version, session, method, name)
        request = self.http.build_request(
            "POST", self._parsed_url, content=w.body(rpc_id, method, params), headers=headers
        )
        async with self._slots:
            if on_send is not None:
                on_send()  # from here on the server may have it (a refused connection says not)
            response = await self.http.send(request, stream=True)
            try:
                if response.status_code >= 300:
                    raise await w.http_refusal(
                        response, self.where, had_session=session is not None
                    )
                if rpc_id is None:
                    return {}, response.headers
                result = await w.read_answer(
                    response,
                    rpc_id,
                    limit,
                    self.where,
                    on_notification,
                    budget,
                    on_request=lambda asked: self._answer_later(negotiated, asked, ask_limit),
                )
                return result, response.headers
            finally:
                await response.aclose()

    def _answer_later(
        self, negotiated: Negotiated | None, asked: dict[str, Any], ask_limit: int | None
    ) -> None:
        """Answer a request the server sent on a response stream, off the stream's reader and
        outside the call slots (the call waiting on it holds one): sampling or elicitation
        asked where the call's questions may be relayed to its caller (`reach.asks`) is
        relayed (at most `MAX_RELAYED` at once per server, past them refused), anything else
        refused (`_mcp_wire.refusal_of`); at most `MAX_ANSWERS` refusals at once per server,
        past them a request is left unanswered."""
        answer = w.refusal_of(asked)
        if answer is None:
            return
        method = str(asked["method"])[:80]
        questions = asks.QUESTIONS.get() if ask_limit is not None else None
        pool = self._answers
        if questions is not None and method in asks.RELAYED and ask_limit is not None:
            if len(self._relays) < MAX_RELAYED:
                job = self._relay(negotiated, asked, questions, ask_limit)
                pool = self._relays
            else:
                log.info("%s asked for %s mid-call; refused: too many wait", self.where, method)
                job = self._send_answer(negotiated, answer)
        else:
            log.info("%s asked Reach for %s mid-call; refused", self.where, method)
            job = self._send_answer(negotiated, answer)
        if pool is self._answers and len(pool) >= MAX_ANSWERS:
            job.close()
            return
        task = asyncio.get_running_loop().create_task(job)
        pool.add(task)
        task.add_done_callback(pool.discard)

    async def _relay(
        self,
        negotiated: Negotiated | None,
        asked: dict[str, Any],
        questions: asks.Questions,
        limit: int,
    ) -> None:
        """The caller's answer to the server's question (or why there is none), in its session."""
        method = str(asked["method"])
        params = asked.get("params")
        tail = await questions.ask(method, params if isinstance(params, dict) else {}, limit)
        answer: dict[str, Any] = {"jsonrpc": "2.0", "id": asked["id"]}
        if isinstance(tail.get("error"), dict):
            answer["error"] = tail["error"]
            log.info(
                "%s asked for %s mid-call; not answered: %s",
                self.where,
                method[:80],
                str(tail["error"].get("message"))[:200],
            )
        else:
            answer["result"] = tail.get("result")
        await self._send_answer(negotiated, answer)

    async def _send_answer(self, negotiated: Negotiated | None, answer: dict[str, Any]) -> None:
        version = negotiated.version if negotiated is not None else None
        session = negotiated.session if negotiated is not None else None
        headers = w.request_headers(version, session, "", None)
        headers.pop(w.H_METHOD, None)
        with contextlib.suppress(Exception):
            await self.http.post(self.url, content=dumps(answer), headers=headers, timeout=5.0)

    def listen(self, changed: Callable[[], None]) -> None:
        """Hold the session's GET stream, or a 2026-07-28 server's `subscriptions/listen`
        (`_mcp_listen`), unless one is held or none can be: a session-based server without a
        session has none."""
        negotiated = self.negotiated
        if negotiated is None or (negotiated.session is None and not negotiated.modern):
            return
        if self._listener is None:
            self._listener = asyncio.get_running_loop().create_task(listen(self, changed))

    # -- negotiation -----------------------------------------------------------------------------

    async def _negotiate(self) -> Negotiated:
        # A hint (what discovery found, or the version of a forgotten session) is taken once;
        # a server that no longer speaks it is probed from scratch.
        hint, self.hint = self.hint, None
        if hint == w.MODERN:
            return Negotiated(w.MODERN)
        if hint in w.SESSION_VERSIONS:
            with contextlib.suppress(w.Unsupported):
                return await self._initialize(hint)
        meta = w.envelope_meta(w.MODERN)
        try:
            result, _ = await self._post(
                None,
                "server/discover",
                {"_meta": meta},
                rpc_id=next_id(),
                limit=w.MAX_LIST_BYTES,
                budget=w.Budget(w.MAX_LIST_BYTES),
            )
        except (w.Unsupported, w.SessionGone, AgentError):
            return await self._initialize_or_refuse()
        versions = result.get("supportedVersions")
        if not isinstance(versions, list) or w.MODERN not in versions:
            return await self._initialize_or_refuse()
        result_meta = result.get("_meta")
        server = result_meta.get(w.META_SERVER_INFO) if isinstance(result_meta, dict) else None
        return Negotiated(w.MODERN, server=_server_info(server or result.get("serverInfo")))

    async def _initialize_or_refuse(self) -> Negotiated:
        try:
            return await self._initialize(w.SESSION_VERSIONS[0])
        except (w.Unsupported, w.SessionGone) as exc:
            raise AgentError(f"{self.where} refused to initialize: {exc}", retryable=False) from exc

    async def _initialize(self, offer: str) -> Negotiated:
        params = {
            "protocolVersion": offer,
            "capabilities": w.SESSION_CAPABILITIES,
            "clientInfo": w.CLIENT_INFO,
        }
        result, headers = await self._post(
            None,
            "initialize",
            params,
            rpc_id=next_id(),
            limit=w.MAX_LIST_BYTES,
            budget=w.Budget(w.MAX_LIST_BYTES),
        )
        version = result.get("protocolVersion")
        if version not in w.SESSION_VERSIONS:
            raise AgentError(
                f"{self.where} speaks MCP {str(version)[:40]!r}; Reach speaks {w.MODERN} and "
                f"{', '.join(w.SESSION_VERSIONS)}",
                retryable=False,
            )
        negotiated = Negotiated(
            str(version),
            session=headers.get(w.H_SESSION) or None,
            server=_server_info(result.get("serverInfo")),
        )
        with contextlib.suppress(AgentError, w.Unsupported, w.SessionGone):
            await self._post(
                negotiated, "notifications/initialized", {}, rpc_id=None, limit=w.ENVELOPE_BYTES
            )
        log.info("%s: MCP %s, session %s", self.where, version, negotiated.session is not None)
        return negotiated

    async def ready(self) -> Negotiated:
        """What was negotiated with this server (negotiating it first if nothing was)."""
        negotiated = self.negotiated
        if negotiated is not None:
            return negotiated
        async with self._lock:
            if self.negotiated is None:
                self.negotiated = await self._negotiate()
            return self.negotiated

    async def renew(self, stale: Negotiated, *, same_version: bool) -> Negotiated:
        """Negotiate again after `stale` was refused (unless another call already did): a new
        session at the same version, or from scratch."""
        async with self._lock:
            if self.negotiated is stale or self.negotiated is None:
                self.hint = stale.version if same_version else None
                self.negotiated = None
                self.negotiated = await self._negotiate()
            return self.negotiated

    # -- requests --------------------------------------------------------------------------------

    async def request(
        self,
        method: str,
        params: dict[str, Any],
        *,
        limit: int,
        name: str | None = None,
        meta: dict[str, Any] | None = None,
        on_notification: Callable[[dict[str, Any]], None] | None = None,
        sent: list[Sent] | None = None,
        tasks: bool = False,
        budget: w.Budget | None = None,
        ask_limit: int | None = None,
    ) -> dict[str, Any]:
        """The result of `method`, resent once (in a new session, or after negotiating again)
        when the server said it did not run it. `sent` collects what went on the wire; `tasks`
        declares the tasks extension (2026-07-28); `budget` bounds every byte read;
        `ask_limit`: questions asked mid-call may be relayed (`_post`)."""
        negotiated = await self.ready()
        for again in (False, True):
            rpc_id = next_id()
            envelope = w.envelope_meta(negotiated.version, tasks=tasks)
            full = {**params, "_meta": {**envelope, **(meta or {})}}

            def on_send(rpc_id: int = rpc_id, negotiated: Negotiated = negotiated) -> None:
                if sent is not None:
                    sent.append(Sent(rpc_id, negotiated))

            try:
                result, _ = await self._post(
                    negotiated,
                    method,
                    full,
                    rpc_id=rpc_id,
                    limit=limit,
                    name=name,
                    on_notification=on_notification,
                    on_send=on_send,
                    budget=budget,
                    ask_limit=ask_limit,
                )
                return result
            except w.SessionGone as exc:
                same_version = True
                if again:
                    raise TransportError(
                        f"{self.where} forgot the session it had just opened: {exc}"
                    ) from exc
                log.info("%s forgot its session; initializing a new one", self.where)
            except w.Unsupported as exc:
                same_version = False
                if again:
                    raise AgentError(
                        f"{self.where} refused MCP {negotiated.version} again: {exc}",
                        retryable=False,
                    ) from exc
                log.info("%s refused MCP %s; negotiating again", self.where, negotiated.version)
            if sent is not None:
                sent.clear()  # refused before it ran: what was sent did not run
            negotiated = await self.renew(negotiated, same_version=same_version)
        raise AssertionError("unreachable")

    async def cancel(self, sent: Sent, reason: str) -> None:
        """Tell a session-based server the request's answer is no longer wanted (a 2026-07-28
        server was told already: its response stream is closed)."""
        if sent.negotiated.modern:
            return
        params = {"requestId": sent.rpc_id, "reason": reason}
        with contextlib.suppress(Exception):
            await asyncio.wait_for(
                self._post(
                    sent.negotiated,
                    "notifications/cancelled",
                    params,
                    rpc_id=None,
                    limit=w.ENVELOPE_BYTES,
                ),
                2.0,
            )

    async def aclose(self) -> None:
        """End the session, if any (a courtesy: the server expires it anyway), and close."""
        negotiated = self.negotiated
        if negotiated is not None and negotiated.session is not None:
            headers = w.request_headers(negotiated.version, negotiated.session, "", None)
            with contextlib.suppress(Exception):
                await self.http.delete(self.url, headers=headers, timeout=1.0)
        for task in [*self._answers, *([self._listener] if self._listener else [])]:
            task.cancel()
        await self.http.aclose()
