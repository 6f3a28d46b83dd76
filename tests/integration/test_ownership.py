"""Who holds an instance_id (issue 25): a process replaced under its instance_id stops keeping
the new record alive, and an instance nobody holds (joined with auth off, or by an admin) is
claimed by an agent token only for a capability it may serve, audited, never silently."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from agent_reach_proto import wire
from tests.conftest import new_stack
from tests.helpers import GatewayProcess, wait_until
from tests.integration.test_auth import audit_lines, bearer, issue_cli

pytestmark = pytest.mark.integration


async def test_replaced_sessions_and_claims_of_unowned_instances(
    temporal_server: str, tmp_path: Path, http: httpx.AsyncClient, capability: str
) -> None:
    # Records outlive the token issues below (CLI runs, seconds on a loaded box).
    stack = new_stack(temporal_server, tmp_path, heartbeat_timeout=60.0)
    async with GatewayProcess(stack, "owners") as gateway:
        agents = f"{gateway.url}/reach/agents"
        instance = f"{capability}-01"

        def join(address: str, cap: str = capability) -> dict[str, str]:
            return {"capability": cap, "instance_id": instance, "service_address": address}

        # Open mode: a second process joins under the same instance_id, then goes away. The
        # first one's heartbeats used to keep the second's record (its address) alive.
        first = await http.post(agents, json=join("127.0.0.1:9"))
        assert first.status_code == 200, first.text
        second = await http.post(agents, json=join("127.0.0.1:10"))
        assert second.status_code == 200, second.text
        assert first.json()["session"] != second.json()["session"]
        beat = f"{agents}/{instance}/heartbeat"
        r = await http.put(beat, headers={wire.HTTP_SESSION: first.json()["session"]})
        assert r.status_code == 409, r.text
        assert r.json()["error"]["type"] == "instance_replaced"
        assert "127.0.0.1:10" in r.json()["error"]["message"]
        r = await http.put(beat, headers={wire.HTTP_SESSION: second.json()["session"]})
        assert r.status_code == 200, r.text
        r = await http.put(beat)  # no session (an older agent): as before
        assert r.status_code == 200, r.text

        # The first token closes the door: the record joined open is held by nobody.
        admin, _ = issue_cli(stack, "--principal", "ops", "--admin")
        narrow, _ = issue_cli(stack, "--principal", "narrow", "--agent", "--capability", "other")
        owner, _ = issue_cli(stack, "--principal", "kr", "--agent", "--capability", capability)

        async def tokens_seen() -> bool:
            return (await http.put(beat, headers=bearer(owner))).status_code != 401

        await wait_until(tokens_seen, 10, every_s=0.1)
        assert (await http.put(beat)).status_code == 401
        # Not adopted by a heartbeat: the agent's token must join (and so claim) it.
        r = await http.put(beat, headers=bearer(owner))
        assert r.status_code == 403, r.text
        # A token for another capability may not take it over by moving it to its own.
        r = await http.post(agents, json=join("127.0.0.1:11", "other"), headers=bearer(narrow))
        assert r.status_code == 403, r.text
        assert "held by nobody" in r.json()["error"]["message"]
        r = await http.post(agents, json=join("127.0.0.1:12"), headers=bearer(owner))
        assert r.status_code == 200, r.text
        # Claimed: now it is kr's, and nobody else's.
        r = await http.put(beat, headers=bearer(owner))
        assert r.status_code == 200, r.text
        r = await http.post(agents, json=join("127.0.0.1:13", "other"), headers=bearer(narrow))
        assert r.status_code == 403, r.text

        # An instance an admin registered is held by nobody too: claimed the same way.
        by_admin = {**join("127.0.0.1:14"), "instance_id": f"{capability}-02"}
        r = await http.post(agents, json=by_admin, headers=bearer(admin))
        assert r.status_code == 200, r.text
        r = await http.post(
            agents, json={**by_admin, "capability": "other"}, headers=bearer(narrow)
        )
        assert r.status_code == 403, r.text

        def claims() -> list[dict[str, object]]:
            return [a for a in audit_lines(stack) if a["event"] == "instance_claimed"]

        await wait_until(lambda: len(claims()) == 1, 10)
        (claimed,) = claims()
        assert claimed["principal"] == "kr"
        assert claimed["instance"] == instance
        assert claimed["previous_address"] == "127.0.0.1:10"
        refused = [a for a in audit_lines(stack) if a["event"] == "join_refused"]
        assert {a["principal"] for a in refused} == {"narrow"}
