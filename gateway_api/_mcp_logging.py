"""Which log messages the MCP front relays to its client: the level it asked for.

The agents behind Reach (an MCP server's `notifications/message`) have their log messages kept
beside the request (`reach.progress`); a streamed tool call relays those at or above the level
its client asked for, and none when it asked for none:

- 2026-07-28 (stateless): per request, `_meta["io.modelcontextprotocol/logLevel"]` of the
  `tools/call` itself; a value that is no level is -32602.
- The handshake generation: `logging/setLevel` for the session. Sessions are stateless tokens
  (`_mcp_wire.new_session`), so the level is kept in the shared policy state under a digest of
  the session id for `SESSION_LEVEL_TTL_S` (each setLevel renews it), where every gateway reads
  it: once per streamed call of a session, beside the call (never before it starts). A client
  without a session cannot keep one: its setLevel is answered and nothing is kept. Session ids
  are minted by anyone (a caller may name any random part after its own digest), so each kept
  level is one key for a day: a caller's setLevels that keep one are bounded by a token bucket
  (`SET_LEVEL_PER_MINUTE`, past it -32000 rate_limited with retry_after_s), at most ~86,400
  keys a caller a day instead of as many as it can send.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
from typing import Any

from gateway_api import _mcp_wire as wire
from gateway_api._mcp_tools import rpc_error_of
from reach.errors import RateLimited, ReachError
from reach.policy.state import Bucket, PolicyState
from reach.progress import LOG_LEVELS

log = logging.getLogger("reach.gateway")

LEVEL_META = "io.modelcontextprotocol/logLevel"
SESSION_LEVEL_TTL_S = 24 * 3600.0
READ_TIMEOUT_S = 1.0
SET_LEVEL_PER_MINUTE = 60.0
"""Kept levels one caller may set a minute (a burst of as many), across gateways."""


def checked(value: Any) -> str:
    """A level the client named, or -32602."""
    if value not in LOG_LEVELS:
        raise wire.RpcError(
            wire.INVALID_PARAMS,
            f"unknown log level {str(value)[:40]!r}",
            {"levels": list(LOG_LEVELS)},
        )
    return str(value)


def asked(message: wire.Message) -> str | None:
    """The level a 2026-07-28 request asks for in its `_meta` (None: no log messages)."""
    value = message.meta.get(LEVEL_META)
    return None if value is None else checked(value)


def _key(session: str) -> str:
    return "mcp-log-level:" + hashlib.sha256(session.encode()).hexdigest()[:32]


async def set_level(
    state: PolicyState, session: str | None, params: dict[str, Any], caller: str
) -> None:
    """`logging/setLevel`: the session's level kept (the store's trouble is a -32603; past
    the caller's bucket, rate_limited)."""
    level = checked(params.get("level"))
    if session is None:
        return
    bucket = Bucket(
        key="mcp-log-level-rate:" + hashlib.sha256(caller.encode()).hexdigest()[:32],
        per_minute=SET_LEVEL_PER_MINUTE,
        capacity=int(SET_LEVEL_PER_MINUTE),
    )
    try:
        wait_s = await state.take([bucket])
        if wait_s > 0:
            said = f"caller {caller!r} set more than {SET_LEVEL_PER_MINUTE:g} log levels a minute"
            limited = RateLimited(said, retry_after_s=max(1, round(wait_s + 0.5)))
            raise rpc_error_of(limited, None)
        await state.put(_key(session), level, SESSION_LEVEL_TTL_S)
    except ReachError as exc:
        raise wire.RpcError(wire.INTERNAL_ERROR, f"the level was not kept: {exc.message}") from None


async def session_level(state: PolicyState, session: str | None) -> str | None:
    """The level the session set (None: none, or the store could not say in time)."""
    if session is None:
        return None
    try:
        level = await asyncio.wait_for(state.peek(_key(session)), READ_TIMEOUT_S)
    except (ReachError, TimeoutError) as exc:
        log.debug("MCP session's log level not read: %s", exc)
        return None
    return level if level in LOG_LEVELS else None
