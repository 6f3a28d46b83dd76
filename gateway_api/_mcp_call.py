"""The MCP front's side of the door for one `tools/call` (`Call`), and the tool result (or the
JSON-RPC error) its outcome is (`outcome`)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable
from typing import Any

from temporalio.service import RPCError

from gateway_api._mcp_ask import Offer
from gateway_api._mcp_tools import call_result, rpc_error_of
from gateway_api.errors import reach_error_of_rpc
from gateway_api.steps.wait import LetGo
from reach.errors import ReachError
from reach.messages import InvokeResponse

log = logging.getLogger("reach.gateway")


class Call:
    """The MCP front's side of the door: it keeps the RequestID once the door has one, and
    hears when the request is durable (`started`). A call as a task lets the request go
    `let_go` seconds after that: the door answers it `accepted` and holds nothing of it (no
    waiter, no room among the bytes in flight); tasks/get reads its result from its workflow.
    A call with an `offer` claims it as soon as it is named, before the request can start, so
    that the agent's first question finds it (`_mcp_ask`)."""

    __slots__ = ("durable", "gone", "let_go", "offer", "request_id")

    def __init__(
        self,
        let_go: float | None = None,
        offer: Offer | None = None,
        gone: asyncio.Future[Any] | None = None,
    ) -> None:
        self.request_id: str | None = None
        self.let_go = let_go
        self.offer = offer
        self.durable = asyncio.Event()
        # Done when the client went away: the door lets the request go (it goes on durably).
        self.gone = gone

    async def named(self, request_id: str, caller: str) -> None:
        self.request_id = request_id
        if self.offer is not None:
            await self.offer.claim(request_id, caller)

    async def started(self, request_id: str) -> LetGo:
        self.durable.set()
        return self.let_go if self.let_go is not None else self.gone


def consumed(task: asyncio.Future[InvokeResponse]) -> None:
    """Its outcome read, so that a refusal nobody awaits is not logged as never retrieved."""
    if not task.cancelled():
        task.exception()


def named(request_id: str) -> Call:
    call = Call()
    call.request_id = request_id
    return call


async def outcome(task: Awaitable[InvokeResponse], front: Call, modern: bool) -> dict[str, Any]:
    try:
        response = await task
    except ReachError as exc:
        raise rpc_error_of(exc, front.request_id) from None
    except RPCError as exc:
        log.error("Temporal call failed on MCP tools/call: %s", exc)
        raise rpc_error_of(reach_error_of_rpc(exc), front.request_id) from None
    return call_result(response, modern)
