"""A late answer forged under an instance_id taken over after its record is gone (hostile review
of issue 25's ownership promise): a request sent to an instance an admin registered (held by
nobody) and answered 202, the record removed, another principal's agent token joins under the
same instance_id and posts the answer. Reproduced: the join is 200 (no record, so no claim is
checked), the answer was taken (202) and the caller's callback carried {"forged": true}; now
it is refused 403: only an admin token answers for an instance nobody owned when it was sent."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from agent_reach_sdk.wire import Answer, Inbound
from tests.conftest import new_stack
from tests.helpers import CallbackReceiver, GatewayProcess, agent_server, wait_until
from tests.integration.test_auth import bearer, issue_cli

pytestmark = pytest.mark.integration


def need(ok: bool, what: object) -> None:
    """A step the attack needs (not an AssertionError, so the xfail cannot hide it)."""
    if not ok:
        raise RuntimeError(str(what))


async def test_an_answer_from_whoever_holds_the_instance_id_now_is_not_taken(
    temporal_server: str, tmp_path: Path, http: httpx.AsyncClient, capability: str
) -> None:
    stack = new_stack(temporal_server, tmp_path, heartbeat_timeout=60.0)
    admin, _ = issue_cli(stack, "--principal", "ops", "--admin")
    caller, _ = issue_cli(stack, "--principal", "orchestrator")
    other, _ = issue_cli(stack, "--principal", "mallory", "--agent", "--capability", capability)

    async def accept(_: Inbound) -> Answer:
        return Answer(202, {"status": "accepted"})

    server = agent_server(accept)
    await server.start()
    instance = f"{capability}-01"
    try:
        async with GatewayProcess(stack, "late") as gateway, CallbackReceiver() as receiver:
            agents = f"{gateway.url}/reach/agents"
            join = {"capability": capability, "instance_id": instance}
            r = await http.post(
                agents,
                json={**join, "service_address": f"127.0.0.1:{server.port}"},
                headers=bearer(admin),
            )
            need(r.status_code == 200, r.text)
            r = await http.post(
                f"{gateway.url}/reach/invoke",
                json={
                    "target": capability,
                    "operation": "write",
                    "payload": {},
                    "callback": receiver.url,
                    "timeout_ms": 60_000,
                },
                headers=bearer(caller),
            )
            need(r.status_code == 202, r.text)
            request_id = r.json()["request_id"]

            async def sent() -> bool:
                got = await http.get(
                    f"{gateway.url}/reach/requests/{request_id}", headers=bearer(caller)
                )
                return got.json().get("instance_id") == instance or bool(got.json().get("attempts"))

            await wait_until(sent, 20, every_s=0.1)
            r = await http.delete(f"{agents}/{instance}", headers=bearer(admin))
            need(r.status_code == 204, r.text)
            r = await http.post(
                agents, json={**join, "service_address": "127.0.0.1:9"}, headers=bearer(other)
            )
            need(r.status_code == 200, r.text)  # no record: no claim to check
            forged = await http.post(
                f"{gateway.url}/reach/requests/{request_id}/result",
                json={"status": "success", "result": {"forged": True}, "instance_id": instance},
                headers=bearer(other),
            )
            assert forged.status_code == 403, forged.text
            assert "admin token" in forged.text, forged.text
            # The operator who registered it may still answer for it: the caller gets that.
            r = await http.post(
                f"{gateway.url}/reach/requests/{request_id}/result",
                json={"status": "success", "result": {"by": "ops"}, "instance_id": instance},
                headers=bearer(admin),
            )
            assert r.status_code == 202, r.text
            await receiver.wait(1, timeout_s=30)
            envelope = receiver.received[0][1]
            assert envelope["result"] == {"by": "ops"}, envelope
    finally:
        await server.close()
