"""Outcomes reported as they are (issue 25)."""

from __future__ import annotations

import httpx
import pytest
from temporalio.client import Client

from tests.helpers import GatewayProcess, invoke, start_agents, wait_until

pytestmark = pytest.mark.integration


async def test_a_terminated_request_reads_as_closed_not_as_reachs_failure(
    gateway: GatewayProcess, http: httpx.AsyncClient, capability: str
) -> None:
    await start_agents(gateway, capability, 1, "--defer")  # answers 202; the result never comes
    r = await invoke(http, gateway, capability, callback="http://127.0.0.1:9/cb", timeout_ms=60_000)
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
