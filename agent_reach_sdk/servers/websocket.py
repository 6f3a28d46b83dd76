"""The agent's WebSocket server: Reach's request frames in, reply frames out, on `websockets`.

The wire contract is written out in `docs/protocols/websocket.md` (its names in
`agent_reach_proto.wire`); this module serves it. Each request frame runs in its own task, so
one connection carries many requests at once and a slow operation never holds up a fast one;
each reply leaves as one text frame built once around the runtime's answer as encoded
(`Answer.content()`), so a remembered answer goes out byte for byte as it did the first time.

Frames are read as bytes and parsed here rather than by the library, so that one request's
broken frame (not UTF-8, not JSON) costs that request alone: websockets would close the whole
connection over invalid UTF-8 in a text frame. A frame too broken to name its request is logged
and dropped; one that names it is answered with a 400 error frame.

websockets writes each message whole, so concurrent replies never interleave on the wire, and
asyncio's transports set TCP_NODELAY on every TCP socket, so no reply waits for Nagle's
algorithm (the tests check both: twenty replies at once on one connection, and the option).

TLS: with `tls` (mTLS, `reach.security.certs`) the server serves wss:// itself, requires a
client certificate from the CA and advertises `wss://host:port/path`. Behind a proxy that
terminates TLS instead, advertise `wss://public-name[:port]/path`. The server serves the
advertised URL's path (`/reach` when the address has none), so the proxy forwards that path
unchanged.

Closing (`close(grace_s)`): the listening socket closes at once (a handshake in progress is
refused with 503), request frames still arriving on open connections are answered with a
retryable 503 error, requests in flight finish for up to `grace_s`, then every connection is
closed with code 1001 (going away), which Reach reads as a clean close, not a failure.
"""

from __future__ import annotations

import asyncio
import json
import logging
from http import HTTPStatus
from typing import Any

from websockets.asyncio.server import Server, ServerConnection, serve
from websockets.exceptions import ConnectionClosed
from websockets.frames import CloseCode
from websockets.http11 import Request, Response

from agent_reach_proto import wire
from agent_reach_sdk.servers import AgentServer, split_hostport
from agent_reach_sdk.wire import INTERNAL_ERROR, Answer, Dispatch, Inbound, error_answer
from reach.messages import dumps
from reach.security.certs import peer_spiffe_ids, reach_identity_for, server_context

log = logging.getLogger("agent_reach_sdk.server")

DEFAULT_PATH = wire.WS_DEFAULT_PATH
# Room in a frame for everything around the payload: type, ids, operation, headers.
FRAME_OVERHEAD = 64 * 1024
# Requests one connection may have running at once; past it, a retryable 503 (one Reach
# process never has this many in flight to one instance unless something is wrong).
MAX_TASKS_PER_CONNECTION = 1024
PING_INTERVAL_S = 20.0
PING_TIMEOUT_S = 20.0
CLOSE_TIMEOUT_S = 2.0

# A reply frame's fixed parts, spelled once: `{"type":"reply","request_id":` ... `,"status":`
# ... `,"body":`.
_REPLY_OPEN = f'{{"{wire.WS_TYPE}":"{wire.WS_REPLY}","{wire.WS_REQUEST_ID}":'.encode()
_REPLY_STATUS = f',"{wire.WS_STATUS}":'.encode()
_REPLY_BODY = f',"{wire.WS_BODY}":'.encode()


def _bad(message: str) -> Answer:
    return error_answer(400, "invalid_request", message)


