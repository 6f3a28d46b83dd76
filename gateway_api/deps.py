"""FastAPI dependencies. All `async def`: FastAPI runs a plain `def` dependency in its thread
pool, a thread hop per dependency per request on the hot path."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import Depends, Header, Path, Request, Security
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from pydantic import BaseModel

from gateway_api.gateway import Gateway
from reach.errors import Unauthorized
from reach.messages import EXAMPLE_REQUEST_ID, REQUEST_ID_PATTERN
from reach.security.tokens import Principal

CAPABILITY_PATTERN = r"^[a-z0-9][a-z0-9._-]{0,63}$"


async def get_gateway(request: Request) -> Gateway:
    gateway: Gateway = request.app.state.gateway
    return gateway


# The header schemas document what `reach.acceptance` enforces (with its clearer messages).
# An empty header counts as no header.
CALLER_SCHEMA = {"pattern": r"^([\x21-\x7e]{1,128})?$"}
TRACEPARENT_SCHEMA = {
    "pattern": r"^([0-9a-f]{2}-[0-9a-f]{32}-[0-9a-f]{16}-[0-9a-f]{2}(-[\x21-\x7e]{1,64})?)?$",
    "not": {"pattern": r"^(ff-|[0-9a-f]{2}-0{32}-|[0-9a-f]{2}-[0-9a-f]{32}-0{16}-)"},
}


# Declares the bearer scheme in the OpenAPI document; the header itself is read raw below, so a
# malformed one gets Reach's own message (and envelope) instead of the framework's.
BEARER = HTTPBearer(
    auto_error=False,
    description="A token from `reach tokens issue` (R18); required once any token exists "
    "(auth.mode). Its principal is the caller.",
)
AuthorizationHeader = Annotated[HTTPAuthorizationCredentials | None, Security(BEARER)]


def _authorization(request: Request) -> str | None:
    return request.headers.get("authorization")


async def document_invoke_headers(
    _scheme: AuthorizationHeader,
    x_reach_caller: Annotated[
        str | None,
        Header(
            description="Who calls (visible ASCII); with a token, it may only repeat the "
            "token's principal",
            json_schema_extra=CALLER_SCHEMA,
        ),
    ] = None,
    traceparent: Annotated[
        str | None,
        Header(description="W3C trace context", json_schema_extra=TRACEPARENT_SCHEMA),
    ] = None,
) -> None:
    """The invoke route's headers in the OpenAPI document. The door reads them itself
    (`gateway_api.steps.identify`), for every front; the IETF draft's `Idempotency-Key`, an
    alias of the body's idempotency_key, is left out of the schema, which cannot say that the
    two must agree."""


async def get_reader(
    request: Request, authorization: AuthorizationHeader = None
) -> Principal | None:
    """Any valid token (None when tokens are not required)."""
    gateway: Gateway = request.app.state.gateway
    return gateway.guard.auth.anyone(_authorization(request)) if gateway.guard else None


async def get_agent(
    request: Request, authorization: AuthorizationHeader = None
) -> Principal | None:
    """An agent (or admin) token (None when tokens are not required)."""
    gateway: Gateway = request.app.state.gateway
    return gateway.guard.auth.agent(_authorization(request)) if gateway.guard else None


def json_body(model: type[BaseModel], description: str, *, required: bool = True) -> dict[str, Any]:
    """OpenAPI for a body the route reads raw and hands to `reach.acceptance`."""
    return {
        "requestBody": {
            "required": required,
            "description": description,
            "content": {"application/json": {"schema": model.model_json_schema()}},
        }
    }


GatewayDep = Annotated[Gateway, Depends(get_gateway)]
RequestIdPath = Annotated[
    str,
    Path(pattern=REQUEST_ID_PATTERN, description="The RequestID", examples=[EXAMPLE_REQUEST_ID]),
]
InstanceIdPath = Annotated[
    str, Path(pattern=REQUEST_ID_PATTERN, description="An instance id", examples=["retriever-01"])
]
CapabilityPath = Annotated[
    str,
    Path(pattern=CAPABILITY_PATTERN, description="A capability", examples=["knowledge-retriever"]),
]


async def require_admin(request: Request, _scheme: AuthorizationHeader) -> Principal:
    """An admin token, always (the admin API and the codec endpoints are never open)."""
    gateway: Gateway = request.app.state.gateway
    if gateway.guard is None:
        raise Unauthorized("this gateway has no token store")
    return gateway.guard.auth.admin(_authorization(request))


AdminDep = Annotated[Principal, Depends(require_admin)]
ReaderDep = Annotated[Principal | None, Depends(get_reader)]
AgentDep = Annotated[Principal | None, Depends(get_agent)]
