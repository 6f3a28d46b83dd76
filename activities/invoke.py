"""The invoke's side effects. Each failure leaves here as an `ApplicationError` whose `type` is
the Reach error type and whose details say whether it is retryable; the workflow, through
`reach.policy`, decides what happens next, so these are never retried by Temporal itself
(except the callback POST, which is always safe to repeat: the receiver dedupes on RequestID).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Coroutine
from typing import Any

import httpx
from temporalio import activity
from temporalio.exceptions import ApplicationError

from connectors import ConnectorSet
from reach.errors import (
    AgentError,
    InternalError,
    NoInstance,
    PayloadTooLarge,
    ReachError,
    UnknownCapability,
)
from reach.invocation import (
    ACTIVITY_CALL,
    ACTIVITY_DELIVER_CALLBACK,
    ACTIVITY_RESOLVE,
    CallbackInput,
    CallInput,
    Endpoint,
    ResolveInput,
)
from reach.messages import Reply
from reach.registry import Registry
from reach.routing import Router

log = logging.getLogger("reach.activities")

HEARTBEAT_EVERY_S = 2.0


def to_application_error(err: ReachError) -> ApplicationError:
    details: dict[str, Any] = {"retryable": err.retryable}
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
        http: httpx.AsyncClient | None = None,
    ) -> None:
        self.registry = registry
        self.router = router
        self.connectors = connectors
        self._http = http or httpx.AsyncClient(trust_env=False)

    async def aclose(self) -> None:
        await self._http.aclose()

    @activity.defn(name=ACTIVITY_RESOLVE)
    async def resolve(self, inp: ResolveInput) -> Endpoint:
        try:
            return await self._resolve(inp)
        except ReachError as err:
            raise to_application_error(err) from err
        except Exception as exc:
            raise _internal("resolve", exc) from exc

    async def _resolve(self, inp: ResolveInput) -> Endpoint:
        instances = await self.registry.instances(inp.capability)
        if not instances and not await self.registry.known(inp.capability):
            raise UnknownCapability(f"no agent has ever registered capability {inp.capability!r}")
        routable = [i for i in instances if i.routable]
        if not routable:
            raise NoInstance(
                f"capability {inp.capability!r} has no healthy instance "
                f"({len(instances)} registered, all unhealthy)"
                if instances
                else f"capability {inp.capability!r} has no live instance"
            )
        # R8: what one routable instance negotiated, the capability can carry; refused before
        # anything is sent, whichever instance routing would have picked.
        smallest = min(routable, key=lambda i: i.max_message_bytes)
        if inp.payload_bytes > smallest.max_message_bytes:
            raise PayloadTooLarge(
                f"the payload is {inp.payload_bytes} bytes; capability {inp.capability!r} "
                f"takes at most {smallest.max_message_bytes} (max_message_bytes negotiated by "
                f"instance {smallest.instance_id})"
            )
        # A retry goes elsewhere when it can; with one instance left, that one is still tried.
        fresh = [i for i in routable if i.instance_id not in inp.exclude] or routable
        chosen = await self.router.pick(inp.capability, fresh, inp.routing_key)
        log.info(
            "routed request=%s capability=%s instance=%s of %d",
            inp.request_id,
            inp.capability,
            chosen.instance_id,
            len(fresh),
        )
        return Endpoint(
            instance_id=chosen.instance_id,
            capability=chosen.capability,
            protocol=chosen.protocol,
            address=chosen.address,
            max_message_bytes=chosen.max_message_bytes,
        )

    @activity.defn(name=ACTIVITY_CALL)
    async def call(self, inp: CallInput) -> Reply:
        try:
            connector = self.connectors.get(inp.endpoint.protocol)
            work = connector.invoke(inp.endpoint, inp.message, inp.timeout_ms / 1000)
            if activity.info().is_local:
                return await work
            return await _heartbeating(work)
        except ReachError as err:
            raise to_application_error(err) from err
        except Exception as exc:
            raise _internal(f"call to {inp.endpoint.instance_id}", exc) from exc

    @activity.defn(name=ACTIVITY_DELIVER_CALLBACK)
    async def deliver_callback(self, inp: CallbackInput) -> int:
        """POST the envelope; return the attempt that was delivered (failures carry theirs)."""
        info = activity.info()
        response = inp.response
        try:
            # Streamed and never read: only the status matters, whatever the receiver sends.
            async with self._http.stream(
                "POST",
                inp.url,
                content=response.model_dump_json(exclude_none=True),
                headers={
                    "Content-Type": "application/json",
                    "X-Reach-Request-Id": response.request_id,
                    "X-Reach-Delivery-Attempt": str(info.attempt),
                },
                timeout=info.start_to_close_timeout.total_seconds()
                if info.start_to_close_timeout
                else 10.0,
            ) as r:
                pass
        except httpx.HTTPError as exc:
            raise ApplicationError(
                f"callback {inp.url} unreachable: {exc!r}",
                {"attempt": info.attempt},
                type="transport_error",
            ) from exc
        if r.is_success:
            return info.attempt
        permanent = 400 <= r.status_code < 500 and r.status_code not in (408, 425, 429)
        raise ApplicationError(
            f"callback {inp.url} answered HTTP {r.status_code}",
            {"attempt": info.attempt},
            type="callback_rejected" if permanent else "callback_failed",
            non_retryable=permanent,
        )


async def _heartbeating(work: Coroutine[Any, Any, Reply]) -> Reply:
    """Await a long call as a regular activity, heartbeating so a lost worker is noticed."""
    task = asyncio.ensure_future(work)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=HEARTBEAT_EVERY_S)
            if done:
                return task.result()
            activity.heartbeat()
    finally:
        task.cancel()
