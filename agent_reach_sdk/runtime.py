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
`<capability>-<host>-<pid>-<4 hex>`. Several gateways (a list, or addresses separated by
commas) are failed over between: a call a gateway fails (refused, timed out, 5xx) is sent to the
next at once, and the agent stays with the one that answers (`_gateways`).

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

The runtime is a composition of one piece per job, each a module of its own:

    _registry_client  join, heartbeats, leave, late answers; a refusal named in the log
    _gateways         the gateway those go to, and the next when it fails
    _dispatch         the operations served, and how one request becomes one answer
    _answers          the answer cache: a request delivered twice runs once
    _deadlines        handlers given up on at their deadline, held until they end
    _host             run() until a signal, start() in a thread of its own
    _settings         the keyword arguments checked at construction
"""

from __future__ import annotations

import asyncio
import logging
import operator
import os
from collections.abc import Callable, Sequence
from types import TracebackType
from typing import Any, Generic, Self, TypeVar, overload

import httpx

from agent_reach_sdk import _host, _settings
from agent_reach_sdk._answers import DEFAULT_REMEMBER_BYTES, AnswerCache
from agent_reach_sdk._deadlines import DeadlineKeeper
from agent_reach_sdk._dispatch import Dispatcher, OperationError, OperationFunc
from agent_reach_sdk._registry_client import HealthCheck, RegistryClient
from agent_reach_sdk._settings import MAX_INFLIGHT, MAX_WEIGHT, default_instance_id
from agent_reach_sdk.context import install_request_id_logging
from agent_reach_sdk.servers import AgentServer, server_class
from agent_reach_sdk.tracing import agent_tracer
from agent_reach_sdk.wire import Dispatch
from reach.limits import DEFAULT_MAX_MESSAGE_BYTES

__all__ = ["AgentRuntime", "OperationError"]

log = logging.getLogger("agent_reach_sdk")

T = TypeVar("T")


class _On(Generic[T]):
    """An attribute of the runtime that lives on one of its pieces: read and set on the runtime
    as before the split, it is the piece's own (so a change reaches the piece that uses it)."""

    def __init__(self, piece: str, name: str = "") -> None:
        self._piece = piece
        self._name = name

    def __set_name__(self, owner: type, name: str) -> None:
        self._name = self._name or name
        self._get = operator.attrgetter(f"{self._piece}.{self._name}")

    @overload
    def __get__(self, obj: None, owner: type) -> Self: ...
    @overload
    def __get__(self, obj: object, owner: type) -> T: ...
    def __get__(self, obj: object, owner: type) -> T | Self:
        if obj is None:
            return self
        value: T = self._get(obj)
        return value

    def __set__(self, obj: object, value: T) -> None:
        setattr(getattr(obj, self._piece), self._name, value)


