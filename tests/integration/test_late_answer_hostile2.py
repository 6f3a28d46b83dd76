"""Hostile review of who answers late (2ff98de): an instance the door chose for attempt 1 but
that left before the call (a stale route: the request went elsewhere, and nothing to it) is
not one the request was sent to, so its owner must not answer the request. Reproduced on a
worker-less gateway (its door routes attempt 1, a worker runs the workflow later): the
request was routed again to another principal's instance, which accepted it (202); the first
principal joined its instance again and its answer was taken, the callback carrying it."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from agent_reach_sdk.wire import Answer, Inbound
from tests.conftest import new_stack
from tests.helpers import CallbackReceiver, GatewayProcess, Worker, agent_server, wait_until
from tests.integration.test_auth import bearer, issue_cli

pytestmark = pytest.mark.integration


async def test_the_owner_of_a_door_route_that_went_stale_does_not_answer_the_request(
    temporal_server: str,
    tmp_path: Path,
    http: httpx.AsyncClient,
    capability: str,
    redis_prefix: str,
) -> None:
    stack = new_stack(
        temporal_server, tmp_path, registry="redis", key_prefix=redis_prefix, heartbeat_timeout=60.0
    )
    caller, _ = issue_cli(stack, "--principal", "orchestrator")
    alice, _ = issue_cli(stack, "--principal", "alice", "--agent", "--capability", capability)
    bob, _ = issue_cli(stack, "--principal", "bob", "--agent", "--capability", capability)
    calls: list[str] = []

    async def accept(request: Inbound) -> Answer:
        calls.append(request.operation)
        return Answer(202, {"status": "accepted"})

    server = agent_server(accept)
    await server.start()
    first, second = f"{capability}-01", f"{capability}-02"
    address = f"127.0.0.1:{server.port}"
    try:
        async with (
            GatewayProcess(stack, "api", worker=False) as api,
            CallbackReceiver() as receiver,
        ):
            agents = f"{api.url}/reach/agents"
            join = {"capability": capability, "service_address": address}
            r = await http.post(agents, json={**join, "instance_id": first}, headers=bearer(alice))
            assert r.status_code == 200, r.text
            r = await http.post(
                f"{api.url}/reach/invoke",
                json={
                    "target": capability,
                    "operation": "write",
                    "payload": {},
                    "callback": receiver.url,
                    "timeout_ms": 60_000,
                },
                headers=bearer(caller),
            )
            assert r.status_code == 202, r.text
            request_id = r.json()["request_id"]
            # The door routed it to alice's instance; it leaves before any worker runs it.
            r = await http.delete(f"{agents}/{first}", headers=bearer(alice))
            assert r.status_code == 204, r.text
            r = await http.post(agents, json={**join, "instance_id": second}, headers=bearer(bob))
            assert r.status_code == 200, r.text
            await Worker(stack).ready()

            async def accepted_by_bob() -> bool:
                got = await http.get(
                    f"{api.url}/reach/requests/{request_id}", headers=bearer(caller)
                )
                return any(
                    a.get("instance_id") == second and a.get("outcome") == "accepted"
                    for a in got.json().get("attempts") or []
                )

            await wait_until(accepted_by_bob, 30, every_s=0.1)
            got = await http.get(f"{api.url}/reach/requests/{request_id}", headers=bearer(caller))
            assert all(a.get("instance_id") != first for a in got.json()["attempts"]), got.text
            assert len(calls) == 1  # bob's instance was sent it; alice's never was
            r = await http.post(agents, json={**join, "instance_id": first}, headers=bearer(alice))
            assert r.status_code == 200, r.text
            forged = await http.post(
                f"{api.url}/reach/requests/{request_id}/result",
                json={"status": "success", "result": {"by": "alice"}, "instance_id": first},
                headers=bearer(alice),
            )
            assert forged.status_code == 403, forged.text
            r = await http.post(
                f"{api.url}/reach/requests/{request_id}/result",
                json={"status": "success", "result": {"by": "bob"}, "instance_id": second},
                headers=bearer(bob),
            )
            assert r.status_code == 202, r.text
            await receiver.wait(1, timeout_s=30)
            assert receiver.received[0][1]["result"] == {"by": "bob"}, receiver.received
    finally:
        await server.close()
