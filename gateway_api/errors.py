"""Every answer leaves the gateway in the one envelope, with the status its error type decides.

Reach's errors, the framework's own (an unknown route, a wrong method, a bad path parameter), a
body over the limit and anything unforeseen all end here; nothing answers in another shape.
"""

from __future__ import annotations

import logging
import re
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import compile_path
from starlette.types import ASGIApp, Message, Receive, Scope, Send
from temporalio.service import RPCError, RPCStatusCode

from agent_reach_proto import wire
from reach.errors import (
    ErrorType,
    InternalError,
    InvalidRequest,
    PayloadTooLarge,
    ReachError,
    RequestClosed,
    Unavailable,
    UnknownRequest,
    http_status_for,
)
from reach.messages import REQUEST_ID_PATTERN, ErrorInfo, InvokeResponse, dumps

log = logging.getLogger("reach.gateway")
_REQUEST_ID = re.compile(REQUEST_ID_PATTERN)

# Temporal answers that mean "not now": the caller may try again.
_TRANSIENT = {
    RPCStatusCode.UNAVAILABLE,
    RPCStatusCode.DEADLINE_EXCEEDED,
    RPCStatusCode.RESOURCE_EXHAUSTED,
    RPCStatusCode.ABORTED,
    RPCStatusCode.CANCELLED,
    RPCStatusCode.UNKNOWN,
}


def status_code_of(response: InvokeResponse, *, running: int = 200) -> int:
    """The HTTP status of an envelope: only Reach's own error types decide it."""
    if response.status == "accepted":
        return 202
    if response.status == "running":
        return running
    if response.status == "timeout":
        return 504
    if response.status == "error" and response.error:
        return http_status_for(response.error.type)
    return 200


def envelope_response(response: InvokeResponse, status_code: int) -> Response:
    headers = {wire.HTTP_REQUEST_ID: response.request_id} if response.request_id else {}
    if response.error is not None and (
        response.error.retry_after_s is not None or status_code in (429, 503)
    ):
        # Every 429 and 503 says when to try again (1 s when Reach knows no better), as the
        # door's own refusals do (`error_response`): no_instance, circuit_open, unavailable.
        headers["Retry-After"] = str(max(1, response.error.retry_after_s or 1))
    if response.replayed_from:
        headers["Idempotent-Replayed"] = "true"
    # Serialized by pydantic's core in one step (the same JSON a dict + json.dumps gives).
    return Response(
        response.model_dump_json(exclude_none=True),
        status_code=status_code,
        headers=headers,
        media_type="application/json",
    )


def error_body(
    request_id: str | None, error_type: ErrorType, message: str, retryable: bool
) -> dict[str, Any]:
    return {
        "request_id": request_id,
        "status": "error",
        "error": ErrorInfo(type=error_type, message=message, retryable=retryable).model_dump(
            exclude_none=True
        ),
    }


def error_response(request_id: str | None, err: ReachError) -> JSONResponse:
    headers = None
    if err.http_status in (429, 503):
        headers = {"Retry-After": str(max(1, err.retry_after_s or 1))}
    body = error_body(request_id, err.type, err.message, err.retryable)
    if err.retry_after_s:
        body["error"]["retry_after_s"] = err.retry_after_s
    if err.outcome_unknown:
        body["error"]["outcome_unknown"] = True
    return JSONResponse(
        body,
        status_code=err.http_status,
        headers=headers,
    )


def _request_id(request: Request) -> str | None:
    """The RequestID an error is about, when there is a valid one (never echo garbage back)."""
    found = getattr(request.state, "request_id", None) or request.path_params.get("request_id")
    return valid_request_id(found)


def valid_request_id(found: object) -> str | None:
    return found if isinstance(found, str) and _REQUEST_ID.fullmatch(found) else None


def reach_error_of_rpc(exc: RPCError) -> ReachError:
    """The one place Temporal's RPC failures become Reach errors."""
    if exc.status in _TRANSIENT:
        return Unavailable(f"workflow engine unavailable: {exc.message}")
    if exc.status == RPCStatusCode.INVALID_ARGUMENT and "size" in exc.message.lower():
        return PayloadTooLarge(f"the workflow engine refused the request's size: {exc.message}")
    if exc.status == RPCStatusCode.INVALID_ARGUMENT:
        return InvalidRequest(f"the workflow engine refused the request: {exc.message}")
    return InternalError(f"workflow engine error ({exc.status.name}): {exc.message}")


