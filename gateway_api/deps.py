from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Header, Request

from gateway_api.service import Gateway


def get_gateway(request: Request) -> Gateway:
    gateway: Gateway = request.app.state.gateway
    return gateway


def get_caller(
    x_reach_caller: Annotated[str | None, Header(max_length=128)] = None,
) -> str:
    # Until per-principal tokens arrive (security step), the caller names itself.
    return x_reach_caller or "anonymous"


def get_traceparent(
    traceparent: Annotated[str | None, Header(max_length=128)] = None,
) -> str | None:
    # W3C trace context from the caller, passed on to the agent unchanged.
    return traceparent


GatewayDep = Annotated[Gateway, Depends(get_gateway)]
TraceparentDep = Annotated[str | None, Depends(get_traceparent)]
CallerDep = Annotated[str, Depends(get_caller)]
