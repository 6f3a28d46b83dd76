from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from gateway_api.deps import CallerDep, GatewayDep, TraceparentDep
from gateway_api.errors import envelope_response
from reach.errors import http_status_for
from reach.invocation import LateAnswer
from reach.messages import InvokeRequest, InvokeResponse, new_request_id

router = APIRouter(prefix="/reach", tags=["invoke"])


def _codes(*codes: int) -> dict[int | str, dict[str, Any]]:
    text = {
        202: "Accepted: the result will be POSTed to the callback URL",
        404: "Unknown capability or request",
        409: "The request already finished",
        413: "Payload larger than the negotiated maximum",
        422: "Invalid request body",
        502: "The agent failed or could not be reached",
        503: "No healthy instance, circuit open, or Temporal/registry unavailable",
        504: "No answer within timeout_ms",
        500: "The request ended without a result",
    }
    return {c: {"model": InvokeResponse, "description": text[c]} for c in codes}


def status_code_of(response: InvokeResponse) -> int:
    if response.status == "accepted":
        return 202
    if response.status == "timeout":
        return 504
    if response.status == "error" and response.error:
        return http_status_for(response.error.type)
    return 200


@router.post(
    "/invoke",
    response_model=InvokeResponse,
    responses=_codes(202, 404, 413, 422, 500, 502, 503, 504),
    summary="Invoke a capability by name (sync without callback, 202 with one)",
)
async def invoke(
    body: InvokeRequest,
    request: Request,
    gateway: GatewayDep,
    caller: CallerDep,
    traceparent: TraceparentDep,
) -> JSONResponse:
    body.request_id = body.request_id or new_request_id()
    request.state.request_id = body.request_id
    response = await gateway.invoke(body, caller, traceparent)
    return envelope_response(response, status_code_of(response))


@router.get(
    "/requests/{request_id}",
    response_model=InvokeResponse,
    responses=_codes(404, 500, 502, 503, 504),
    summary="Status and result of any request",
)
async def get_request(request_id: str, gateway: GatewayDep) -> JSONResponse:
    response = await gateway.status(request_id)
    return envelope_response(response, status_code_of(response))


@router.post(
    "/requests/{request_id}/result",
    status_code=202,
    responses=_codes(404, 409, 413, 422, 503),
    summary="An agent's late (asynchronous) answer to a request it accepted with 202",
)
async def post_late_result(
    request_id: str, answer: LateAnswer, gateway: GatewayDep
) -> dict[str, str]:
    await gateway.late_answer(request_id, answer)
    return {"request_id": request_id, "status": "received"}
