"""The door: every invoke, from every front, passes these steps in this order.

    identify   who calls, in which trace, with which key     steps/identify.py   401 403 422
    admit      room for its body among those in flight,      steps/admit.py      503
               and within its caller's share of that room
    accept     the body as the standard request              steps/accept.py     413 422
    rules      may this caller call this operation (R19)     steps/rules.py      403
    callback   the callback URL is not request forgery       steps/callback.py   422
    known      a registered capability, or a repeat          steps/known.py      404
    context    the conversation it continues is the caller's steps/conversation.py 404 422
    plan       timeout, retries, idempotency, mode           steps/plan.py
    limits     the rule's and the capability's rate limits   steps/limits.py     429 (or queue)
    route      attempt 1's instance, from the local view     steps/route.py
    start      the durable workflow keyed by the RequestID   steps/start.py      409 503
    wait       a synchronous request's verdict               steps/wait.py       (200 502 504)
    account    one audit record and the metrics              steps/account.py

The rules come before anything is looked up, so a denied caller learns nothing of what
exists. A front (`gateway_api.front`) only translates its wire format into the metadata and
body read here, and the envelope back; it adds no policy of its own.
"""

from __future__ import annotations

import asyncio
import logging
import time

from temporalio.service import RPCError

from gateway_api.engine import Engine
from gateway_api.front import Body, Front
from gateway_api.live import Live
from gateway_api.steps import rules
from gateway_api.steps.accept import accept
from gateway_api.steps.account import Ledger
from gateway_api.steps.admit import admitted
from gateway_api.steps.callback import vet_callback
from gateway_api.steps.conversation import continued
from gateway_api.steps.identify import CALLER, Identity, Metadata, identify
from gateway_api.steps.known import Capabilities
from gateway_api.steps.limits import Limiter
from gateway_api.steps.plan import plan
from gateway_api.steps.route import FirstRoute
from gateway_api.steps.start import invoke_input, start
from gateway_api.steps.wait import SYNC_GRACE_S, Verdicts
from reach.errors import ReachError
from reach.messages import InvokeRequest, InvokeResponse
from reach.security.guard import Guard
from reach.telemetry.logs import current_request_id
from reach.telemetry.metrics import ReachMetrics

log = logging.getLogger("reach.gateway")


