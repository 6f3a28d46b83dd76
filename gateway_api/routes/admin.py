"""The admin API (R26): tokens, rules and the configuration change without a restart.

Every route needs an admin token (`reach tokens issue --principal ops --admin`), also when
the rest of the gateway is open; every change is audited with the admin's principal.
"""

from __future__ import annotations

import time
from typing import Any

from fastapi import APIRouter, Request, Response
from pydantic import BaseModel, ConfigDict, Field

from gateway_api.deps import AdminDep, GatewayDep
from reach.config import RuleSettings
from reach.errors import InvalidRequest, UnknownRequest
from reach.messages import ErrorResponse
from reach.security.guard import ConfigWatcher, Guard
from reach.security.tokens import PRINCIPAL_PATTERN, Kind, TokenRecord, issue

router = APIRouter(prefix="/reach/admin", tags=["admin"])

_ERR: dict[int | str, dict[str, Any]] = {
    code: {"model": ErrorResponse, "description": text}
    for code, text in {
        401: "Missing, invalid, expired or revoked token",
        403: "Not an admin token",
        404: "Unknown token",
        413: "Body larger than the limit",
        422: "Invalid body",
        500: "A bug in Reach",
        503: "The token store is unavailable",
    }.items()
}


class TokenView(BaseModel):
    """A token as listed: never its secret, nor its hash."""

    id: str
    principal: str
    kind: Kind
    capabilities: list[str]
    created_at: float
    expires_at: float | None = None
    revoked_at: float | None = None
    state: str
    note: str | None = None

    @classmethod
    def of(cls, record: TokenRecord) -> TokenView:
        return cls(**record.model_dump(exclude={"sha256"}), state=record.state(time.time()))


class TokenList(BaseModel):
    tokens: list[TokenView]


class IssueTokenBody(BaseModel):
    model_config = ConfigDict(extra="forbid")

    principal: str = Field(pattern=PRINCIPAL_PATTERN)
    kind: Kind = "caller"
    capabilities: list[str] = Field(default_factory=list, max_length=256)
    ttl_s: float | None = Field(default=None, gt=0, le=10 * 365 * 86_400)
    note: str | None = Field(default=None, max_length=256)


class IssuedToken(BaseModel):
    token: str = Field(description="Shown once: only its hash is kept.")
    record: TokenView


class RulesBody(BaseModel):
    model_config = ConfigDict(extra="forbid")

    rules: list[RuleSettings] = Field(max_length=10_000)


class RulesView(BaseModel):
    source: str = Field(description="file (reach.yaml) or admin (an override set here)")
    rules: list[RuleSettings]


class ReloadResult(BaseModel):
    applied: bool
    restart: list[str] = Field(
        default_factory=list, description="Changed sections that apply only after a restart."
    )


def _guard(gateway: Any) -> Guard:
    guard: Guard = gateway.guard
    return guard


@router.get("/tokens", response_model=TokenList, responses=_ERR, summary="List tokens")
async def list_tokens(gateway: GatewayDep, admin: AdminDep) -> TokenList:
    records = await _guard(gateway).tokens.load()
    return TokenList(tokens=[TokenView.of(r) for r in sorted(records, key=lambda r: r.created_at)])


@router.post(
    "/tokens",
    status_code=201,
    response_model=IssuedToken,
    responses=_ERR,
    summary="Issue a token (its secret is in this answer only)",
)
async def issue_token(body: IssueTokenBody, gateway: GatewayDep, admin: AdminDep) -> IssuedToken:
    guard = _guard(gateway)
    try:
        token, record = issue(
            body.principal, body.kind, body.capabilities, ttl_s=body.ttl_s, note=body.note
        )
    except ValueError as exc:
        raise InvalidRequest(str(exc)) from None
    await guard.tokens.save(record)
    guard.cache.changed()
    guard.audit.record(
        "token_issued",
        principal=admin.name,
        token_id=record.id,
        subject=record.principal,
        kind=record.kind,
        capabilities=record.capabilities,
    )
    return IssuedToken(token=token, record=TokenView.of(record))


@router.delete(
    "/tokens/{token_id}", response_model=TokenView, responses=_ERR, summary="Revoke a token"
)
async def revoke_token(token_id: str, gateway: GatewayDep, admin: AdminDep) -> TokenView:
    guard = _guard(gateway)
    try:
        record = await guard.tokens.revoke(token_id)
    except LookupError:
        raise UnknownRequest(f"no token with id {token_id!r}") from None
    await guard.cache.reload()
    guard.audit.record("token_revoked", principal=admin.name, token_id=record.id)
    return TokenView.of(record)


@router.get("/rules", response_model=RulesView, responses=_ERR, summary="The rules in force")
async def get_rules(gateway: GatewayDep, admin: AdminDep) -> RulesView:
    guard = _guard(gateway)
    rules = guard.override if guard.override is not None else guard.file_rules
    return RulesView(source=guard.rules_source, rules=rules)


@router.put(
    "/rules",
    response_model=RulesView,
    responses=_ERR,
    summary="Replace the rules on every gateway sharing the store (an override of the file's)",
)
async def put_rules(body: RulesBody, gateway: GatewayDep, admin: AdminDep) -> RulesView:
    guard = _guard(gateway)
    await guard.set_override(body.rules, admin.name)
    return RulesView(source=guard.rules_source, rules=body.rules)


@router.delete("/rules", response_model=RulesView, responses=_ERR, summary="Back to the file's")
async def clear_rules(gateway: GatewayDep, admin: AdminDep) -> RulesView:
    guard = _guard(gateway)
    await guard.set_override(None, admin.name)
    return RulesView(source=guard.rules_source, rules=guard.file_rules)


@router.post(
    "/config/reload",
    response_model=ReloadResult,
    responses=_ERR,
    summary="Re-read the configuration file now (it is also re-read when it changes)",
)
async def reload_config(request: Request, gateway: GatewayDep, admin: AdminDep) -> Response:
    watcher: ConfigWatcher | None = getattr(request.app.state, "config_watcher", None)
    if watcher is None:
        raise InvalidRequest("this gateway was started without a configuration file")
    if not watcher.check(principal=admin.name):
        raise InvalidRequest(
            f"refused; the running configuration stays: {watcher.last_problem or 'invalid'}"
        )
    result = ReloadResult(applied=True, restart=watcher.last_restart)
    return Response(result.model_dump_json(), media_type="application/json")
