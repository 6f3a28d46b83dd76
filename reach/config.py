"""One validated settings model for `reach.yaml` plus `REACH_…` environment overrides (R7, R26).

Precedence, highest first: explicit keyword arguments, `REACH_…` environment variables (nested
fields with `__`, e.g. `REACH_REGISTRY__TYPE=redis`), the YAML file, the defaults below. The
Temporal connection also honours the standard `TEMPORAL_ADDRESS`, `TEMPORAL_NAMESPACE`,
`TEMPORAL_API_KEY` and `TEMPORAL_TLS_*` variables (applied where the client connects).

A wrong field fails at start-up with a message that names the file and the field.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SecretStr,
    ValidationError,
    field_validator,
    model_validator,
)
from pydantic_settings import (
    BaseSettings,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
)

from reach.invocation import CallbackPlan, CapabilityMode
from reach.limits import (
    DEFAULT_MAX_MESSAGE_BYTES,
    TEMPORAL_GRPC_LIMIT_BYTES,
    TEMPORAL_PAYLOAD_LIMIT_BYTES,
    max_message_ceiling,
)
from reach.messages import MAX_TIMEOUT_MS

DEFAULT_CONFIG_FILE = "reach.yaml"
DAY_MS = 86_400_000
CONFIG_ENV_VAR = "REACH_CONFIG"


class ConfigError(Exception):
    """The configuration is invalid; the message names the source and the field."""


class _Section(BaseModel):
    # Every number finite: `.inf` in a timeout would pass `gt=0` and break every request.
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)


class RegistrySettings(_Section):
    type: Literal["memory", "redis"] = "memory"
    heartbeat_timeout: float = Field(default=30.0, gt=0, le=86_400, description="seconds")
    heartbeat_interval: float = Field(default=5.0, gt=0, description="seconds")
    redis_url: str = "redis://127.0.0.1:6379/0"
    key_prefix: str = Field(default="reach", min_length=1)
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

    @model_validator(mode="after")
    def _interval_below_timeout(self) -> RegistrySettings:
        if self.heartbeat_interval >= self.heartbeat_timeout:
            raise ValueError("heartbeat_interval must be shorter than heartbeat_timeout")
        return self


class TransportSettings(_Section):
    default_protocol: str = "http"
    ports: dict[str, Annotated[int, Field(ge=-1, le=65535)]] = Field(
        default_factory=lambda: {"http": 7600, "grpc": 7601},
        description="grpc: the gateway's gRPC front (0 = any free port, -1 = off). The HTTP "
        "port is `listen_port`.",
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


class RetrySettings(_Section):
    """How a retryable failure is tried again (R13): exponential backoff on durable timers."""

    max_retries: int = Field(default=2, ge=0, le=10)
    backoff_base_ms: int = Field(default=1000, ge=1, le=DAY_MS, description="the first backoff")
    backoff_multiplier: float = Field(default=2.0, ge=1.0, le=10.0)
    backoff_cap_ms: int = Field(default=30_000, ge=1, le=DAY_MS, description="no backoff is longer")
    jitter: float = Field(
        default=0.0,
        ge=0.0,
        le=1.0,
        description="each backoff is shortened by up to this fraction, at random",
    )


class CircuitBreakerSettings(_Section):
    """One breaker per capability, shared by every gateway and worker through the store (R14)."""

    enabled: bool = True
    error_threshold: int = Field(
        default=3, ge=1, description="failures that open it (consecutive, or within `window`)"
    )
    window: int = Field(
        default=0,
        ge=0,
        le=64,
        description="0: `error_threshold` consecutive failures open it; N: that many failures "
        "among the last N outcomes do",
    )
    open_duration_ms: int = Field(default=10_000, ge=1, le=DAY_MS)
    half_open_probes: int = Field(
        default=1, ge=1, le=100, description="requests let through after open_duration_ms"
    )

    @model_validator(mode="after")
    def _threshold_fits_window(self) -> CircuitBreakerSettings:
        if self.window and self.error_threshold > self.window:
            raise ValueError("error_threshold cannot exceed window")
        return self


class OutlierSettings(_Section):
    """Per-instance ejection from routing after consecutive failures."""

    enabled: bool = True
    consecutive_failures: int = Field(default=3, ge=1, le=1000)
    base_ejection_ms: int = Field(
        default=30_000, ge=1, le=DAY_MS, description="first ejection; doubles with each repeat"
    )
    max_ejection_ms: int = Field(default=300_000, ge=1, le=DAY_MS)


class LimitSettings(_Section):
    """A token bucket: `per_minute` tokens a minute, at most `burst` saved up."""

    per_minute: float = Field(ge=0.01, le=6_000_000, allow_inf_nan=False)
    burst: int | None = Field(
        default=None, ge=1, le=1_000_000_000, description="defaults to per_minute"
    )

    @property
    def capacity(self) -> int:
        return self.burst if self.burst is not None else max(1, int(self.per_minute))


class RateLimitSettings(_Section):
    """R15: per (caller, capability) and per capability, atomic across processes."""

    per_caller: LimitSettings | None = None
    per_capability: LimitSettings | None = None
    on_limit: Literal["reject", "queue"] = "reject"
    max_queue_wait_ms: int = Field(
        default=3_600_000,
        ge=0,
        le=2 * DAY_MS,
        description="how long a request with a callback may wait for a token (queue); a "
        "synchronous one waits at most until its deadline",
    )


class OperationSettings(_Section):
    """Per 'capability:operation' (R23); what is written here overrides what agents declare."""

    timeout_ms: int | None = Field(default=None, ge=1, le=MAX_TIMEOUT_MS)
    idempotent: bool | None = None
    retry: RetrySettings | None = None


class CapabilityPolicySettings(OperationSettings):
    """Per capability; unset fields fall back to the `policy` defaults."""

    circuit_breaker: CircuitBreakerSettings | None = None
    outlier: OutlierSettings | None = None
    rate_limit: RateLimitSettings | None = None


class PolicySettings(_Section):
    default_retry: int = Field(
        default=2, ge=0, le=10, description="retry.max_retries, where `retry` does not say"
    )
    default_timeout_ms: int = Field(default=5000, ge=1, le=MAX_TIMEOUT_MS)
    retry: RetrySettings | None = None
    idempotent_operations: list[str] = Field(
        default_factory=list,
        description="Operations idempotent for every capability. An operation that no agent "
        "declared idempotent and no configuration names is not retried without an "
        "idempotency_key (R13).",
    )
    idempotency_retention_s: float = Field(
        default=86_400.0,
        gt=0,
        le=30 * 86_400,
        allow_inf_nan=False,
        description="How long an idempotency_key keeps its first request's result.",
    )
    capabilities: dict[str, CapabilityPolicySettings] = Field(default_factory=dict)
    operations: dict[str, OperationSettings] = Field(
        default_factory=dict, description="Per 'capability:operation' overrides (R23)."
    )
    circuit_breaker: CircuitBreakerSettings = Field(default_factory=CircuitBreakerSettings)
    outlier: OutlierSettings = Field(default_factory=OutlierSettings)
    rate_limit: RateLimitSettings | None = None

    @model_validator(mode="after")
    def _operation_keys(self) -> PolicySettings:
        for key in self.operations:
            cap, sep, op = key.partition(":")
            if not (sep and cap and op):
                raise ValueError(
                    f"operations key {key!r} must be 'capability:operation', "
                    "e.g. 'knowledge-retriever:query'"
                )
        return self

    def retry_for(self, capability: str, operation: str) -> RetrySettings:
        op = self.operations.get(f"{capability}:{operation}")
        cap = self.capabilities.get(capability)
        for chosen in (op.retry if op else None, cap.retry if cap else None, self.retry):
            if chosen is not None:
                return chosen
        return RetrySettings(max_retries=self.default_retry)

    def breaker_for(self, capability: str) -> CircuitBreakerSettings:
        cap = self.capabilities.get(capability)
        return (cap.circuit_breaker if cap else None) or self.circuit_breaker

    def outlier_for(self, capability: str) -> OutlierSettings:
        cap = self.capabilities.get(capability)
        return (cap.outlier if cap else None) or self.outlier

    def rate_limit_for(self, capability: str) -> RateLimitSettings | None:
        cap = self.capabilities.get(capability)
        return (cap.rate_limit if cap else None) or self.rate_limit


HASH_ON_PATTERN = r"^(routing_key|payload(\.[A-Za-z0-9_-]{1,64}){1,8})$"


class RoutingSettings(_Section):
    """How one capability's instances are chosen (R12, R17, R22); `routing:` holds the defaults
    and `capabilities.<name>.routing` what a capability changes."""

    strategy: str | None = Field(
        default=None,
        pattern=r"^[a-z0-9_]{1,64}$",
        description="round_robin (default), weighted_round_robin, least_request, "
        "consistent_hash, or a plug-in of the entry-point group agent_reach.routing",
    )
    hash_on: str | None = Field(
        default=None,
        pattern=HASH_ON_PATTERN,
        description="consistent_hash: the request's routing_key (default), or a payload field "
        "such as payload.user_id (the routing_key is used when the field is missing)",
    )
    vnodes: int | None = Field(
        default=None, ge=1, le=1000, description="virtual nodes per instance of weight 1"
    )
    balance_factor: float | None = Field(
        default=None,
        ge=1.0,
        le=100.0,
        description="consistent_hash: no instance takes more than this times the mean "
        "in-flight load (bounded load)",
    )
    fallback: str | None = Field(
        default=None,
        pattern=r"^[a-z0-9_]{1,64}$",
        description="the strategy for a consistent_hash request without a key",
    )
    weights: dict[str, Annotated[int, Field(ge=1, le=1000)]] | None = Field(
        default=None, description="instance id -> weight; overrides the weight sent at Join"
    )
    max_inflight: int | None = Field(
        default=None,
        ge=1,
        le=1_000_000,
        description="requests in flight at which an instance is passed over (an instance's "
        "own max_inflight from Join, when smaller, holds)",
    )


class RoutingDefaults(RoutingSettings):
    """The `routing:` section: every capability's defaults, and the view and lease knobs."""

    strategy: str | None = Field(default="round_robin", pattern=r"^[a-z0-9_]{1,64}$")
    vnodes: int | None = Field(default=100, ge=1, le=1000)
    balance_factor: float | None = Field(default=1.25, ge=1.0, le=100.0)
    fallback: str | None = Field(default="round_robin", pattern=r"^[a-z0-9_]{1,64}$")
    inflight_lease_s: float = Field(
        default=10.0,
        ge=1.0,
        le=3600.0,
        description="a process renews its in-flight counts this often (x1/3); a crashed "
        "process's counts expire after it",
    )
    inflight_refresh_ms: int = Field(
        default=100,
        ge=10,
        le=60_000,
        description="how stale other processes' in-flight counts may be when routing",
    )
    view_resync_s: float = Field(
        default=5.0,
        ge=0.5,
        le=3600.0,
        description="the local registry view is re-read whole this often (Redis), besides "
        "the change events that keep it fresh within milliseconds",
    )

    def merged(self, override: RoutingSettings | None) -> RoutingSettings:
        """A capability's routing: what it sets, else these defaults."""
        base = {name: getattr(self, name) for name in RoutingSettings.model_fields}
        if override is not None:
            base |= override.model_dump(exclude_none=True)
        return RoutingSettings.model_validate(base)