class AgentRuntime:
    # Kept by the registry client: what the agent tells the gateway.
    reach_url = _On[str]("_registry")  # the gateway talked to now
    reach_urls = _On[tuple[str, ...]]("_registry")  # every gateway, in order of preference
    capability = _On[str]("_registry")
    instance_id = _On[str]("_registry")
    protocol = _On[str]("_registry")
    service_address = _On[str]("_registry")
    heartbeat_interval = _On[float]("_registry")
    token = _On[str | None]("_registry")
    health_check = _On[HealthCheck | None]("_registry")
    async_callback = _On[bool]("_registry")
    weight = _On[int]("_registry")
    max_inflight = _On[int | None]("_registry")
    ack = _On[dict[str, Any] | None]("_registry")
    # Kept by the dispatcher: operations actually run (re-deliveries answered from memory
    # excluded).
    executed = _On[int]("_dispatcher")
    # Private, read and set by tests that drive one piece through the runtime.
    _client = _On[httpx.AsyncClient | None]("_registry", "client")
    _tracer = _On[Any]("_dispatcher", "tracer")
    _overdue = _On[dict[str, asyncio.Task[Any]]]("_deadlines", "overdue")

    def __init__(
        self,
        capability: str,
        *,
        reach_address: str | Sequence[str] | None = None,
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
        """`reach_address` is the gateway (`host:port` or a URL), or several: a list of them, or
        one string of them separated by commas. With several, the first is used until it fails
        (connection refused or reset, a timeout, a 5xx); then the next is tried at once, and
        the agent stays with whichever answers (see docs/agents.md, "Several gateways").

        `service_address` is where Reach calls this instance: `host:port` for http, grpc
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
        _settings.check_int("weight", weight, MAX_WEIGHT)
        if max_inflight is not None:
            _settings.check_int("max_inflight", max_inflight, MAX_INFLIGHT)
        self._server_class = server_class(protocol)  # an unknown protocol fails here
        install_request_id_logging()
        self.tls = _settings.tls_files(protocol, tls_cert, tls_key, tls_ca)
        instance_id = (
            instance_id or _settings.certified_id(self.tls) or default_instance_id(capability)
        )
        _settings.check_certified(self.tls, instance_id)
        service_address = service_address or self._server_class.default_address
        self._listen = listen or service_address
        self._tracing = tracing
        self._tracer_provider: Any = None  # the provider built here, flushed at stop
        self._server: AgentServer | None = None
        self._deadlines = DeadlineKeeper()
        self._answers = AnswerCache(remember, remember_bytes, still_running=self._deadlines.overdue)
        self._dispatcher = Dispatcher(
            capability=capability,
            instance_id=instance_id,
            protocol=protocol,
            max_message_bytes=max_message_bytes,
            answers=self._answers,
            deadlines=self._deadlines,
        )
        self._registry = RegistryClient(
            reach_urls=_settings.reach_urls(reach_address),
            token=token or os.environ.get("REACH_AGENT_TOKEN") or None,
            capability=capability,
            instance_id=instance_id,
            protocol=protocol,
            service_address=service_address,
            heartbeat_interval=heartbeat_interval,
            health_check=health_check,
            max_message_bytes=max_message_bytes,
            async_callback=async_callback,
            weight=weight,
            max_inflight=max_inflight,
            operations=self._dispatcher.join_operations,
            running=lambda: self._answers.running,
            on_join=self._negotiated,
        )
        self._host = _host.ThreadHost()

    @property
    def max_message_bytes(self) -> int:
        """The largest message either way: the one offered until a Join negotiates it."""
        return self._registry.max_message_bytes

    @max_message_bytes.setter
    def max_message_bytes(self, value: int) -> None:
        self._registry.max_message_bytes = value
        self._dispatcher.max_message_bytes = value

    def _negotiated(self, max_message_bytes: int) -> None:
        self._dispatcher.max_message_bytes = max_message_bytes
        if self._server is not None:
            self._server.max_body_bytes = max_message_bytes

    # -- operations ---------------------------------------------------------------------------

    def operation(
        self,
        name: str,
        *,
        idempotent: bool | None = None,
        timeout_ms: int | None = None,
        input_schema: dict[str, Any] | None = None,
        description: str | None = None,
    ) -> Callable[[OperationFunc], OperationFunc]:
        """Register `func(payload)` or `func(payload, ctx)`, sync or async, as operation `name`.

        `idempotent=True` declares that running it twice is safe, so Reach may retry it on a
        retryable failure (`False`: never without the caller's idempotency key); `timeout_ms`
        is its own deadline (1 ms to 24 h). Both are sent at Join; Reach's configuration for
        the operation, where it has one, wins.

        `input_schema` (a JSON Schema object) and `description` say what the operation takes
        and does (Reach's MCP front lists them as the tool's); by default they are derived from
        the handler: its docstring, and the payload's annotation (a pydantic model, which the
        handler is then handed validated, or a TypedDict; see `agent_reach_sdk._schema`)."""
        return self._dispatcher.operation(
            name,
            idempotent=idempotent,
            timeout_ms=timeout_ms,
            input_schema=input_schema,
            description=description,
        )

    @property
    def operations(self) -> list[str]:
        return self._dispatcher.operations

    @property
    def dispatch(self) -> Dispatch:
        """Answer one request, whatever protocol it came by (the servers call this): the
        dispatcher's own, so serving a request goes through nothing of the runtime's."""
        return self._dispatcher.dispatch

    @property
    def remembered(self) -> tuple[int, int]:
        """How many answers the duplicate memory holds, and their bytes as sent."""
        return self._answers.remembered

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
        dispatcher, registry = self._dispatcher, self._registry
        if dispatcher.tracer is None:
            dispatcher.tracer, self._tracer_provider = agent_tracer(self._tracing, self.capability)
        self._server = self._server_class(
            self.dispatch,
            listen=self._listen,
            advertise=registry.service_address,
            instance_id=registry.instance_id,
            max_body_bytes=self.max_message_bytes,
            tls=self.tls,
        )
        await self._server.start()
        registry.service_address = self._server.service_address
        registry.open()
        try:
            await registry.join()
        except httpx.HTTPError as exc:
            where = ", ".join(registry.reach_urls)  # each was tried
            log.warning("cannot join Reach at %s yet (%r); retrying", where, exc)
        except BaseException:
            # Refused (or cancelled): nothing may stay bound for a retry to trip over.
            await self.astop(leave=False, grace_s=0)
            raise
        registry.start_heartbeats()

    async def astop(self, *, leave: bool = True, grace_s: float = 5.0) -> None:
        """Leave Reach (no new traffic is routed here), stop taking requests, and let those
        in flight finish for up to `grace_s` seconds."""
        registry = self._registry
        await registry.stop_heartbeats()
        if leave:
            await registry.leave()
        registry.joined.clear()
        if self._server is not None:
            await self._server.close(grace_s)
            self._server = None
        # Handlers cancelled at their deadline or just now: their cleanup runs.
        await self._deadlines.drain(grace_s)
        await registry.close()
        if self._tracer_provider is not None:  # the spans of the requests just finished
            await asyncio.to_thread(self._tracer_provider.force_flush, 3000)

    def run(self) -> None:
        """Serve until Ctrl-C or SIGTERM, then leave cleanly (the smallest agent's last line)."""
        _host.run(self.serve_forever)

    async def serve_forever(self) -> None:
        """`run()` for asyncio code: serve on this loop until SIGINT/SIGTERM, then leave."""
        await _host.serve_until_signalled(
            self, lambda: (self.capability, self.protocol, self.service_address)
        )

    def start(self) -> None:
        """Start in a background thread (for plain, non-asyncio scripts)."""
        self._host.start(self.astart, self.astop, name=f"reach-{self.instance_id}")

    def stop(self) -> None:
        self._host.stop()

    def wait_joined(self, timeout: float | None = None) -> bool:
        return self._registry.joined.wait(timeout)

    # -- talking to Reach ---------------------------------------------------------------------

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
        not standard JSON): Reach would refuse it, so it is not sent; `RuntimeError` when Reach
        refuses it (the message says what Reach said).
        """
        await self._registry.send_result(
            request_id, result, error_type=error_type, error_message=error_message
        )

    async def _join(self) -> None:
        """One Join over `_client` (tests drive it with a stand-in gateway)."""
        await self._registry.join()
