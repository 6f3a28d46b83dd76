"""The registry's data: what an agent proposes at Join (`JoinRequest`, with its per-operation
`OperationDeclaration`s), what Reach agrees to (`Ack`), a heartbeat's `HealthReport`, the
stored `InstanceRecord`, and `declared_policy`, what the routable instances declare together.
Pure pydantic models and functions: no store, no I/O (the `Registry` that keeps them is the
package's `__init__`).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from typing import Annotated, Any, Literal, Protocol

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StringConstraints,
    TypeAdapter,
    ValidatorFunctionWrapHandler,
    WithJsonSchema,
    WrapValidator,
    field_serializer,
    field_validator,
)
from pydantic_core import PydanticCustomError

from reach.messages import MAX_TIMEOUT_MS, CapabilityName, InstanceId, JsonInt, OperationName

HealthStatus = Literal["ok", "degraded", "unhealthy"]


# What an operation may say about itself (OperationDeclaration.description, .input_schema).
MAX_DESCRIPTION_CHARS = 4096
MAX_INPUT_SCHEMA_BYTES = 64 * 1024
MAX_INPUT_SCHEMA_DEPTH = 32


def _depth(value: Any) -> int:
    """How deep a JSON value nests (a scalar: 0), without recursion; counting stops past the
    limit."""
    deepest, stack = 0, [(value, 1)]
    while stack and deepest <= MAX_INPUT_SCHEMA_DEPTH:
        item, level = stack.pop()
        if isinstance(item, dict):
            item = list(item.values())
        if isinstance(item, list):
            deepest = max(deepest, level)
            stack.extend((child, level + 1) for child in item)
    return deepest


LabelKey = Annotated[str, StringConstraints(pattern=r"^[A-Za-z0-9_.:/-]{1,64}$")]
LabelValue = Annotated[str, StringConstraints(pattern=r"^[^\x00-\x1f\x7f]{0,256}$")]


class OperationDeclaration(BaseModel):
    """What an agent says about one of its operations at Join (both fields optional)."""

    model_config = ConfigDict(
        extra="forbid",
        json_schema_extra={"examples": [{"name": "query", "idempotent": True, "timeout_ms": 3000}]},
    )

    name: OperationName
    idempotent: bool | None = Field(
        default=None, description="True: safe to retry on a retryable failure."
    )
    timeout_ms: JsonInt | None = Field(
        default=None, ge=1, le=MAX_TIMEOUT_MS, description="The operation's own deadline."
    )
    description: str | None = Field(
        default=None,
        max_length=MAX_DESCRIPTION_CHARS,
        description="What the operation does, for people and for the MCP and A2A fronts.",
    )
    input_schema: dict[str, Any] | None = Field(
        default=None,
        description="A JSON Schema object its payload follows (an MCP tool's inputSchema); at "
        "most 64 KiB as JSON.",
    )

    @field_validator("input_schema")
    @classmethod
    def _schema_bounded(cls, schema: dict[str, Any] | None) -> dict[str, Any] | None:
        if schema is None:
            return None
        if len(json.dumps(schema, separators=(",", ":"))) > MAX_INPUT_SCHEMA_BYTES:
            raise ValueError(f"input_schema is larger than {MAX_INPUT_SCHEMA_BYTES} bytes as JSON")
        if _depth(schema) > MAX_INPUT_SCHEMA_DEPTH:
            raise ValueError(f"input_schema nests deeper than {MAX_INPUT_SCHEMA_DEPTH} levels")
        return schema

    @property
    def declares(self) -> bool:
        """Whether it says anything beyond the name."""
        return (
            self.idempotent is not None
            or self.timeout_ms is not None
            or self.description is not None
            or self.input_schema is not None
        )


_OPERATION_NAME: TypeAdapter[str] = TypeAdapter(OperationName)


def _name_or_declaration(value: Any, _: ValidatorFunctionWrapHandler) -> str | OperationDeclaration:
    """One entry of `operations`, validated as the form it is written in, so that a refusal
    names the entry's own field (`operations.1.timeout_ms`), not every form it is not."""
    if isinstance(value, str):
        return _OPERATION_NAME.validate_python(value, strict=True)
    if isinstance(value, dict | OperationDeclaration):
        return OperationDeclaration.model_validate(value, strict=True)
    raise PydanticCustomError(
        "operation_type",
        "Input should be an operation name or an object with its name and policy",
    )


