"""Questions an agent asks mid-call (an MCP server's `sampling/createMessage` and
`elicitation/create`), relayed to the client that made the call through Reach's MCP front,
and that client's answer back to the agent.

The call runs in an activity, maybe in another process than the front's response stream, so
both meet in the policy state every gateway and worker shares (as progress does:
`reach.progress`), keyed by the RequestID:

- **The offer.** While the MCP front holds a `tools/call`'s response stream open for a client
  that declared what it can answer at `initialize` (its session says so), it keeps an offer
  under `offer_key`: a digest of the caller, the capabilities (`SAMPLING`, `FORM`, `URL`) and
  which stream it is. It is claimed (one stream of a request relays, however many attach),
  refreshed while the stream is open (`OFFER_TTL_S`) and released when it closes.
- **The question.** The agent's request reaches the call's `Questions` (the activity sets them
  for the call, `QUESTIONS`). No offer (the call did not come through the MCP front with an
  open stream: `POST /reach/invoke`, gRPC, A2A, a task), another caller's, a capability the
  client did not declare, a question over the call's message bound, or more than
  `MAX_ASKS_PER_CALL` in one call: refused at once (`refusal`, JSON-RPC -32601). Otherwise the
  question is written (`question_key`, its number in `index_key`) and its answer awaited
  (`answer_key`) until the call's deadline (a little past it, `DEADLINE_GRACE_S`: the call
  ends as a timeout), the offer going (the stream closed), or the call's end, whichever comes
  first.
- **The relay.** The front relays each question addressed to its stream as a JSON-RPC request
  with a fresh id (`ASK_ID_PREFIX` and a random token, whose record under `ask_id_key` names
  the answer's key, the caller and the bound). The client's response, POSTed to `/mcp` on any
  gateway, is matched by that id, checked (the same caller, within the bound, the first answer
  only) and claimed under `answer_key`, where the waiting call reads it and answers the agent.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import time
from contextvars import ContextVar
from typing import Any

from reach.errors import ReachError
from reach.policy.state import PolicyState

SAMPLING = "s"
FORM = "e"
URL = "u"
"""The capabilities an offer names: sampling, form-mode and URL-mode elicitation."""
RELAYED = frozenset({"sampling/createMessage", "elicitation/create"})

MAX_ASKS_PER_CALL = 16
"""Questions one call may have relayed; past them each is refused at once."""
OFFER_TTL_S = 30.0
"""An offer outlives its stream's last refresh by this much (a gateway that died with it)."""
OFFER_REFRESH_S = 10.0
OFFER_CHECK_S = 1.0
"""How often a waiting question checks that the stream it went to is still open."""
POLL_FIRST_S = 0.02
POLL_MAX_S = 0.25
DEADLINE_GRACE_S = 1.0
"""A question unanswered at the call's deadline waits this much longer, so that the call ends
as the timeout it is (its connector's deadline) rather than as the agent's error (the agent
answering its tool call with the refusal) that counts against the agent's health."""
KEPT_S = 60.0
"""How long a question's records outlive the call's deadline."""
ASK_ID_PREFIX = "reach-ask-"
GONE = '{"gone":true}'
"""Claimed where a question's answer goes once its call gave it up: a late answer is refused
(nobody waits for it), and one that came just before is still taken."""

METHOD_NOT_FOUND = -32601
INTERNAL_ERROR = -32603


def digest(caller: str) -> str:
    return hashlib.sha256(caller.encode()).hexdigest()[:32]


def offer_key(request_id: str) -> str:
    return f"mcp-ask-offer:{request_id}"


def index_key(request_id: str) -> str:
    return f"mcp-asks:{request_id}"


def question_key(request_id: str, attempt: int, n: int) -> str:
    return f"mcp-ask:{request_id}:{attempt}:{n}"


def answer_key(request_id: str, attempt: int, n: int) -> str:
    return f"mcp-answer:{request_id}:{attempt}:{n}"


def ask_id_key(token: str) -> str:
    return f"mcp-ask-id:{token}"


def needed(method: str, params: Any) -> str | None:
    """The capability a question needs its client to have declared (None: not relayed)."""
    if method == "sampling/createMessage":
        return SAMPLING
    if method == "elicitation/create":
        mode = params.get("mode") if isinstance(params, dict) else None
        return URL if mode == "url" else FORM
    return None


def declared(capabilities: Any) -> str:
    """What a client's `initialize` capabilities say it answers: `SAMPLING` for `sampling`;
    for `elicitation`, `FORM` when it names no mode or names `form` (an empty object is form
    mode), `URL` when it names `url`."""
    if not isinstance(capabilities, dict):
        return ""
    caps = SAMPLING if isinstance(capabilities.get("sampling"), dict) else ""
    elicitation = capabilities.get("elicitation")
    if isinstance(elicitation, dict):
        modes = {k for k in ("form", "url") if isinstance(elicitation.get(k), dict)}
        caps += FORM if not modes or "form" in modes else ""
        caps += URL if "url" in modes else ""
    return caps


REFUSED = "Agent-Reach did not relay"  # how a refusal's words begin (connectors tell it apart)
UNANSWERED = "Agent-Reach relayed"  # how a given-up question's words begin


