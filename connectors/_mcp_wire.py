"""MCP on the wire, for `connectors.mcp`: the names both protocol generations use, reading one
JSON-RPC answer from a Streamable HTTP response (JSON or SSE, bounded), and what an answer means
in Reach's vocabulary (the rules are `docs/protocols/mcp.md`'s).

Two generations share one endpoint URL:

- 2026-07-28 ("stateless"): every request is a self-contained POST carrying the protocol version
  in `params._meta` and in the `MCP-Protocol-Version`, `Mcp-Method` and `Mcp-Name` headers; no
  handshake, no session; closing the response stream is the cancellation.
- 2025-11-25 / 2025-06-18 / 2025-03-26 ("session-based"): `initialize` first, the
  `Mcp-Session-Id` the server hands out on every later request, `notifications/cancelled` to
  cancel.
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import json
from collections.abc import Callable
from typing import Any

import httpx

from connectors._mcp_stream import MAX_DISCOVERY_BYTES as MAX_DISCOVERY_BYTES
from connectors._mcp_stream import Budget as Budget
from connectors._mcp_stream import Pace, limited, sse_messages
from reach.acceptance import check_json, parse_json
from reach.asks import REFUSED, UNANSWERED
from reach.errors import (
    AgentError,
    AgentFault,
    DeadlineExceeded,
    ReachError,
    TransportError,
)
from reach.messages import Reply, dumps
from reach.registry.models import (
    MAX_DESCRIPTION_CHARS,
    Discovery,
    OperationDeclaration,
)

MODERN = "2026-07-28"
# Offered in this order at `initialize`: a server answers with the one it speaks.
SESSION_VERSIONS = ("2025-11-25", "2025-06-18", "2025-03-26")

ACCEPT = "application/json, text/event-stream"
H_VERSION = "MCP-Protocol-Version"
H_SESSION = "Mcp-Session-Id"
H_METHOD = "Mcp-Method"
H_NAME = "Mcp-Name"
META_VERSION = "io.modelcontextprotocol/protocolVersion"
META_CAPABILITIES = "io.modelcontextprotocol/clientCapabilities"
META_CLIENT_INFO = "io.modelcontextprotocol/clientInfo"
META_SERVER_INFO = "io.modelcontextprotocol/serverInfo"
CLIENT_INFO = {"name": "agent-reach", "version": "1"}
# What Reach declares at `initialize`: nothing. One session serves every caller's calls to a
# server, and most calls (POST /reach/invoke, gRPC, A2A, a front client that declared
# nothing) have nobody to answer a question: a server that checks the client's capabilities
# and would do without must keep doing without, as it did before questions were relayed. A
# server that asks anyway (the `mcp` package's do not check) is relayed to the call's caller
# when that caller came through the MCP front and can answer (`reach.asks`), and refused at
# once otherwise. Declaring them per registration is the planned opt-in.
SESSION_CAPABILITIES: dict[str, Any] = {}
TASKS = "io.modelcontextprotocol/tasks"
MAX_TASK_ID_CHARS = 256

# JSON-RPC and MCP error codes this connector tells apart.
PARSE_ERROR = -32700
INVALID_REQUEST = -32600
METHOD_NOT_FOUND = -32601
INVALID_PARAMS = -32602
INTERNAL_ERROR = -32603
REQUEST_TIMEOUT = -32001
HEADER_MISMATCH = -32020
MISSING_CAPABILITY = -32021
UNSUPPORTED_VERSION = -32022

_CODE_NAMES = {
    PARSE_ERROR: "parse_error",
    INVALID_REQUEST: "invalid_request",
    METHOD_NOT_FOUND: "method_not_found",
    INVALID_PARAMS: "invalid_params",
    INTERNAL_ERROR: "internal_error",
    HEADER_MISMATCH: "header_mismatch",
    MISSING_CAPABILITY: "missing_client_capability",
    UNSUPPORTED_VERSION: "unsupported_protocol_version",
    -32042: "url_elicitation_required",
}

# Discovery's bounds: pages of tools/list, tools kept (Discovery.operations' own cap), bytes of
# one page, the tools a discovery names as skipped.
MAX_PAGES = 32
MAX_TOOLS = 256
MAX_LIST_BYTES = 4 * 1024 * 1024
MAX_SKIPPED_NAMED = 20
# An answer's envelope around a result: the result may come twice (structuredContent and the
# text block the SDKs add beside it), plus the JSON-RPC wrapping and the SSE framing.
ENVELOPE_BYTES = 64 * 1024


def read_limit(result_limit: int) -> int:
    """How many bytes of a response are read for a result of at most `result_limit` bytes."""
    return 2 * result_limit + ENVELOPE_BYTES


class Unsupported(Exception):
    """The server refused the protocol version this request carried: it did not run the
    request (nothing was dispatched), so negotiating again and resending it is safe."""


class SessionGone(Exception):
    """The server answered 404 to a request carrying a session id: it does not know the
    session (expired, restarted), so it did not run the request."""


def header_value(value: str) -> str:
    """A value as an `Mcp-Name` header carries it: as it is when plain visible ASCII, else
    the `=?base64?...?=` form the 2026-07-28 transport defines."""
    plain = value.isascii() and value.isprintable() and value == value.strip()
    if plain and not (value.startswith("=?base64?") and value.endswith("?=")):
        return value
    return f"=?base64?{base64.b64encode(value.encode()).decode('ascii')}?="


def envelope_meta(version: str, *, tasks: bool = False) -> dict[str, Any]:
    """What a 2026-07-28 request's `params._meta` must carry (empty for the session-based
    generations, which said it once at `initialize`); `tasks`: declare the tasks extension
    (a tool call may then be answered with a task, which Reach follows)."""
    if version != MODERN:
        return {}
    capabilities: dict[str, Any] = {"extensions": {TASKS: {}}} if tasks else {}
    return {META_VERSION: MODERN, META_CAPABILITIES: capabilities, META_CLIENT_INFO: CLIENT_INFO}


def request_headers(
    version: str | None, session: str | None, method: str, name: str | None
) -> dict[str, str]:
    headers = {"Accept": ACCEPT, "Content-Type": "application/json"}
    if version is not None:
        headers[H_VERSION] = version
    if session is not None:
        headers[H_SESSION] = session
    if version == MODERN:
        headers[H_METHOD] = method
        if name is not None:
            headers[H_NAME] = header_value(name)
    return headers


def body(rpc_id: int | None, method: str, params: dict[str, Any]) -> bytes:
    message: dict[str, Any] = {"jsonrpc": "2.0", "method": method, "params": params}
    if rpc_id is not None:
        message["id"] = rpc_id
    return dumps(message)


# -- reading one answer --------------------------------------------------------------------------


def _parsed(raw: bytes, where: str) -> Any:
    try:
        return parse_json(raw, what="its answer")
    except ReachError as exc:
        raise AgentError(f"{where}: {exc.message}", retryable=False) from exc


async def read_answer(
    response: httpx.Response,
    rpc_id: int,
    limit: int,
    where: str,
    on_notification: Callable[[dict[str, Any]], None] | None = None,
    budget: Budget | None = None,
    on_request: Callable[[dict[str, Any]], None] | None = None,
) -> dict[str, Any]:
    """The JSON-RPC response to request `rpc_id` in `response` (a 2xx): its `result`, or the
    typed error its `error` stands for. Notifications on an SSE stream (progress) go to
    `on_notification`; a request the server sends back (sampling, elicitation, ping) to
    `on_request`, which answers it (`refusal_of`: Reach has no model and no user to ask).
    `budget`: what the whole response may read (else only each message is bounded)."""
    kind = response.headers.get("content-type", "").split(";")[0].strip().lower()
    if kind == "text/event-stream":
        pace = Pace()
        async for data in sse_messages(response, limit, where, budget, pace):
            message = _parsed(data, where)
            if isinstance(message, dict):
                if "method" not in message and (
                    message.get("id") == rpc_id
                    or ("error" in message and message.get("id") is None)
                ):
                    return outcome(message, where, response.status_code)
                if "method" in message and on_notification is not None and "id" not in message:
                    on_notification(message)
                elif "method" in message and on_request is not None and "id" in message:
                    on_request(message)
            if budget is not None:
                budget.skip(where)
            await pace.tick()
        raise TransportError(
            f"{where} closed its event stream before answering", outcome_unknown=True
        )
    if kind != "application/json":
        raise AgentError(f"{where} answered with content type {kind or 'none'!r}", retryable=False)
    raw = b"".join([chunk async for chunk in limited(response, limit, where, budget)])
    message = _parsed(raw, where)
    if not isinstance(message, dict):
        raise AgentError(f"{where} answered with JSON that is not one JSON-RPC response")
    return outcome(message, where, response.status_code)


def refusal_of(request: dict[str, Any]) -> dict[str, Any] | None:
    """Reach's answer to a request a server sent it mid-call: a `ping` is answered; anything
    else (sampling/createMessage, elicitation/create, roots/list) is JSON-RPC error -32601
    naming why, so the server's tool goes on (or fails) at once rather than waiting for an
    answer that never comes. None: an id JSON-RPC does not allow (nothing can answer it)."""
    rpc_id = request.get("id")
    if isinstance(rpc_id, bool) or not isinstance(rpc_id, str | int):
        return None
    method = str(request.get("method"))[:80]
    if method == "ping":
        return {"jsonrpc": "2.0", "id": rpc_id, "result": {}}
    error = {
        "code": METHOD_NOT_FOUND,
        "message": f"Agent-Reach does not serve {method!r}: it calls tools on behalf of its "
        "callers and has no model to sample and no user to ask (it declares no sampling, "
        "elicitation or roots capability)",
    }
    return {"jsonrpc": "2.0", "id": rpc_id, "error": error}


def outcome(message: dict[str, Any], where: str, status: int) -> dict[str, Any]:
    """A JSON-RPC response's result, or its error raised as Reach's."""
    error = message.get("error")
    if error is not None:
        raise error_for(error, where, status)
    result = message.get("result")
    if not isinstance(result, dict):
        raise AgentError(f"{where} answered a JSON-RPC response without a result object")
    return result


def error_for(error: Any, where: str, status: int | None = None) -> Exception:
    """A JSON-RPC error as the closed vocabulary (`Unsupported` for a refused protocol
    version, which the caller negotiates again from). The server's code and message travel
    as the `agent_error`'s fault."""
    if not isinstance(error, dict):
        error = {}
    code = error.get("code") if isinstance(error.get("code"), int) else None
    text = str(error.get("message") or "")
    if code == UNSUPPORTED_VERSION:
        return Unsupported(text)
    name = _CODE_NAMES.get(code or 0, "jsonrpc_error")
    fault = AgentFault(type=name, message=text, status=code)
    said = f" JSON-RPC error {code}" + (f": {text}" if text else "")
    if code == REQUEST_TIMEOUT:
        return DeadlineExceeded(f"{where} answered{said}")
    # The server's own trouble (internal, or its implementation-defined band) may pass;
    # a request it found wrong would be found wrong again.
    retryable = code == INTERNAL_ERROR or (code is not None and -32019 <= code <= -32000)
    # Unless its trouble was Reach's question going unanswered or refused: a retry would ask
    # the same caller again, who did not answer the first time.
    if REFUSED in text or UNANSWERED in text:
        retryable = False
    # A tool that failed on Reach's own refusal of its question was served: the server says so.
    if code == METHOD_NOT_FOUND and REFUSED not in text:
        return AgentError(f"{where}: operation not served;{said}", retryable=False, fault=fault)
    return AgentError(f"{where} answered{said}", retryable=retryable, fault=fault)