class Door:
    def __init__(
        self,
        live: Live,
        engine: Engine,
        capabilities: Capabilities,
        limiter: Limiter,
        route: FirstRoute,
        verdicts: Verdicts,
        guard: Guard | None = None,
        metrics: ReachMetrics | None = None,
    ) -> None:
        self.live = live
        self.engine = engine
        self.capabilities = capabilities
        self.limiter = limiter
        self.route = route
        self.verdicts = verdicts
        self.guard = guard
        self.metrics = metrics
        self._accounting: set[asyncio.Task[None]] = set()  # outcomes no caller waits for

    async def invoke(self, metadata: Metadata, body: Body, front: Front) -> InvokeResponse:
        """One invoke through the door; a refusal is raised as a `ReachError` (or Temporal's
        `RPCError`, which `gateway_api.errors.reach_error_of_rpc` names)."""
        identity = self._identify(metadata)
        room = admitted(self.live.settings, metadata, body, identity.caller)
        try:
            readable = await room.__aenter__()
        except ReachError as exc:
            self._refused(metadata, exc, identity.caller)
            raise
        try:
            try:
                request, payload_bytes = accept(await readable.read(), self.live.limits, identity)
            except ReachError as exc:
                self._refused(metadata, exc, identity.caller)
                raise
            return await self._through(request, payload_bytes, identity, front)
        finally:
            await room.__aexit__(None, None, None)

    async def _through(
        self, request: InvokeRequest, payload_bytes: int, identity: Identity, front: Front
    ) -> InvokeResponse:
        assert request.request_id is not None
        await front.named(request.request_id, identity.caller)  # envelopes name it from here
        on_logs = current_request_id.set(request.request_id)
        ledger = Ledger(request, identity.caller, self.guard, self.metrics, self.capabilities)
        try:
            response = await self._pass(request, payload_bytes, identity, ledger, front)
        except asyncio.CancelledError:
            # The caller stopped waiting (a gRPC deadline, a shutdown): the request carries
            # on durably, and is accounted when its outcome is known.
            if not request.callback:
                self._account_later(request, ledger)
            raise
        except BaseException as exc:
            await ledger.refused(exc)
            raise
        finally:
            current_request_id.reset(on_logs)
        await ledger.answered(response)
        return response

    def _identify(self, metadata: Metadata) -> Identity:
        try:
            return identify(metadata, self.guard.auth if self.guard else None)
        except ReachError as exc:
            self._refused(metadata, exc, None)  # a forged caller, no valid token
            raise

    def _refused(self, metadata: Metadata, exc: ReachError, caller: str | None) -> None:
        """A refusal before the request has its RequestID (identity, room, the body)."""
        if self.guard is not None:
            self.guard.audit.record(
                "refused",
                caller=caller,
                claimed_caller=metadata.get(CALLER) if caller is None else None,
                status=exc.http_status,
                error_type=exc.type,
                reason=exc.message,
            )

    def _account_later(self, request: InvokeRequest, ledger: Ledger) -> None:
        task = asyncio.create_task(self._account_outcome(request, ledger))
        self._accounting.add(task)
        task.add_done_callback(self._accounting.discard)

    async def _account_outcome(self, request: InvokeRequest, ledger: Ledger) -> None:
        assert request.request_id is not None
        settings = self.live.settings.policy
        wait_s = (request.timeout_ms or settings.default_timeout_ms) / 1000 + SYNC_GRACE_S
        try:
            async with asyncio.timeout(wait_s):
                response = await self.engine.outcome(self.engine.handle(request.request_id))
        except (RPCError, TimeoutError) as exc:  # not started, or no verdict by its deadline
            log.info("request %s: no outcome to account (%s)", request.request_id, exc)
            return
        await ledger.answered(response)

    async def _pass(
        self,
        request: InvokeRequest,
        payload_bytes: int,
        identity: Identity,
        ledger: Ledger,
        front: Front,
    ) -> InvokeResponse:
        entered = time.perf_counter()
        settings, caller = self.live.settings, identity.caller
        ledger.decision = decision = rules.decide(self.guard, caller, request)
        if request.callback:
            await vet_callback(self.live.address_guard(), str(request.callback))
        await self.capabilities.check(request, self.engine)
        if request.context_id is not None:
            await continued(self.engine, request, caller)
        call = plan(settings, request)
        now_ms = int(time.time() * 1000)
        await self.limiter.by_rule(request, caller, decision)
        await self.limiter.by_capability(settings, request, caller, call, now_ms)
        await self.route.ready(request, call)
        key = self.route.key(self.live.routing_for(request.target), request)
        endpoint = self.route.pick(request, call, key, payload_bytes, now_ms)
        inp = invoke_input(
            request,
            identity,
            call,
            now_ms=now_ms,
            payload_bytes=payload_bytes,
            hash_key=key,
            endpoint=endpoint,
            callback_plan=self.live.callback_plan,
        )
        wait = None if request.callback else self.verdicts.expect(inp.request_id)
        try:
            run = await start(self.engine, inp)
            if run.started and self.metrics is not None:
                self.metrics.accepted(request.target, time.perf_counter() - entered)
            if not run.started and endpoint is not None:
                self.route.unused(inp.request_id)
            if request.callback:
                if not run.started:  # a repeat: of a request that closed without a result?
                    closed = await self.engine.ended_without_result(run.handle)
                    if closed is not None:
                        return closed
                return InvokeResponse(request_id=inp.request_id, status="accepted")
            started = getattr(front, "started", None)  # a front that answers before the verdict
            # It may let the request go before its verdict (then answered `accepted`, and
            # nothing of it is held here: steps/wait.py).
            let_go = await started(inp.request_id) if started is not None else None
            return await self.verdicts.verdict(run, wait, now_ms, let_go)
        finally:
            self.verdicts.done(wait)
