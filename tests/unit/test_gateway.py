"""Gateway logic without servers: the last-resort 500, the rules for repeats."""

from __future__ import annotations

import httpx
import pytest
from fastapi import FastAPI

from gateway_api.errors import CatchBugs, install_error_handlers
from gateway_api.service import check_repeat
from reach.errors import RequestConflict
from reach.invocation import CallPlan, InvokeInput


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


def test_a_repeat_of_a_request_accepted_before_fingerprints_still_attaches() -> None:
    def inp(fingerprint: str | None, callback: str | None = None) -> InvokeInput:
        plan = CallPlan(timeout_ms=1, idempotent=True, max_retries=0)
        return InvokeInput(
            request_id="r",
            caller="c",
            target="t",
            operation="o",
            accepted_at_ms=0,
            deadline_ms=1,
            plan=plan,
            fingerprint=fingerprint,
            callback=callback,
        )

    check_repeat("r", inp(None), inp("abc"))  # legacy: attaches
    check_repeat("r", inp("abc", "http://a/cb"), inp("abc"))  # may drop the callback
    with pytest.raises(RequestConflict):
        check_repeat("r", inp("abc"), inp("abd"))
    with pytest.raises(RequestConflict):
        check_repeat("r", inp("abc"), inp("abc", "http://a/cb"))
