"""Gateway logic without servers: the last-resort 500, the rules for repeats."""

from __future__ import annotations

import httpx
import pytest
from fastapi import FastAPI

from gateway_api.errors import CatchBugs, install_error_handlers
from gateway_api.steps.start import check_repeat
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


def _inp(payload: dict[str, object], callback: str | None = None, **kw: object) -> InvokeInput:
    fields: dict[str, object] = {
        "request_id": "r",
        "caller": "c",
        "target": "t",
        "operation": "o",
        "payload": payload,
        "accepted_at_ms": 0,
        "deadline_ms": 1,
        "plan": CallPlan(timeout_ms=3000, idempotent=True, max_retries=0),
        "callback": callback,
        **kw,
    }
    return InvokeInput.model_validate(fields)


def test_a_repeat_is_judged_by_what_it_asks_not_how_it_is_spelled() -> None:
    first = _inp({"a": 1, "b": [1, 2]}, "http://a/cb")
    check_repeat("r", first, _inp({"b": [1, 2], "a": 1}, "http://a/cb"))  # key order
    check_repeat("r", first, _inp({"a": 1, "b": [1, 2]}))  # may drop the callback
    for other in (
        _inp({"a": 2, "b": [1, 2]}),
        _inp({"a": 1, "b": [1, 2]}, caller="someone-else"),
        _inp({"a": 1, "b": [1, 2]}, idempotency_key="k"),
        _inp({"a": 1, "b": [1, 2]}, plan=CallPlan(timeout_ms=1, idempotent=True, max_retries=0)),
        _inp({"a": 1, "b": [1, 2]}, "http://elsewhere/cb"),
    ):
        with pytest.raises(RequestConflict):
            check_repeat("r", first, other)