def refusal(method: str, why: str, code: int = METHOD_NOT_FOUND) -> dict[str, Any]:
    """The JSON-RPC error (as a response's tail) that answers a question not relayed."""
    message = (
        f"{REFUSED} {method[:80]!r} to its caller: {why}. It has no model to sample and no "
        "user to ask of its own"
    )
    return {"error": {"code": code, "message": message}}


def unanswered(method: str, why: str) -> dict[str, Any]:
    """The JSON-RPC error that answers a question relayed to its caller and given up."""
    message = f"{UNANSWERED} {method[:80]!r} to its caller, and no answer came: {why}"
    return {"error": {"code": INTERNAL_ERROR, "message": message}}


def decode(raw: str | None) -> dict[str, Any] | None:
    if raw is None:
        return None
    with contextlib.suppress(ValueError, RecursionError):
        value = json.loads(raw)
        return value if isinstance(value, dict) else None
    return None


class Questions:
    """One call's questions, asked by its connector (`ask`), ended with the call (`close`)."""

    def __init__(
        self, state: PolicyState, request_id: str, caller: str, attempt: int, until_s: float
    ) -> None:
        self.state = state
        self.request_id = request_id
        self.caller = digest(caller)
        self.attempt = attempt
        self.until_s = until_s  # the call's deadline (epoch seconds)
        self.asked = 0  # questions admitted (the call's bound)
        self.written = 0  # questions numbered and stored, in that order
        self._ended = asyncio.Event()
        # Questions asked at once are numbered and written one after another: question n is
        # stored before the index says n, and the index never goes back, or the front, which
        # relays up to the index, skips a question for good.
        self._writing = asyncio.Lock()

    def close(self) -> None:
        self._ended.set()

    async def ask(self, method: str, params: dict[str, Any], limit: int) -> dict[str, Any]:
        """The answer to relay to the agent, as a JSON-RPC response's tail (`result` or
        `error`): the caller's client's, or a refusal (at once when it cannot be relayed)."""
        if self._ended.is_set():
            return refusal(method, "the call has ended")
        if self.asked >= MAX_ASKS_PER_CALL:
            return refusal(method, f"one call may ask at most {MAX_ASKS_PER_CALL} questions")
        try:
            held = await self.state.peek(offer_key(self.request_id))
        except ReachError as exc:
            return refusal(method, f"the shared state could not say who may answer: {exc.message}")
        offer = decode(held)
        if offer is None:
            why = (
                "no client that can answer waits on this call (only a client of Reach's MCP "
                "front that declared sampling or elicitation at initialize is asked, on the "
                "call's open response stream, and only in a session: 2025-11-25 or "
                "2025-06-18; a 2026-07-28 call has no channel for questions)"
            )
            return refusal(method, why)
        if offer.get("caller") != self.caller:
            return refusal(method, "the stream open for this request is another caller's")
        need = needed(method, params)
        if need is None or need not in str(offer.get("caps", "")):
            return refusal(method, "the caller's client did not declare that capability")
        question = json.dumps(
            {
                "method": method,
                "params": params,
                "stream": offer.get("stream"),
                "until_s": self.until_s,
                "limit": limit,
            },
            separators=(",", ":"),
            ensure_ascii=False,
        )
        if len(question.encode()) > limit:
            return refusal(method, f"the question is larger than {limit} bytes")
        self.asked += 1
        ttl = max(self.until_s - time.time(), 0.0) + KEPT_S
        try:
            async with self._writing:
                self.written = n = self.written + 1
                await self.state.put(question_key(self.request_id, self.attempt, n), question, ttl)
                await self.state.put(index_key(self.request_id), f"{self.attempt}:{n}", ttl)
            return await self._answer(method, n, held or "")
        except ReachError as exc:
            return refusal(method, f"the shared state failed: {exc.message}", INTERNAL_ERROR)

    async def _answer(self, method: str, n: int, offered: str) -> dict[str, Any]:
        loop = asyncio.get_running_loop()
        key = answer_key(self.request_id, self.attempt, n)
        wait = POLL_FIRST_S
        check_at = loop.time() + OFFER_CHECK_S
        while True:
            answer = decode(await self.state.peek(key))
            if answer is not None:
                return answer
            left = self.until_s + DEADLINE_GRACE_S - time.time()
            if left <= 0:
                why = "the call's deadline passed"
                return await self._given_up(key, unanswered(method, why))
            if loop.time() >= check_at:
                check_at = loop.time() + OFFER_CHECK_S
                if await self.state.peek(offer_key(self.request_id)) != offered:
                    why = "the caller's stream closed first"
                    return await self._given_up(key, unanswered(method, why))
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._ended.wait(), min(wait, left))
            if self._ended.is_set():
                why = "the call ended first"
                return await self._given_up(key, unanswered(method, why))
            wait = min(wait * 2, POLL_MAX_S)

    async def _given_up(self, key: str, why: dict[str, Any]) -> dict[str, Any]:
        """`why`, once the question's answer is claimed as `GONE` (a later one is refused),
        unless the answer came just before: then it is the answer."""
        ttl = max(self.until_s - time.time(), 0.0) + KEPT_S
        try:
            held = await self.state.claim(key, GONE, ttl)
        except ReachError:
            return why
        answer = decode(held) if held != GONE else None
        return answer if answer is not None else why


# The questions of the call running in this context (set by the activity around the
# connector's invoke, beside the progress sink; None: nobody to relay to).
QUESTIONS: ContextVar[Questions | None] = ContextVar("reach_questions", default=None)
