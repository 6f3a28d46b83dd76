"""The sections for what Reach connects to: the registry store, agents (transport), callbacks
and Temporal (with the dev server `reach up` embeds)."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import ConfigDict, Field, field_validator, model_validator

from reach.config.base import Section
from reach.invocation import CallbackPlan
from reach.limits import (
    DEFAULT_MAX_MESSAGE_BYTES,
    TEMPORAL_GRPC_LIMIT_BYTES,
    TEMPORAL_PAYLOAD_LIMIT_BYTES,
)


class RegistrySettings(Section):
    type: Literal["memory", "redis"] = Field(
        default="memory",
        description="Where instances, breakers, limits and keys live: memory (one process) or "
        "redis (shared by every gateway and worker).",
    )
    heartbeat_timeout: float = Field(
        default=30.0,
        gt=0,
        le=86_400,
        description="Seconds without a heartbeat before an instance is evicted.",
    )
    heartbeat_interval: float = Field(
        default=5.0,
        gt=0,
        description="Seconds between heartbeats, proposed to agents in the Ack; shorter than "
        "heartbeat_timeout.",
    )
    redis_url: str = Field(
        default="redis://127.0.0.1:6379/0",
        description="The Redis (type: redis); its scheme names the topology. redis:// (rediss://, "
        "unix://) one server; redis+sentinel://host:26379[,host:port...]/<master name>[/<db>] "
        "the master those sentinels name, followed across a failover (?sentinel_password= when "
        "the sentinels have their own); redis+cluster://host:6379[,host:port...] a Redis "
        "Cluster, every key of key_prefix in one hash slot ({<key_prefix>}). "
        "See docs/scale-out.md.",
    )
    key_prefix: str = Field(
        default="reach",
        min_length=1,
        description="Prefix of every Redis key and channel Reach uses: deployments sharing one "
        "Redis keep apart by it.",
    )
    redis_timeout_s: float = Field(
        default=1.0,
        gt=0,
        le=60,
        description="Socket timeout for every Redis command: a stuck Redis is a 503, not a hang.",
    )
    redis_max_connections: int = Field(
        default=64,
        ge=2,
        le=10_000,
        description="Connections per process; past them a command waits (up to "
        "redis_timeout_s) for one to free.",
    )
    capability_retention_s: float = Field(
        default=3600.0,
        gt=0,
        le=30 * 86_400,
        description="How long a capability whose instances all left stays known (503 "
        "no_instance rather than 404 unknown_capability); then its name is forgotten.",
    )
    max_capabilities: int = Field(
        default=1000,
        ge=1,
        le=1_000_000,
        description="Most capabilities the registry holds (each is kept capability_retention_s "
        "and is a metrics label); a Join for a new one past it is refused 503 unavailable. "
        "Re-joins and new instances of known capabilities are not.",
    )
    new_capabilities_per_minute: int = Field(
        default=60,
        ge=1,
        le=1_000_000,
        description="Most new capabilities one principal may create per minute (agent tokens "
        "by name; admin tokens and open mode share one count); past it a Join is 429.",
    )

    @field_validator("redis_url")
    @classmethod
    def _redis_url_names_a_topology(cls, url: str) -> str:
        # The store's own parser, so a URL it would refuse at start-up is refused here, by
        # `reach config check` too. Imported late: reach.store imports reach.config.
        from reach.store.redis_connect import parse_redis_url

        parse_redis_url(url)
        return url

    @model_validator(mode="after")
    def _interval_below_timeout(self) -> RegistrySettings:
        if self.heartbeat_interval >= self.heartbeat_timeout:
            raise ValueError("heartbeat_interval must be shorter than heartbeat_timeout")
        return self


class TransportSettings(Section):
    default_protocol: str = Field(
        default="http",
        description="From the seed's schema (SPEC R7); nothing reads it: a Join that names no "
        "protocol is http.",
    )
    ports: dict[str, Annotated[int, Field(ge=-1, le=65535)]] = Field(
        default_factory=lambda: {"http": 7600, "grpc": 7601},
        description="grpc: the gateway's gRPC front (0 = any free port, -1 = off). The HTTP "
        "port is `listen_port`; an `http` key that says another port is an error.",
    )
    max_message_bytes: int = Field(
        default=DEFAULT_MAX_MESSAGE_BYTES,
        ge=1024,
        description="Largest payload or result, as sent (compact UTF-8 JSON); at most "
        "temporal.payload_limit_bytes minus 64 KiB for the envelope around it.",
    )
    idle_timeout_s: float = Field(
        default=60.0, gt=0, description="Connections to an agent idle this long are closed."
    )
    max_pools: int = Field(
        default=1024, ge=1, description="Most agent addresses with open connections at once."
    )
    drain_s: float = Field(
        default=20.0,
        ge=0,
        le=3600,
        description="When the gateway stops (SIGTERM), synchronous waits in flight are let "
        "finish this long at most; one still open is then answered `running` (504) with its "
        "RequestID, and the request goes on. Keep it below the platform's stop grace "
        "(Kubernetes: terminationGracePeriodSeconds).",
    )
    # The gateway's own HTTP port (gateway_api.http_limits): what a connection may hold.
    http_keep_alive_s: int = Field(
        default=75,
        ge=1,
        le=3600,
        description="An idle keep-alive connection to the gateway's HTTP port is closed after "
        "this long; longer than clients keep one (httpx 5 s, aiohttp 15 s), so they close first.",
    )
    http_header_timeout_s: float = Field(
        default=10.0,
        gt=0,
        le=600,
        description="A request's headers must arrive within this long of its first byte (of "
        "the connection, for its first request); else 408 and the connection is closed.",
    )
    http_body_timeout_s: float = Field(
        default=60.0,
        gt=0,
        le=3600,
        description="A request's whole body must arrive within this long of its headers; else "
        "the connection is closed (nothing was accepted).",
    )
    max_connections: int = Field(
        default=1000,
        ge=1,
        le=1_000_000,
        description="Most HTTP connections the gateway holds at once; a request on one past "
        "them is answered 503 unavailable (Retry-After) and its connection closed.",
    )
    grpc_max_connections: int = Field(
        default=1000,
        ge=1,
        le=1_000_000,
        description="Most connections the gateway's gRPC front holds at once; one past them is "
        "closed as it is accepted (its client sees UNAVAILABLE 'Socket closed', nothing read).",
    )
    grpc_max_concurrent_rpcs: int = Field(
        default=1000,
        ge=1,
        le=1_000_000,
        description="Most Invoke and Join calls in flight on the gRPC front at once, and as "
        "many open Heartbeat streams apart; a call past them ends UNAVAILABLE with the 503 "
        "envelope naming this setting and grpc-retry-pushback-ms, before anything is read.",
    )
    max_inflight_bytes: int = Field(
        default=32 * 1024 * 1024,
        ge=0,
        description="Most bytes of invoke bodies the door holds at once (each costs the "
        "gateway 12-22 times its size in memory until answered: bench/door_memory.py); past it a "
        "new invoke is refused 503 unavailable with Retry-After before its body is read, and "
        "was not started. One invoke is always admitted when none is in flight. 0: no bound.",
    )
    caller_inflight_share: float = Field(
        default=0.5,
        gt=0,
        le=1,
        description="The share of max_inflight_bytes one caller may hold while it holds any: "
        "past it its next invoke is refused 503 unavailable with Retry-After (not started) and "
        "the rest stays for other callers. 1: no share, only the whole bound.",
    )


class CallbackSettings(CallbackPlan):
    # Bounded here, not on CallbackPlan: plans already in histories must keep decoding.
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    attempt_timeout_s: float = Field(
        default=10.0, gt=0, le=3600, description="How long one POST to the callback URL may take."
    )
    retry_window_s: float = Field(
        default=3600.0,
        gt=0,
        le=30 * 86_400,
        description="How long a callback is retried until the receiver answers 2xx; then its "
        "delivery is given_up (the result stays readable).",
    )
    initial_backoff_s: float = Field(
        default=1.0, gt=0, le=86_400, description="The first wait between callback attempts."
    )
    max_backoff_s: float = Field(
        default=5.0,
        gt=0,
        le=86_400,
        description="The longest wait between callback attempts (the wait doubles up to it): "
        "a receiver that is back is served within about this long. retry_window_s bounds how "
        "long it is tried (at 5 s, some 720 attempts an hour for a receiver that stays down).",
    )


class DevServerSettings(Section):
    """The embedded Temporal dev server that `reach up` starts."""

    db_filename: str = Field(
        default=".reach/temporal.db",
        description="The dev server's SQLite file: requests outlive a restart of `reach up`.",
    )
    port: int = Field(default=7233, description="The dev server's gRPC port (Temporal's frontend).")
    ui_port: int = Field(default=8233, description="The dev server's Temporal UI port.")
    headless: bool = Field(default=False, description="true: the dev server serves no UI.")
    retention_hours: float = Field(
        default=72.0,
        ge=24,
        description="How long closed requests are kept, and so how long a RequestID stays "
        "deduplicated (Temporal's namespace retention; its minimum is one day).",
    )


class TemporalSettings(Section):
    address: str = Field(
        default="127.0.0.1:7233",
        description="The Temporal frontend (host:port); TEMPORAL_ADDRESS wins over it. Unset, "
        "it follows temporal.dev_server.port (127.0.0.1:<port>), so moving the embedded dev "
        "server moves what the gateway, worker.py and the CLI talk to.",
    )
    namespace: str = Field(
        default="default",
        description="The Temporal namespace; its retention is how long a RequestID is "
        "deduplicated. TEMPORAL_NAMESPACE wins over it.",
    )
    task_queue: str = Field(
        default="reach-invoke",
        description="The invoke workflows' task queue (queue-mode calls use "
        "reach-cap-<capability>).",
    )
    connect_wait_s: float = Field(
        default=30.0,
        ge=0,
        le=3600,
        description="How long start-up waits for Temporal to answer; and how long `reach "
        "gateway` goes on without an answer from it before it exits with an error (`reach up` "
        "restarts its own dev server instead).",
    )
    rpc_timeout_s: float = Field(
        default=5.0,
        gt=0,
        le=300,
        description="How long one call to Temporal (start, describe, update) may take before "
        "the caller gets a 503: a stuck server is an answer, not a hang.",
    )
    payload_limit_bytes: int = Field(
        default=TEMPORAL_PAYLOAD_LIMIT_BYTES,
        gt=128 * 1024,
        description="The cluster's largest payload blob (server dynamic config "
        "limit.blobSize.error; 2 MiB unless your cluster raised it).",
    )
    grpc_limit_bytes: int = Field(
        default=TEMPORAL_GRPC_LIMIT_BYTES,
        gt=512 * 1024,
        description="The largest gRPC message the cluster takes (4 MiB by default).",
    )
    workflow_sandbox: bool = Field(
        default=False,
        description="Run InvokeWorkflow in the SDK's determinism sandbox. The sandbox re-imports "
        "the workflow module for every request (~9 ms per invoke here, bench/invoke.py); "
        "the workflow is Reach's own code, so the test suite runs it sandboxed and replays "
        "committed histories, and production runs it without.",
    )
    inline_activations: bool = Field(
        default=True,
        description="Run InvokeWorkflow's activations on the process's event loop rather than "
        "handing each to a thread (unsandboxed only; the sandbox always uses threads). Saves "
        "two thread hand-offs per activation: ~1 ms of CPU per invoke, ~10% more throughput "
        "(bench/invoke.py). It is the SDK's debug_mode path: no deadlock detection, and while an "
        "activation runs the process serves nothing else, so a slow one (a bug) would hold "
        "HTTP and heartbeats as long as it ran, where threads fail its task after 2 s. Reach's "
        "workflow never blocks (the test suite runs it in the sandbox, which refuses blocking "
        "calls); false restores the thread pool.",
    )
    workflow_task_timeout_s: float = Field(
        default=2.0,
        gt=0,
        le=120,
        description="How long a workflow task may run before Temporal gives it to another "
        "worker (the start's task_timeout): after a SIGKILL of the process that ran a "
        "request's task, the request waits this long before anyone else takes it. A local "
        "activity longer than 80% of it costs one workflow task heartbeat each (three "
        "history events and a round trip to Temporal); see Operations, Recovery.",
    )
    sticky_schedule_to_start_s: float = Field(
        default=2.0,
        gt=0,
        le=120,
        description="How long a request's next workflow task waits for the worker that ran "
        "its last one (its sticky queue) before any worker may take it: the wait after that "
        "worker died. A busy worker that does not take it in time hands it on, and the next "
        "worker replays the history instead of resuming the run from its cache.",
    )
    dev_server: DevServerSettings = Field(
        default_factory=DevServerSettings,
        description="The embedded Temporal dev server that `reach up` starts.",
    )
    ui_url: str | None = Field(
        default=None,
        pattern=r"^https?://[^\s]+$",
        description="The Temporal UI's base URL, which the dashboard (/ui) links each request "
        "to. Default: http://127.0.0.1:<dev_server.ui_port> (no links when dev_server.headless).",
    )

    @property
    def ui_base_url(self) -> str | None:
        """`ui_url`, else the embedded dev server's UI (None: headless, no UI to link to)."""
        if self.ui_url:
            return self.ui_url.rstrip("/")
        return None if self.dev_server.headless else f"http://127.0.0.1:{self.dev_server.ui_port}"

    @model_validator(mode="after")
    def _address_follows_the_dev_server(self) -> TemporalSettings:
        # Only when nobody wrote an address: a written one (or TEMPORAL_ADDRESS, applied by
        # the client) always wins.
        if "address" not in self.model_fields_set and "port" in self.dev_server.model_fields_set:
            self.address = f"127.0.0.1:{self.dev_server.port}"
        return self
