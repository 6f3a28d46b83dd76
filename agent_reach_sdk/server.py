"""A small asyncio HTTP/1.1 server for agent operations (keep-alive, one write per response).

Headers and body go out in a single write with TCP_NODELAY: two small sends meet Nagle's
algorithm and delayed ACKs and cost ~40 ms per call.
"""

from __future__ import annotations

import asyncio
import logging
import socket
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from http import HTTPStatus
from typing import Any

from reach.messages import dumps

log = logging.getLogger("agent_reach_sdk.server")

MAX_HEADER_BYTES = 64 * 1024


@dataclass
class HttpRequest:
    method: str
    path: str
    headers: dict[str, str]  # lower-case names
    body: bytes


@dataclass
class HttpResponse:
    status: int
    body: dict[str, Any] | None = None
    _content: bytes | None = field(default=None, init=False, repr=False, compare=False)

    def content(self) -> bytes:
        """The body as sent, encoded once (a remembered answer is sent again as it was).

        Raises what `reach.messages.dumps` raises for a body that is not standard JSON.
        """
        if self._content is None:
            self._content = dumps(self.body) if self.body is not None else b""
        return self._content

    def encode(self, keep_alive: bool) -> bytes:
        payload = self.content()
        reason = HTTPStatus(self.status).phrase
        head = (
            f"HTTP/1.1 {self.status} {reason}\r\n"
            f"Content-Type: application/json\r\n"
            f"Content-Length: {len(payload)}\r\n"
            f"Connection: {'keep-alive' if keep_alive else 'close'}\r\n\r\n"
        )
        return head.encode() + payload


INTERNAL_ERROR = HttpResponse(500, {"error": {"type": "agent_error", "message": "internal error"}})

Handler = Callable[[HttpRequest], Awaitable[HttpResponse]]


class HttpAgentServer:
    def __init__(self, handler: Handler, host: str, port: int, max_body_bytes: int) -> None:
        self._handler = handler
        self.host = host
        self.port = port
        self.max_body_bytes = max_body_bytes
        self._server: asyncio.Server | None = None
        self._conns: dict[asyncio.Task[None], asyncio.StreamWriter] = {}

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._serve, self.host, self.port)
        self.port = self._server.sockets[0].getsockname()[1]

    async def close(self, grace_s: float = 2.0) -> None:
        if self._server is None:
            return
        self._server.close()
        # Closing the transports ends idle keep-alive reads with EOF; a handler still running
        # gets a moment to finish before it is cancelled.
        for writer in self._conns.values():
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
        try:
            while True:
                request = await self._read(reader)
                if request is None:
                    break
                if isinstance(request, HttpResponse):
                    writer.write(request.encode(keep_alive=False))
                    await writer.drain()
                    break
                keep_alive = request.headers.get("connection", "").lower() != "close"
                try:
                    response = await self._handler(request)
                    data = response.encode(keep_alive)  # a body that is not JSON fails here
                except Exception:
                    log.exception("operation handler crashed")
                    data = INTERNAL_ERROR.encode(keep_alive)
                writer.write(data)
                await writer.drain()
                if not keep_alive:
                    break
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            self._conns.pop(task, None)
            writer.close()

    async def _read(self, reader: asyncio.StreamReader) -> HttpRequest | HttpResponse | None:
        try:
            head = await reader.readuntil(b"\r\n\r\n")
        except asyncio.IncompleteReadError:
            return None
        except asyncio.LimitOverrunError:
            return HttpResponse(431, {"error": {"type": "invalid_request", "message": "headers"}})
        lines = head.decode("latin-1").split("\r\n")
        try:
            method, target, _version = lines[0].split(" ", 2)
        except ValueError:
            return HttpResponse(400, {"error": {"type": "invalid_request", "message": "bad line"}})
        headers: dict[str, str] = {}
        for line in lines[1:]:
            if ":" in line:
                name, value = line.split(":", 1)
                headers[name.strip().lower()] = value.strip()
        try:
            length = int(headers.get("content-length", "0"))
        except ValueError:
            length = -1
        if length < 0:
            return HttpResponse(400, {"error": {"type": "invalid_request", "message": "length"}})
        if length > self.max_body_bytes:
            return HttpResponse(
                413,
                {
                    "error": {
                        "type": "payload_too_large",
                        "message": f"{length} bytes > limit {self.max_body_bytes}",
                    }
                },
            )
        body = await reader.readexactly(length) if length else b""
        return HttpRequest(method.upper(), target.split("?", 1)[0], headers, body)
