"""The MCP front's side of questions asked mid-call (`reach.asks`): an MCP server behind Reach
asks for sampling or elicitation during a `tools/call`, and the client that made the call
through this front answers.

- `Offer`: a streamed `tools/call` whose session declared what its client can answer
  (`_mcp_wire.session_caps`) offers to relay its request's questions while its stream is
  open: claimed when the door names the RequestID (before the call can start, so the first
  question finds it), refreshed while the stream runs, released when it ends or its client
  goes away (`Offer.watch`). Each question
  addressed to this stream is sent on it as a server-to-client JSON-RPC request whose id is
  fresh (`reach.asks.ASK_ID_PREFIX` and a random token), its record kept where every gateway
  reads it.
- `answer`: a JSON-RPC response POSTed to `/mcp` (any gateway) is matched by that id and
  written where the waiting call reads it. Refused, with a JSON-RPC error and an HTTP status
  saying why: an id that is not a question of Reach's or no longer waits (404), another
  caller's question (403), an answer that is neither a result object nor an error (400), one
  over the question's bound (413), a question already answered (409).
"""

from __future__ import annotations

import json
import logging
import re
import secrets
import time
from typing import Any

from starlette.types import Receive, Send

from gateway_api import _mcp_http as http
from gateway_api import _mcp_wire as wire
from gateway_api.http_limits import disconnected
from reach import asks
from reach.errors import ReachError
from reach.policy.state import PolicyState

log = logging.getLogger("reach.gateway")

_TOKEN = re.compile(r"[0-9a-f]{32}")
MAX_ERROR_MESSAGE_CHARS = 1000


class Offer:
    """One streamed call's offer to relay its questions (see the module docstring)."""

    def __init__(self, state: PolicyState, caps: str) -> None:
        self.state = state
        self.caps = caps
        self.stream = secrets.token_hex(8)
        self.key: str | None = None  # set once claimed
        self.value = ""
        self.request_id = ""
        self.caller = ""
        self.seen = (0, 0)  # (attempt, n) of the last question looked at
        self.refreshed = 0.0

    @property
    def open(self) -> bool:
        return self.key is not None

    async def claim(self, request_id: str, caller: str) -> None:
        """Offer to relay `request_id`'s questions, unless another stream already does (a
        repeat of the request attached to it) or the store cannot say (then none is)."""
        key = asks.offer_key(request_id)
        said = {"caller": asks.digest(caller), "caps": self.caps, "stream": self.stream}
        value = json.dumps(said)
        try:
            held = await self.state.claim(key, value, asks.OFFER_TTL_S)
        except ReachError as exc:
            log.info("MCP questions of %s will not be relayed: %s", request_id, exc.message)
            return
        if held == value:
            self.key, self.value = key, value
            self.request_id, self.caller = request_id, caller
            self.refreshed = time.monotonic()

    async def watch(self, receive: Receive) -> None:
        """Until the client goes away (its stream closed), then the offer is released: a
        question waiting on it is given up within `reach.asks.OFFER_CHECK_S`, not held to the
        call's deadline (the server's `send` says nothing of a client gone)."""
        await disconnected(receive)
        await self.close()

    async def close(self) -> None:
        if self.key is not None:
            key, self.key = self.key, None
            try:
                await self.state.release(key, self.value)
            except ReachError as exc:  # it lapses by itself (OFFER_TTL_S)
                log.debug("MCP question offer %s not released: %s", key, exc.message)

    async def forward(self, send: Send) -> bool:
        """Relay on the stream each question asked since the last look; whether any was."""
        if self.key is None:
            return False
        try:
            await self._refresh()
            mark = await self.state.peek(asks.index_key(self.request_id))
            if mark is None:
                return False
            attempt, _, count = mark.partition(":")
            now = (int(attempt), int(count))
        except (ReachError, ValueError) as exc:
            log.debug("MCP questions of %s not read: %s", self.request_id, exc)
            return False
        if now <= self.seen:
            return False
        first = self.seen[1] + 1 if now[0] == self.seen[0] else 1
        frames = []
        for n in range(max(first, now[1] - asks.MAX_ASKS_PER_CALL + 1), now[1] + 1):
            frame = await self._question(now[0], n)
            if frame is not None:
                frames.append(frame)
        self.seen = now
        if frames:
            await http.chunk(send, b"".join(frames))
        return bool(frames)

    async def _refresh(self) -> None:
        if time.monotonic() - self.refreshed < asks.OFFER_REFRESH_S or self.key is None:
            return
        self.refreshed = time.monotonic()
        if await self.state.peek(self.key) == self.value:
            await self.state.put(self.key, self.value, asks.OFFER_TTL_S)

    async def _question(self, attempt: int, n: int) -> bytes | None:
        """Question `n` as a JSON-RPC request of this front's (None: not this stream's)."""
        try:
            question = asks.decode(
                await self.state.peek(asks.question_key(self.request_id, attempt, n))
            )
            if question is None or question.get("stream") != self.stream:
                return None
            token = secrets.token_hex(16)
            until_s = float(question.get("until_s") or 0)
            record = {
                "answer": asks.answer_key(self.request_id, attempt, n),
                "caller": asks.digest(self.caller),
                "limit": int(question.get("limit") or 0),
                "until_s": until_s,
            }
            ttl = max(until_s - time.time(), 0.0) + asks.KEPT_S
            await self.state.put(asks.ask_id_key(token), json.dumps(record), ttl)
        except (ReachError, TypeError, ValueError) as exc:
            log.info("MCP question %s of %s not relayed: %s", n, self.request_id, exc)
            return None
        params = question.get("params")
        request = {
            "jsonrpc": "2.0",
            "id": asks.ASK_ID_PREFIX + token,
            "method": str(question.get("method")),
            "params": params if isinstance(params, dict) else {},
        }
        return wire.sse_event(request)


