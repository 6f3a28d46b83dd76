"""The MCP front's tools: Reach's operations as tools, and an invoke's envelope as a tool result.

**Names.** A tool is `capability.operation` (both names are valid MCP tool-name characters).
Capability and operation names may hold dots themselves, so a tool name is read back against
the catalog (the registry's routable operations); an operation's name alone calls it too while
exactly one tool the caller may call has it. A name the catalog does not hold is split at its
first dot and handed to the door, which says what it is (its rules first: a denied caller
learns nothing of what exists).

**The catalog** is every routable instance's operations, with what the agents declared (the
first instance by id that declares a description or an input schema speaks for the
operation; an operation declared idempotent by its instances is `idempotentHint`). It is read
from the registry at most every `CATALOG_TTL_S` (and again at once after a change this
gateway made), so listing tools costs a few store reads a second at most, whatever the
number of clients. `tools/list` is the catalog filtered through the caller's rules: an
operation a rule denies is not listed (calling it anyway is the door's 403, audited).

**Results.** (The rule docs/mcp-front.md documents.) An envelope with status `success` is a
result: `structuredContent` is the agent's result object, and one text block holds it as JSON
(for clients that read text only); a result that is only MCP content blocks
(`{"content": [...]}`, with at most their `text` beside: what an MCP server behind Reach
answered without structured content) is passed on as those blocks. An envelope that says the
call failed after Reach took it (`error`, `timeout`, still `running` at its deadline) is a
result with `isError: true`, the error's message as text and the envelope's error as
`structuredContent`, so a model reads what went wrong. A refusal before any agent was
involved is a JSON-RPC error (`rpc_error_of`). Every result's `_meta` names the RequestID
(`reach/requestId`), the status and the instance.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from gateway_api import _mcp_wire as wire
from reach.errors import ReachError
from reach.messages import InvokeResponse, dumps
from reach.registry import InstanceRecord, OperationDeclaration, Registry
from reach.security.guard import Guard

CATALOG_TTL_S = 2.0
OPEN_OBJECT: dict[str, Any] = {"type": "object"}

# Reach error types that say the call's params were wrong (the tool, its arguments).
_BAD_PARAMS = frozenset({"invalid_request", "payload_too_large", "unknown_capability"})
_BLOCK_TYPES = frozenset({"text", "image", "audio", "resource", "resource_link"})


@dataclass(frozen=True, slots=True)
class Tool:
    capability: str
    operation: str
    description: str | None = None
    input_schema: dict[str, Any] | None = None
    idempotent: bool | None = None

    @property
    def name(self) -> str:
        return f"{self.capability}.{self.operation}"

    def listed(self) -> dict[str, Any]:
        schema = self.input_schema
        tool: dict[str, Any] = {
            "name": self.name,
            # An MCP input schema is an object's; anything else is not offered as one.
            "inputSchema": schema if schema and schema.get("type") == "object" else OPEN_OBJECT,
        }
        if self.description:
            tool["description"] = self.description
        if self.idempotent is not None:
            tool["annotations"] = {"idempotentHint": self.idempotent}
        return tool


def _tools_of(capability: str, records: Iterable[InstanceRecord]) -> list[Tool]:
    found: dict[str, list[OperationDeclaration]] = {}
    for record in records:
        if not record.routable:
            continue
        for name in record.operations:
            declared = record.declared.get(name)
            found.setdefault(name, []).extend([declared] if declared else [])
    tools = []
    for name in sorted(found):
        said = found[name]
        votes = {d.idempotent for d in said if d.idempotent is not None}
        tools.append(
            Tool(
                capability,
                name,
                description=next((d.description for d in said if d.description), None),
                input_schema=next((d.input_schema for d in said if d.input_schema), None),
                idempotent=all(votes) if votes else None,
            )
        )
    return tools


@dataclass
class Catalog:
    """Every routable operation as a tool, read from the registry at most every TTL."""

    registry: Registry
    ttl_s: float = CATALOG_TTL_S
    _tools: dict[str, Tool] = field(default_factory=dict)
    _read_at: float = float("-inf")

    def __post_init__(self) -> None:
        self.registry.on_change(self._changed)

    def _changed(self, _capability: str, _instance_id: str) -> None:
        self._read_at = float("-inf")

    async def tools(self) -> dict[str, Tool]:
        if time.monotonic() - self._read_at < self.ttl_s:
            return self._tools
        read_at = time.monotonic()
        tools: dict[str, Tool] = {}
        for capability in await self.registry.capabilities():
            for tool in _tools_of(capability, await self.registry.instances(capability)):
                tools[tool.name] = tool
        self._tools, self._read_at = tools, read_at
        return tools

    async def listed_for(self, caller: str, guard: Guard | None) -> list[dict[str, Any]]:
        """The tools the caller may call, as `tools/list` lists them."""
        rules = guard.rules if guard is not None else None
        return [
            tool.listed()
            for tool in (await self.tools()).values()
            if rules is None or rules.decide(caller, tool.capability, tool.operation).allowed
        ]

    async def target(self, name: str, caller: str, guard: Guard | None) -> tuple[str, str]:
        """The (capability, operation) a tool name calls. A name the catalog does not hold
        (read again first: it may be a moment old) is split at its first dot; when the caller
        may call it and its capability is listed, it is an unknown tool here; otherwise the
        door says what it is (a rule's 403 first)."""
        tool = (await self.tools()).get(name)
        if tool is None:
            self._read_at = float("-inf")
            tool = (await self.tools()).get(name)
        if tool is None:
            tool = self._by_operation(name, caller, guard)
        if tool is not None:
            return tool.capability, tool.operation
        capability, dot, operation = name.partition(".")
        unknown = wire.RpcError(
            wire.INVALID_PARAMS,
            f"unknown tool {name[:200]!r}: Reach's tools are named capability.operation "
            "(tools/list)",
        )
        if not dot or not capability or not operation:
            raise unknown
        allowed = guard is None or guard.rules.decide(caller, capability, operation).allowed
        if allowed and any(t.capability == capability for t in self._tools.values()):
            raise unknown
        return capability, operation

    def _by_operation(self, name: str, caller: str, guard: Guard | None) -> Tool | None:
        """The one tool the caller may call whose operation is `name` (None: none, or more
        than one): a client that knows only the operation's name (the conformance suite's
        fixed tool names) still reaches it while it is unambiguous."""
        rules = guard.rules if guard is not None else None
        found = [
            tool
            for tool in self._tools.values()
            if tool.operation == name
            and (rules is None or rules.decide(caller, tool.capability, name).allowed)
        ]
        return found[0] if len(found) == 1 else None


def content_blocks(result: dict[str, Any]) -> list[dict[str, Any]] | None:
    """The MCP content blocks a result carries as its whole answer (`{"content": [...]}`,
    beside at most their `text`: what Reach's MCP connector makes of a server's answer
    without structured content), else None."""
    blocks = result.get("content")
    if not isinstance(blocks, list) or not blocks or set(result) - {"content", "text"}:
        return None
    for block in blocks:
        if not isinstance(block, dict) or block.get("type") not in _BLOCK_TYPES:
            return None
    return blocks


def call_result(response: InvokeResponse, modern: bool) -> dict[str, Any]:
    """The tool result of an envelope (see the module docstring)."""
    meta: dict[str, Any] = {wire.REQUEST_ID_META: response.request_id}
    meta[wire.STATUS_META] = response.status
    if response.instance_id:
        meta[wire.INSTANCE_META] = response.instance_id
    out: dict[str, Any]
    if response.status == "success":
        value = response.result if response.result is not None else {}
        blocks = content_blocks(value)
        if blocks is not None:
            out = {"content": blocks, "isError": False}
        else:
            out = {
                "content": [{"type": "text", "text": dumps(value).decode()}],
                "structuredContent": value,
                "isError": False,
            }
    else:
        envelope = response.model_dump(mode="json", exclude_none=True)
        error = envelope.get("error") or {
            "type": response.status,
            "message": f"request {response.request_id} is still running; its result: "
            f"GET /reach/requests/{response.request_id}",
        }
        out = {
            "content": [{"type": "text", "text": f"{error['type']}: {error['message']}"}],
            "structuredContent": {"error": error},
            "isError": True,
        }
    if modern:
        out["resultType"] = "complete"
    out["_meta"] = meta
    return out


def rpc_error_of(exc: ReachError, request_id: str | None) -> wire.RpcError:
    """A refusal of Reach's as a JSON-RPC error: the call's params (-32602) or Reach (-32000),
    with the envelope's error (type, HTTP status, retryable, the RequestID) as `data`."""
    data: dict[str, Any] = {"type": exc.type, "status": exc.http_status, "retryable": exc.retryable}
    if exc.retry_after_s:
        data["retry_after_s"] = exc.retry_after_s
    if exc.outcome_unknown:
        data["outcome_unknown"] = True
    if request_id is not None:
        data["request_id"] = request_id
    code = wire.INVALID_PARAMS if exc.type in _BAD_PARAMS else wire.REACH_REFUSED
    message = exc.message
    if exc.type == "unknown_capability":
        message = f"unknown tool: {exc.message}"
    return wire.RpcError(code, message, data)
