"""The MCP front's wire: JSON-RPC messages, the protocol generations, sessions, SSE frames.

Pure functions and constants (no gateway, no I/O), so the front (`gateway_api.mcp_front`) reads
as the protocol's steps. Written against the MCP specification, not the `mcp` package: that
package takes half a second to import, which a gateway that never sees an MCP client should
not pay.

**Generations.** A request whose `params._meta` carries `io.modelcontextprotocol/protocolVersion`
is the stateless 2026-07-28 protocol (`MODERN`): every request says its version and the
client's capabilities, and its `MCP-Protocol-Version`, `Mcp-Method` and `Mcp-Name` headers
must agree with the body (else `HEADER_MISMATCH`, 400). Anything else is the handshake
protocol (`HANDSHAKE`: 2025-11-25, 2025-06-18, and the older 2025-03-26 and 2024-11-05), where
`initialize` negotiates the version and answers with an `Mcp-Session-Id`.

**Sessions are stateless tokens.** `r1.<version>.<caller digest>.<random>`, and `.<caps>`
after it when the client declared what it can answer mid-call (`reach.asks.declared`: `s`
sampling, `e` form and `u` URL elicitation): any gateway accepts any of them without a shared
table (nothing is kept per session), and a session id presented by another caller than the
one that initialized it is "not found" (404: initialize again). The bearer token on every
request stays the only authentication (a caller naming capabilities its client lacks only
has its own calls asked what it cannot answer).
"""

from __future__ import annotations

import hashlib
import json
import secrets
from typing import Any, Final

from reach import acceptance
from reach.errors import ReachError

MODERN: Final = ("2026-07-28",)
HANDSHAKE: Final = ("2024-11-05", "2025-03-26", "2025-06-18", "2025-11-25")
LATEST_HANDSHAKE: Final = HANDSHAKE[-1]

VERSION_META: Final = "io.modelcontextprotocol/protocolVersion"
CAPABILITIES_META: Final = "io.modelcontextprotocol/clientCapabilities"
SERVER_INFO_META: Final = "io.modelcontextprotocol/serverInfo"
# Reach's own `_meta` keys, in a tool call's params and in its result.
REQUEST_ID_META: Final = "reach/requestId"
IDEMPOTENCY_META: Final = "reach/idempotencyKey"
TIMEOUT_META: Final = "reach/timeoutMs"
STATUS_META: Final = "reach/status"
INSTANCE_META: Final = "reach/instanceId"

# Lower-case HTTP header names.
SESSION_HEADER: Final = "mcp-session-id"
VERSION_HEADER: Final = "mcp-protocol-version"
METHOD_HEADER: Final = "mcp-method"
NAME_HEADER: Final = "mcp-name"

# JSON-RPC and MCP error codes.
PARSE_ERROR: Final = -32700
INVALID_REQUEST: Final = -32600
METHOD_NOT_FOUND: Final = -32601
INVALID_PARAMS: Final = -32602
INTERNAL_ERROR: Final = -32603
REACH_REFUSED: Final = -32000  # Reach refused the call; `data` is its error (type, status, ...)
SESSION_NOT_FOUND: Final = -32001
HEADER_MISMATCH: Final = -32020
UNSUPPORTED_VERSION: Final = -32022

# The HTTP status of a JSON-RPC error (others: 200).
_HTTP_STATUS: Final = {
    PARSE_ERROR: 400,
    INVALID_REQUEST: 400,
    HEADER_MISMATCH: 400,
    UNSUPPORTED_VERSION: 400,
}
# With the stateless protocol, which says so for these too.
_MODERN_HTTP_STATUS: Final = {**_HTTP_STATUS, INVALID_PARAMS: 400, METHOD_NOT_FOUND: 404}


RequestKey = str | int | None


class RpcError(Exception):
    """A JSON-RPC error answer; `http_status` overrides the table (401, 404, 413, ...)."""

    def __init__(
        self,
        code: int,
        message: str,
        data: Any = None,
        *,
        http_status: int | None = None,
        key: RequestKey = None,
    ) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.data = data
        self.http_status = http_status
        self.key = key  # the request id it answers (None: unread)

    def status(self, modern: bool) -> int:
        if self.http_status is not None:
            return self.http_status
        return (_MODERN_HTTP_STATUS if modern else _HTTP_STATUS).get(self.code, 200)


class Message:
    """One JSON-RPC message from a client: a request (it has an `id`), a notification, or a
    response to a request of ours (a question relayed mid-call: `gateway_api._mcp_ask`)."""

    @property
    def is_response(self) -> bool:
        return "method" not in self.body and ("result" in self.body or "error" in self.body)

    __slots__ = ("body", "id", "is_request", "method", "params")

    def __init__(self, body: dict[str, Any]) -> None:
        self.body = body
        self.is_request = "id" in body and "method" in body
        self.id: RequestKey = body.get("id")
        self.method: str | None = body.get("method")
        params = body.get("params")
        self.params: dict[str, Any] = params if isinstance(params, dict) else {}

    @property
    def meta(self) -> dict[str, Any]:
        meta = self.params.get("_meta")
        return meta if isinstance(meta, dict) else {}

    @property
    def modern(self) -> bool:
        return VERSION_META in self.meta


