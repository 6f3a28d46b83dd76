"""The `routing:` section and each capability's own routing and mode (R12, R17, R22)."""

from __future__ import annotations

from typing import Annotated

from pydantic import Field

from reach.config.base import Section
from reach.invocation import CapabilityMode

HASH_ON_PATTERN = r"^(routing_key|payload(\.[A-Za-z0-9_-]{1,64}){1,8})$"


class RoutingSettings(Section):
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

    strategy: str | None = Field(
        default="round_robin",
        pattern=r"^[a-z0-9_]{1,64}$",
        description="round_robin, weighted_round_robin, least_request, consistent_hash, or a "
        "plug-in of the entry-point group agent_reach.routing",
    )
    vnodes: int | None = Field(
        default=100, ge=1, le=1000, description="virtual nodes per instance of weight 1"
    )
    balance_factor: float | None = Field(
        default=1.25,
        ge=1.0,
        le=100.0,
        description="consistent_hash: no instance takes more than this times the mean "
        "in-flight load (bounded load)",
    )
    fallback: str | None = Field(
        default="round_robin",
        pattern=r"^[a-z0-9_]{1,64}$",
        description="the strategy for a consistent_hash request without a key",
    )
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


class CapabilitySettings(Section):
    mode: CapabilityMode = Field(
        default="inline",
        description="inline: the gateway's own worker calls the agent inside the first workflow "
        "task (the fast path); queue: a regular activity on task queue "
        "reach-cap-<capability>, served by `worker.py --capability`.",
    )
    routing: RoutingSettings | None = None
