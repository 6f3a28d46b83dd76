"""The door: every invoke, from every front, passes these steps in this order.

    identify   who calls, in which trace, with which key     steps/identify.py   401 403 422
    admit      room for its body among those in flight       steps/admit.py      503
    accept     the body as the standard request              steps/accept.py     413 422
    rules      may this caller call this operation (R19)     steps/rules.py      403
    callback   the callback URL is not request forgery       steps/callback.py   422
    known      a registered capability, or a repeat          steps/known.py      404
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

import time

from gateway_api.engine import Engine
from gateway_api.front import Body, Front
from gateway_api.live import Live
from gateway_api.steps import rules
from gateway_api.steps.accept import accept
from gateway_api.steps.account import Ledger
from gateway_api.steps.admit import admitted
from gateway_api.steps.callback import vet_callback
from gateway_api.steps.identify import CALLER, Identity, Metadata, identify
from gateway_api.steps.known import Capabilities
from gateway_api.steps.limits import Limiter
from gateway_api.steps.plan import plan
from gateway_api.steps.route import FirstRoute
from gateway_api.steps.start import invoke_input, start
from gateway_api.steps.wait import Verdicts
from reach.errors import ReachError
from reach.messages import InvokeRequest, InvokeResponse
from reach.security.guard import Guard
from reach.telemetry.logs import current_request_id
from reach.telemetry.metrics import ReachMetrics


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

    async def invoke(self, metadata: Metadata, body: Body, front: Front) -> InvokeResponse:
        """One invoke through the door; a refusal is raised as a `ReachError` (or Temporal's
        `RPCError`, which `gateway_api.errors.reach_error_of_rpc` names)."""
        identity = self._identify(metadata)
        async with admitted(self.live.settings, metadata, body) as room:
            request, payload_bytes = accept(await room.read(), self.live.limits, identity)
            assert request.request_id is not None
            await front.named(request.request_id, identity.caller)  # envelopes name it now
            on_logs = current_request_id.set(request.request_id)
            ledger = Ledger(request, identity.caller, self.guard, self.metrics, self.capabilities)
            try:
                response = await self._pass(request, payload_bytes, identity, ledger)
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
            if self.guard is not None:  # who tried, and why not (a forged caller, no token)
                self.guard.audit.record(
                    "refused",
                    claimed_caller=metadata.get(CALLER),
                    status=exc.http_status,
                    error_type=exc.type,
                    reason=exc.message,
                )
            raise

    async def _pass(
        self, request: InvokeRequest, payload_bytes: int, identity: Identity, ledger: Ledger
    ) -> InvokeResponse:
        entered = time.perf_counter()
        settings, caller = self.live.settings, identity.caller
        ledger.decision = decision = rules.decide(self.guard, caller, request)
        if request.callback:
            await vet_callback(self.live.address_guard(), str(request.callback))
        await self.capabilities.check(request, self.engine)
        call = plan(settings, request)
        now_ms = int(time.time() * 1000)
        await self.limiter.by_rule(request, caller, decision)
        await self.limiter.by_capability(settings, request, caller, call, now_ms)
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
                return InvokeResponse(request_id=inp.request_id, status="accepted")
            return await self.verdicts.verdict(run, wait, now_ms)
        finally:
            self.verdicts.done(wait)
