"""Temporal's codec-server protocol, so the Temporal UI and `temporal workflow show
--codec-endpoint http://<gateway>/codec` can show encrypted history in the clear.

    POST /codec/encode   {"payloads": [{"metadata": {k: base64}, "data": base64}, ...]}
    POST /codec/decode   the same shape in and out

Bodies are the protobuf JSON of temporal.api.common.v1.Payloads. Both need an admin token;
the browser's preflight (OPTIONS) needs none. Answers carry CORS headers for the origins in
`security.encryption.codec_cors_origins` (the UI on port 8233 by default). Registered only
while `security.encryption.enabled`.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Coroutine
from typing import Any

from fastapi import APIRouter, Request, Response
from fastapi.routing import APIRoute
from google.protobuf import json_format
from pydantic import BaseModel, Field
from temporalio.api.common.v1 import Payload, Payloads

from activities.codec import EncryptionCodec
from gateway_api.deps import AdminDep, json_body
from gateway_api.errors import error_response
from reach.config import EncryptionSettings
from reach.errors import Forbidden, InvalidRequest, NotFound, ReachError
from reach.messages import ErrorResponse
from reach.security.crypto import CryptoError, PayloadCipher

ALLOW_HEADERS = "Authorization, Content-Type, X-Namespace"
ALLOW_METHODS = "POST, OPTIONS"
PREFLIGHT_MAX_AGE_S = 600
# Protobuf JSON takes standard or URL-safe base64, padded or not.
_BASE64 = re.compile(r"^[A-Za-z0-9+/_-]*={0,2}$")


class CodecPayload(BaseModel):
    """One `temporal.api.common.v1.Payload` in protobuf JSON."""

    metadata: dict[str, str] = Field(default_factory=dict, description="name -> base64 value")
    data: str = Field(default="", description="base64")


class CodecPayloads(BaseModel):
    """`temporal.api.common.v1.Payloads` in protobuf JSON."""

    payloads: list[CodecPayload] = Field(default_factory=list)


_RESPONSES: dict[int | str, Any] = {
    200: {"model": CodecPayloads, "description": "The payloads, encoded or decoded, in order"},
    401: {"model": ErrorResponse, "description": "No valid admin token"},
    403: {"model": ErrorResponse, "description": "The token is not an admin's"},
    413: {"model": ErrorResponse, "description": "Body larger than the limit"},
    422: {
        "model": ErrorResponse,
        "description": "Not Payloads JSON, or a payload that no known key opens",
    },
}


def router(settings: EncryptionSettings) -> APIRouter:
    """The codec endpoints for this deployment's keys (404 `encryption is off` without them)."""
    cipher = PayloadCipher.from_settings(settings)
    codec = EncryptionCodec(cipher) if cipher is not None else None
    origins = frozenset(o.rstrip("/") for o in settings.codec_cors_origins)

    def cors(request: Request) -> dict[str, str]:
        origin = request.headers.get("origin")
        if origin is None or origin.rstrip("/") not in origins:
            return {"Vary": "Origin"}
        return {
            "Access-Control-Allow-Origin": origin,
            "Access-Control-Allow-Credentials": "true",
            "Vary": "Origin",
        }

    def the_codec() -> EncryptionCodec:
        if codec is None:
            raise NotFound("payload encryption is off (security.encryption.enabled)")
        return codec

    class CorsRoute(APIRoute):
        """Every answer, an error's too, carries the CORS headers: a browser shows the UI
        nothing of an answer without them, not even why it failed."""

        def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
            handler = super().get_route_handler()

            async def with_cors(request: Request) -> Response:
                try:
                    response = await handler(request)
                except ReachError as exc:
                    response = error_response(None, exc)
                response.headers.update(cors(request))
                return response

            return with_cors

    api = APIRouter(prefix="/codec", tags=["codec"], route_class=CorsRoute)

    @api.post(
        "/encode",
        responses=_RESPONSES,
        summary="Encrypt payloads with the active key (Temporal codec server)",
        openapi_extra=json_body(CodecPayloads, "Payloads, protobuf JSON"),
    )
    async def encode(request: Request, _admin: AdminDep) -> Response:
        payloads = parse_payloads(await request.body())
        encoded = [the_codec().encrypt(p) for p in payloads.payloads]
        return payloads_response(encoded)

    @api.post(
        "/decode",
        responses=_RESPONSES,
        summary="Decrypt payloads; unencrypted ones come back as they are (Temporal codec server)",
        openapi_extra=json_body(CodecPayloads, "Payloads, protobuf JSON"),
    )
    async def decode(request: Request, _admin: AdminDep) -> Response:
        payloads = parse_payloads(await request.body())
        codec = the_codec()
        decoded = []
        for index, payload in enumerate(payloads.payloads):
            try:
                decoded.append(codec.decrypt(payload))
            except CryptoError as exc:
                raise InvalidRequest(f"payloads[{index}]: {exc}") from None
        return payloads_response(decoded)

    async def preflight(request: Request) -> Response:
        the_codec()
        headers = cors(request)
        if "Access-Control-Allow-Origin" not in headers:
            raise Forbidden(
                f"origin {request.headers.get('origin')!r} may not call the codec server "
                "(security.encryption.codec_cors_origins)"
            )
        headers |= {
            "Access-Control-Allow-Methods": ALLOW_METHODS,
            "Access-Control-Allow-Headers": ALLOW_HEADERS,
            "Access-Control-Max-Age": str(PREFLIGHT_MAX_AGE_S),
        }
        return Response(status_code=204, headers=headers)

    for path in ("/encode", "/decode"):
        api.add_api_route(path, preflight, methods=["OPTIONS"], include_in_schema=False)
    return api


def parse_payloads(body: bytes) -> Payloads:
    """The body as `Payloads` (protobuf JSON); InvalidRequest (422) when it is not one."""
    message = Payloads()
    try:
        tree = json.loads(body)
        if not isinstance(tree, dict):
            raise ValueError("the body is not a JSON object")
        # Protobuf's own base64 reader skips what it cannot read: garbage must not become b"".
        for index, item in enumerate(tree.get("payloads") or []):
            if isinstance(item, dict):
                _check_base64(f"payloads[{index}].data", item.get("data"))
                for name, value in (item.get("metadata") or {}).items():
                    _check_base64(f"payloads[{index}].metadata.{name}", value)
        json_format.ParseDict(tree, message)
    except (json_format.ParseError, ValueError, TypeError, AttributeError, RecursionError) as exc:
        raise InvalidRequest(
            f'body: expected Temporal Payloads JSON {{"payloads": [{{"metadata": {{}}, '
            f'"data": "<base64>"}}]}}: {exc}'
        ) from None
    return message


def _check_base64(where: str, value: object) -> None:
    if isinstance(value, str) and not _BASE64.fullmatch(value):
        raise ValueError(f"{where} is not base64")


def payloads_response(payloads: list[Payload]) -> Response:
    body = json_format.MessageToJson(Payloads(payloads=payloads), indent=None)
    return Response(body, media_type="application/json")
