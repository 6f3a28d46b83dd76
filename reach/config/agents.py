"""`agents:`: instances registered by URL when a gateway starts (A2A agents, MCP servers).

Each entry is what `POST /reach/agents` takes for a protocol whose instances are registered
by URL (`docs/instances-by-url.md`): the gateway discovers what the instance serves, joins it
and keeps it alive by a probe. An entry whose instance does not answer at start is kept and
joins once a probe reaches it.
"""

from __future__ import annotations

from pydantic import Field

from reach.config.base import Section
from reach.messages import MAX_TIMEOUT_MS, REQUEST_ID_PATTERN


class UrlAgentOperation(Section):
    """What configuration says of one discovered operation, over what discovery found."""

    name: str = Field(
        pattern=r"^[A-Za-z0-9_][A-Za-z0-9_.-]{0,63}$",
        description="The operation (an A2A skill id, an MCP tool name).",
    )
    idempotent: bool | None = Field(
        default=None, description="Whether a retry is safe without an idempotency_key."
    )
    timeout_ms: int | None = Field(
        default=None, ge=1, le=MAX_TIMEOUT_MS, description="The operation's own deadline."
    )


class UrlAgentSettings(Section):
    """One instance registered by URL at start (`reach agents add` does the same at runtime)."""

    protocol: str = Field(
        pattern=r"^[a-z0-9_-]{1,32}$",
        description="A protocol whose instances are registered by URL: a2a or mcp.",
    )
    url: str = Field(
        min_length=1,
        max_length=2048,
        pattern=r"^[\x21-\x7e]+$",
        description="The instance's URL: an A2A agent's base URL, an MCP server's endpoint.",
    )
    capability: str = Field(
        pattern=r"^[a-z0-9][a-z0-9._-]{0,63}$", description="The capability it serves."
    )
    instance_id: str | None = Field(
        default=None,
        pattern=REQUEST_ID_PATTERN,
        description="Its instance id; derived from the protocol and URL when absent (the same "
        "URL, the same id).",
    )
    operations: list[UrlAgentOperation] = Field(
        default_factory=list,
        max_length=256,
        description="Declarations over the discovered operations, per name (e.g. idempotent).",
    )
