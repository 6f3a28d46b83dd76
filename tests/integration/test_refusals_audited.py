"""Refusals at the door leave an audit line (issue 25): a caller header that is not the
token's, a Join for a capability the token may not serve, a takeover of another principal's
instance, a late answer from an agent that does not hold the instance."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from tests.conftest import new_stack
from tests.helpers import GatewayProcess, rid, wait_until
from tests.integration.test_auth import audit_lines, bearer, issue_cli

pytestmark = pytest.mark.integration


async def test_every_refusal_at_the_door_is_audited(
    temporal_server: str, tmp_path: Path, http: httpx.AsyncClient, capability: str
) -> None:
    stack = new_stack(temporal_server, tmp_path)
    caller, _ = issue_cli(stack, "--principal", "orchestrator")
    owner, _ = issue_cli(stack, "--principal", "kr", "--agent", "--capability", capability)
    other, _ = issue_cli(stack, "--principal", "intruder", "--agent", "--capability", "*")
    narrow, _ = issue_cli(stack, "--principal", "narrow", "--agent", "--capability", "elsewhere")
    async with GatewayProcess(stack, "audited") as gateway:
        url = gateway.url
        instance = f"{capability}-01"
        join = {"capability": capability, "instance_id": instance, "service_address": "127.0.0.1:9"}

        r = await http.post(f"{url}/reach/agents", json=join, headers=bearer(owner))
        assert r.status_code == 200, r.text
        r = await http.post(
            f"{url}/reach/invoke",
            json={"target": capability, "operation": "query", "payload": {}},
            headers={**bearer(caller), "X-Reach-Caller": "someone-else"},
        )
        assert r.status_code == 403, r.text
        r = await http.post(f"{url}/reach/agents", json=join, headers=bearer(narrow))
        assert r.status_code == 403, r.text
        r = await http.put(f"{url}/reach/agents/{instance}/heartbeat", headers=bearer(other))
        assert r.status_code == 403, r.text
        r = await http.post(
            f"{url}/reach/requests/{rid()}/result",
            json={"status": "success", "result": {"forged": True}, "instance_id": instance},
            headers=bearer(other),
        )
        assert r.status_code == 403, r.text

        wanted = {"refused", "join_refused", "heartbeat_refused", "answer_refused"}

        def events() -> dict[str, dict[str, object]]:
            return {a["event"]: a for a in audit_lines(stack) if a["event"] in wanted}

        await wait_until(lambda: events().keys() == wanted, 10)
        found = events()
        assert found["refused"]["claimed_caller"] == "someone-else"
        assert found["join_refused"]["principal"] == "narrow"
        assert found["heartbeat_refused"]["principal"] == "intruder"
        assert found["answer_refused"]["instance"] == instance
        assert all(a["status"] == 403 for a in found.values())