def _refused(status: int, code: int, message: str, key: wire.RequestKey) -> http.Answer:
    return http.Answer(status, wire.error(key, wire.RpcError(code, message)), {})


async def answer(state: PolicyState, message: wire.Message, caller: str) -> None:
    """A client's JSON-RPC response to a question relayed to it, written for the waiting
    call; a refusal is raised as the `http.Answer` that says why."""
    key = message.id
    ours = isinstance(key, str) and key.startswith(asks.ASK_ID_PREFIX)
    token = key[len(asks.ASK_ID_PREFIX) :] if isinstance(key, str) and ours else ""
    if not _TOKEN.fullmatch(token):
        said = f"no question of Reach's has id {str(key)[:80]!r}"
        raise _refused(404, wire.INVALID_PARAMS, said, key)
    try:
        record = asks.decode(await state.peek(asks.ask_id_key(token)))
    except ReachError as exc:
        said = f"the answer was not kept: {exc.message}"
        raise _refused(503, wire.INTERNAL_ERROR, said, key) from None
    if record is None:
        said = f"question {key!r} is not waiting for an answer (answered, ended, or unknown)"
        raise _refused(404, wire.INVALID_PARAMS, said, key)
    if record.get("caller") != asks.digest(caller):
        said = f"question {key!r} was asked of another caller: only its caller answers it"
        raise _refused(403, wire.REACH_REFUSED, said, key)
    tail = _tail(message.body)
    if tail is None:
        said = "an answer is a result object, or an error with an integer code and a message"
        raise _refused(400, wire.INVALID_REQUEST, said, key)
    raw = json.dumps(tail, separators=(",", ":"), ensure_ascii=False)
    limit = int(record.get("limit") or 0)
    if len(raw.encode()) > limit:
        said = f"the answer is larger than the {limit} bytes its question allows"
        raise _refused(413, wire.INVALID_REQUEST, said, key)
    ttl = max(float(record.get("until_s") or 0) - time.time(), 0.0) + asks.KEPT_S
    try:
        held = await state.claim(str(record.get("answer")), raw, ttl)
    except ReachError as exc:
        said = f"the answer was not kept: {exc.message}"
        raise _refused(503, wire.INTERNAL_ERROR, said, key) from None
    if held == asks.GONE:
        said = f"question {key!r} no longer waits for an answer: its call gave it up"
        raise _refused(404, wire.INVALID_PARAMS, said, key)
    if held != raw:
        raise _refused(409, wire.INVALID_REQUEST, f"question {key!r} was answered already", key)


def _tail(body: dict[str, Any]) -> dict[str, Any] | None:
    """The answer as the agent is given it: the result object, or the error (its code, its
    message, its data)."""
    if "result" in body and "error" not in body:
        result = body["result"]
        return {"result": result} if isinstance(result, dict) else None
    error = body.get("error")
    if not isinstance(error, dict) or "result" in body:
        return None
    code, said = error.get("code"), error.get("message")
    if isinstance(code, bool) or not isinstance(code, int) or not isinstance(said, str):
        return None
    out: dict[str, Any] = {"code": code, "message": said[:MAX_ERROR_MESSAGE_CHARS]}
    if "data" in error:
        out["data"] = error["data"]
    return {"error": out}
