"""Every error leaves the gateway in the one envelope, with the documented status code."""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from temporalio.service import RPCError

from reach.errors import ReachError, RequestClosed, UnknownRequest
from reach.messages import ErrorInfo, InvokeResponse

log = logging.getLogger("reach.gateway")


def envelope_response(response: InvokeResponse, status_code: int) -> JSONResponse:
    headers = {"X-Reach-Request-Id": response.request_id} if response.request_id else None
    return JSONResponse(
        response.model_dump(mode="json", exclude_none=True),
        status_code=status_code,
        headers=headers,
    )


def error_body(request: Request, error_type: str, message: str, retryable: bool) -> dict[str, Any]:
    request_id = getattr(request.state, "request_id", None) or request.path_params.get("request_id")
    return {
        "request_id": request_id,
        "status": "error",
        "error": ErrorInfo(type=error_type, message=message, retryable=retryable).model_dump(),
    }


def _validation_message(exc: RequestValidationError) -> str:
    parts = []
    for err in exc.errors():
        loc = err.get("loc", ())
        if err.get("type") == "json_invalid":
            detail = (err.get("ctx") or {}).get("error", "")
            parts.append(f"body is not valid JSON (at character {loc[-1]}): {detail}")
            continue
        if tuple(loc) == ("body",) and err.get("type") == "model_attributes_type":
            parts.append("body must be a JSON object (Content-Type: application/json)")
            continue
        where = ".".join(str(p) for p in loc if p != "body") or "body"
        parts.append(f"{where}: {err.get('msg', 'invalid')}")
    return "; ".join(parts)


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(ReachError)
    async def _reach_error(request: Request, exc: ReachError) -> JSONResponse:
        if not isinstance(exc, UnknownRequest | RequestClosed):
            log.info("%s %s -> %s: %s", request.method, request.url.path, exc.type, exc.message)
        headers = {"Retry-After": "1"} if exc.http_status in (429, 503) else None
        return JSONResponse(
            error_body(request, exc.type, exc.message, exc.retryable),
            status_code=exc.http_status,
            headers=headers,
        )

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        return JSONResponse(
            error_body(request, "invalid_request", _validation_message(exc), False),
            status_code=422,
        )

    @app.exception_handler(RPCError)
    async def _temporal_down(request: Request, exc: RPCError) -> JSONResponse:
        log.error("Temporal call failed on %s: %s", request.url.path, exc)
        return JSONResponse(
            error_body(request, "unavailable", f"workflow engine unavailable: {exc.message}", True),
            status_code=503,
            headers={"Retry-After": "1"},
        )