OperationEntry = Annotated[
    OperationName | OperationDeclaration,
    WrapValidator(_name_or_declaration),
    # Written out, not a $ref: the gateway's OpenAPI embeds the Join body's schema as it is.
    WithJsonSchema(
        {"anyOf": [_OPERATION_NAME.json_schema(), OperationDeclaration.model_json_schema()]}
    ),
]


class JoinRequest(BaseModel):
    """What an agent proposes when it starts (R8)."""

    model_config = ConfigDict(
        extra="forbid",
        json_schema_extra={
            "examples": [
                {
                    "capability": "knowledge-retriever",
                    "instance_id": "retriever-09",
                    "protocol": "http",
                    "service_address": "127.0.0.1:9001",
                    "heartbeat_interval": 5,
                    "operations": [
                        "query",
                        {"name": "index", "idempotent": False, "timeout_ms": 30000},
                    ],
                }
            ]
        },
    )

    capability: CapabilityName
    instance_id: InstanceId
    protocol: str = Field(default="http", pattern=r"^[a-z0-9_-]{1,32}$")
    service_address: str = Field(
        min_length=1,
        max_length=512,
        pattern=r"^[\x21-\x7e]+$",
        description="Where Reach calls this instance; its form is the protocol's (checked by "
        "the connector).",
    )
    heartbeat_interval: float | None = Field(default=None, gt=0, le=3600, allow_inf_nan=False)
    operations: list[OperationEntry] = Field(
        default_factory=list,
        max_length=256,
        description="The operations served: a name, or an object that also declares whether "
        "the operation is idempotent and its timeout_ms. Each name at most once.",
    )
    max_message_bytes: JsonInt | None = Field(default=None, gt=0, le=1 << 40)
    async_callback: bool = False
    labels: dict[LabelKey, LabelValue] = Field(default_factory=dict, max_length=32)
    weight: JsonInt = Field(
        default=1,
        ge=1,
        le=1000,
        description="This instance's share under weighted round robin and on a hash ring, "
        "relative to the others (configuration may override it).",
    )
    max_inflight: JsonInt | None = Field(
        default=None,
        ge=1,
        le=1_000_000,
        description="Requests in flight at which routing passes this instance over until it "
        "drains (R17).",
    )

    @field_validator("operations")
    @classmethod
    def _each_name_once(
        cls, operations: list[str | OperationDeclaration]
    ) -> list[str | OperationDeclaration]:
        seen: set[str] = set()
        for entry in operations:
            name = entry if isinstance(entry, str) else entry.name
            if name in seen:
                raise ValueError(f"operation {name!r} is listed more than once")
            seen.add(name)
        return operations

    @property
    def operation_names(self) -> list[str]:
        return [entry if isinstance(entry, str) else entry.name for entry in self.operations]

    @property
    def declarations(self) -> dict[str, OperationDeclaration]:
        """The operations that declared something, by name."""
        return {
            entry.name: entry
            for entry in self.operations
            if isinstance(entry, OperationDeclaration) and entry.declares
        }


class Ack(BaseModel):
    """What Reach and the agent agreed on; later messages never exceed it."""

    instance_id: str
    capability: str
    heartbeat_interval: float
    heartbeat_timeout: float
    max_message_bytes: int
    async_callback: bool
    session: str | None = Field(
        default=None,
        description="This Join's session: heartbeats that name it (X-Reach-Session) are "
        "refused once another process has joined under the same instance_id. Not a secret.",
    )


class HealthReport(BaseModel):
    """A heartbeat body: a light self-check, not just 'alive' (R21).

    `checks` is free-form JSON, at most 16 KiB and 64 levels (`reach.acceptance`).
    """

    model_config = ConfigDict(
        extra="forbid",
        json_schema_extra={"examples": [{"status": "ok", "checks": {"index": "loaded"}}]},
    )

    status: HealthStatus = "ok"
    checks: dict[str, Any] = Field(default_factory=dict)
    inflight: JsonInt = Field(default=0, ge=0, le=1_000_000_000)


