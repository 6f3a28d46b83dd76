"""The invoke's side effects. Each failure leaves here as an `ApplicationError` whose `type` is
the Reach error type and whose details say whether it is retryable; the workflow, through
`reach.policy`, decides what happens next, so these are never retried by Temporal itself
(except the callback POST, which is always safe to repeat: the receiver dedupes on RequestID).
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

import httpx
from temporalio import activity
from temporalio.client import Client, WorkflowFailureError
from temporalio.exceptions import ApplicationError
from temporalio.service import RPCError, RPCStatusCode

from activities import _following as following
from activities._conversations import check_follow_up, keep_owner
from activities._heartbeats import awaited, heartbeating
from activities._progress import Recorder, recording
from activities._sent import NotSent, claim_send, idempotent
from activities.receivers import ReceiverSlots
from activities.telemetry import traced_call
from agent_reach_proto import wire
from connectors import ConnectorSet, GuardedTransport, refusal_in
from reach.config import SECRET_KEY_NAMES, SecuritySettings
from reach.errors import (
    AgentError,
    DeadlineExceeded,
    InternalError,
    ReachError,
    TransportError,
    http_status_for,
)
from reach.invocation import (
    ACTIVITY_CALL,
    ACTIVITY_CANCEL_TASK,
    ACTIVITY_CLAIM_KEY,
    ACTIVITY_DELIVER_CALLBACK,
    ACTIVITY_FOLLOW,
    ACTIVITY_FOLLOW_TASK,
    ACTIVITY_PINNED,
    ACTIVITY_PINNED_ATTEMPT,
    ACTIVITY_RELEASE_KEY,
    ACTIVITY_RELEASE_ROUTE,
    ACTIVITY_RESOLVE,
    ACTIVITY_TAKE_TOKEN,
    STALE_ROUTE,
    CallbackInput,
    CallInput,
    ClaimInput,
    ClaimOutcome,
    Endpoint,
    FollowInput,
    FollowTaskInput,
    PinQuery,
    ResolveInput,
    TakeInput,
)
from reach.messages import InvokeResponse, Reply
from reach.outcome import carried
from reach.policy.engine import PolicyEngine
from reach.registry import Registry
from reach.registry.view import RegistryView
from reach.resolve import Resolver, StaleRoute, pinned_instance
from reach.routing import Router
from reach.security.audit import AuditLog
from reach.security.netguard import AddressGuard
from reach.security.redact import safe_url
from reach.security.webhooks import caller_secret, message_id, webhook_headers
from reach.telemetry import tracing
from reach.telemetry.metrics import ReachMetrics

log = logging.getLogger("reach.activities")

# A callback POST heartbeats this often, so a worker that dies mid-POST is noticed within the
# delivery's heartbeat timeout (workflows.callback), not its whole attempt timeout.
CALLBACK_HEARTBEAT_EVERY_S = 1.0


def to_application_error(
    err: ReachError, *, not_sent: bool = False, claimed: bool = False, pinned_before: bool = False
) -> ApplicationError:
    """`not_sent`: refused before the call was sent (`NotSent`), so the workflow never
    re-delivers it (it would be refused again). `claimed`: this run made the attempt's send-once
    claim itself, so no earlier run of it sent it (the workflow need not suspect a lost one).
    `pinned_before`: another run had pinned the door's route first (`Resolver.check_first`)."""
    details: dict[str, Any] = {"retryable": err.retryable}
    if not_sent:
        details["not_sent"] = True
    if claimed:
        details["claimed"] = True
    if pinned_before:
        details["pinned_before"] = True
    if err.retry_after_s is not None:
        details["retry_after_s"] = err.retry_after_s
    if err.outcome_unknown:
        details["outcome_unknown"] = True
    if isinstance(err, AgentError) and err.fault is not None:
        details["agent"] = err.fault.model_dump(exclude_none=True)
    return ApplicationError(err.message, details, type=err.type, non_retryable=True)


def _internal(what: str, exc: Exception) -> ApplicationError:
    """A failure that is no Reach error is a bug here: typed, logged, never retried."""
    log.exception("%s failed unexpectedly", what)
    return to_application_error(InternalError(f"{what} failed inside Reach: {exc!r}"))


