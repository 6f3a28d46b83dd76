"""The `policy:` section: retries, breakers, outlier ejection and rate limits (R13-R15, R23)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from reach.config.base import DAY_MS, Section
from reach.messages import MAX_TIMEOUT_MS


class RetrySettings(Section):
    """How a retryable failure is tried again (R13): exponential backoff on durable timers."""

    max_retries: int = Field(
        default=2,
        ge=0,
        le=10,
        description="Attempts after the first, each after a backoff and on another healthy "
        "instance when there is one.",
    )
    backoff_base_ms: int = Field(default=1000, ge=1, le=DAY_MS, description="the first backoff")
    backoff_multiplier: float = Field(
        default=2.0,
        ge=1.0,
        le=10.0,
        description="Each backoff is the one before times this (1 s, 2 s, 4 s ...).",
    )
    backoff_cap_ms: int = Field(default=30_000, ge=1, le=DAY_MS, description="no backoff is longer")
    jitter: float = Field(
        default=0.0,
        ge=0.0,
        le=1.0,
        description="each backoff is shortened by up to this fraction, at random",
    )


class CircuitBreakerSettings(Section):
    """One breaker per capability, shared by every gateway and worker through the store (R14)."""

    enabled: bool = Field(
        default=True,
        description="false: no breaker; failures never stop traffic to the capability.",
    )
    error_threshold: int = Field(
        default=3,
        ge=1,
        description="failures that open it (consecutive, or within `window`), from most of the "
        "instances routing serves from (more than half; one instance's alone are ejection's)",
    )
    window: int = Field(
        default=0,
        ge=0,
        le=64,
        description="0: `error_threshold` consecutive failures open it; N: that many failures "
        "among the last N outcomes do",
    )
    open_duration_ms: int = Field(
        default=10_000,
        ge=1,
        le=DAY_MS,
        description="How long an open breaker fails requests fast (503 circuit_open) before "
        "letting probes through.",
    )
    half_open_probes: int = Field(
        default=1, ge=1, le=100, description="requests let through after open_duration_ms"
    )

    @model_validator(mode="after")
    def _threshold_fits_window(self) -> CircuitBreakerSettings:
        if self.window and self.error_threshold > self.window:
            raise ValueError("error_threshold cannot exceed window")
        return self


class OutlierSettings(Section):
    """Per-instance ejection from routing after consecutive failures."""

    enabled: bool = Field(
        default=True, description="false: failing instances are never ejected from routing."
    )
    consecutive_failures: int = Field(
        default=3,
        ge=1,
        le=1000,
        description="Failures in a row (transport errors, 5xx, timeouts) that eject an instance.",
    )
    base_ejection_ms: int = Field(
        default=30_000, ge=1, le=DAY_MS, description="first ejection; doubles with each repeat"
    )
    max_ejection_ms: int = Field(
        default=300_000,
        ge=1,
        le=DAY_MS,
        description="The longest ejection, however often an instance repeats.",
    )


class LimitSettings(Section):
    """A token bucket: `per_minute` tokens a minute, at most `burst` saved up."""

    per_minute: float = Field(
        ge=0.01, le=6_000_000, allow_inf_nan=False, description="Tokens added a minute."
    )
    burst: int | None = Field(
        default=None, ge=1, le=1_000_000_000, description="defaults to per_minute"
    )

    @property
    def capacity(self) -> int:
        return self.burst if self.burst is not None else max(1, int(self.per_minute))


class RateLimitSettings(Section):
    """R15: per (caller, capability) and per capability, atomic across processes."""

    per_caller: LimitSettings | None = None
    per_capability: LimitSettings | None = None
    on_limit: Literal["reject", "queue"] = Field(
        default="reject",
        description="reject: 429 rate_limited with Retry-After; queue: the request waits for a "
        "token on durable timers.",
    )
    max_queue_wait_ms: int = Field(
        default=3_600_000,
        ge=0,
        le=2 * DAY_MS,
        description="how long a request with a callback may wait for a token (queue); a "
        "synchronous one waits at most until its deadline",
    )


class OperationSettings(Section):
    """Per 'capability:operation' (R23); what is written here overrides what agents declare."""

    timeout_ms: int | None = Field(
        default=None,
        ge=1,
        le=MAX_TIMEOUT_MS,
        description="The operation's deadline; a caller's shorter timeout_ms wins.",
    )
    idempotent: bool | None = Field(
        default=None,
        description="true: retried after a retryable failure without an idempotency_key; overrides"
        " what agents declare.",
    )
    retry: RetrySettings | None = None


class CapabilityPolicySettings(OperationSettings):
    """Per capability; unset fields fall back to the `policy` defaults."""

    circuit_breaker: CircuitBreakerSettings | None = None
    outlier: OutlierSettings | None = None
    rate_limit: RateLimitSettings | None = None


class PolicySettings(Section):
    default_retry: int = Field(
        default=2, ge=0, le=10, description="retry.max_retries, where `retry` does not say"
    )
    default_timeout_ms: int = Field(
        default=5000,
        ge=1,
        le=MAX_TIMEOUT_MS,
        description="The deadline when neither the caller nor the operation says.",
    )
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