async def http_refusal(response: httpx.Response, where: str, *, had_session: bool) -> Exception:
    """What a non-2xx answer means: a JSON-RPC error in its body first (a 2026-07-28 server
    sends one with a table-mapped status), else the status as the HTTP connector reads it."""
    code = response.status_code
    raw = b""
    with contextlib.suppress(httpx.HTTPError):
        async for chunk in limited(response, ENVELOPE_BYTES, where):
            raw += chunk
    if code == 404 and had_session:
        return SessionGone(raw.decode("utf-8", "replace")[:200])
    lowered = raw.decode("utf-8", "replace").lower()
    if code == 400 and "protocol version" in lowered and "unsupported" in lowered:
        # How a 2025 server refuses an MCP-Protocol-Version it does not speak (its body, when
        # it has one, is a generic -32600): nothing ran.
        return Unsupported(raw.decode("utf-8", "replace")[:200])
    message: Any = None
    with contextlib.suppress(ValueError, UnicodeDecodeError, RecursionError):
        message = json.loads(raw)
    if isinstance(message, dict) and isinstance(message.get("error"), dict):
        return error_for(message["error"], where, code)
    text = raw.decode("utf-8", "replace").strip()[:1000]
    fault = AgentFault(type="http_error", message=text, status=code)
    said = f" HTTP {code}" + (f": {text}" if text else "")
    if code == 404:
        return AgentError(
            f"{where}: no MCP endpoint here (register the server's Streamable HTTP endpoint "
            f"itself, often .../mcp);{said}",
            retryable=False,
            fault=fault,
        )
    if 300 <= code < 400:  # never followed: the registered URL should be the endpoint itself
        to = response.headers.get("location", "")[:200]
        return AgentError(
            f"{where} redirects to {to!r}: register that URL", retryable=False, fault=fault
        )
    return AgentError(f"{where} answered{said}", retryable=code >= 500 or code == 429, fault=fault)