def parse(raw: bytes) -> Message:
    """The body as one JSON-RPC message; a batch, a body that is not JSON or not a message is
    refused (-32700, -32600), nesting past Reach's limit too (as `POST /reach/invoke` does)."""
    try:
        body = acceptance.parse_json(raw, what="the JSON-RPC message")
    except ReachError as exc:
        raise RpcError(PARSE_ERROR, exc.message) from None
    if isinstance(body, list):
        raise RpcError(
            INVALID_REQUEST,
            "JSON-RPC batches are not supported (MCP removed them in 2025-06-18): send one "
            "message per request",
        )
    if not isinstance(body, dict):
        raise RpcError(INVALID_REQUEST, "a JSON-RPC message is a JSON object")
    key = body.get("id")
    if body.get("jsonrpc") != "2.0":
        raise RpcError(INVALID_REQUEST, 'a JSON-RPC 2.0 message has "jsonrpc": "2.0"', key=key)
    if "id" in body and (isinstance(key, bool) or not isinstance(key, str | int)):
        raise RpcError(INVALID_REQUEST, "a request id is a string or an integer")
    method = body.get("method")
    if "method" in body and not isinstance(method, str):
        raise RpcError(INVALID_REQUEST, "method is a string", key=key)
    if "method" not in body and "result" not in body and "error" not in body:
        raise RpcError(INVALID_REQUEST, "neither a request, a notification nor a response")
    if "params" in body and not isinstance(body["params"], dict):
        raise RpcError(INVALID_PARAMS, "params is an object", key=key)
    return Message(body)


def check_modern(message: Message, headers: dict[str, str]) -> str:
    """The stateless protocol's envelope checks, in the specification's order; the version."""
    meta = message.meta
    missing = [k for k in (VERSION_META, CAPABILITIES_META) if k not in meta]
    if missing:
        raise RpcError(INVALID_PARAMS, f"params._meta is missing {', '.join(missing)}")
    version = meta[VERSION_META]
    if headers.get(VERSION_HEADER) != version:
        raise RpcError(
            HEADER_MISMATCH, "the MCP-Protocol-Version header does not match params._meta"
        )
    if headers.get(METHOD_HEADER) is not None and headers[METHOD_HEADER] != message.method:
        raise RpcError(HEADER_MISMATCH, "the Mcp-Method header does not match the method")
    name = message.params.get("name")
    said = headers.get(NAME_HEADER)
    if message.method == "tools/call" and said is not None and said != name:
        raise RpcError(HEADER_MISMATCH, "the Mcp-Name header does not match params.name")
    if not isinstance(version, str) or version not in MODERN:
        raise RpcError(
            UNSUPPORTED_VERSION,
            "Unsupported protocol version",
            {"supported": [*MODERN, *HANDSHAKE], "requested": version},
        )
    return version


def negotiate(requested: Any) -> str:
    """The handshake version answered to `initialize`: the client's when Reach speaks it,
    else the newest Reach speaks (the client then decides whether to go on)."""
    return requested if requested in HANDSHAKE else LATEST_HANDSHAKE


# -- sessions ------------------------------------------------------------------------------------


def _digest(caller: str) -> str:
    return hashlib.sha256(caller.encode()).hexdigest()[:16]


_CAPS = frozenset("seu")


def new_session(version: str, caller: str, caps: str = "") -> str:
    """A session id; `caps`: what the client can answer mid-call (`reach.asks.declared`)."""
    return f"r1.{version}.{_digest(caller)}.{secrets.token_hex(8)}" + (f".{caps}" if caps else "")


def session_version(session: str, caller: str) -> str | None:
    """The version a session negotiated, or None: not one of Reach's, or another caller's."""
    parts = session.split(".")
    if len(parts) not in (4, 5) or parts[0] != "r1" or parts[1] not in HANDSHAKE:
        return None
    if len(parts) == 5 and not (parts[4] and set(parts[4]) <= _CAPS and len(parts[4]) <= 3):
        return None
    if not secrets.compare_digest(parts[2], _digest(caller)):
        return None
    return parts[1]


def session_caps(session: str | None, caller: str) -> str:
    """What the session's client declared it can answer mid-call ("" for none, or for a
    session that is not this caller's)."""
    if session is None or session_version(session, caller) is None:
        return ""
    parts = session.split(".")
    return parts[4] if len(parts) == 5 else ""


# -- answers -------------------------------------------------------------------------------------


def encode(value: Any) -> bytes:
    """JSON as UTF-8; a string UTF-8 cannot carry (a lone surrogate, which JSON's `\\ud800`
    escape lets a client send, in the request id an answer repeats) is written escaped."""
    text = json.dumps(value, separators=(",", ":"), ensure_ascii=False)
    try:
        return text.encode()
    except UnicodeEncodeError:
        return json.dumps(value, separators=(",", ":")).encode()


def result(key: RequestKey, value: dict[str, Any]) -> dict[str, Any]:
    return {"jsonrpc": "2.0", "id": key, "result": value}


def error(key: RequestKey, exc: RpcError) -> dict[str, Any]:
    body: dict[str, Any] = {"code": exc.code, "message": exc.message}
    if exc.data is not None:
        body["data"] = exc.data
    return {"jsonrpc": "2.0", "id": key, "error": body}


def sse_event(value: dict[str, Any]) -> bytes:
    return b"event: message\ndata: " + encode(value) + b"\n\n"


def accepts(headers: dict[str, str], media: str) -> bool:
    accept = headers.get("accept", "")
    return media in accept or "*/*" in accept
