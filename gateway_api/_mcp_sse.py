"""A `tools/call` answered as an SSE stream by the MCP front: `X-Reach-Request-Id` in its
headers at once, the agents' progress as `notifications/progress` (when the client gave a
`progressToken`), their log messages as `notifications/message` (when the client asked for a
level: `_mcp_logging`), keep-alive comments, and the result as the last event.

Progress and log messages come from the record the call's activity keeps in the shared policy
state (`reach.progress`: an MCP server's notifications behind Reach), read every `RELAY_EVERY_S`
while the call runs and once more before the result; its notes are forwarded under the
client's token, each only when its progress is above the last one sent (the spec's rule that
progress increases: a retried attempt's notes, which start again, are not sent). The first
notification, progress 0, names the RequestID. Log messages are sent in the order they came,
each once, those below the client's level not at all; what the record kept is what is sent
(the last `reach.progress.MAX_LOGS` of each write, their data redacted as the audit redacts).
A call whose client can answer its agents' questions (sampling, elicitation) has them sent on
the stream as requests of the front's own, at the same pace (`gateway_api._mcp_ask`).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from starlette.types import Send

from gateway_api import _mcp_http as http
from gateway_api import _mcp_wire as wire
from gateway_api._mcp_ask import Offer
from gateway_api._mcp_listen import RECHECK_S  # the same pace as a listen stream's
from reach import progress
from reach.errors import ReachError
from reach.messages import InvokeResponse
from reach.policy.state import PolicyState

log = logging.getLogger("reach.gateway")

KEEPALIVE_S = 15.0
RELAY_EVERY_S = 0.25
"""How often a streamed call with a progress token reads its progress record (one store read)."""

Outcome = Callable[[asyncio.Future[InvokeResponse]], Awaitable[dict[str, Any]]]


def progress_token(message: wire.Message) -> str | int | None:
    token = message.meta.get("progressToken")
    if isinstance(token, str | int) and not isinstance(token, bool):
        return token
    return None


class Relay:
    """The progress notifications and log messages of one streamed call."""

    def __init__(
        self, state: PolicyState, request_id: str, token: str | int | None, level: str | None
    ) -> None:
        self.state = state
        self.key = progress.progress_key(request_id)
        self.token = token  # None: no progress relayed
        self.level = level  # None: no log messages relayed
        self.sent_progress = 0.0  # the opening notice's
        self.seen = 0  # notes of the record already looked at (its count)
        self.sent_log = (0, 0)  # (attempt, seq) of the last log message looked at

    def notice(self, request_id: str) -> bytes:
        if self.token is None:
            return b""
        note = {
            "progressToken": self.token,
            "progress": 0,
            "message": f"Reach request {request_id} is running",
        }
        return wire.sse_event(
            {"jsonrpc": "2.0", "method": "notifications/progress", "params": note}
        )

    async def forward(self, send: Send) -> bool:
        """Send what the record holds beyond what was sent; whether anything was."""
        try:
            raw = await self.state.peek(self.key)
        except ReachError:  # the store's trouble: the call goes on, its progress unsaid
            return False
        timed = self._progress(raw) if self.token is not None else []
        if self.level is not None:
            timed += self._logs(raw, self.level)
        frames = b"".join(frame for _, frame in sorted(timed, key=lambda t: t[0]))
        if frames:
            await http.chunk(send, frames)
        return bool(frames)

    def _progress(self, raw: str | None) -> list[tuple[float, bytes]]:
        count, notes = progress.decode(raw)
        new = notes[max(0, len(notes) - (count - self.seen)) :] if count > self.seen else []
        self.seen = max(self.seen, count)
        out = []
        for note in new:
            if note.get("progress", 0) <= self.sent_progress:
                continue
            self.sent_progress = note["progress"]
            params: dict[str, Any] = {"progressToken": self.token, "progress": note["progress"]}
            params.update({k: note[k] for k in ("total", "message") if k in note})
            notice = {"jsonrpc": "2.0", "method": "notifications/progress", "params": params}
            out.append((float(note["at_ms"]), wire.sse_event(notice)))
        return out

    def _logs(self, raw: str | None, level: str) -> list[tuple[float, bytes]]:
        """Each log message past the last one looked at (by attempt, then number: a retried
        attempt's are new), at or above the client's level."""
        out = []
        for note in progress.decode_logs(raw)[1]:
            place = (int(note.get("attempt", 1)), note["seq"])
            if place <= self.sent_log:
                continue
            self.sent_log = place
            if not progress.level_at_least(note["level"], level):
                continue
            params = {k: note[k] for k in ("level", "logger", "data") if k in note}
            notice = {"jsonrpc": "2.0", "method": "notifications/message", "params": params}
            out.append((float(note["at_ms"]), wire.sse_event(notice)))
        return out


async def stream(
    send: Send,
    message: wire.Message,
    task: asyncio.Future[InvokeResponse],
    request_id: str,
    outcome: Outcome,
    state: PolicyState,
    level: str | None = None,
    asks: Offer | None = None,
    check: Callable[[], object] | None = None,
) -> None:
    """The rest of a long call as an SSE stream (see the module docstring); `level`: the log
    messages relayed (`_mcp_logging`); `asks`: the agents' questions relayed (`_mcp_ask`);
    `check`: the caller's token checked again every `RECHECK_S`, a token revoked (or expired)
    since the call began ending the stream with its error before the call's later notes and
    result (the call goes on), as the A2A front's streams and the MCP listen streams end."""
    try:
        await send(
            {
                "type": "http.response.start",
                "status": 200,
                "headers": [
                    (b"content-type", b"text/event-stream"),
                    (b"cache-control", b"no-cache, no-transform"),
                    (b"x-accel-buffering", b"no"),
                    (b"x-reach-request-id", request_id.encode()),
                ],
            }
        )
        token = progress_token(message)
        relay = None
        if token is not None or level is not None:
            relay = Relay(state, request_id, token, level)
            if token is not None:
                await http.chunk(send, relay.notice(request_id))
        loop = asyncio.get_running_loop()
        said = checked = loop.time()
        while not task.done():
            every = RELAY_EVERY_S if relay is not None or asks is not None else KEEPALIVE_S
            await asyncio.wait({task}, timeout=every if check is None else min(every, RECHECK_S))
            if check is not None and loop.time() - checked >= RECHECK_S - 0.01:
                checked = loop.time()
                try:
                    check()
                except ReachError as exc:
                    data = {"type": exc.type, "status": exc.http_status, "request_id": request_id}
                    error = wire.RpcError(wire.REACH_REFUSED, exc.message, data)
                    await http.chunk(send, wire.sse_event(wire.error(message.id, error)))
                    await send({"type": "http.response.body", "body": b"", "more_body": False})
                    return
            forwarded = relay is not None and await relay.forward(send)
            if (asks is not None and await asks.forward(send)) or forwarded:
                said = loop.time()
            elif not task.done() and loop.time() - said >= KEEPALIVE_S - 0.01:
                await http.chunk(send, b": keep-alive\n\n")
                said = loop.time()
        if relay is not None:
            await relay.forward(send)  # the last notes, recorded before the call ended
        try:
            frame = wire.result(message.id, await outcome(task))
        except wire.RpcError as exc:
            frame = wire.error(message.id, exc)
        await http.chunk(send, wire.sse_event(frame))
        await send({"type": "http.response.body", "body": b"", "more_body": False})
    except OSError:  # the client went away: the request carries on durably
        log.info("MCP stream of %s closed by the client; the request carries on", request_id)