# -- a tool call's answer ------------------------------------------------------------------------


def _text_of(blocks: list[Any]) -> str | None:
    texts = [b["text"] for b in blocks if isinstance(b, dict) and b.get("type") == "text"]
    texts = [t for t in texts if isinstance(t, str)]
    return "\n".join(texts) if texts else None


def tool_reply(result: dict[str, Any], where: str, limit: int, *, tasks: bool = False) -> Reply:
    """A `tools/call` result as Reach's Reply (the mapping rule of docs/protocols/mcp.md):

    - `isError: true`: an `agent_error` (not retryable: the tool ran and said no), with the
      text blocks as the server's words;
    - `structuredContent` when present: the result (an object as it is, another JSON value
      as `{"value": ...}`);
    - else the content blocks, lossless: `{"content": [...]}`, plus `"text"`, the text blocks
      joined by newlines, when there is any;
    - a task (`resultType: "task"`, only when the call declared the tasks extension): accepted,
      with the task to follow.
    """
    kind = result.get("resultType", "complete")
    if kind == "task" and tasks:
        return Reply(status="accepted", follow=task_handle(result, where))
    if kind != "complete":
        raise AgentError(
            f"{where} answered a {kind!r} result, which Reach cannot continue "
            "(only complete results are)",
            retryable=False,
        )
    blocks = result.get("content")
    blocks = blocks if isinstance(blocks, list) else []
    if result.get("isError") is True:
        words = _text_of(blocks) or ""
        fault = AgentFault(type="tool_error", message=words)
        raise AgentError(
            f"{where}: the tool failed" + (f": {words[:300]}" if words else ""),
            retryable=False,
            fault=fault,
        )
    if "structuredContent" in result and result["structuredContent"] is not None:
        data = result["structuredContent"]
        mapped: dict[str, Any] = data if isinstance(data, dict) else {"value": data}
    else:
        mapped = {"content": blocks}
        text = _text_of(blocks)
        if text is not None:
            mapped["text"] = text
    try:
        check_json(mapped, what="its result", limit=limit)
    except ReachError as exc:
        raise AgentError(f"{where}; {exc.message}", retryable=False) from exc
    return Reply(status="ok", result=mapped)


