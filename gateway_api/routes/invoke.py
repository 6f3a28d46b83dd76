from __future__ import annotations

import asyncio
from typing import Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import Response
from pydantic import BaseModel
from starlette.types import Receive, Scope

from gateway_api.deps import (
    AgentDep,
    GatewayDep,
    ReaderDep,
    RequestIdPath,
    document_invoke_headers,
    json_body,
)
from gateway_api.errors import envelope_response, status_code_of
from gateway_api.front import Body
from gateway_api.gateway import Gateway
from gateway_api.http_limits import disconnected
from gateway_api.steps.identify import TRACEPARENT, Metadata
from reach import acceptance
from reach.acceptance import LateAnswerBody
from reach.errors import ReachError
from reach.messages import ErrorResponse, InvokeRequest, InvokeResponse
from reach.telemetry import tracing

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
    dependencies=[Depends(document_invoke_headers)],
)
async def invoke(request: Request, gateway: GatewayDep) -> Response:
    # Served by `gateway_api.fast.InvokeFastPath` in the app; this route documents it (OpenAPI)
    # and serves an app mounted without that path. Both answer through `answer_invoke`.
    body = _RequestBody(request)
    return await answer_invoke(gateway, metadata_of(request.scope), body, HttpFront(request.state))


def metadata_of(scope: Scope) -> dict[str, str]:
    """Header name -> value (latin-1, as Starlette reads it); the first of repeated ones."""
    found: dict[str, str] = {}
    for name, value in scope["headers"]:
        key = name.decode("latin-1")
        if key not in found:
            found[key] = value.decode("latin-1")
    return found


class HttpFront:
    """The HTTP front's side of the door: it keeps the RequestID where the error envelopes
    (and `CatchBugs`' last-resort 500) find it, and, given the connection's `receive`, lets a
    synchronous request go when its client disconnects while it waits (`started`): the
    request goes on durably, and the gateway holds nothing of it for nobody."""

    __slots__ = ("_gone", "caller", "receive", "state")

    def __init__(self, state: Any, receive: Receive | None = None) -> None:
        self.state = state
        self.caller: str | None = None
        self.receive = receive
        self._gone: asyncio.Task[None] | None = None

    async def started(self, request_id: str) -> asyncio.Future[Any] | None:
        if self.receive is None:
            return None
        self._gone = asyncio.create_task(disconnected(self.receive))
        return self._gone

    def close(self) -> None:
        """The door answered: stop listening for the client's disconnect."""
        if self._gone is not None:
            self._gone.cancel()
            self._gone = None

    @property
    def request_id(self) -> str | None:
        return getattr(self.state, "request_id", None)

    async def named(self, request_id: str, caller: str) -> None:
        self.state.request_id = request_id
        self.caller = caller


class _RequestBody:
    __slots__ = ("request",)

    def __init__(self, request: Request) -> None:
        self.request = request

    async def read(self) -> bytes:
        return await self.request.body()


async def answer_invoke(
    gateway: Gateway, metadata: Metadata, body: Body, front: HttpFront
) -> Response:
    """POST /reach/invoke through the door. With tracing on, in a server span that continues
    the caller's `traceparent`."""
    active = tracing.tracer
    if active is None:
        return _envelope(await gateway.door.invoke(metadata, body, front))
    attributes = {"http.request.method": "POST", "url.path": "/reach/invoke"}
    traceparent = metadata.get(TRACEPARENT)  # read leniently: the door refuses a bad one
    with tracing.server_span(active, "POST /reach/invoke", traceparent, attributes) as span:
        try:
            response = await gateway.door.invoke(metadata, body, front)
        except ReachError as exc:  # answered in the envelope by the caller of this function
            span.set_attribute("http.response.status_code", exc.http_status)
            span.set_attribute("reach.error_type", exc.type)
            raise
        finally:
            if front.request_id:
                span.set_attribute("reach.request_id", front.request_id)
            if front.caller:
                span.set_attribute("reach.caller", front.caller)
        answer = _envelope(response)
        span.set_attribute("http.response.status_code", answer.status_code)
        return answer


def _envelope(response: InvokeResponse) -> Response:
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
    response = await gateway.requests.status(request_id, reader)
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
    verdict = await gateway.requests.late_answer(request_id, answer, agent)
    return LateAnswerAck(request_id=request_id, status=verdict)
