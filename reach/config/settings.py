"""`ReachSettings`: the whole `reach:` mapping, its sections and the checks across them."""

from __future__ import annotations

import ipaddress
from typing import Literal
from urllib.parse import urlsplit

from pydantic import Field, model_validator
from pydantic_settings import (
    BaseSettings,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
)

from reach.config.agents import UrlAgentSettings
from reach.config.connections import (
    CallbackSettings,
    RegistrySettings,
    TemporalSettings,
    TransportSettings,
)
from reach.config.observability import MetricsSettings, TelemetrySettings
from reach.config.policy import PolicySettings
from reach.config.routing import CapabilitySettings, RoutingDefaults, RoutingSettings
from reach.config.security import AuditSettings, AuthSettings, RuleSettings, SecuritySettings
from reach.invocation import CapabilityMode
from reach.limits import max_message_ceiling

# What a loopback gateway may reach when `security.allow_networks` is not written.
LOOPBACK_NETWORKS = ("127.0.0.0/8", "::1/128")


def _loopback(host: str) -> bool:
    """A literal loopback address or `localhost` (no name is resolved while loading)."""
    if host.rstrip(".") == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


class ReachSettings(BaseSettings):
    model_config = SettingsConfigDict(
        env_prefix="REACH_",
        env_nested_delimiter="__",
        extra="forbid",
        validate_default=True,
        allow_inf_nan=False,
    )

    listen_host: str = Field(
        default="127.0.0.1",
        description="The address the gateway binds; beyond loopback it needs tokens, or auth.mode:"
        " open written on purpose.",
    )
    listen_port: int = Field(
        default=7600,
        ge=1,
        le=65535,
        description="The gateway's HTTP port (the API, /ui, /metrics).",
    )
    event_loop: Literal["auto", "uvloop", "asyncio"] = Field(
        default="auto",
        description="The gateway's and workers' event loop: uvloop when installed (auto), or "
        "the standard library's. uvloop takes ~1 ms off a durable invoke here (bench/invoke.py).",
    )
    public_url: str | None = Field(
        default=None,
        description="How agents reach this gateway; defaults to listen host:port. A worker "
        "apart from its gateways (worker.py) gives it to A2A agents for push notifications; "
        "without it that worker follows their tasks by polling.",
    )
    registry: RegistrySettings = Field(
        default_factory=RegistrySettings,
        description="Where instances register and heartbeat, and the store of shared state.",
    )
    transport: TransportSettings = Field(
        default_factory=TransportSettings,
        description="Ports, message size and connections to agents.",
    )
    policy: PolicySettings = Field(
        default_factory=PolicySettings,
        description="Timeouts, retries, breakers, ejection, rate limits: defaults, per capability,"
        " per operation.",
    )
    capabilities: dict[str, CapabilitySettings] = Field(
        default_factory=dict, description="Per capability: its mode and its routing."
    )
    routing: RoutingDefaults = Field(default_factory=RoutingDefaults)
    callback: CallbackSettings = Field(
        default_factory=CallbackSettings,
        description="How a result is POSTed to a callback URL and retried.",
    )
    temporal: TemporalSettings = Field(
        default_factory=TemporalSettings, description="The Temporal connection and the workers."
    )
    auth: AuthSettings = Field(default_factory=AuthSettings)
    rules: list[RuleSettings] = Field(default_factory=list, description="R19; deny wins")
    agents: list[UrlAgentSettings] = Field(
        default_factory=list,
        max_length=1000,
        description="Instances registered by URL at start (A2A agents, MCP servers); see "
        "docs/instances-by-url.md.",
    )
    audit: AuditSettings = Field(default_factory=AuditSettings)
    security: SecuritySettings = Field(
        default_factory=SecuritySettings,
        description="Allowed networks, mTLS to agents, encryption of history, signed callbacks.",
    )
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

    @model_validator(mode="after")
    def _public_url_is_a_url(self) -> ReachSettings:
        # Handed to A2A agents as their push notifications' address: one without its scheme
        # (REACH_PUBLIC_URL=gateway:7600) was taken, and every agent's pushes went nowhere.
        url = self.public_url
        if url:  # '' is unset, as gateway_url reads it
            parsed = urlsplit(url)
            if parsed.scheme not in ("http", "https") or not parsed.hostname:
                raise ValueError(
                    f"public_url={url[:200]!r}: how agents reach this gateway, "
                    "http(s)://host[:port][/path] (REACH_PUBLIC_URL)"
                )
        return self

    @model_validator(mode="after")
    def _a_local_gateway_reaches_local_agents(self) -> ReachSettings:
        # A gateway that serves this machine only reaches this machine's agents and callbacks
        # unless the file says otherwise: the seed's reach.yaml names no allowlist, and its
        # demo agents listen on loopback. A gateway on any other address keeps the strict
        # default (global unicast only), so the forgery guard holds where it matters.
        security = self.security
        if "allow_networks" not in security.model_fields_set and _loopback(self.listen_host):
            security.allow_networks = list(LOOPBACK_NETWORKS)
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
