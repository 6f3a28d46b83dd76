"""The gateway's last resort: a bug is still a readable 500 in the envelope."""

from __future__ import annotations

import httpx
from fastapi import FastAPI

from gateway_api.errors import CatchBugs, install_error_handlers


async def test_a_bug_is_a_500_envelope_not_a_dropped_connection() -> None:
    app = FastAPI()
    install_error_handlers(app)
    app.add_middleware(CatchBugs)

    @app.get("/reach/requests/{request_id}")
    async def broken(request_id: str) -> None:
        raise RuntimeError("a bug")

    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://gw") as client:
        r = await client.get("/reach/requests/req-1")
    assert r.status_code == 500
    assert r.json() == {
        "request_id": "req-1",
        "status": "error",
        "error": {
            "type": "internal",
            "message": "Reach failed on this request (RuntimeError); see the gateway log",
            "retryable": False,
        },
    }
