from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response
from pydantic import BaseModel

from gateway_api.deps import (
    AgentDep,
    CallerDep,
    GatewayDep,
    IdempotencyKeyDep,
    ReaderDep,
    RequestIdPath,
    TraceparentDep,
    json_body,
)
from gateway_api.errors import envelope_response
from gateway_api.service import Gateway, status_code_of
from reach import acceptance
from reach.acceptance import LateAnswerBody
from reach.errors import ReachError
from reach.messages import ErrorResponse, InvokeRequest, InvokeResponse, new_request_id
from reach.telemetry import tracing
from reach.telemetry.logs import current_request_id

router = APIRouter(prefix="/reach", tags=["invoke"])

_TEXT = {
    200: "The request's envelope",
    202: "Accepted: the result will be POSTed to the callback URL",
    401: "Missing, invalid, expired or revoked token (when tokens are required)",
    403: "Denied by a rule (named), a caller header that is not the token's, or a token of "
    "the wrong kind",
    404: "Unknown capability or request",
    409: "A repeated request_id with another body, or a late answer after the end",
    413: "Body or payload larger than the limit",
    422: "Invalid request: the message names the field or header",
    500: "A bug in Reach (never an agent's failure)",
    502: "The agent failed or could not be reached (agent_error, transport_error)",
    503: "No healthy instance, or Temporal/registry unavailable (Retry-After)",
    504: "No answer within timeout_ms (status timeout), or no verdict yet (status running)",
}


def _codes(*codes: int) -> dict[int | str, Any]:
    return {
        c: {"model": InvokeResponse if c < 300 else ErrorResponse, "description": _TEXT[c]}
        for c in codes
    }


class LateAnswerAck(BaseModel):
    request_id: str
    status: str


@router.post(
    "/invoke",
    response_model=InvokeResponse,
    responses=_codes(202, 401, 403, 404, 409, 413, 422, 500, 502, 503, 504),
    summary="Invoke a capability by name (sync without callback, 202 with one)",
    openapi_extra=json_body(InvokeRequest, "The standard request (R9)"),
)
async def invoke(
    request: Request,
    gateway: GatewayDep,
    caller: CallerDep,
    traceparent: TraceparentDep,
    idempotency_key: IdempotencyKeyDep,
) -> Response:
    # Served by `gateway_api.fast.InvokeFastPath` in the app; this route documents it (OpenAPI)
    # and serves an app mounted without that path. Both answer through `answer_invoke`.
    return await answer_invoke(
        gateway, await request.body(), caller, traceparent, idempotency_key, request.state
    )


async def answer_invoke(
    gateway: Gateway,
    raw: bytes,
    caller: str,
    traceparent: str | None,
    idempotency_key: str | None,
    state: Any,
) -> Response:
    """POST /reach/invoke once its headers are read: `state.request_id` is set as soon as the
    request has one (error envelopes name it). With tracing on, in a server span that
    continues the caller's `traceparent`."""
    active = tracing.tracer
    if active is None:
        return await _answer_invoke(gateway, raw, caller, traceparent, idempotency_key, state)
    attributes = {
        "http.request.method": "POST",
        "url.path": "/reach/invoke",
        "reach.caller": caller,
    }
    with tracing.server_span(active, "POST /reach/invoke", traceparent, attributes) as span:
        try:
            response = await _answer_invoke(
                gateway, raw, caller, traceparent, idempotency_key, state
            )
        except ReachError as exc:  # answered in the envelope by the caller of this function
            span.set_attribute("http.response.status_code", exc.http_status)
            span.set_attribute("reach.error_type", exc.type)
            raise
        finally:
            request_id = getattr(state, "request_id", None)
            if request_id:
                span.set_attribute("reach.request_id", request_id)
        span.set_attribute("http.response.status_code", response.status_code)
        return response


async def _answer_invoke(
    gateway: Gateway,
    raw: bytes,
    caller: str,
    traceparent: str | None,
    idempotency_key: str | None,
    state: Any,
) -> Response:
    body, payload_json = acceptance.invoke_request(raw, gateway.limits)
    body.idempotency_key = acceptance.one_idempotency_key(body.idempotency_key, idempotency_key)
    body.request_id = body.request_id or new_request_id()
    state.request_id = body.request_id
    token = current_request_id.set(body.request_id)  # on this request's log records
    try:
        response = await gateway.invoke(body, payload_json, caller, traceparent)
    finally:
        current_request_id.reset(token)
    # A sync caller still without a verdict at the deadline gets a gateway timeout.
    return envelope_response(response, status_code_of(response, running=504))


@router.get(
    "/requests/{request_id}",
    response_model=InvokeResponse,
    responses=_codes(401, 403, 404, 422, 500, 502, 503, 504),
    summary="Status and result of any request, and its callback delivery",
)
async def get_request(
    request_id: RequestIdPath, gateway: GatewayDep, reader: ReaderDep
) -> Response:
    response = await gateway.status(request_id, reader)
    return envelope_response(response, status_code_of(response))


@router.post(
    "/requests/{request_id}/result",
    status_code=202,
    response_model=LateAnswerAck,
    responses=_codes(401, 403, 404, 409, 413, 422, 500, 503),
    summary="An agent's late (asynchronous) answer to a request it accepted with 202",
    openapi_extra=json_body(LateAnswerBody, "The agent's answer"),
)
async def post_late_result(
    request_id: RequestIdPath, request: Request, gateway: GatewayDep, agent: AgentDep
) -> LateAnswerAck:
    answer = acceptance.late_answer(await request.body(), gateway.limits)
    verdict = await gateway.late_answer(request_id, answer, agent)
    return LateAnswerAck(request_id=request_id, status=verdict)
