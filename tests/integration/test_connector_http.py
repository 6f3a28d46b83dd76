"""The HTTP connector against real servers: every outcome becomes a Reply or a typed error."""

from __future__ import annotations

import asyncio
import json
import time

import pytest

from agent_reach_sdk.server import HttpAgentServer, HttpRequest, HttpResponse
from connectors.http import HttpConnector
from gateway_api.devserver import free_port
from reach.errors import AgentError, DeadlineExceeded, PayloadTooLarge, TransportError
from reach.invocation import Endpoint
from reach.messages import Header, Message

pytestmark = pytest.mark.integration

SEEN: list[HttpRequest] = []


async def handler(request: HttpRequest) -> HttpResponse:
    SEEN.append(request)
    op = request.path.rsplit("/", 1)[-1]
    if op == "ok":
        return HttpResponse(200, {"got": json.loads(request.body)})
    if op == "list":
        return HttpResponse(200, [1, 2])  # type: ignore[arg-type]
    if op == "later":
        return HttpResponse(202, {"status": "accepted"})
    if op == "slow":
        await asyncio.sleep(1)
        return HttpResponse(200, {})
    if op == "overloaded":
        return HttpResponse(503, {"error": {"type": "agent_error", "message": "busy"}})
    if op == "big":
        return HttpResponse(413, {"error": {"type": "payload_too_large", "message": "no"}})
    return HttpResponse(404, {"error": {"type": "invalid_request", "message": "unknown op"}})


def message(operation: str) -> Message:
    return Message(
        header=Header(
            request_id="req-1",
            caller="tester",
            target="cap",
            operation=operation,
            attempt=2,
            deadline_ms=int(time.time() * 1000) + 5000,
            idempotency_key="key-1",
            traceparent="00-abc-def-01",
        ),
        payload={"q": "x"},
    )


async def test_http_connector_outcomes() -> None:
    server = HttpAgentServer(handler, "127.0.0.1", 0, 1 << 20)
    await server.start()
    ep = Endpoint(
        instance_id="a1", capability="cap", protocol="http", address=f"127.0.0.1:{server.port}"
    )
    try:
        async with HttpConnector() as conn:
            reply = await conn.invoke(ep, message("ok"), 2)
            assert reply.status == "ok"
            assert reply.result == {"got": {"q": "x"}}
            h = SEEN[-1].headers
            assert h["x-reach-request-id"] == "req-1"
            assert h["x-reach-caller"] == "tester"
            assert h["x-reach-attempt"] == "2"
            assert h["idempotency-key"] == "key-1"
            assert h["traceparent"] == "00-abc-def-01"
            assert int(h["x-reach-deadline-ms"]) > time.time() * 1000
            assert (await conn.invoke(ep, message("list"), 2)).result == {"value": [1, 2]}
            assert (await conn.invoke(ep, message("later"), 2)).status == "accepted"
            with pytest.raises(DeadlineExceeded):
                await conn.invoke(ep, message("slow"), 0.2)
            with pytest.raises(AgentError) as busy:
                await conn.invoke(ep, message("overloaded"), 2)
            assert busy.value.retryable
            with pytest.raises(AgentError) as missing:
                await conn.invoke(ep, message("nope"), 2)
            assert not missing.value.retryable
            with pytest.raises(PayloadTooLarge):
                await conn.invoke(ep, message("big"), 2)
            dead = ep.model_copy(update={"address": f"127.0.0.1:{free_port()}"})
            with pytest.raises(TransportError) as refused:
                await conn.invoke(dead, message("ok"), 2)
            assert refused.value.retryable
    finally:
        await server.close()
