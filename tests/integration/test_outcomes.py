"""Outcomes reported as they are (issue 25)."""

from __future__ import annotations

from typing import Any

import grpc
import httpx
import pytest
from temporalio.client import Client

from agent_reach_proto import gateway_pb2 as pb
from tests.helpers import GatewayProcess, invoke, rid, start_agents, wait_until
from tests.integration.test_auth import audit_lines
from tests.integration.test_grpc_front import front_address

pytestmark = pytest.mark.integration


async def test_a_terminated_request_reads_as_closed_not_as_reachs_failure(
    gateway: GatewayProcess, http: httpx.AsyncClient, capability: str
) -> None:
    await start_agents(gateway, capability, 1, "--defer")  # answers 202; the result never comes
    body = {"callback": "http://127.0.0.1:9/cb", "timeout_ms": 60_000}
    r = await invoke(http, gateway, capability, **body)
    assert r.status_code == 202, r.text
    request_id = r.json()["request_id"]
    client = await Client.connect(gateway.stack.temporal)

    async def running() -> bool:
        read = await http.get(f"{gateway.url}/reach/requests/{request_id}")
        return bool(read.json()["status"] == "running")

    await wait_until(running, 10)
    await client.get_workflow_handle(request_id).terminate("an operator's test")
    read = await http.get(f"{gateway.url}/reach/requests/{request_id}")
    assert read.status_code == 409, read.text  # was 500: "a bug in Reach"
    error = read.json()["error"]
    assert error["type"] == "request_closed"
    assert "terminated by an operator" in error["message"]
    # A repeat with the same callback is told so too, not "accepted" for a delivery that
    # will never come.
    again = await invoke(http, gateway, capability, request_id=request_id, **body)
    assert again.status_code == 409, again.text
    assert again.json()["error"]["type"] == "request_closed"


async def test_a_call_whose_grpc_caller_gave_up_is_still_accounted(
    gateway: GatewayProcess, http: httpx.AsyncClient, capability: str
) -> None:
    """A gRPC deadline shorter than the call cancelled the door's wait, and with it the
    request's audit record and metrics, while the request ran to its end."""
    await start_agents(gateway, capability, 1, "--delay-ms", "1500")
    request_id = rid()
    async with grpc.aio.insecure_channel(front_address(gateway)) as channel:
        call = channel.unary_unary(
            "/reach.v1.Reach/Invoke",
            request_serializer=pb.InvokeRequest.SerializeToString,
            response_deserializer=pb.InvokeResponse.FromString,
        )
        message = pb.InvokeRequest(
            request_id=request_id, target=capability, operation="query", payload_json="{}"
        )
        with pytest.raises(grpc.aio.AioRpcError) as gave_up:
            await call(message, timeout=0.5)
        assert gave_up.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED

    def outcome() -> list[dict[str, Any]]:
        return [
            a
            for a in audit_lines(gateway.stack)
            if a["event"] == "invoke" and a.get("request_id") == request_id
        ]

    await wait_until(lambda: bool(outcome()), 20)
    [record] = outcome()
    assert (record["outcome"], record["status"]) == ("success", 200)
    assert record["duration_ms"] >= 1500
