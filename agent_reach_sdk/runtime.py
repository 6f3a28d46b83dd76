"""AgentRuntime: join Reach, heartbeat with a health report, serve operations (R2, R8, R21, R24).

The smallest complete agent (any protocol: "http", "grpc", "websocket", "mqtt"):

    from agent_reach_sdk import AgentRuntime

    runtime = AgentRuntime("knowledge-retriever", protocol="grpc")

    @runtime.operation("query", idempotent=True, timeout_ms=3000)
    async def query(payload: dict) -> dict: ...

    runtime.run()          # blocks until Ctrl-C or SIGTERM, then leaves cleanly

What an operation declares (`idempotent`, `timeout_ms`) is sent at Join: Reach retries one
declared idempotent on a retryable failure and holds it to that deadline, unless Reach's own
configuration for it says otherwise (that wins). One that neither declares nor is configured
idempotent is retried only for a caller that gave an idempotency key.

`runtime.start()` runs it in a background thread instead (plain scripts), and
`async with runtime:` on the current loop (asyncio code). The gateway is `reach_address`
(default: `$REACH_ADDRESS`, else 127.0.0.1:7600); `instance_id` defaults to
`<capability>-<host>-<pid>-<4 hex>`.

Activities run at least once, so a request can be delivered twice (a worker crashed between the
agent's answer and the workflow recording it). The runtime remembers recent RequestIDs with their
answers and answers a re-delivered request without running the operation again, on every
protocol. The memory is bounded twice: at most `remember` answers and `remember_bytes` bytes of
them as sent, the oldest forgotten first; an answer bigger than `remember_bytes` on its own is
not remembered at all.

Results are sent as `reach.messages.dumps` encodes them, the encoding Reach measures with. A
result larger than the `max_message_bytes` negotiated at Join is not sent (Reach could not carry
it): the caller gets `result_too_large` naming both sizes, marked not retryable (the same
operation would produce the same result), and the agent's log says so.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import functools
import inspect
import json
import logging
import os
import secrets
import signal
import socket
import threading
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Coroutine
from pathlib import Path
from types import TracebackType
from typing import Any, Self

import httpx

from agent_reach_sdk import wire
from agent_reach_sdk.context import (
    Deferred,
    RequestContext,
    current_request_id,
    install_request_id_logging,
)
from agent_reach_sdk.servers import AgentServer, server_class
from agent_reach_sdk.tracing import agent_tracer, traced_dispatch
from agent_reach_sdk.wire import Answer, Inbound, error_answer
from reach.limits import DEFAULT_MAX_MESSAGE_BYTES
from reach.messages import MAX_TIMEOUT_MS, dumps
from reach.security.certs import TlsFiles, identity_of

log = logging.getLogger("agent_reach_sdk")

LATE_ANSWER_TIMEOUT_S = 30.0

OperationFunc = Callable[..., Any]
HealthCheck = Callable[[], dict[str, Any] | Awaitable[dict[str, Any]]]

DEFAULT_REMEMBER_BYTES = 16 * 1024 * 1024
MAX_WEIGHT = 1000
MAX_INFLIGHT = 1_000_000
# The last millisecond of the year 9999: a later deadline is not a time (nor a float's).
_LATEST_DEADLINE_MS = 253_402_300_799_999


class OperationError(Exception):
    """Raise from an operation to answer with a typed error instead of a result."""

    def __init__(self, message: str, *, type: str = "agent_error", status: int = 422) -> None:
        """`status` is HTTP-style and decides whether Reach may retry: 429 and 5xx yes, other
        4xx no, 504 is a timeout. Only 400-599 say that the same way on every protocol."""
        if not 400 <= status <= 599:
            raise ValueError(f"OperationError status must be 400-599, not {status}")
        super().__init__(message)
        self.message = message
        self.type = type
        self.status = status


def _url(address: str) -> str:
    return address.rstrip("/") if "://" in address else f"http://{address.rstrip('/')}"


def _check_int(name: str, value: object, maximum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= maximum:
        raise ValueError(f"{name} must be an integer from 1 to {maximum}, not {value!r}")


def default_instance_id(capability: str) -> str:
    """Unique per process and start: `<capability>-<host>-<pid>-<4 hex>`."""
    host = socket.gethostname().split(".", 1)[0].lower() or "host"
    host = "".join(c if c.isalnum() or c in "-_" else "-" for c in host)[:32]
    return f"{capability}-{host}-{os.getpid()}-{secrets.token_hex(2)}"


def _tls_files(protocol: str, cert: str | None, key: str | None, ca: str | None) -> TlsFiles | None:
    """The agent's mTLS files, from the arguments or else the environment; None without."""
    given = {
        "tls_cert": cert or os.environ.get("REACH_AGENT_TLS_CERT") or None,
        "tls_key": key or os.environ.get("REACH_AGENT_TLS_KEY") or None,
        "tls_ca": ca or os.environ.get("REACH_AGENT_TLS_CA") or None,
    }
    if not any(given.values()):
        return None
    missing = [name for name, value in given.items() if value is None]
    if missing:
        raise ValueError(
            f"mTLS needs tls_cert, tls_key and tls_ca (or $REACH_AGENT_TLS_CERT/KEY/CA); "
            f"missing: {', '.join(missing)}"
        )
    if protocol == "mqtt":
        raise ValueError(
            "mTLS is not served by the MQTT agent server: Reach reaches MQTT agents through "
            "the broker, which authenticates both sides (configure TLS on the broker)"
        )
    return TlsFiles(
        Path(str(given["tls_ca"])), Path(str(given["tls_cert"])), Path(str(given["tls_key"]))
    )