def _methods_on(request: Request) -> list[str]:
    """Every method the API documents on the request's path (from the OpenAPI document: the
    framework's router keeps included routes in private structures)."""
    paths: list[tuple[re.Pattern[str], list[str]]] | None = getattr(
        request.app.state, "allowed_methods", None
    )
    if paths is None:
        paths = [
            (compile_path(template)[0], [m.upper() for m in ops])
            for template, ops in request.app.openapi().get("paths", {}).items()
        ]
        request.app.state.allowed_methods = paths
    found = {m for regex, methods in paths if regex.match(request.url.path) for m in methods}
    return sorted(found)


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(ReachError)
    async def _reach_error(request: Request, exc: ReachError) -> JSONResponse:
        if not isinstance(exc, UnknownRequest | RequestClosed):
            log.info("%s %s -> %s: %s", request.method, request.url.path, exc.type, exc.message)
        return error_response(_request_id(request), exc)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        return JSONResponse(
            error_body(_request_id(request), "invalid_request", _validation_message(exc), False),
            status_code=422,
        )

    @app.exception_handler(StarletteHTTPException)
    async def _framework(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        error_type: ErrorType = (
            "not_found"
            if exc.status_code == 404
            else "method_not_allowed"
            if exc.status_code == 405
            else "invalid_request"
            if exc.status_code < 500
            else "internal"
        )
        message = f"{request.method} {request.url.path}: {exc.detail}"
        headers = dict(exc.headers or {})
        if exc.status_code == 405:
            # Starlette names only the first route on the path; list every route's methods.
            headers["Allow"] = ", ".join(_methods_on(request))
        return JSONResponse(
            error_body(_request_id(request), error_type, message, False),
            status_code=http_status_for(error_type),
            headers=headers or None,
        )

    @app.exception_handler(RPCError)
    async def _temporal(request: Request, exc: RPCError) -> JSONResponse:
        err = reach_error_of_rpc(exc)
        log.error("Temporal call failed on %s: %s", request.url.path, exc)
        return error_response(_request_id(request), err)


class CatchBugs:
    """Answer an unforeseen exception with the 500 envelope, and keep the connection.

    Starlette's own last-resort handler sends the response and then re-raises, and the server
    drops the connection on the re-raise, so a client could read a reset instead of the answer.
    """

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def tracked(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, tracked)
        except Exception as exc:
            log.error(
                "%s %s failed inside Reach", scope.get("method"), scope.get("path"), exc_info=exc
            )
            if started:
                raise
            request = Request(scope)
            response = JSONResponse(
                error_body(
                    _request_id(request),
                    "internal",
                    f"Reach failed on this request ({type(exc).__name__}); see the gateway log",
                    False,
                ),
                status_code=500,
            )
            await response(scope, receive, send)


def _validation_message(exc: RequestValidationError) -> str:
    parts = []
    for err in exc.errors():
        loc = [str(p) for p in err.get("loc", ())]
        where = ".".join(loc[1:] if loc and loc[0] in ("path", "query", "header") else loc)
        kind = f"{loc[0]} parameter " if loc and loc[0] in ("path", "query", "header") else ""
        parts.append(f"{kind}{where or 'request'}: {err.get('msg', 'invalid')}")
    return "; ".join(parts)


class BodyLimit:
    """Refuse a request body past `limit` bytes without keeping it: at once when Content-Length
    says so, or as soon as a chunked stream passes it. The parsed size is checked again in
    `reach.acceptance`.

    The refused body is still read (and dropped) up to `drain` bytes, because most clients read
    no answer before they have sent their whole request: closing on them would turn a clear
    413 into a connection reset. Past `drain`, the connection is simply closed.
    """

    def __init__(self, app: ASGIApp, limit: int, drain: int | None = None) -> None:
        self.app = app
        self.limit = limit
        self.drain = drain if drain is not None else max(16 * limit, 64 * 1024 * 1024)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = _content_length(scope)
        if declared is not None and declared > self.limit:
            if declared <= self.drain:
                await _discard(receive, self.drain)
            await self._refuse(send, f"{declared} bytes")
            return
        seen = 0

        async def counted() -> Message:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.limit:
                    if message.get("more_body", False):
                        await _discard(receive, self.drain - seen)
                    raise PayloadTooLarge(self._message(f"more than {self.limit} bytes"))
            return message

        await self.app(scope, counted, send)

    def _message(self, size: str) -> str:
        return (
            f"request body is {size}; the limit is {self.limit} bytes (transport.max_message_bytes)"
        )

    async def _refuse(self, send: Send, size: str) -> None:
        body = dumps(error_body(None, "payload_too_large", self._message(size), False))
        await send(
            {
                "type": "http.response.start",
                "status": 413,
                "headers": [
                    (b"content-type", b"application/json"),
                    (b"content-length", str(len(body)).encode()),
                    (b"connection", b"close"),
                ],
            }
        )
        await send({"type": "http.response.body", "body": body})


async def _discard(receive: Receive, budget: int) -> None:
    """Read and drop the rest of a request body, up to `budget` bytes."""
    while budget > 0:
        message = await receive()
        if message["type"] != "http.request":
            return
        budget -= len(message.get("body", b""))
        if not message.get("more_body", False):
            return


def _content_length(scope: Scope) -> int | None:
    for name, value in scope.get("headers", ()):
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None
    return None
