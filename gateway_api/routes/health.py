from __future__ import annotations

import asyncio

from fastapi import APIRouter
from fastapi.responses import JSONResponse
from temporalio.service import RPCError

from gateway_api.deps import GatewayDep

router = APIRouter(tags=["health"])

READY_CHECK_S = 2.0


@router.get("/healthz", summary="Liveness: the process answers")
async def healthz() -> dict[str, str]:
    return {"status": "ok"}


@router.get(
    "/readyz",
    summary="Readiness: Temporal and the registry store answer",
    responses={503: {"description": "A dependency is down"}},
)
async def readyz(gateway: GatewayDep) -> JSONResponse:
    checks: dict[str, bool] = {}
    try:
        checks["temporal"] = await asyncio.wait_for(
            gateway.client.service_client.check_health(), READY_CHECK_S
        )
    except (RPCError, TimeoutError):
        checks["temporal"] = False
    # The store's own socket timeout bounds this one (registry.redis_timeout_s).
    checks["registry"] = await gateway.registry.store.ping()
    ok = all(checks.values())
    return JSONResponse(
        {"status": "ok" if ok else "unavailable", "checks": checks}, status_code=200 if ok else 503
    )
