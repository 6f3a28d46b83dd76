from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import JSONResponse

from gateway_api.deps import GatewayDep

router = APIRouter(tags=["health"])


@router.get("/healthz", summary="Liveness: the process answers")
async def healthz() -> dict[str, str]:
    return {"status": "ok"}


@router.get(
    "/readyz",
    summary="Readiness: Temporal and the registry store answer",
    responses={503: {"description": "A dependency is down"}},
)
async def readyz(gateway: GatewayDep) -> JSONResponse:
    checks = await gateway.views.readiness()
    ok = all(checks.values())
    return JSONResponse(
        {"status": "ok" if ok else "unavailable", "checks": checks}, status_code=200 if ok else 503
    )
