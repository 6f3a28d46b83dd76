"""The dashboard at `/ui`: one static page (gateway_api/ui/, no build step) that polls the API.

The page reads `GET /reach/capabilities[/{name}]`, `GET /reach/requests` and
`GET /reach/requests/{id}/timeline` like any client, with the token the user gives it when
tokens are required, plus `GET /ui/config.json` for what only the server knows: the Temporal
UI's address and namespace (for links) and its clock (for heartbeat ages). The page itself is
public and carries no data; everything it shows comes through those authenticated calls. Not
part of the API: left out of the OpenAPI document.
"""

from __future__ import annotations

import functools
import time
from pathlib import Path

from fastapi import APIRouter
from fastapi.responses import JSONResponse, RedirectResponse, Response

import reach
from gateway_api.deps import GatewayDep, ReaderDep

UI_DIR = Path(__file__).resolve().parent.parent / "ui"
POLL_MS = 1500

# Only the page's own script and style run; data reaches the DOM as text, and this stops any
# markup that slipped in from running or loading anything.
_HEADERS = {
    "Content-Security-Policy": "default-src 'none'; script-src 'self'; style-src 'self'; "
    "connect-src 'self'; img-src 'self' data:; base-uri 'none'; form-action 'none'; "
    "frame-ancestors 'none'",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-cache",
}
_TYPES = {
    "index.html": "text/html; charset=utf-8",
    "dashboard.js": "text/javascript; charset=utf-8",
    "dashboard.css": "text/css; charset=utf-8",
}

router = APIRouter(include_in_schema=False)


@functools.cache
def _asset(name: str) -> bytes:
    return (UI_DIR / name).read_bytes()


def _serve(name: str) -> Response:
    return Response(_asset(name), media_type=_TYPES[name], headers=_HEADERS)


@router.get("/ui")
async def page() -> Response:
    return _serve("index.html")


@router.get("/ui/")
async def page_slashed() -> Response:
    """The page's own address has no slash (its assets are relative to it): sent there."""
    return RedirectResponse("/ui", status_code=308)


@router.get("/ui/dashboard.js")
async def script() -> Response:
    return _serve("dashboard.js")


@router.get("/ui/dashboard.css")
async def style() -> Response:
    return _serve("dashboard.css")


@router.get("/ui/config.json")
async def config(gateway: GatewayDep, reader: ReaderDep) -> JSONResponse:
    temporal = gateway.settings.temporal
    return JSONResponse(
        {
            "version": reach.__version__,
            "temporal_ui": temporal.ui_base_url,
            "namespace": temporal.namespace,
            "server_time": time.time(),
            "poll_ms": POLL_MS,
        },
        headers={"Cache-Control": "no-store"},
    )