# -- a tool list as operations -------------------------------------------------------------------


def declaration(tool: dict[str, Any]) -> OperationDeclaration | None:
    """A tool as an operation (None: its name cannot be one). Its annotations decide retry
    safety: `readOnlyHint` or `idempotentHint` true is idempotent, anything else is not. A
    description past the limit is cut; an input schema past the limits is left out."""
    hints = tool.get("annotations")
    hints = hints if isinstance(hints, dict) else {}
    idempotent = hints.get("readOnlyHint") is True or hints.get("idempotentHint") is True
    description = tool.get("description")
    if isinstance(description, str) and len(description) > MAX_DESCRIPTION_CHARS:
        description = description[: MAX_DESCRIPTION_CHARS - 1] + "…"
    schema = tool.get("inputSchema")
    fields: dict[str, Any] = {
        "name": tool.get("name"),
        "idempotent": idempotent,
        "description": description if isinstance(description, str) else None,
    }
    try:
        return OperationDeclaration.model_validate(
            {**fields, "input_schema": schema if isinstance(schema, dict) else None}
        )
    except ValueError:
        pass
    try:
        return OperationDeclaration.model_validate(fields)  # the schema was what did not fit
    except ValueError:
        return None


def discovery(tools: list[Any], details: dict[str, Any]) -> Discovery:
    """The tools a server listed as a Discovery; `version` is a hash of the list as served."""
    operations: list[OperationDeclaration] = []
    skipped: list[str] = []
    seen: set[str] = set()
    for tool in tools:
        op = declaration(tool) if isinstance(tool, dict) else None
        if op is None or op.name in seen or len(operations) >= MAX_TOOLS:
            name = tool.get("name") if isinstance(tool, dict) else None
            skipped.append(str(name)[:80])
            continue
        seen.add(op.name)
        operations.append(op)
    version = hashlib.sha256(
        json.dumps(tools, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()
    ).hexdigest()[:32]
    if skipped:
        details = {
            **details,
            "skipped_tools": skipped[:MAX_SKIPPED_NAMED],
            "skipped_count": len(skipped),
        }
    return Discovery(operations=operations, version=version, details=details)


# -- the tasks extension (io.modelcontextprotocol/tasks, 2026-07-28) -------------------------------


def task_handle(task: dict[str, Any], where: str) -> dict[str, Any]:
    """What the request's history keeps to follow a task: its id (and the poll interval the
    server asked for)."""
    task_id = task.get("taskId")
    if not isinstance(task_id, str) or not task_id or len(task_id) > MAX_TASK_ID_CHARS:
        raise AgentError(f"{where} answered a task without a usable taskId", retryable=False)
    handle: dict[str, Any] = {"task_id": task_id}
    poll = task.get("pollIntervalMs")
    if isinstance(poll, int) and not isinstance(poll, bool) and poll >= 0:
        handle["poll_ms"] = poll
    return handle


def task_reply(task: dict[str, Any], where: str, limit: int) -> Reply:
    """A `tasks/get` result as where the call stands: still working (accepted, to be followed),
    its tool's answer (the result rule), its JSON-RPC error, or a task that ended otherwise
    (`input_required`: Reach cannot give the input; `canceled`)."""
    handle = task_handle(task, where)
    status = task.get("status")
    said = task.get("statusMessage")
    words = {"message": str(said)[:1000]} if said else {}
    if status == "working":
        return Reply(status="accepted", follow=handle)
    if status == "completed":
        result = task.get("result")
        if not isinstance(result, dict):
            raise AgentError(f"{where} completed task {handle['task_id']} without a result")
        return tool_reply(result, where, limit)
    if status == "failed":
        error = error_for(task.get("error"), f"{where} (task {handle['task_id']})")
        if isinstance(error, ReachError):
            raise error
        raise AgentError(f"{where}: task {handle['task_id']} failed: {error}", retryable=False)
    if status == "input_required":
        asked = task.get("inputRequests")
        keys = sorted(asked)[:20] if isinstance(asked, dict) else []
        result = {"task_id": handle["task_id"], "state": "input_required", **words}
        return Reply(status="input_required", result={**result, "input_requests": keys})
    if status == "cancelled":
        return Reply(
            status="canceled",
            result={"task_id": handle["task_id"], "state": "cancelled", **words},
        )
    raise AgentError(f"{where}: task {handle['task_id']} is {str(status)[:40]!r}", retryable=False)