class CapabilitySettings(_Section):
    mode: CapabilityMode = "inline"
    routing: RoutingSettings | None = None


class CallbackSettings(CallbackPlan):
    # Bounded here, not on CallbackPlan: plans already in histories must keep decoding.
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    attempt_timeout_s: float = Field(default=10.0, gt=0, le=3600)
    retry_window_s: float = Field(default=3600.0, gt=0, le=30 * 86_400)
    initial_backoff_s: float = Field(default=1.0, gt=0, le=86_400)
    max_backoff_s: float = Field(default=60.0, gt=0, le=86_400)


class DevServerSettings(_Section):
    """The embedded Temporal dev server that `reach up` starts."""

    db_filename: str = ".reach/temporal.db"
    port: int = 7233
    ui_port: int = 8233
    headless: bool = False
    retention_hours: float = Field(
        default=72.0,
        ge=24,
        description="How long closed requests are kept, and so how long a RequestID stays "
        "deduplicated (Temporal's namespace retention; its minimum is one day).",
    )


class TemporalSettings(_Section):
    address: str = "127.0.0.1:7233"
    namespace: str = "default"
    task_queue: str = "reach-invoke"
    connect_wait_s: float = Field(
        default=30.0, ge=0, le=3600, description="How long start-up waits for Temporal to answer."
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
    dev_server: DevServerSettings = Field(default_factory=DevServerSettings)
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


SECRET_KEY_NAMES = (
    "password",
    "token",
    "secret",
    "api_key",
    "authorization",
    "credentials",
    "passwd",
    "passphrase",
    "private_key",
    "cookie",
)


class AuthSettings(_Section):
    """Who may use the gateway (R18): bearer tokens for callers, agents and admins."""

    mode: Literal["auto", "tokens", "open"] = Field(
        default="auto",
        description="auto: tokens are required as soon as one exists, and until then the "
        "gateway serves only on loopback; tokens: always required; open: never (must be "
        "written explicitly to serve a non-loopback address without tokens).",
    )
    tokens_file: str = Field(
        default=".reach/tokens.json",
        description="Where tokens live with the memory registry (with redis: in Redis).",
    )
    resync_s: float = Field(
        default=30.0,
        gt=0,
        le=3600,
        description="A full re-read of the token store this often, besides change notices.",
    )


class RuleSettings(_Section):
    """One authorization rule, in R19's shape. `*` matches any caller or capability."""

    name: str | None = Field(default=None, max_length=128, description="Named in 403s and audit.")
    caller: str = Field(min_length=1, max_length=128)
    target_capability: str = Field(min_length=1, max_length=64)
    allowed_operations: list[str] = Field(default_factory=list)
    denied_operations: list[str] = Field(default_factory=list)
    rate_limit_per_minute: float | None = Field(default=None, ge=0.01, le=6_000_000)

    @property
    def label(self) -> str:
        return self.name or f"{self.caller}->{self.target_capability}"


class AuditSettings(_Section):
    """One redacted JSON record per invoke, Join, eviction, token change, denial (R20)."""

    sink: Literal["file", "stdout", "both", "none"] = "file"
    file: str = ".reach/audit.jsonl"
    max_string: int = Field(
        default=256, ge=8, le=1_000_000, description="Longer strings keep {len, sha256} only."
    )
    redact_keys: list[str] = Field(default_factory=lambda: list(SECRET_KEY_NAMES))
    flush_interval_ms: int = Field(default=200, ge=1, le=60_000)


class TlsSettings(_Section):
    """mTLS between Reach and agents: Reach presents `cert_file` and verifies each agent's
    certificate against `ca_file`, for the identity spiffe://<trust_domain>/agent/<id>."""

    enabled: bool = False
    ca_file: str = ".reach/certs/ca.pem"
    cert_file: str = ".reach/certs/reach.pem"
    key_file: str = ".reach/certs/reach-key.pem"
    trust_domain: str = Field(default="reach.local", pattern=r"^[a-z0-9][a-z0-9.-]{0,252}$")


class EncryptionSettings(_Section):
    """AES-GCM encryption of every payload in workflow history (a Temporal payload codec)."""

    enabled: bool = False
    active_key: str | None = Field(default=None, description="The key id new payloads use.")
    keys: dict[str, SecretStr] = Field(
        default_factory=dict,
        description="key id -> base64 of 32 random bytes; keep old ids to read old requests. "
        'Set through REACH_SECURITY__ENCRYPTION__KEYS=\'{"k1": "..."}\', not in the file.',
    )
    codec_cors_origins: list[str] = Field(
        default_factory=lambda: ["http://localhost:8233", "http://127.0.0.1:8233"],
        description="Browser origins (the Temporal UI) allowed to call /codec/encode and "
        "/codec/decode.",
    )

    @model_validator(mode="after")
    def _active_key_known(self) -> EncryptionSettings:
        if self.enabled and (self.active_key is None or self.active_key not in self.keys):
            raise ValueError("encryption.enabled needs active_key naming one of keys")
        return self

    @model_validator(mode="after")
    def _keys_are_aes256(self) -> EncryptionSettings:
        if not self.keys:
            return self
        from reach.security.crypto import decode_key  # cryptography loads only when used

        for key_id, secret in self.keys.items():
            try:
                decode_key(secret.get_secret_value())
            except ValueError as exc:  # the message names the key id, never its value
                raise ValueError(f"keys.{key_id} {exc}") from None
        return self


class SecuritySettings(_Section):
    allow_networks: list[str] = Field(
        default_factory=list,
        description="Networks (CIDR) callback URLs and agent addresses may resolve to beyond "
        "global unicast, e.g. 127.0.0.0/8 for development. Empty: global addresses only.",
    )
    tls: TlsSettings = Field(default_factory=TlsSettings)
    encryption: EncryptionSettings = Field(default_factory=EncryptionSettings)
    webhook_key: SecretStr | None = Field(
        default=None,
        description="Master secret for signing callbacks; each caller's secret derives from it "
        "(`reach tokens webhook-secret CALLER`). None: callbacks are sent unsigned.",
    )

    @field_validator("allow_networks")
    @classmethod
    def _networks_are_cidrs(cls, value: list[str]) -> list[str]:
        # Imported here: reach.security's package may import this module.
        from reach.security.netguard import parse_networks

        parse_networks(value)
        return value


class TelemetrySettings(_Section):
    """Traces (OpenTelemetry) and the log format, for the gateway and workers (R25). Read at
    start-up: a change takes effect after a restart."""

    traces: Literal["none", "console", "otlp", "file"] = Field(
        default="none",
        description="Where finished spans go: none (no tracing, no cost), console (stdout), "
        "otlp (an OpenTelemetry collector over gRPC), file (JSON lines, one span a line).",
    )
    otlp_endpoint: str | None = Field(
        default=None,
        max_length=512,
        description="traces: otlp; default: $OTEL_EXPORTER_OTLP_ENDPOINT, else "
        "http://localhost:4317.",
    )
    file: str | None = Field(
        default=None,
        max_length=4096,
        description="traces: file; the JSON-lines file spans are appended to (tests, offline "
        "debugging). Default: .reach/spans.jsonl.",
    )
    service_name: str = Field(default="agent-reach", min_length=1, max_length=128)
    sample_ratio: float = Field(
        default=1.0,
        ge=0.0,
        le=1.0,
        description="Share of new traces recorded; a caller's traceparent decides for its own.",
    )
    logs_format: Literal["text", "json"] = Field(
        default="text",
        description="json: one object a line (ts, level, logger, message, request_id, "
        "trace_id, span_id).",
    )
    heartbeat_log_sample: float = Field(
        default=0.01,
        ge=0.0,
        le=1.0,
        description="Share of heartbeat and handshake records logged (logger reach.heartbeat, "
        "kept apart from the main log); joins, leaves, health changes and evictions are "
        "always logged in the main log.",
    )
    heartbeat_log_file: str | None = Field(
        default=None,
        max_length=4096,
        description="Where the sampled heartbeat records go; default: standard error, beside "
        "(but not through) the main log.",
    )


class MetricsSettings(_Section):
    """Prometheus metrics (`GET /metrics` on the gateway; workers on `worker_port`). Read at
    start-up: a change takes effect after a restart."""

    enabled: bool = Field(
        default=True, description="false: nothing is recorded and /metrics is not served."
    )
    worker_port: int | None = Field(
        default=None,
        ge=0,
        le=65535,
        description="`worker.py` processes serve GET /metrics on this port (0: any free one; "
        "none: not served). The gateway serves its own on its API port.",
    )
    worker_host: str = Field(
        default="127.0.0.1",
        min_length=1,
        max_length=255,
        description="The address a worker's metrics port binds (keep it internal: the port "
        "has no authentication).",
    )


class ReachSettings(BaseSettings):
    model_config = SettingsConfigDict(
        env_prefix="REACH_",
        env_nested_delimiter="__",
        extra="forbid",
        validate_default=True,
        allow_inf_nan=False,
    )

    listen_host: str = "127.0.0.1"
    listen_port: int = Field(default=7600, ge=1, le=65535)
    event_loop: Literal["auto", "uvloop", "asyncio"] = Field(
        default="auto",
        description="The gateway's and workers' event loop: uvloop when installed (auto), or "
        "the standard library's. uvloop takes ~1 ms off a durable invoke here (bench/invoke.py).",
    )
    public_url: str | None = Field(
        default=None, description="How agents reach this gateway; defaults to listen host:port."
    )
    registry: RegistrySettings = Field(default_factory=RegistrySettings)
    transport: TransportSettings = Field(default_factory=TransportSettings)
    policy: PolicySettings = Field(default_factory=PolicySettings)
    capabilities: dict[str, CapabilitySettings] = Field(default_factory=dict)
    routing: RoutingDefaults = Field(default_factory=RoutingDefaults)
    callback: CallbackSettings = Field(default_factory=CallbackSettings)
    temporal: TemporalSettings = Field(default_factory=TemporalSettings)
    auth: AuthSettings = Field(default_factory=AuthSettings)
    rules: list[RuleSettings] = Field(default_factory=list, description="R19; deny wins")
    audit: AuditSettings = Field(default_factory=AuditSettings)
    security: SecuritySettings = Field(default_factory=SecuritySettings)
    telemetry: TelemetrySettings = Field(default_factory=TelemetrySettings)
    metrics: MetricsSettings = Field(default_factory=MetricsSettings)

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        # The YAML file is passed as init kwargs by `load_settings`, below the environment.
        return env_settings, init_settings

    @model_validator(mode="after")
    def _messages_fit_in_temporal(self) -> ReachSettings:
        t = self.temporal
        ceiling = max_message_ceiling(t.payload_limit_bytes, t.grpc_limit_bytes)
        if self.transport.max_message_bytes > ceiling:
            raise ValueError(
                f"transport.max_message_bytes={self.transport.max_message_bytes} cannot be "
                f"carried: temporal.payload_limit_bytes={t.payload_limit_bytes} and "
                f"temporal.grpc_limit_bytes={t.grpc_limit_bytes} leave at most {ceiling} "
                "bytes for a message"
            )
        return self

    def routing_for(self, capability: str) -> RoutingSettings:
        cap = self.capabilities.get(capability)
        return self.routing.merged(cap.routing if cap else None)

    def capability_mode(self, capability: str) -> CapabilityMode:
        cap = self.capabilities.get(capability)
        return cap.mode if cap else "inline"

    @property
    def gateway_url(self) -> str:
        if self.public_url:
            return self.public_url.rstrip("/")
        host = "127.0.0.1" if self.listen_host in ("0.0.0.0", "::") else self.listen_host
        return f"http://{host}:{self.listen_port}"


def _format_errors(source: str, exc: ValidationError) -> str:
    lines = []
    for err in exc.errors():
        loc = ".".join(str(p) for p in err["loc"]) or "(top level)"
        lines.append(f"  reach.{loc}: {err['msg']}")
    return f"invalid configuration in {source}:\n" + "\n".join(lines)


def read_yaml(path: Path) -> dict[str, Any]:
    try:
        raw = yaml.safe_load(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise ConfigError(f"cannot read configuration file {path}: {exc.strerror}") from exc
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path} is not valid YAML: {exc}") from exc
    if raw is None:
        return {}
    if not isinstance(raw, dict) or set(raw) != {"reach"} or not isinstance(raw["reach"], dict):
        raise ConfigError(f"{path}: expected one top-level mapping 'reach:' (see R7)")
    return dict(raw["reach"])


def config_file(path: str | Path | None = None) -> Path | None:
    """The configuration file in use: `path`, or $REACH_CONFIG, or ./reach.yaml if present."""
    chosen = path or os.environ.get(CONFIG_ENV_VAR)
    if chosen:
        file_path = Path(chosen)
        if not file_path.is_file():
            raise ConfigError(f"configuration file {file_path} does not exist")
        return file_path
    if Path(DEFAULT_CONFIG_FILE).is_file():
        return Path(DEFAULT_CONFIG_FILE)
    return None


def load_settings(path: str | Path | None = None, **overrides: Any) -> ReachSettings:
    """Load settings from `path` (or $REACH_CONFIG, or ./reach.yaml if present) and the env."""
    file_path = config_file(path)
    data = read_yaml(file_path) if file_path else {}
    data.update(overrides)
    source = str(file_path) if file_path else "environment/defaults"
    try:
        settings = ReachSettings(**data)
    except ValidationError as exc:
        raise ConfigError(_format_errors(f"{source} (or REACH_* variables)", exc)) from exc
    # Plug-ins are looked up here, not in the model: reach.routing builds on this module.
    from reach.routing import check_routing

    try:
        check_routing(settings)
    except ConfigError as exc:
        raise ConfigError(f"invalid configuration in {source}: {exc}") from exc
    return settings