class ReachActivities:
    def __init__(
        self,
        registry: Registry,
        router: Router,
        connectors: ConnectorSet,
        policy: PolicyEngine,
        http: httpx.AsyncClient | None = None,
        view: RegistryView | None = None,
        security: SecuritySettings | None = None,
        metrics: ReachMetrics | None = None,
    ) -> None:
        self.registry = registry
        self.metrics = metrics
        # A view that is not started (unit tests) reads the store on every resolve.
        self.view = view or RegistryView(registry)
        self.router = router
        self.connectors = connectors
        self.policy = policy
        self.resolver = Resolver(registry, self.view, policy, router)
        self.client: Client | None = None  # set by the worker: following another request
        self._recording: set[asyncio.Task[None]] = set()
        # Callbacks go only where the address guard allows (global unicast, else
        # security.allow_networks), to the address it checked, and follow no redirect.
        security = security if security is not None else SecuritySettings()
        self._http = http or httpx.AsyncClient(
            transport=GuardedTransport(AddressGuard(security.allow_networks)),
            trust_env=False,
            follow_redirects=False,
        )
        key = security.webhook_key
        self._webhook_key = key.get_secret_value() if key is not None else None
        self._secrets: dict[str, str] = {}  # caller -> its webhook secret
        self._receivers = ReceiverSlots()  # at most so many POSTs to one receiver at once
        # The audit trail (the gateway's guard's, or a worker's own): a callback request's
        # outcome record. None: not recorded here.
        self.audit: AuditLog | None = None

    async def aclose(self) -> None:
        await self._http.aclose()

    @activity.defn(name=ACTIVITY_RESOLVE)
    async def resolve(self, inp: ResolveInput) -> Endpoint:
        try:
            local = _runs_local()
            work = self.resolver.resolve(inp, reserve=bool(inp.attempt) and local)
            # Queue mode: heartbeats, so a worker lost mid-resolve is noticed within the
            # heartbeat timeout as a lost inline one is within the workflow task's.
            return await (work if local else heartbeating(work))
        except ReachError as err:
            raise to_application_error(err) from err
        except Exception as exc:
            raise _internal("resolve", exc) from exc

    @activity.defn(name=ACTIVITY_RELEASE_ROUTE)
    async def release_route(self, request_id: str) -> bool:
        """Attempt 1 was routed at the door but its call never began (the deadline came
        first, the idempotency key answered): free the in-flight slot the door counted."""
        self.resolver.release(request_id)
        return True

    @activity.defn(name=ACTIVITY_PINNED)
    async def pinned(self, request_id: str) -> str:
        """The instance attempt 1 of `request_id` was pinned to ("" when none is recorded):
        a lost workflow task's call may have gone there."""
        return await self.pinned_attempt(PinQuery(request_id=request_id, attempt=1))

    @activity.defn(name=ACTIVITY_PINNED_ATTEMPT)
    async def pinned_attempt(self, query: PinQuery) -> str:
        """The instance attempt `query.attempt` was pinned to ("" when none is recorded)."""
        try:
            pinned = await pinned_instance(self.policy, query.request_id, query.attempt, query.made)
            return pinned or ""
        except ReachError as err:
            raise to_application_error(err) from err

    @activity.defn(name=ACTIVITY_CLAIM_KEY)
    async def claim_key(self, inp: ClaimInput) -> ClaimOutcome:
        """Make this request the owner of its idempotency key, or name the one that is."""
        try:
            mine = f"{inp.request_id} {inp.fingerprint}"
            held = await self.policy.state.claim(inp.key, mine, inp.ttl_s)
        except ReachError as err:
            raise to_application_error(err) from err
        owner, _, fingerprint = held.partition(" ")
        return ClaimOutcome(owner=owner, same_request=fingerprint == inp.fingerprint)

    @activity.defn(name=ACTIVITY_RELEASE_KEY)
    async def release_key(self, inp: ClaimInput) -> bool:
        """Free a key whose request ended before any agent was called, so the caller can retry
        with it (nothing was executed, so there is no result to keep)."""
        try:
            return await self.policy.state.release(inp.key, f"{inp.request_id} {inp.fingerprint}")
        except ReachError as err:
            raise to_application_error(err) from err

    @activity.defn(name=ACTIVITY_FOLLOW)
    async def follow(self, inp: FollowInput) -> InvokeResponse:
        """The result of the request that owns the idempotency key (waits while it runs)."""
        if self.client is None:
            raise to_application_error(InternalError("no Temporal client to follow a request"))
        handle = self.client.get_workflow_handle(inp.request_id, result_type=InvokeResponse)
        try:
            first: InvokeResponse = await handle.result()
            return first
        except WorkflowFailureError as exc:
            # Its error or timeout fails its workflow, the envelope inside (reach.outcome).
            cause = exc.cause
            if isinstance(cause, ApplicationError):
                carries = carried(cause.type, cause.details)
                if carries is not None:
                    return carries
            raise to_application_error(
                InternalError(f"request {inp.request_id} ended without a result: {exc.cause}")
            ) from exc
        except RPCError as exc:
            if exc.status != RPCStatusCode.NOT_FOUND:
                raise
            # Kept shorter by Temporal than the key by Reach (idempotency_retention_s).
            raise to_application_error(
                InternalError(
                    f"request {inp.request_id}, which first used this idempotency_key, is no "
                    "longer kept by Temporal; keep idempotency_retention_s within its retention"
                )
            ) from exc

    @activity.defn(name=ACTIVITY_TAKE_TOKEN)
    async def take_token(self, inp: TakeInput) -> float:
        """0 when a token was taken from every bucket, else the seconds until one could be."""
        try:
            return await self.policy.take(inp.buckets)
        except ReachError as err:
            raise to_application_error(err) from err

    @activity.defn(name=ACTIVITY_CALL)
    async def call(self, inp: CallInput) -> Reply:
        endpoint, header = inp.endpoint, inp.message.header
        inflight = self.router.inflight.begin(
            endpoint.capability, endpoint.instance_id, f"{header.request_id}:{header.attempt}"
        )
        failed = False  # the agent's fault: its latency is then counted as high (routing)
        called: float | None = None  # when the connector call began (metrics)
        outcome = "cancelled"
        recorder: Recorder | None = None
        claimed = False  # this run claimed the attempt's send: no earlier run sent it
        before = False  # another run pinned the door's route first: it may have sent it
        try:
            if inp.check_first:
                # A regular activity runs once per scheduling, so only a local one can be a
                # silent re-run of a call already sent; the workflow says whether it is.
                before = await self.resolver.check_first(
                    endpoint,
                    header.request_id,
                    inp.movable,
                    fresh=inp.first_run or not _runs_local(),
                    deadline_ms=header.deadline_ms,
                    token=inp.pin_token,
                )
            connector = self.connectors.get(endpoint.protocol)
            if connector.continues(inp.message):  # a follow-up: only to its own caller
                await check_follow_up(
                    self.policy.state, connector, endpoint.capability, inp.message
                )
            if not connector.deduplicates and not idempotent(self.policy.settings, inp):
                await claim_send(self.policy.state, inp)
                claimed = True
            if self.metrics is not None and header.attempt > 1:
                self.metrics.retry(endpoint.capability)
            called = time.perf_counter()
            if connector.reports_progress:  # its notes go to the request's timeline
                audit = self.audit  # log messages are redacted as its records are
                keys = audit.settings.redact_keys if audit is not None else SECRET_KEY_NAMES
                recorder = Recorder(self.policy.state, inp, keys)
            with recording(recorder):
                if tracing.tracer is not None:  # a client span: the agent's span is its child
                    reply = await traced_call(tracing.tracer, connector, inp, awaited)
                else:
                    work = connector.invoke(endpoint, inp.message, inp.timeout_ms / 1000)
                    if activity.info().is_local:
                        reply = await work
                    else:
                        reply = await heartbeating(work)
            outcome = "success"
        except StaleRoute as stale:
            said = {"pinned_before": True} if stale.pinned_before else {}
            raise ApplicationError(
                str(stale), said, type=STALE_ROUTE, non_retryable=True
            ) from stale
        except NotSent as refused:  # not the agent's fault: nothing is recorded against it
            outcome = refused.err.type
            raise to_application_error(refused.err, not_sent=True, pinned_before=before) from None
        except ReachError as err:
            outcome = err.type
            if inp.judge_timeouts or not isinstance(err, DeadlineExceeded):
                failed = counts_as_failure(err)
                await self._record(inp.endpoint, ok=not failed)
            raise to_application_error(err, claimed=claimed, pinned_before=before) from err
        except Exception as exc:
            outcome = "internal"
            raise _internal(f"call to {inp.endpoint.instance_id}", exc) from exc
        finally:
            self.router.inflight.end(inflight, failed=failed)
            if recorder is not None:
                await recorder.close()
            if called is not None and self.metrics is not None:
                seconds = time.perf_counter() - called
                self.metrics.agent_call(endpoint.capability, endpoint.protocol, outcome, seconds)
        await self._record(inp.endpoint, ok=True)
        if connector.conversations(reply):
            await keep_owner(
                self.policy.state, connector, endpoint.capability, header.caller, reply
            )
        return reply

    @activity.defn(name=ACTIVITY_FOLLOW_TASK)
    async def follow_task(self, inp: FollowTaskInput) -> Reply:
        """One look at an agent's long work (an A2A task) a call answered with a handle for
        (`activities._following`): the last answer."""
        try:
            connector = self.connectors.get(inp.endpoint.protocol)
            return await following.look(connector, inp, _runs_local())
        except ReachError as err:
            raise to_application_error(err) from err
        except Exception as exc:
            raise _internal(f"following {inp.endpoint.instance_id}'s task", exc) from exc

    @activity.defn(name=ACTIVITY_CANCEL_TASK)
    async def cancel_task(self, inp: FollowTaskInput) -> bool:
        """The request's deadline passed while the agent's work went on: ask it to stop."""
        try:
            connector = self.connectors.get(inp.endpoint.protocol)
            await connector.cancel(inp.endpoint, inp.handle, inp.timeout_ms / 1000)
        except ReachError as err:
            raise to_application_error(err) from err
        except Exception as exc:
            raise _internal(f"canceling {inp.endpoint.instance_id}'s task", exc) from exc
        return True

    async def _record(self, endpoint: Endpoint, ok: bool) -> None:
        """Count the outcome without holding up the answer: a slow store must not turn a
        success into a timeout (the task is kept until it ends)."""
        # Whom routing serves from now: one instance's failures are not the capability's.
        snap = self.view.cached(endpoint.capability)
        routable = snap.ids if snap is not None else frozenset()
        task = asyncio.create_task(
            self.policy.record(
                endpoint.capability, endpoint.instance_id, ok, endpoint.probe, routable
            )
        )
        self._recording.add(task)
        task.add_done_callback(self._recording.discard)

    def _audit_outcome(self, inp: CallbackInput) -> None:
        """A callback request's one audit record (R20), written once its outcome is known:
        the door could only say it was accepted. The first delivery attempt writes it (a
        re-run of that attempt after a crash may write it again: at least once)."""
        assert self.audit is not None
        response = inp.response
        error = response.error
        self.audit.record(
            "invoke",
            request_id=response.request_id,
            caller=inp.caller,
            capability=inp.target,
            operation=inp.operation,
            instance=response.instance_id,
            duration_ms=response.duration_ms,
            status=outcome_status(response),
            outcome=response.status,
            error_type=error.type if error else None,
            outcome_unknown=error.outcome_unknown if error else None,
            attempts=len(response.attempts) if response.attempts else None,
            callback=safe_url(inp.url),
        )

    @activity.defn(name=ACTIVITY_DELIVER_CALLBACK)
    async def deliver_callback(self, inp: CallbackInput) -> int:
        """POST the envelope; return the attempt that was delivered (failures carry theirs).
        It heartbeats while the POST is in flight: a worker that dies mid-POST is noticed by
        the delivery's heartbeat timeout, and another worker sends it again.

        Signed (Standard Webhooks) when `security.webhook_key` is set: the id is the same on
        every attempt, the timestamp is this attempt's, the signature covers the bytes sent."""
        info = activity.info()
        response = inp.response
        if info.attempt == 1 and self.audit is not None:
            self._audit_outcome(inp)
        body = response.model_dump_json(exclude_none=True).encode()
        headers = {
            "Content-Type": "application/json",
            wire.HTTP_REQUEST_ID: response.request_id,
            wire.HTTP_DELIVERY_ATTEMPT: str(info.attempt),
        }
        secret = self._webhook_secret(inp.caller)
        if secret is not None:
            headers |= webhook_headers(secret, message_id(response.request_id), body, time.time())
        timeout = info.start_to_close_timeout
        try:
            r = await heartbeating(
                self._post(inp, body, headers, timeout.total_seconds() if timeout else 10.0),
                CALLBACK_HEARTBEAT_EVERY_S,
            )
        except httpx.HTTPError as exc:
            refused = refusal_in(exc)
            if refused is not None:  # nothing was sent, and never will be: not retried
                raise ApplicationError(
                    f"callback {safe_url(inp.url)}: {refused}",
                    {"attempt": info.attempt},
                    type="callback_rejected",
                    non_retryable=True,
                ) from None
            # `from None`: the message says why; httpx's chained causes and their stack traces
            # would push the failure past Temporal's size limit, which then shows a pending
            # delivery's last error only as "Failure exceeds size limit."
            raise ApplicationError(
                f"callback {safe_url(inp.url)} unreachable: {_without(exc, inp.url)}",
                {"attempt": info.attempt},
                type="transport_error",
            ) from None
        if r.is_success:
            return info.attempt
        # A redirect is never followed, so it would answer the same every time: permanent.
        permanent = 300 <= r.status_code < 500 and r.status_code not in (408, 425, 429)
        raise ApplicationError(
            f"callback {safe_url(inp.url)} answered HTTP {r.status_code}",
            {"attempt": info.attempt},
            type="callback_rejected" if permanent else "callback_failed",
            non_retryable=permanent,
        )

    async def _post(
        self, inp: CallbackInput, body: bytes, headers: dict[str, str], timeout_s: float
    ) -> httpx.Response:
        """One callback POST, streamed and never read: only the status matters, whatever the
        receiver sends; not sent while its receiver or caller holds many (activities.receivers)."""
        with self._receivers.taken(inp.url, inp.caller):
            async with self._http.stream(
                "POST", inp.url, content=body, headers=headers, timeout=timeout_s
            ) as r:
                return r

    def _webhook_secret(self, caller: str | None) -> str | None:
        """The caller's signing secret, when callbacks are signed (None: send unsigned)."""
        if self._webhook_key is None:
            return None
        if caller is None:  # an input recorded before callbacks named their caller
            log.warning("callback of an unknown caller sent unsigned")
            return None
        secret = self._secrets.get(caller)
        if secret is None:
            if len(self._secrets) >= 10_000:
                self._secrets.clear()
            secret = self._secrets[caller] = caller_secret(self._webhook_key, caller)
        return secret


def _without(exc: Exception, url: str) -> str:
    """The exception as text, without the URL's credentials should its message quote it."""
    return f"{type(exc).__name__}: {str(exc).replace(url, safe_url(url))}"


def _runs_local() -> bool:
    try:
        return activity.info().is_local
    except RuntimeError:  # called outside an activity (tests)
        return True


def counts_as_failure(err: ReachError) -> bool:
    """What breakers and outlier ejection count against an agent: it could not be reached,
    did not answer in time, or failed on its side (5xx, UNAVAILABLE). A 4xx is the request's
    fault, not the agent's."""
    if isinstance(err, TransportError | DeadlineExceeded):
        return True
    return isinstance(err, AgentError) and err.retryable


def outcome_status(response: InvokeResponse) -> int:
    """The HTTP status an envelope means (as the gateway answers it)."""
    if response.status == "timeout":
        return 504
    if response.status == "error" and response.error is not None:
        return http_status_for(response.error.type)
    return 200