class InstanceRecord(BaseModel):
    instance_id: str
    capability: str
    protocol: str
    address: str
    operations: list[str] = Field(default_factory=list)
    # Empty in records written before declarations existed.
    declared: dict[str, OperationDeclaration] = Field(default_factory=dict)
    max_message_bytes: int
    async_callback: bool
    heartbeat_interval: float
    labels: dict[str, str] = Field(default_factory=dict)
    weight: int = 1
    max_inflight: int | None = None
    # An instance registered by URL (`registered_by_url`): what its discovery found, and its
    # version and ETag, for the probe. Left out of a joined instance's record: joined records
    # are stored as before, and an older gateway reads either (it ignores what it lacks).
    registered_by_url: bool = Field(
        default=False,
        exclude_if=lambda v: not v,
        description="Registered by its URL (an A2A agent, an MCP server) and kept alive by "
        "probes; absent for an instance that joined (docs/instances-by-url.md).",
    )
    details: dict[str, Any] = Field(
        default_factory=dict,
        exclude_if=lambda v: not v,
        description="What discovery found, the protocol's own: an A2A card's name and "
        "JSON-RPC URL, an MCP server's protocol version.",
    )
    discovery_version: str | None = Field(
        default=None,
        exclude_if=lambda v: v is None,
        description="Changes whenever what the instance serves changes.",
    )
    discovery_etag: str | None = Field(default=None, exclude_if=lambda v: v is None)
    status: HealthStatus = "ok"
    checks: dict[str, Any] = Field(default_factory=dict)
    inflight: int = 0
    joined_at: float
    last_seen: float
    # The principal whose agent token registered it (None: auth off): only it may heartbeat,
    # leave, answer late or join again under this instance_id.
    principal: str | None = None
    # The last Join's session (`Ack.session`); None in records written before sessions.
    session: str | None = None

    @field_validator("declared", mode="before")
    @classmethod
    def _known_fields_only(cls, declared: Any) -> Any:
        """A record written by a newer gateway may declare more: what this one does not know
        is left out, so that the record (and the instance) stays readable here."""
        if not isinstance(declared, dict):
            return declared
        known = OperationDeclaration.model_fields
        return {
            name: {k: v for k, v in entry.items() if k in known}
            if isinstance(entry, dict)
            else entry
            for name, entry in declared.items()
        }

    @field_serializer("declared")
    def _declared_without_blanks(
        self, declared: dict[str, OperationDeclaration]
    ) -> dict[str, dict[str, Any]]:
        # What an operation left unsaid is not stored: records stay small, and older gateways
        # read them as they always did.
        return {name: entry.model_dump(exclude_none=True) for name, entry in declared.items()}

    @property
    def routable(self) -> bool:
        return self.status != "unhealthy"


class Declares(Protocol):
    """What `declared_policy` reads of an instance (a record, or a routing view's entry)."""

    @property
    def routable(self) -> bool: ...

    @property
    def declared(self) -> Mapping[str, OperationDeclaration]: ...


def declared_policy(instances: Iterable[Declares], operation: str) -> OperationDeclaration | None:
    """What the routable instances together declare for `operation` (None: nothing).

    Idempotent only if one declares it so and none declares otherwise (an instance silent about
    it has no say); the timeout is the smallest declared. Unhealthy instances are left out.
    """
    said = [i.declared[operation] for i in instances if i.routable and operation in i.declared]
    votes = {d.idempotent for d in said if d.idempotent is not None}
    timeouts = [d.timeout_ms for d in said if d.timeout_ms is not None]
    idempotent = None if not votes else all(votes)
    timeout_ms = min(timeouts) if timeouts else None
    if idempotent is None and timeout_ms is None:
        return None
    return OperationDeclaration(name=operation, idempotent=idempotent, timeout_ms=timeout_ms)


class Discovery(BaseModel):
    """What an instance registered by URL serves, as its protocol's connector found it
    (`Connector.discover`): an A2A agent's card, an MCP server's tool list.

    `operations` become the instance's operations (and their declarations); `version` changes
    whenever what is served changes (a hash of the card or the tool list), so a probe that finds
    another version updates the registry; `etag` lets the next probe ask conditionally;
    `details` is what `GET /reach/capabilities/{name}` shows per instance and what the
    connector reads back at invoke time through `Endpoint.details` (the card's JSON-RPC URL,
    the MCP protocol version negotiated): small, JSON, the protocol's own.
    """

    operations: list[OperationDeclaration] = Field(default_factory=list, max_length=256)
    version: str = ""
    etag: str | None = None
    details: dict[str, Any] = Field(default_factory=dict)