def parse_request(data: bytes, max_body_bytes: int) -> tuple[str | None, Inbound | Answer | None]:
    """A frame as (request_id, what to do): an `Inbound` to dispatch, an error `Answer` to send,
    or None to drop it; request_id None means nobody can be answered."""
    try:
        frame: Any = json.loads(data.decode("utf-8"))
    except (ValueError, RecursionError):
        return wire.request_id_in(data), _bad("the frame is not UTF-8 JSON")
    if not isinstance(frame, dict):
        return None, None
    request_id = frame.get(wire.WS_REQUEST_ID)
    if not isinstance(request_id, str) or not request_id:
        return None, None
    kind = frame.get(wire.WS_TYPE)
    if kind != wire.WS_REQUEST:
        # Another type is reserved for extensions: not ours to answer.
        return request_id, (None if isinstance(kind, str) else _bad('"type" must be "request"'))
    operation = frame.get(wire.WS_OPERATION)
    if not isinstance(operation, str) or not operation:
        return request_id, _bad('"operation" must be a non-empty string')
    headers = frame.get(wire.WS_HEADERS)
    if headers is None:
        headers = {}
    if not isinstance(headers, dict) or not all(isinstance(v, str) for v in headers.values()):
        return request_id, _bad('"headers" must map names to strings')
    names = {str(name).lower(): value for name, value in headers.items()}
    names.setdefault(wire.REQUEST_ID, request_id)  # the runtime deduplicates by it
    payload = frame.get(wire.WS_PAYLOAD)
    if payload is None:
        payload = {}
    if not isinstance(payload, dict):
        return request_id, _bad('"payload" must be a JSON object')
    try:
        body = dumps(payload)  # as Reach measured it
    except (ValueError, RecursionError):
        return request_id, _bad('"payload" is not standard JSON')
    if len(body) > max_body_bytes:
        return request_id, error_answer(
            413, "payload_too_large", f"the payload passes the limit of {max_body_bytes} bytes"
        )
    return request_id, Inbound(operation, names, body)


def reply_frame(request_id: str, answer: Answer) -> bytes:
    """The reply frame around `answer`, its body spliced in as encoded (never re-encoded).

    Raises what `Answer.content()` raises for a body that is not JSON.
    """
    body = answer.content() or b"null"
    return b"".join(
        (
            _REPLY_OPEN,
            dumps(request_id),
            _REPLY_STATUS,
            str(int(answer.status)).encode(),
            _REPLY_BODY,
            body,
            b"}",
        )
    )


def _path_of(address: str) -> str:
    if "://" not in address:
        return DEFAULT_PATH
    path = address.split("://", 1)[1].partition("/")[2].rstrip("/")
    return f"/{path}" if path else DEFAULT_PATH