def _certified_id(tls: TlsFiles | None) -> str | None:
    """The instance id in the agent's certificate (spiffe://<td>/agent/<id>), if any."""
    if tls is None:
        return None
    try:
        identity = identity_of(tls.cert)
    except OSError as exc:
        raise ValueError(f"cannot read the agent certificate {tls.cert}: {exc}") from None
    return identity[1] if identity else None


def _check_certified(tls: TlsFiles | None, instance_id: str) -> None:
    certified = _certified_id(tls)
    if tls is not None and certified != instance_id:
        raise ValueError(
            f"the certificate {tls.cert} is for agent {certified!r}, not {instance_id!r}: "
            "Reach would refuse the Join (issue one with `reach certs issue --agent "
            f"{instance_id}`)"
        )


class AgentRuntime:
    def __init__(
        self,
        capability: str,
        *,
        reach_address: str | None = None,
        instance_id: str | None = None,
        protocol: str = "http",
        service_address: str | None = None,
        heartbeat_interval: float = 5.0,
        token: str | None = None,
        health_check: HealthCheck | None = None,
        listen: str | None = None,
        max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
        async_callback: bool = True,
        remember: int = 4096,
        remember_bytes: int = DEFAULT_REMEMBER_BYTES,
        weight: int = 1,
        max_inflight: int | None = None,
        tls_cert: str | None = None,
        tls_key: str | None = None,
        tls_ca: str | None = None,
        tracing: str | Any | None = None,
    ) -> None:
        """`service_address` is where Reach calls this instance: `host:port` for http, grpc
        and websocket (port 0 = any free port, filled in before joining); for mqtt, the
        broker's `host:port` (the request topic is added). `listen` is where to bind when it
        differs from the address advertised (e.g. 0.0.0.0:9001 behind a public name).

        `weight` (1 to 1000) is this instance's share under weighted round robin and on a hash
        ring, relative to the other instances (Reach's configuration may override it);
        `max_inflight` (1 to 1,000,000, or None for no limit) is the number of requests in
        flight at which routing passes this instance over until it drains. Both are sent at
        Join, each only when it differs from its default, so a gateway that predates them
        still accepts the Join. An out-of-range value raises `ValueError` here.

        mTLS (R18): `tls_cert` and `tls_key` (this instance's certificate, from
        `reach certs issue --agent ID`) and `tls_ca` (the CA that signed Reach's), or
        `$REACH_AGENT_TLS_CERT`, `$REACH_AGENT_TLS_KEY` and `$REACH_AGENT_TLS_CA`: the server
        then serves TLS (http, grpc, websocket), refuses clients without a certificate from the
        CA, and joins with a TLS address (https://, wss://; host:port for grpc). The instance id
        defaults to the one in the certificate, and another id is refused here (`ValueError`):
        Reach would refuse it at Join.

        Traces (`agent_reach_sdk.tracing`): `tracing` is "file:PATH", "console",
        "otlp[:ENDPOINT]", "none" or an OpenTelemetry TracerProvider (default:
        `$REACH_AGENT_TRACES`, else the process's global provider if the agent configured one).
        Then each request's handler runs in a server span continuing the traceparent Reach
        sent (a child of Reach's connector span); without one, tracing costs nothing."""
        _check_int("weight", weight, MAX_WEIGHT)
        if max_inflight is not None:
            _check_int("max_inflight", max_inflight, MAX_INFLIGHT)
        self._server_class = server_class(protocol)  # an unknown protocol fails here
        install_request_id_logging()
        self.reach_url = _url(reach_address or os.environ.get("REACH_ADDRESS", "127.0.0.1:7600"))
        self.capability = capability
        self.tls = _tls_files(protocol, tls_cert, tls_key, tls_ca)
        self.instance_id = instance_id or _certified_id(self.tls) or default_instance_id(capability)
        _check_certified(self.tls, self.instance_id)
        self.protocol = protocol
        self.service_address = service_address or self._server_class.default_address
        self.heartbeat_interval = heartbeat_interval
        # The agent token (R18): Join, heartbeats, leave and late answers carry it.
        self.token = token or os.environ.get("REACH_AGENT_TOKEN") or None
        self.health_check = health_check
        self.max_message_bytes = max_message_bytes
        self.async_callback = async_callback
        self.weight = weight
        self.max_inflight = max_inflight
        self.ack: dict[str, Any] | None = None
        self._listen = listen or self.service_address
        # Each operation with how it is called, worked out once at registration rather than per
        # call; one entry, so a dispatch never pairs a re-registered function with an old shape.
        self._calls: dict[str, tuple[OperationFunc, _Shape]] = {}
        self._declared: dict[str, dict[str, Any]] = {}  # only operations that declare something
        self._remember = remember
        self._remember_bytes = remember_bytes
        self._recent: OrderedDict[str, Answer] = OrderedDict()
        self._recent_size = 0  # bytes of the remembered answers, as sent
        self._inflight: dict[str, asyncio.Future[Answer]] = {}
        # Handlers given up on (deadline, shutdown) that still run, by RequestID: held here so
        # they are not destroyed mid-cleanup, waited for at stop, and not run twice at once.
        self._overdue: dict[str, asyncio.Task[Any]] = {}
        self._server: AgentServer | None = None
        self._client: httpx.AsyncClient | None = None
        self._heartbeat_task: asyncio.Task[None] | None = None
        self._joined = threading.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self.executed = 0  # operations actually run (re-deliveries answered from memory excluded)
        self._tracing = tracing
        self._tracer: Any = None  # an OpenTelemetry Tracer when tracing is on (astart decides)
        self._tracer_provider: Any = None  # the provider built here, flushed at stop

    # -- operations ---------------------------------------------------------------------------

    def operation(
        self, name: str, *, idempotent: bool | None = None, timeout_ms: int | None = None
    ) -> Callable[[OperationFunc], OperationFunc]:
        """Register `func(payload)` or `func(payload, ctx)`, sync or async, as operation `name`.

        `idempotent=True` declares that running it twice is safe, so Reach may retry it on a
        retryable failure (`False`: never without the caller's idempotency key); `timeout_ms`
        is its own deadline (1 ms to 24 h). Both are sent at Join; Reach's configuration for
        the operation, where it has one, wins."""
        if idempotent is not None and not isinstance(idempotent, bool):
            raise TypeError(f"idempotent must be a bool or None, not {idempotent!r}")
        if timeout_ms is not None and (
            isinstance(timeout_ms, bool)
            or not isinstance(timeout_ms, int)
            or not 1 <= timeout_ms <= MAX_TIMEOUT_MS
        ):
            raise ValueError(
                f"timeout_ms must be an integer from 1 to {MAX_TIMEOUT_MS} (24 h), not "
                f"{timeout_ms!r}"
            )
        declared: dict[str, Any] = {}
        if idempotent is not None:
            declared["idempotent"] = idempotent
        if timeout_ms is not None:
            declared["timeout_ms"] = timeout_ms

        def register(func: OperationFunc) -> OperationFunc:
            self._calls[name] = (func, _Shape.of(func))
            if declared:
                self._declared[name] = declared
            else:
                self._declared.pop(name, None)
            return func

        return register

    @property
    def operations(self) -> list[str]:
        return sorted(self._calls)

    def _join_operations(self) -> list[str | dict[str, Any]]:
        """The Join body's `operations`: a plain name, or an object with what it declares."""
        return [
            {"name": name, **self._declared[name]} if name in self._declared else name
            for name in self.operations
        ]

    # -- lifecycle ----------------------------------------------------------------------------

    async def __aenter__(self) -> Self:
        await self.astart()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.astop()

    async def astart(self) -> None:
        install_request_id_logging()
        if self._tracer is None:
            self._tracer, self._tracer_provider = agent_tracer(self._tracing, self.capability)
        self._server = self._server_class(
            self.dispatch,
            listen=self._listen,
            advertise=self.service_address,
            instance_id=self.instance_id,
            max_body_bytes=self.max_message_bytes,
            tls=self.tls,
        )
        await self._server.start()
        self.service_address = self._server.service_address
        self._client = self._reach_client()
        try:
            await self._join()
        except httpx.HTTPError as exc:
            log.warning("cannot join Reach at %s yet (%r); retrying", self.reach_url, exc)
        except BaseException:
            # Refused (or cancelled): nothing may stay bound for a retry to trip over.
            await self.astop(leave=False, grace_s=0)
            raise
        self._heartbeat_task = asyncio.create_task(self._heartbeat_loop())

    async def astop(self, *, leave: bool = True, grace_s: float = 5.0) -> None:
        """Leave Reach (no new traffic is routed here), stop taking requests, and let those
        in flight finish for up to `grace_s` seconds."""
        if self._heartbeat_task is not None:
            self._heartbeat_task.cancel()
            await asyncio.gather(self._heartbeat_task, return_exceptions=True)
            self._heartbeat_task = None
        if leave and self._client is not None and self._joined.is_set():
            try:
                await self._client.delete(f"/reach/agents/{self.instance_id}")
                log.info("left Reach instance=%s", self.instance_id)
            except httpx.HTTPError:
                pass
        self._joined.clear()
        if self._server is not None:
            await self._server.close(grace_s)
            self._server = None
        if self._overdue:  # handlers cancelled at the deadline or just now: their cleanup runs
            _, stuck = await asyncio.wait(set(self._overdue.values()), timeout=max(grace_s, 1.0))
            if stuck:
                log.warning("%d handlers still running after their cancellation", len(stuck))
        if self._client is not None:
            await self._client.aclose()
            self._client = None
        if self._tracer_provider is not None:  # the spans of the requests just finished
            await asyncio.to_thread(self._tracer_provider.force_flush, 3000)

    def run(self) -> None:
        """Serve until Ctrl-C or SIGTERM, then leave cleanly (the smallest agent's last line)."""
        logging.basicConfig(
            level=logging.INFO, format="%(asctime)s %(levelname)s [%(request_id)s] %(message)s"
        )
        with contextlib.suppress(KeyboardInterrupt):
            asyncio.run(self.serve_forever())

    async def serve_forever(self) -> None:
        """`run()` for asyncio code: serve on this loop until SIGINT/SIGTERM, then leave."""
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        installed = []
        for sig in (signal.SIGINT, signal.SIGTERM):
            with contextlib.suppress(NotImplementedError, RuntimeError, ValueError):
                loop.add_signal_handler(sig, stop.set)
                installed.append(sig)
        try:
            async with self:
                log.info(
                    "serving %s over %s at %s (Ctrl-C to leave)",
                    self.capability,
                    self.protocol,
                    self.service_address,
                )
                await stop.wait()
                log.info("leaving Reach: no new requests; finishing those in flight")
        finally:
            for sig in installed:
                loop.remove_signal_handler(sig)

    def start(self) -> None:
        """Start in a background thread (for plain, non-asyncio scripts)."""
        if self._thread is not None:
            raise RuntimeError("already started")
        started = threading.Event()
        failure: list[BaseException] = []

        def run() -> None:
            loop = asyncio.new_event_loop()
            self._loop = loop
            try:
                loop.run_until_complete(self.astart())
            except BaseException as exc:
                failure.append(exc)
                started.set()
                return
            started.set()
            loop.run_forever()
            loop.run_until_complete(self.astop())
            loop.close()

        self._thread = threading.Thread(target=run, name=f"reach-{self.instance_id}", daemon=True)
        self._thread.start()
        started.wait()
        if failure:
            self._thread = None
            raise failure[0]

    def stop(self) -> None:
        if self._thread is None or self._loop is None:
            return
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)
        self._thread = None

    def wait_joined(self, timeout: float | None = None) -> bool:
        return self._joined.wait(timeout)

    # -- talking to Reach ---------------------------------------------------------------------

    def _reach_client(self) -> httpx.AsyncClient:
        headers = {"Authorization": f"Bearer {self.token}"} if self.token else {}
        return httpx.AsyncClient(
            base_url=self.reach_url, headers=headers, timeout=5.0, trust_env=False
        )

    async def _join(self) -> None:
        assert self._client is not None
        body: dict[str, Any] = {
            "capability": self.capability,
            "instance_id": self.instance_id,
            "protocol": self.protocol,
            "service_address": self.service_address,
            "heartbeat_interval": self.heartbeat_interval,
            "operations": self._join_operations(),
            "max_message_bytes": self.max_message_bytes,
            "async_callback": self.async_callback,
        }
        # Only when not the default: a gateway that predates them refuses unknown fields.
        if self.weight != 1:
            body["weight"] = self.weight
        if self.max_inflight is not None:
            body["max_inflight"] = self.max_inflight
        r = await self._client.post("/reach/agents", json=body)
        if r.status_code != 200:
            raise RuntimeError(f"Reach refused the join: HTTP {r.status_code} {r.text}")
        self.ack = r.json()
        self.heartbeat_interval = float(self.ack["heartbeat_interval"])
        self.max_message_bytes = int(self.ack["max_message_bytes"])
        if self._server is not None:
            self._server.max_body_bytes = self.max_message_bytes
        self._joined.set()
        log.info(
            "joined Reach capability=%s instance=%s address=%s heartbeat=%.1fs",
            self.capability,
            self.instance_id,
            self.service_address,
            self.heartbeat_interval,
        )

    async def _health(self) -> dict[str, Any]:
        report: dict[str, Any] = {"status": "ok", "checks": {}}
        if self.health_check is not None:
            try:
                got = self.health_check()
                if inspect.isawaitable(got):
                    got = await got
                report.update(got)
            except Exception as exc:
                report = {"status": "unhealthy", "checks": {"health_check": repr(exc)}}
        report["inflight"] = len(self._inflight)
        return report

    async def _heartbeat_loop(self) -> None:
        assert self._client is not None
        while True:
            await asyncio.sleep(self.heartbeat_interval)
            try:
                if not self._joined.is_set():
                    await self._join()
                    continue
                r = await self._client.put(
                    f"/reach/agents/{self.instance_id}/heartbeat", json=await self._health()
                )
                if r.status_code == 404:
                    # Evicted, or the gateway restarted with an empty registry: join again.
                    log.warning(
                        "Reach no longer knows instance %s; joining again", self.instance_id
                    )
                    self._joined.clear()
                    await self._join()
            except (httpx.HTTPError, RuntimeError) as exc:
                logging.getLogger("agent_reach_sdk.heartbeat").debug("heartbeat failed: %r", exc)

    async def send_result(
        self,
        request_id: str,
        result: dict[str, Any] | None = None,
        *,
        error_type: str | None = None,
        error_message: str | None = None,
    ) -> None:
        """Deliver the answer to a request this instance accepted with `ctx.defer()` (R3).

        Raises `ValueError` for a result larger than the negotiated `max_message_bytes` (or
        not standard JSON): Reach would refuse it, so it is not sent.
        """
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
        if self._client is not None:
            await self._post_result(self._client, request_id, content)
            return
        # Not running (e.g. a restarted process answering an old request): a one-off client.
        async with self._reach_client() as client:
            await self._post_result(client, request_id, content)

    @staticmethod
    async def _post_result(
        client: httpx.AsyncClient, request_id: str, content: bytes, attempts: int = 8
    ) -> None:
        for attempt in range(attempts):
            try:
                r = await client.post(
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
                    raise RuntimeError(f"Reach refused the late answer: {r.status_code} {r.text}")
            await asyncio.sleep(0.5 * 2**attempt)
        raise RuntimeError(f"could not deliver the late answer for {request_id}")

    # -- serving ------------------------------------------------------------------------------

    async def dispatch(self, request: Inbound) -> Answer:
        """Answer one request, whatever protocol it came by (the servers call this); with
        tracing on, in a server span that continues the request's traceparent."""
        if self._tracer is not None:
            attributes = {
                "reach.capability": self.capability,
                "reach.instance_id": self.instance_id,
                "reach.protocol": self.protocol,
            }
            return await traced_dispatch(self._tracer, request, self._dispatch, attributes)
        return await self._dispatch(request)

    async def _dispatch(self, request: Inbound) -> Answer:
        name = request.operation
        call = self._calls.get(name)
        if call is None:
            return error_answer(404, "invalid_request", f"operation {name!r} is not served here")
        request_id = request.headers.get(wire.REQUEST_ID) or f"local-{time.time_ns()}"
        cached = self._recent.get(request_id)
        if cached is not None:
            return cached
        running = self._inflight.get(request_id)
        if running is not None:
            return await asyncio.shield(running)
        if request_id in self._overdue:
            return error_answer(
                503,
                "agent_error",
                "an earlier delivery of this request is still running past its deadline",
                retryable=True,
            )
        future: asyncio.Future[Answer] = asyncio.get_running_loop().create_future()
        self._inflight[request_id] = future
        try:
            response = await self._execute(call, name, request_id, request)
            future.set_result(response)
        except asyncio.CancelledError:
            # This delivery was cancelled (its caller left, the agent is stopping): a duplicate
            # waiting on it was not, and gets an answer that says to send it again.
            future.set_result(
                error_answer(
                    503,
                    "agent_error",
                    "the delivery this one waited on was cancelled",
                    retryable=True,
                )
            )
            raise
        except BaseException as exc:
            future.set_exception(exc)
            future.exception()  # mark retrieved: a waiting duplicate sees it, nobody else must
            raise
        finally:
            self._inflight.pop(request_id, None)
        if response.status in (200, 202):
            self._keep(request_id, response)
        return response

    def _keep(self, request_id: str, response: Answer) -> None:
        size = len(response.content())
        if size > self._remember_bytes:
            return  # it would push out everything else and still not fit
        old = self._recent.pop(request_id, None)
        if old is not None:
            self._recent_size -= len(old.content())
        self._recent[request_id] = response
        self._recent_size += size
        while len(self._recent) > self._remember or self._recent_size > self._remember_bytes:
            _, dropped = self._recent.popitem(last=False)
            self._recent_size -= len(dropped.content())

    @property
    def remembered(self) -> tuple[int, int]:
        """How many answers the duplicate memory holds, and their bytes as sent."""
        return len(self._recent), self._recent_size

    async def _execute(
        self, call: tuple[OperationFunc, _Shape], name: str, request_id: str, request: Inbound
    ) -> Answer:
        h = request.headers
        try:
            deadline = int(h[wire.DEADLINE_MS]) if h.get(wire.DEADLINE_MS) else None
            attempt = int(h.get(wire.ATTEMPT) or "1")
        except ValueError:
            return error_answer(
                400, "invalid_request", "X-Reach-Deadline-Ms and X-Reach-Attempt are integers"
            )
        if deadline is not None and not 0 <= deadline <= _LATEST_DEADLINE_MS:
            return error_answer(
                400,
                "invalid_request",
                "X-Reach-Deadline-Ms is milliseconds since the Unix epoch, "
                f"0 to {_LATEST_DEADLINE_MS}",
            )
        ctx = RequestContext(
            request_id=request_id,
            operation=name,
            caller=h.get(wire.CALLER, "anonymous"),
            attempt=attempt,
            deadline_ms=deadline,
            idempotency_key=h.get(wire.IDEMPOTENCY_KEY),
            headers=dict(h),
        )
        try:
            payload = json.loads(request.body or b"{}")
        except ValueError:
            return error_answer(400, "invalid_request", "body is not JSON")
        remaining = (deadline / 1000 - time.time()) if deadline is not None else None
        if remaining is not None and remaining <= 0:
            return error_answer(504, "timeout", "the request's deadline passed before it started")
        token = current_request_id.set(request_id)
        try:
            self.executed += 1
            func, shape = call
            result = await self._own_task(request_id, shape.call(func, payload, ctx), remaining)
        except _DeadlinePassed:
            log.warning("operation %s passed its deadline", name)
            return error_answer(504, "timeout", "the operation passed the request's deadline")
        except OperationError as exc:
            return error_answer(exc.status, exc.type, exc.message)
        except Exception as exc:
            log.exception("operation %s failed", name)
            return error_answer(500, "agent_error", f"{type(exc).__name__}: {exc}")
        finally:
            current_request_id.reset(token)
        if isinstance(result, Deferred):
            return Answer(202, {"request_id": request_id, "status": "accepted"})
        if not isinstance(result, dict):
            result = {"value": result}
        response = Answer(200, result)
        try:
            size = len(response.content())
        except (TypeError, ValueError) as exc:
            log.error("operation %s returned a result that is not standard JSON: %s", name, exc)
            return error_answer(500, "agent_error", f"the result is not standard JSON: {exc}")
        if size > self.max_message_bytes:
            log.error(
                "operation %s returned %d bytes, more than the negotiated max_message_bytes %d;"
                " not sent",
                name,
                size,
                self.max_message_bytes,
            )
            return error_answer(
                500,
                "result_too_large",
                f"the result of {name} is {size} bytes > negotiated {self.max_message_bytes}",
                retryable=False,
            )
        return response

    async def _own_task(
        self, request_id: str, work: Coroutine[Any, Any, Any], timeout_s: float | None
    ) -> Any:
        """`work`'s result, run in a task of its own, given up on after `timeout_s`.

        Its own task: a context variable the handler sets stays its own (a keep-alive
        connection's next request runs in the caller's task). Given up on, not waited for: a
        handler that ignores its cancellation keeps running, unheard (and held in `_overdue`
        until it ends), and the answer is not held up by it. A cancellation from outside
        (shutdown, the caller gone) cancels it and ends the request at once.
        """
        loop = asyncio.get_running_loop()
        task = loop.create_task(work)
        settled: asyncio.Future[None] = loop.create_future()

        def settle(_: object = None) -> None:
            if not settled.done():
                settled.set_result(None)

        task.add_done_callback(settle)
        timer = loop.call_later(timeout_s, settle) if timeout_s is not None else None
        try:
            await settled
        except asyncio.CancelledError:
            self._give_up(request_id, task)
            raise
        finally:
            if timer is not None:
                timer.cancel()
            task.remove_done_callback(settle)
        if not task.done():
            self._give_up(request_id, task)
            raise _DeadlinePassed
        if task.cancelled():  # the handler raised CancelledError itself; nobody cancelled it
            raise RuntimeError("the handler raised CancelledError without being cancelled")
        return task.result()

    def _give_up(self, request_id: str, task: asyncio.Task[Any]) -> None:
        task.cancel()
        if not task.done():
            self._overdue[request_id] = task

            def ended(_: object) -> None:
                if self._overdue.get(request_id) is task:
                    del self._overdue[request_id]

            task.add_done_callback(ended)
        task.add_done_callback(_forget)


class _Shape:
    """How an operation is called: with the context or without, on the loop or in a thread."""

    __slots__ = ("is_async", "takes_ctx")

    def __init__(self, takes_ctx: bool, is_async: bool) -> None:
        self.takes_ctx = takes_ctx
        self.is_async = is_async

    @classmethod
    def of(cls, func: OperationFunc) -> _Shape:
        # An object (not a class) whose __call__ is a coroutine function is awaited too.
        is_async = inspect.iscoroutinefunction(func) or (
            not inspect.isclass(func)
            and inspect.iscoroutinefunction(getattr(func, "__call__", None))  # noqa: B004
        )
        return cls(len(inspect.signature(func).parameters) >= 2, is_async)

    async def call(self, func: OperationFunc, payload: Any, ctx: RequestContext) -> Any:
        args = (payload, ctx) if self.takes_ctx else (payload,)
        try:
            if self.is_async:
                return await func(*args)
            result = await _in_daemon_thread(func, *args)
            if inspect.isawaitable(result):  # a plain function that hands back a coroutine
                return await result
            return result
        except (KeyboardInterrupt, SystemExit, GeneratorExit) as exc:
            # The handler's own, not the process's (run() takes signals on the loop): as an
            # Exception it is the request's error instead of the event loop's end.
            raise RuntimeError(f"the handler raised {type(exc).__name__}") from exc


class _DeadlinePassed(Exception):
    """The request's deadline passed first (a TimeoutError the handler raises is its own)."""


def _forget(task: asyncio.Future[Any]) -> None:
    """A handler given up on: what it ends with is read, so asyncio does not log it as never
    retrieved (an error it raised is the handler's own; the request was already answered)."""
    if not task.cancelled():
        task.exception()


async def _in_daemon_thread(func: Callable[..., Any], *args: Any) -> Any:
    """Run a plain (blocking) handler in a thread of its own, with the caller's context (the
    RequestID for logs). A daemon thread, unlike `asyncio.to_thread`'s pool: a handler stuck
    past the shutdown grace cannot keep the process from exiting on SIGTERM."""
    loop = asyncio.get_running_loop()
    done: asyncio.Future[Any] = loop.create_future()
    context = contextvars.copy_context()

    def settle(outcome: Callable[[], None]) -> None:
        if not done.done():
            outcome()

    def run() -> None:
        try:
            result = context.run(func, *args)
        except BaseException as exc:
            with contextlib.suppress(RuntimeError):  # the loop is gone: nobody waits
                loop.call_soon_threadsafe(settle, functools.partial(done.set_exception, exc))
        else:
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(settle, functools.partial(done.set_result, result))

    threading.Thread(target=run, name="reach-handler", daemon=True).start()
    return await done
