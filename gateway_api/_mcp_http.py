"""The MCP front's HTTP plumbing: reading a bounded body, sending JSON, SSE chunks and answers
decided before any JSON-RPC dispatch (`Answer`), as plain ASGI."""

from __future__ import annotations

import contextlib
from typing import Any
from urllib.parse import urlsplit

from starlette.types import Receive, Send

from gateway_api import _mcp_wire as wire
from reach.config import ReachSettings

LOOPBACK = frozenset({"localhost", "127.0.0.1", "::1"})
_EVERY_ADDRESS = ("0.0.0.0", "::")


class Answer(Exception):
    """An HTTP answer decided before any JSON-RPC dispatch (401, 403, 405, 413, 415)."""

    def __init__(self, status: int, body: dict[str, Any] | None, headers: dict[str, str]) -> None:
        super().__init__(status)
        self.status, self.body, self.headers = status, body, headers


def hostname(value: str, *, url: bool = False) -> str | None:
    """The host name of a Host header (or of an Origin's URL), lower case, without a port."""
    try:
        return urlsplit(value if url else f"//{value}").hostname
    except ValueError:
        return None


def host_allowed(settings: ReachSettings, host: str | None) -> bool:
    """DNS rebinding: a gateway that listens on loopback (or one address) answers only to
    loopback names, that address and its `public_url`'s name; one listening on every address
    to any name."""
    if settings.listen_host in _EVERY_ADDRESS:
        return True
    names = LOOPBACK | {settings.listen_host.strip("[]").lower()}
    public = hostname(settings.public_url, url=True) if settings.public_url else None
    return host is not None and (host in names or host == public)


def origin_allowed(
    settings: ReachSettings, origin: str | None, host: str | None, *, tokens: bool
) -> bool:
    """Whether a web page from `origin` (its host name) may call: from loopback, from the
    `public_url`'s name, or from the very Host it sent to; not the last on a gateway that
    listens on every address without tokens, where any name is its Host (a name rebound to
    the gateway's address sends Origin = Host), so a page anywhere could drive it."""
    if origin is None:
        return False
    public = hostname(settings.public_url, url=True) if settings.public_url else None
    if origin in LOOPBACK or origin == public:
        return True
    return origin == host and (tokens or settings.listen_host not in _EVERY_ADDRESS)


def refusal(kind: str, message: str) -> dict[str, Any]:
    return wire.error(None, wire.RpcError(wire.REACH_REFUSED, message, {"type": kind}))


async def read(receive: Receive, limit: int) -> bytes:
    chunks, size = [], 0
    while True:
        event = await receive()
        if event["type"] == "http.disconnect":
            raise Answer(400, None, {})  # nobody is left to read it
        chunk = event.get("body", b"")
        size += len(chunk)
        if size > limit:
            error = wire.RpcError(wire.INVALID_REQUEST, f"the message is larger than {limit} bytes")
            raise Answer(413, wire.error(None, error), {})
        chunks.append(chunk)
        if not event.get("more_body", False):
            return b"".join(chunks)


async def chunk(send: Send, data: bytes) -> None:
    await send({"type": "http.response.body", "body": data, "more_body": True})


async def respond(send: Send, status: int, body: bytes, headers: dict[str, str]) -> None:
    raw = [(k.encode("latin-1"), v.encode("latin-1")) for k, v in headers.items()]
    if body:
        raw.append((b"content-type", b"application/json"))
    raw.append((b"content-length", str(len(body)).encode()))
    with contextlib.suppress(OSError):
        await send({"type": "http.response.start", "status": status, "headers": raw})
        await send({"type": "http.response.body", "body": body})


async def respond_json(
    send: Send, status: int, body: dict[str, Any] | None, headers: dict[str, str]
) -> None:
    await respond(send, status, wire.encode(body) if body is not None else b"", headers)
