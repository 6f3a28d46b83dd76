"""The registry client: what an agent says to the gateway (R2, R3, R21).

Join (with what each operation declares), a heartbeat with a health report every
`heartbeat_interval` seconds, Leave at stop, and late answers (`send_result`) for requests
accepted with `ctx.defer()`. An instance the gateway no longer knows (evicted, or a gateway
restarted with an empty registry) joins again at its next heartbeat.

Given several gateways (`reach_address` as a list, or addresses separated by commas), every call
goes through `_gateways`: on a gateway that fails, the next is tried at once, and the agent
stays with the one that answers, so its heartbeats move before `heartbeat_timeout` evicts it and
a late answer is resent to the next gateway rather than lost.

A gateway that refuses (a 4xx: a loopback address outside `security.allow_networks`, no token
or one that may not serve this capability, ...) is named in the log with its own message, once
per change of what it says rather than at every retry; a 401, or a 403 about the token, says how
to get one, and a 403 about the instance_id (another principal holds it) says to choose another.
A refused Leave says so (never "left Reach"). Heartbeats that no gateway answers are a WARNING
at the first failure, then at most once a minute while they go on, and a line when one is
answered again.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import threading
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import httpx

from agent_reach_proto import wire
from agent_reach_sdk._beats import BeatGroup, group_for
from agent_reach_sdk._gateways import Gateways
from reach.messages import dumps

log = logging.getLogger("agent_reach_sdk")
_debug = logging.getLogger("agent_reach_sdk.heartbeat")

LATE_ANSWER_TIMEOUT_S = 30.0
# Each call's timeout (and with several gateways the most one of them may take at a Join or a
# heartbeat: see `_registry_timeout`).
CLIENT_TIMEOUT_S = 5.0
FAILOVER_MIN_TIMEOUT_S = 1.0
# While heartbeats keep failing, a WARNING at most this often (the first failure always).
BEAT_WARN_EVERY_S = 60.0

HealthCheck = Callable[[], dict[str, Any] | Awaitable[dict[str, Any]]]


class JoinRefused(RuntimeError):
    """The gateway answered the Join with an error (the message says what it said)."""


def refusal(r: httpx.Response) -> str:
    """What the gateway said, from its error envelope: `422 invalid_request: <message>`.

    A body in another shape (a proxy's page, an older gateway) is quoted, shortened."""
    error: Any = None
    try:
        body = r.json()
    except ValueError:
        body = None
    if isinstance(body, dict):
        error = body.get("error")
    if isinstance(error, dict) and isinstance(error.get("message"), str):
        kind = f" {error['type']}" if isinstance(error.get("type"), str) else ""
        return f"{r.status_code}{kind}: {error['message']}"
    text = r.text.strip()
    reason = f"{r.status_code} {r.reason_phrase}".strip()
    return f"{reason}: {text[:300]}" if text else reason


class RegistryClient:
    def __init__(
        self,
        *,
        reach_urls: Sequence[str],
        token: str | None,
        capability: str,
        instance_id: str,
        protocol: str,
        service_address: str,
        heartbeat_interval: float,
        health_check: HealthCheck | None,
        max_message_bytes: int,
        async_callback: bool,
        weight: int,
        max_inflight: int | None,
        operations: Callable[[], list[str | dict[str, Any]]],
        running: Callable[[], int],
        on_join: Callable[[int], None],
    ) -> None:
        """`operations` gives the Join's operation list, `running` the requests in flight (for
        the health report); `on_join` hears the `max_message_bytes` a Join negotiated."""
        self.gateways = Gateways(reach_urls, self.new_client)
        # The agent token (R18): Join, heartbeats, leave and late answers carry it.
        self.token = token
        self.capability = capability
        self.instance_id = instance_id
        self.protocol = protocol
        self.service_address = service_address
        self.heartbeat_interval = heartbeat_interval
        self.health_check = health_check
        self.max_message_bytes = max_message_bytes
        self.async_callback = async_callback
        self.weight = weight
        self.max_inflight = max_inflight
        self.ack: dict[str, Any] | None = None
        self.client: httpx.AsyncClient | None = None
        self.joined = threading.Event()
        self._operations = operations
        self._running = running
        self._on_join = on_join
        self._heartbeats: asyncio.Task[None] | None = None
        self._group: BeatGroup | None = None
        self._refused: str | None = None  # the refusal last logged, until the gateway accepts
        self._beat_failures = 0  # heartbeats in a row that no gateway answered
        self._beat_warned_at = 0.0

    @property
    def reach_url(self) -> str:
        """The gateway calls go to first now (the first address given, until it fails)."""
        return self.gateways.url

    @reach_url.setter
    def reach_url(self, url: str) -> None:
        self.gateways.replace([url])

    @property
    def reach_urls(self) -> tuple[str, ...]:
        return self.gateways.urls

    @property
    def client(self) -> httpx.AsyncClient | None:
        """The current gateway's client while running (None before `open`, after `close`)."""
        return self.gateways.client

    @client.setter
    def client(self, client: httpx.AsyncClient | None) -> None:
        self.gateways.client = client

    def open(self) -> None:
        self.gateways.open()

    def new_client(self, url: str | None = None) -> httpx.AsyncClient:
        headers = {"Authorization": f"Bearer {self.token}"} if self.token else {}
        return httpx.AsyncClient(
            base_url=url or self.reach_url,
            headers=headers,
            timeout=CLIENT_TIMEOUT_S,
            trust_env=False,
        )

    async def close(self) -> None:
        await self.gateways.close()

    def _registry_timeout(self) -> dict[str, float]:
        """With several gateways, a Join or heartbeat gives each at most its share of the time
        the registry allows between heartbeats, so one that hangs cannot hold the heartbeat
        past `heartbeat_timeout`; with one gateway, the client's own timeout as before."""
        count = len(self.gateways.urls)
        if count == 1:
            return {}
        ack = self.ack or {}
        allowed = float(ack.get("heartbeat_timeout") or 6 * self.heartbeat_interval)
        share = (allowed - self.heartbeat_interval) / count
        return {"timeout": min(CLIENT_TIMEOUT_S, max(FAILOVER_MIN_TIMEOUT_S, share))}

    # -- join, heartbeats, leave ----------------------------------------------------------------

    async def join(self) -> None:
        assert self.client is not None
        body: dict[str, Any] = {
            "capability": self.capability,
            "instance_id": self.instance_id,
            "protocol": self.protocol,
            "service_address": self.service_address,
            "heartbeat_interval": self.heartbeat_interval,
            "operations": self._operations(),
            "max_message_bytes": self.max_message_bytes,
            "async_callback": self.async_callback,
        }
        # Only when not the default: a gateway that predates them refuses unknown fields.
        if self.weight != 1:
            body["weight"] = self.weight
        if self.max_inflight is not None:
            body["max_inflight"] = self.max_inflight
        r = await self.gateways.send(
            "joining", "POST", "/reach/agents", json=body, **self._registry_timeout()
        )
        if r.status_code != 200:
            raise JoinRefused(self._refused_by(r, "join"))
        self._accepted()
        self.ack = r.json()
        self.heartbeat_interval = float(self.ack["heartbeat_interval"])
        self.max_message_bytes = int(self.ack["max_message_bytes"])
        self._on_join(self.max_message_bytes)
        self.joined.set()
        log.info(
            "joined Reach capability=%s instance=%s address=%s heartbeat=%.1fs",
            self.capability,
            self.instance_id,
            self.service_address,
            self.heartbeat_interval,
        )

    def start_heartbeats(self) -> None:
        # The instances this process hosts for the same gateways and token beat together.
        self._group = group_for(self.gateways.urls, self.token)
        self._group.add(self)
        self._heartbeats = asyncio.create_task(self._heartbeat_loop())

    async def stop_heartbeats(self) -> None:
        if self._group is not None:
            self._group.remove(self)
            self._group = None
        if self._heartbeats is not None:
            self._heartbeats.cancel()
            await asyncio.gather(self._heartbeats, return_exceptions=True)
            self._heartbeats = None

    async def _send_heartbeat(self, report: dict[str, Any]) -> httpx.Response:
        """This instance's heartbeat: in its group's batch when it has company, else alone."""
        session = (self.ack or {}).get("session")
        group = self._group
        if group is not None and group.batching:
            entry = {"instance_id": self.instance_id, **report}
            if session:
                entry["session"] = session
            answer = await group.beat(self.gateways, entry, self._registry_timeout())
            if answer is not None:
                return answer
        return await self.gateways.send(
            "heartbeating",
            "PUT",
            f"/reach/agents/{self.instance_id}/heartbeat",
            json=report,
            headers={wire.HTTP_SESSION: session} if session else None,
            **self._registry_timeout(),
        )

    async def leave(self) -> None:
        """Deregister; the log says what happened (left, already forgotten, or refused)."""
        if self.client is not None and self.joined.is_set():
            try:
                r = await self.gateways.send(
                    "leaving", "DELETE", f"/reach/agents/{self.instance_id}"
                )
            except httpx.HTTPError as exc:
                log.warning(
                    "could not tell Reach that instance %s leaves (%r); it is evicted once "
                    "its heartbeats stop for heartbeat_timeout",
                    self.instance_id,
                    exc,
                )
            else:
                if r.status_code in (200, 204):
                    log.info("left Reach instance=%s", self.instance_id)
                elif r.status_code == 404:
                    log.info(
                        "Reach no longer knew instance %s (evicted or never kept): nothing to "
                        "leave",
                        self.instance_id,
                    )
                else:
                    self._refused = None  # always said: it is the last word of this agent
                    self._refused_by(r, "leave")
        self.joined.clear()

    async def health(self) -> dict[str, Any]:
        report: dict[str, Any] = {"status": "ok", "checks": {}}
        if self.health_check is not None:
            try:
                got = self.health_check()
                if inspect.isawaitable(got):
                    got = await got
                report.update(got)
            except Exception as exc:
                report = {"status": "unhealthy", "checks": {"health_check": repr(exc)}}
        report["inflight"] = self._running()
        return report

    async def _heartbeat_loop(self) -> None:
        assert self.client is not None
        while True:
            group = self._group
            if group is not None and group.batching:
                await group.turn()
            else:
                await asyncio.sleep(self.heartbeat_interval)
            what = "heartbeat" if self.joined.is_set() else "join"
            try:
                if not self.joined.is_set():
                    await self.join()
                    self._beat_answered()
                    continue
                r = await self._send_heartbeat(await self.health())
                if r.status_code == 404:
                    # Evicted, or the gateway restarted with an empty registry: join again.
                    log.warning(
                        "Reach no longer knows instance %s; joining again", self.instance_id
                    )
                    self.joined.clear()
                    await self.join()
                elif r.status_code == 200:
                    self._accepted()
                else:
                    self._refused_by(r, "heartbeat")
                self._beat_answered()
            except httpx.HTTPError as exc:
                self._beat_failed(what, exc)
            except RuntimeError as exc:  # a refused Join, already logged by `_refused_by`
                _debug.debug("heartbeat failed: %r", exc)

    def _beat_failed(self, what: str, exc: Exception) -> None:
        """A heartbeat (or Join) that no gateway answered: WARNING at the first of a run of
        failures, then at most every `BEAT_WARN_EVERY_S` while they go on (DEBUG between)."""
        now = time.monotonic()
        self._beat_failures += 1
        if self._beat_failures == 1:
            self._beat_warned_at = now
            ack = self.ack or {}
            timeout = ack.get("heartbeat_timeout")
            within = f" after {timeout} s without one" if timeout else ""
            log.warning(
                "the %s of instance %s to Reach at %s failed (%r); retrying every %.1f s "
                "(Reach evicts an instance%s)",
                what,
                self.instance_id,
                ", ".join(self.gateways.urls),
                exc,
                self.heartbeat_interval,
                within,
            )
        elif now - self._beat_warned_at >= BEAT_WARN_EVERY_S:
            self._beat_warned_at = now
            log.warning(
                "the heartbeats of instance %s still fail (%d in a row; the last: %r)",
                self.instance_id,
                self._beat_failures,
                exc,
            )
        else:
            _debug.debug("heartbeat failed: %r", exc)

    def _beat_answered(self) -> None:
        if self._beat_failures:
            log.info(
                "Reach answers the heartbeats of instance %s again (after %d failed)",
                self.instance_id,
                self._beat_failures,
            )
            self._beat_failures = 0

    # -- refusals -------------------------------------------------------------------------------

    def _refused_by(self, r: httpx.Response, what: str) -> str:
        """Say what the gateway said (logged once until it says something else); return it."""
        said = refusal(r)
        line = self._refusal_line(what, said, r.status_code)
        if said == self._refused:
            _debug.debug("Reach still refuses the %s: %s", what, said)
        else:
            self._refused = said
            # A 4xx needs a person (an address to allow, a token to issue); a 5xx is Reach's.
            log.log(logging.ERROR if r.status_code < 500 else logging.WARNING, "%s", line)
        return line

    def _refusal_line(self, what: str, said: str, status: int) -> str:
        line = f"Reach refused the {what} of instance {self.instance_id}: {said}"
        if status not in (401, 403):
            return line
        if status == 403 and self._about_instance(said):
            # Its instance_id, not its token: another principal, an admin or reach.yaml holds
            # it (or it is not registered). Token advice here sent people to issue tokens.
            held = any(word in said for word in ("held by", "registered by"))
            return f"{line}. The refusal is about instance_id {self.instance_id!r}, not " + (
                "the token: this agent may not take that instance_id over. Start it with an "
                "instance_id of its own (AgentRuntime(instance_id=...))"
                if held
                else "the token"
            )
        whose = "this agent's token" if self.token else "this agent, which has no token"
        return (
            f"{line}. The gateway refused {whose}: issue one with `reach tokens issue "
            f"--principal NAME --agent --capability {self.capability}` and pass token=... to "
            "AgentRuntime (or set $REACH_AGENT_TOKEN)"
        )

    def _about_instance(self, said: str) -> bool:
        """Whether the gateway's refusal names this instance (it quotes the id as Python does:
        `instance 'x' ...`, `instance_id 'x' ...`)."""
        quoted = repr(self.instance_id)
        return f"instance {quoted}" in said or f"instance_id {quoted}" in said

    def _accepted(self) -> None:
        if self._refused is not None:
            log.info("Reach accepts instance %s again", self.instance_id)
            self._refused = None

    # -- late answers ---------------------------------------------------------------------------

    async def send_result(
        self,
        request_id: str,
        result: dict[str, Any] | None = None,
        *,
        error_type: str | None = None,
        error_message: str | None = None,
    ) -> None:
        body: dict[str, Any] = {"instance_id": self.instance_id}
        if error_type or error_message:
            body.update(status="error", error_type=error_type, error_message=error_message)
        else:
            size = len(dumps(result or {}))
            if size > self.max_message_bytes:
                raise ValueError(
                    f"the result for {request_id} is {size} bytes > negotiated "
                    f"max_message_bytes {self.max_message_bytes}"
                )
            body.update(status="success", result=result or {})
        content = dumps(body)
        if self.client is not None:
            await self._post_result(self.gateways, request_id, content)
            return
        # Not running (e.g. a restarted process answering an old request): one-off clients.
        one_off = Gateways(self.gateways.urls, self.new_client)
        one_off.current = self.gateways.current
        try:
            await self._post_result(one_off, request_id, content)
        finally:
            await one_off.close()

    async def _post_result(
        self, gateways: Gateways, request_id: str, content: bytes, attempts: int = 8
    ) -> None:
        # Each attempt tries every gateway (a dead one's answer is resent to the next at once);
        # the backoff is only between attempts that found none answering.
        for attempt in range(attempts):
            try:
                r = await gateways.send(
                    "sending late answers",
                    "POST",
                    f"/reach/requests/{request_id}/result",
                    content=content,
                    headers={"Content-Type": "application/json"},
                    # Longer than Reach waits for a worker to take it (2 x rpc_timeout_s), so
                    # the SDK hears Reach's answer instead of resending over it.
                    timeout=LATE_ANSWER_TIMEOUT_S,
                )
            except httpx.HTTPError as exc:
                log.warning("late answer for %s not delivered (%r); retrying", request_id, exc)
            else:
                if r.status_code in (200, 202):
                    return
                if r.status_code < 500:
                    said = refusal(r)
                    raise RuntimeError(
                        self._refusal_line(f"late answer for {request_id}", said, r.status_code)
                    )
            await asyncio.sleep(0.5 * 2**attempt)
        raise RuntimeError(f"could not deliver the late answer for {request_id}")
