"""`POST /reach/a2a/push/{request_id}`: an A2A agent's push notification about the task a
request follows (docs/protocols/a2a.md, "Push notifications").

Thin on purpose: it is not a caller's invoke, so no token, rule or limit of a caller applies;
the app's own middleware does (the Host check, the body limit), and the request's own push
token (`reach.security.a2a_push`, sent as `X-A2A-Notification-Token`) is checked in constant
time before anything else is read. A notification is then only a nudge: the request's
workflow is signalled to look at the task now (`SIGNAL_A2A_PUSH`); what the body says is not
read, the look reads the task from the agent. So a forged or replayed notification with the
right token costs one `GetTask`, and one that never comes costs one fallback wait.
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
from collections.abc import Awaitable, Callable

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from temporalio.service import RPCError, RPCStatusCode

from gateway_api.errors import error_response, reach_error_of_rpc
from gateway_api.gateway import Gateway
from reach.errors import PayloadTooLarge, Unauthorized, UnknownRequest
from reach.messages import REQUEST_ID_PATTERN
from reach.security.a2a_push import SIGNAL_A2A_PUSH, TOKEN_HEADER, push_token_ok

log = logging.getLogger("reach.gateway")

MAX_PUSH_BYTES = 1024 * 1024
"""A notification's body, which is not read, may declare at most this many bytes."""
_REQUEST_ID = re.compile(REQUEST_ID_PATTERN)
PUSH_GAP_S = 1.0
"""A gateway signals one request at most once in this long: a flood of notifications with the
request's token (the agent holds it, and it never changes) was a signal and a GetTask look
each, ~8 history events a push, and each look grew the fallback poll's wait toward 5 min."""
PUSH_GAP_MAX_S = 10.0
PUSH_STEADY_AFTER = 10
"""Past this many signals of one request without a quiet PUSH_QUIET_S, its gap doubles up to
PUSH_GAP_MAX_S: each signal and its look are history events (~4-8), so an agent pushing every
second for hours (or anyone holding the token) filled the workflow's history (51,200 events on
the dev server) in ~1.5 h; paced so, it takes a day or more, and the end of a task is still
noticed within PUSH_GAP_MAX_S of its last push."""
PUSH_QUIET_S = 60.0
_PACED_MAX = 10_000


class PushPacer:
    """Which requests were signalled in the last PUSH_GAP_S, and the one trailing signal each
    of them has pending for the pushes that came since (so the last push is never lost)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._last: dict[str, float] = {}
        self._burst: dict[str, int] = {}  # signals since the request's last quiet
        self._pending: dict[str, asyncio.Task[None]] = {}

    def gap(self, rid: str) -> float:
        over = self._burst.get(rid, 0) - PUSH_STEADY_AFTER
        return PUSH_GAP_S if over < 0 else min(PUSH_GAP_S * 2.0 ** (over + 1), PUSH_GAP_MAX_S)

    def _signalled(self, rid: str, at: float) -> None:
        last = self._last.get(rid)
        quiet = last is None or at - last >= PUSH_QUIET_S
        self._burst[rid] = 1 if quiet else self._burst.get(rid, 0) + 1
        self._last[rid] = at

    def now(self, rid: str, signal: Callable[[], Awaitable[None]]) -> bool:
        """True: signal it now. False: folded into a pending signal (started if none is)."""
        at = self._clock()
        last = self._last.get(rid)
        if rid in self._pending:
            # Its trailing signal is due (it may not have woken yet, the gap just past): this
            # push is that signal's, not one more (signals came in pairs ms apart).
            return False
        gap = self.gap(rid)
        if last is None or at - last >= gap:
            if len(self._last) >= _PACED_MAX:
                age = PUSH_QUIET_S if len(self._last) < 2 * _PACED_MAX else PUSH_GAP_S
                self._last = {k: v for k, v in self._last.items() if at - v < age}
                self._burst = {k: n for k, n in self._burst.items() if k in self._last}
            self._signalled(rid, at)
            return True
        if len(self._pending) < _PACED_MAX:
            self._pending[rid] = asyncio.create_task(self._later(rid, last + gap, signal))
        return False

    async def _later(self, rid: str, when: float, signal: Callable[[], Awaitable[None]]) -> None:
        try:
            await asyncio.sleep(max(0.0, when - self._clock()))
            self._signalled(rid, self._clock())
            await signal()
        except RPCError as exc:  # ended meanwhile, or the server away: the poll covers it
            log.info("A2A push for %s (coalesced): not signalled (%s)", rid, exc.message)
        finally:
            self._pending.pop(rid, None)


async def _signal(gateway: Gateway, rid: str) -> None:
    handle = gateway.client.get_workflow_handle(rid)
    await handle.signal(SIGNAL_A2A_PUSH, rpc_timeout=gateway.rpc_timeout)


async def pushed(request: Request) -> Response:
    gateway: Gateway = request.app.state.gateway
    rid = request.path_params["request_id"]
    key = gateway.settings.security.webhook_key
    if key is None or not _REQUEST_ID.fullmatch(rid):
        # Without a webhook key no push config was ever handed out: there is nothing here.
        return error_response(
            None,
            UnknownRequest(
                "no push notifications are taken here (security.webhook_key is not set)"
                if key is None
                else f"{rid[:140]!r} is not a RequestID"
            ),
        )
    token = request.headers.get(TOKEN_HEADER, "")
    if not token or not push_token_ok(key.get_secret_value(), rid, token[:256]):
        return error_response(
            rid,
            Unauthorized(
                f"a push notification for {rid} needs that request's token in {TOKEN_HEADER} "
                "(the one its push config was sent with)"
            ),
        )
    declared = request.headers.get("content-length", "0")
    if not declared.isdigit() or int(declared) > MAX_PUSH_BYTES:
        return error_response(
            rid, PayloadTooLarge(f"a push notification of at most {MAX_PUSH_BYTES} bytes")
        )
    pacer: PushPacer | None = getattr(request.app.state, "a2a_push_pacer", None)
    if pacer is None:
        pacer = request.app.state.a2a_push_pacer = PushPacer()
    if not pacer.now(rid, lambda: _signal(gateway, rid)):
        # Another push for it was signalled less than PUSH_GAP_S ago: this one is folded into
        # the signal sent at the gap's end (the look then reads whatever the agent said last).
        return JSONResponse({"request_id": rid, "running": True}, status_code=202)
    try:
        await _signal(gateway, rid)
    except RPCError as exc:
        if exc.status == RPCStatusCode.NOT_FOUND:
            # Ended already (the last look found the end first), or never started here.
            log.info("A2A push for %s: no running request (%s)", rid, exc.message)
            return JSONResponse({"request_id": rid, "running": False}, status_code=200)
        return error_response(rid, reach_error_of_rpc(exc))
    return JSONResponse({"request_id": rid, "running": True}, status_code=202)