class WebSocketAgentServer(AgentServer):
    protocol = "websocket"

    def __init__(self, dispatch: Dispatch, **kwargs: Any) -> None:
        super().__init__(dispatch, **kwargs)
        # The path Reach connects to: the advertised URL's, else /reach (as the connector does).
        self.path = _path_of(self.advertise)
        self.port = 0
        self.accepted = 0  # connections accepted since start
        self._server: Server | None = None
        self._connections: set[ServerConnection] = set()
        self._tasks: set[asyncio.Task[None]] = set()
        self._closing = False
        # mTLS: the one client identity served (Reach's); None: any certificate from the CA.
        self.client_id = None if self.tls is None else reach_identity_for(self.tls.cert)

    @property
    def connection_count(self) -> int:
        """Connections open now."""
        return len(self._connections)

    async def start(self) -> None:
        host, port = split_hostport(self.listen)
        self._closing = False
        tls = self.tls
        self._server = await serve(
            self._serve,
            host,
            port,
            process_request=self._check_path,
            compression=None,
            max_size=self.max_body_bytes + FRAME_OVERHEAD,
            ping_interval=PING_INTERVAL_S,
            ping_timeout=PING_TIMEOUT_S,
            close_timeout=CLOSE_TIMEOUT_S,
            # mTLS: a client without a certificate from the CA fails the handshake.
            ssl=None if tls is None else server_context(tls.ca, tls.cert, tls.key),
        )
        self.port = self._server.sockets[0].getsockname()[1]

    @property
    def service_address(self) -> str:
        host, port = split_hostport(self.advertise)
        shown = f"[{host}]" if ":" in host else host
        hostport = f"{shown}:{port or self.port}"
        scheme, sep, _ = self.advertise.partition("://")
        if self.tls is not None:
            return f"wss://{hostport}{self.path}"
        return f"{scheme.lower()}://{hostport}{self.path}" if sep else hostport

    async def close(self, grace_s: float = 5.0) -> None:
        if self._server is None:
            return
        self._closing = True
        self._server.close(close_connections=False)
        if self._tasks:
            _, late = await asyncio.wait(set(self._tasks), timeout=grace_s)
            for task in late:
                task.cancel()
            await asyncio.gather(*late, return_exceptions=True)
        await asyncio.gather(
            *(
                ws.close(CloseCode.GOING_AWAY, "agent shutting down")
                for ws in list(self._connections)
            ),
            return_exceptions=True,
        )
        await self._server.wait_closed()
        self._server = None

    def _check_path(self, connection: ServerConnection, request: Request) -> Response | None:
        if self.client_id is not None and self.client_id not in peer_spiffe_ids(
            connection.transport.get_extra_info("peercert")
        ):
            log.warning("refused a TLS client that is not %s", self.client_id)
            return connection.respond(
                HTTPStatus.FORBIDDEN, f"only {self.client_id} may call this agent\n"
            )
        path = request.path.split("?", 1)[0]
        if path != self.path:
            return connection.respond(
                HTTPStatus.NOT_FOUND, f"no WebSocket endpoint at {path}; Reach's is {self.path}\n"
            )
        return None

    async def _serve(self, ws: ServerConnection) -> None:
        self.accepted += 1
        self._connections.add(ws)
        running: set[asyncio.Task[None]] = set()
        try:
            while True:
                try:
                    data = await ws.recv(decode=False)
                except ConnectionClosed:
                    return
                if self._closing or len(running) >= MAX_TASKS_PER_CONNECTION:
                    await self._refuse(ws, data)
                    continue
                task = asyncio.get_running_loop().create_task(self._request(ws, data))
                # Kept past the connection's end: an operation that finishes is remembered by
                # the runtime, so a re-delivery on the next connection is answered, not re-run.
                for tasks in (running, self._tasks):
                    tasks.add(task)
                    task.add_done_callback(tasks.discard)
        finally:
            self._connections.discard(ws)

    async def _refuse(self, ws: ServerConnection, data: bytes) -> None:
        request_id, parsed = parse_request(data, self.max_body_bytes)
        if request_id is None or parsed is None:
            return
        if self._closing:
            answer = error_answer(503, "unavailable", "the agent is shutting down")
        else:
            answer = error_answer(
                503, "overloaded", f"{MAX_TASKS_PER_CONNECTION} requests already run here"
            )
        await self._send(ws, request_id, answer)

    async def _request(self, ws: ServerConnection, data: bytes) -> None:
        request_id, parsed = parse_request(data, self.max_body_bytes)
        if request_id is None:
            log.warning("dropped a frame that names no request: %r", data[:200])
            return
        if parsed is None:
            log.debug("ignored a frame of another type for %s", request_id)
            return
        if isinstance(parsed, Answer):
            answer = parsed
        else:
            try:
                answer = await self.dispatch(parsed)
            except Exception:
                log.exception("operation handler crashed")
                answer = INTERNAL_ERROR
        await self._send(ws, request_id, answer)

    async def _send(self, ws: ServerConnection, request_id: str, answer: Answer) -> None:
        try:
            frame = reply_frame(request_id, answer)
        except (TypeError, ValueError):
            log.exception("an operation answered with a body that is not JSON")
            frame = reply_frame(request_id, INTERNAL_ERROR)
        try:
            await ws.send(frame, text=True)
        except ConnectionClosed:
            log.debug("the reply to %s was not sent: the connection closed", request_id)
