"""The connector's listen streams (`McpServer.listen`) against a server on loopback that
answers every one with 200 and an event stream it ends at once (or with one event past
`ENVELOPE_BYTES`): the pauses between them must keep growing. They were reset to 0.5 s on each
200, so such a server got two listens a second, and for 2026-07-28 a rediscovery with each."""

from __future__ import annotations

import asyncio
import contextlib

import httpx
import pytest

from connectors.mcp import McpServer, Negotiated
from connectors.mcp import wire_rules as w

WINDOW_S = 3.2  # pauses of 0.5 and 1 s: three listens in it; reset each time: seven


class ClosingServer:
    """Answers every request with 200 text/event-stream and `body`, counting them."""

    def __init__(self, body: bytes) -> None:
        self.body = body
        self.requests = 0

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(OSError, asyncio.IncompleteReadError):
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = 0
                for line in head.split(b"\r\n"):
                    if line.lower().startswith(b"content-length:"):
                        length = int(line.split(b":")[1])
                await reader.readexactly(length)
                self.requests += 1
                writer.write(
                    b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
                    b"content-length: %d\r\n\r\n%s" % (len(self.body), self.body)
                )
                await writer.drain()
        writer.close()


@pytest.mark.parametrize(
    ("negotiated", "body"),
    [
        (Negotiated(w.MODERN), b""),
        (Negotiated(w.MODERN), b"data: " + b"x" * (w.ENVELOPE_BYTES + 1) + b"\n\n"),
        (Negotiated("2025-06-18", session="s1"), b""),
    ],
    ids=["listen-ends-at-once", "listen-event-too-big", "get-stream-ends-at-once"],
)
async def test_a_stream_that_ends_at_once_is_opened_again_after_growing_pauses(
    negotiated: Negotiated, body: bytes
) -> None:
    served = ClosingServer(body)
    tcp = await asyncio.start_server(served.handle, "127.0.0.1", 0)
    port = tcp.sockets[0].getsockname()[1]
    changed: list[None] = []
    async with tcp, httpx.AsyncClient() as http:
        server = McpServer(f"http://127.0.0.1:{port}/mcp", http, 4)
        server.negotiated = negotiated
        server.listen(lambda: changed.append(None))
        await asyncio.sleep(WINDOW_S)
        await server.aclose()
    assert 2 <= served.requests <= 4, served.requests
    assert len(changed) <= 3, len(changed)
