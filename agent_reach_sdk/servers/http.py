"""The agent's HTTP/1.1 server: `POST /reach/{operation}`, on h11 over asyncio streams.

h11 does the parsing (chunked bodies, pipelining, `Expect: 100-continue`, and the strictness
that keeps request smuggling out); this module only moves bytes. Each response leaves in a
single write with TCP_NODELAY: headers and body as two small sends meet Nagle's algorithm and
delayed ACKs and cost ~40 ms per call.

The wire contract it serves: `docs/protocols/http.md` (names: `agent_reach_proto.wire`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
from http import HTTPStatus
from typing import Any

import h11

from agent_reach_proto import wire
from agent_reach_sdk.servers import AgentServer, split_hostport
from agent_reach_sdk.wire import INTERNAL_ERROR, Answer, Dispatch, Inbound, error_answer
from reach.security.certs import peer_spiffe_ids, reach_identity_for, server_context

log = logging.getLogger("agent_reach_sdk.server")

MAX_HEADER_BYTES = 64 * 1024
READ_CHUNK = 64 * 1024
PREFIX = wire.HTTP_PATH_PREFIX
# A kept-alive connection may wait this long for its next request: longer than Reach keeps an
# idle connection (transport.idle_timeout_s, 60 s), so Reach, not the agent, closes it first
# and never sends on a connection the agent is closing.
IDLE_TIMEOUT_S = 300.0
# Once a request has begun, its head must be complete, and every read of its body arrive,
# within this (a client trickling bytes cannot hold a connection and a task for good).
REQUEST_TIMEOUT_S = 30.0
# With mTLS: the whole handshake, so a client that connects and says nothing is let go.
TLS_HANDSHAKE_TIMEOUT_S = 10.0


class _TooLarge(Exception):
    pass


class _Ended(Exception):
    """The client went quiet past a timeout, or away mid-request: close without answering."""


class HttpAgentServer(AgentServer):
    protocol = "http"

    def __init__(self, dispatch: Dispatch, **kwargs: Any) -> None:
        super().__init__(dispatch, **kwargs)
        self._server: asyncio.Server | None = None
        self._conns: dict[asyncio.Task[None], asyncio.StreamWriter] = {}
        self._busy: set[asyncio.Task[None]] = set()
        self._closing = False
        self.port = 0
        # mTLS: the one client identity served (Reach's); None: any certificate from the CA.
        self.client_id = None if self.tls is None else reach_identity_for(self.tls.cert)

    async def start(self) -> None:
        host, port = split_hostport(self.listen)
        tls = self.tls
        self._server = await asyncio.start_server(
            self._serve,
            host,
            port,
            limit=READ_CHUNK,
            # mTLS: a client without a certificate from the CA fails the handshake.
            ssl=None if tls is None else server_context(tls.ca, tls.cert, tls.key),
            ssl_handshake_timeout=None if tls is None else TLS_HANDSHAKE_TIMEOUT_S,
        )
        self.port = self._server.sockets[0].getsockname()[1]

    @property
    def service_address(self) -> str:
        host, port = split_hostport(self.advertise)
        hostport = f"{host}:{port or self.port}"
        return hostport if self.tls is None else f"https://{hostport}"

    async def close(self, grace_s: float = 5.0) -> None:
        if self._server is None:
            return
        self._closing = True
        self._server.close()
        # Idle keep-alive connections end now; one with a request running answers it first
        # (with `Connection: close`), or is cancelled after `grace_s`.
        for task, writer in list(self._conns.items()):
            if task not in self._busy:
                writer.close()
        if self._conns:
            _, running = await asyncio.wait(set(self._conns), timeout=grace_s)
            for task in running:
                task.cancel()
            await asyncio.gather(*running, return_exceptions=True)
        await self._server.wait_closed()
        self._server = None

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._conns[task] = writer
        sock = writer.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        conn = h11.Connection(h11.SERVER, max_incomplete_event_size=MAX_HEADER_BYTES)
        refusal = self._refusal(writer)  # once per connection: its certificate is its own
        try:
            while not self._closing or task in self._busy:
                event = await self._next(conn, reader, new_request=True)
                if isinstance(event, h11.Request):
                    self._busy.add(task)
                    try:
                        answer, close = await self._request(conn, reader, writer, event, refusal)
                    finally:
                        self._busy.discard(task)
                    if not await self._send(conn, writer, answer, close=close):
                        break
                    if close or conn.our_state is h11.MUST_CLOSE or self._closing:
                        break
                    conn.start_next_cycle()
                else:  # ConnectionClosed, or the peer's half of the cycle ended badly
                    break
        except h11.RemoteProtocolError as exc:
            status = exc.error_status_hint
            answer = error_answer(status, "invalid_request", str(exc))
            await self._send(conn, writer, answer, close=True)
        except (_Ended, ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            self._conns.pop(task, None)
            writer.close()

    def _refusal(self, writer: asyncio.StreamWriter) -> Answer | None:
        """The 403 for every request on a connection whose client certificate (from the CA,
        the handshake saw to that) is not Reach's, e.g. another agent's; None to serve it."""
        if self.client_id is None:
            return None
        if self.client_id in peer_spiffe_ids(writer.get_extra_info("peercert")):
            return None
        log.warning("refused a TLS client that is not %s", self.client_id)
        return error_answer(403, "forbidden", f"only {self.client_id} may call this agent")

    def route(self, method: str, path: str) -> str | None:
        """The operation a request names: `POST /reach/{operation}`, else none."""
        if method != "POST" or not path.startswith(PREFIX) or len(path) == len(PREFIX):
            return None
        return path[len(PREFIX) :]

    async def _next(
        self, conn: h11.Connection, reader: asyncio.StreamReader, *, new_request: bool = False
    ) -> object:
        """The next h11 event. Waiting for a new request: up to IDLE_TIMEOUT_S for its first
        bytes, then REQUEST_TIMEOUT_S for the whole head; within a body, REQUEST_TIMEOUT_S
        for each read. Past them, `_Ended`."""
        loop = asyncio.get_running_loop()
        head_deadline: float | None = None
        while True:
            event = conn.next_event()
            if event is not h11.NEED_DATA:
                return event
            if not new_request:
                timeout = REQUEST_TIMEOUT_S
            elif head_deadline is None and not conn.trailing_data[0]:
                timeout = IDLE_TIMEOUT_S
            else:
                if head_deadline is None:
                    head_deadline = loop.time() + REQUEST_TIMEOUT_S
                timeout = head_deadline - loop.time()
            try:
                async with asyncio.timeout(max(timeout, 0)):
                    data = await reader.read(READ_CHUNK)
            except TimeoutError:
                raise _Ended from None
            if new_request and head_deadline is None and data:
                head_deadline = loop.time() + REQUEST_TIMEOUT_S
            conn.receive_data(data)

    async def _request(
        self,
        conn: h11.Connection,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        request: h11.Request,
        refusal: Answer | None = None,
    ) -> tuple[Answer, bool]:
        """The answer, and whether the connection must close after it (the body was not read,
        or the request was framed ambiguously)."""
        method = request.method.decode("ascii", "replace").upper()
        path = request.target.decode("latin-1").split("?", 1)[0]
        headers = {
            name.decode("latin-1").lower(): value.decode("latin-1")
            for name, value in request.headers
        }
        if "content-length" in headers and "transfer-encoding" in headers:
            # RFC 9112 6.1: a request framed both ways is how smuggling starts; answer and close.
            message = "Content-Length and Transfer-Encoding together"
            return error_answer(400, "invalid_request", message), True
        try:
            body = await self._body(conn, reader, writer, headers)
        except _TooLarge:
            message = f"the body passes the limit of {self.max_body_bytes}"
            return error_answer(413, "payload_too_large", message), True
        if refusal is not None:
            return refusal, True
        operation = self.route(method, path)
        if operation is None:
            return error_answer(404, "invalid_request", f"no route {method} {path}"), False
        try:
            return await self.dispatch(Inbound(operation, headers, body)), False
        except Exception:
            log.exception("operation handler crashed")
            return INTERNAL_ERROR, False

    async def _body(
        self,
        conn: h11.Connection,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        headers: dict[str, str],
    ) -> bytes:
        with contextlib.suppress(ValueError):
            if int(headers.get("content-length", "0")) > self.max_body_bytes:
                raise _TooLarge
        if conn.they_are_waiting_for_100_continue:
            writer.write(conn.send(h11.InformationalResponse(status_code=100, headers=[])) or b"")
        chunks: list[bytes] = []
        size = 0
        while True:
            event = await self._next(conn, reader)
            if isinstance(event, h11.Data):
                size += len(event.data)
                if size > self.max_body_bytes:
                    raise _TooLarge
                chunks.append(bytes(event.data))
            elif isinstance(event, h11.EndOfMessage):
                return b"".join(chunks)
            else:
                raise _Ended("the client went away mid-body")

    async def _send(
        self,
        conn: h11.Connection,
        writer: asyncio.StreamWriter,
        answer: Answer,
        *,
        close: bool = False,
    ) -> bool:
        """Write the whole response at once; False when the connection must end."""
        if conn.our_state not in (h11.IDLE, h11.SEND_RESPONSE):
            return False
        try:
            payload = answer.content()  # a body that is not JSON fails here
        except (TypeError, ValueError):
            log.exception("an operation answered with a body that is not JSON")
            answer = INTERNAL_ERROR
            payload = answer.content()
        headers = [
            ("Content-Type", "application/json"),
            ("Content-Length", str(len(payload))),
        ]
        if close or self._closing:
            headers.append(("Connection", "close"))
        try:
            data = conn.send(
                h11.Response(status_code=answer.status, headers=headers, reason=_reason(answer))
            )
            data = (data or b"") + (conn.send(h11.Data(data=payload)) or b"")
            data += conn.send(h11.EndOfMessage()) or b""
        except h11.LocalProtocolError as exc:
            log.error("cannot send HTTP %s (%s); closing the connection", answer.status, exc)
            return False
        writer.write(data)
        await writer.drain()
        return True


def _reason(answer: Answer) -> bytes:
    try:
        return HTTPStatus(answer.status).phrase.encode()
    except ValueError:
        return b""
