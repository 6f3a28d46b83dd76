"""A caller's token revoked while its A2A front stream is open (SendStreamingMessage): the
stream ends with the token's error within a poll of the revocation, before the task's later
updates and its result; the task itself goes on to its end. A real gateway with tokens required,
a real a2a-sdk agent behind it, the real dev server."""

from __future__ import annotations

import json
import time
from pathlib import Path

import httpx
import pytest

from tests.a2a_agents import A2AAgentProcess
from tests.conftest import new_stack
from tests.helpers import GatewayProcess, wait_until
from tests.integration.test_auth import bearer, issue_cli

pytestmark = pytest.mark.integration

FINAL = ("TASK_STATE_COMPLETED", "TASK_STATE_FAILED", "TASK_STATE_CANCELED")


async def test_a_revoked_caller_s_stream_ends_before_the_task_does(
    temporal_server: str, tmp_path: Path
) -> None:
    stack = new_stack(temporal_server, tmp_path)
    admin, _ = issue_cli(stack, "--principal", "ops", "--admin")
    caller, caller_id = issue_cli(stack, "--principal", "orchestrator")
    agent = A2AAgentProcess(tmp_path, "revoked")
    try:
        async with GatewayProcess(stack, "revoked") as gateway:
            await agent.ready()
            async with httpx.AsyncClient(trust_env=False, timeout=60) as http:
                r = await http.post(
                    f"{gateway.url}/reach/agents",
                    headers=bearer(admin),
                    json={
                        "capability": "a2a-revoked",
                        "instance_id": "a2a-revoked-1",
                        "protocol": "a2a",
                        "service_address": agent.url,
                    },
                )
                assert r.status_code == 200, r.text
                message = {
                    "messageId": "m-revoked",
                    "role": "ROLE_USER",
                    "parts": [{"data": {"seconds": 6}}],
                    "metadata": {"operation": "slow", "timeout_ms": 30_000},
                }
                body = {
                    "jsonrpc": "2.0",
                    "id": 1,
                    "method": "SendStreamingMessage",
                    "params": {"message": message},
                }
                after: list[dict[str, object]] = []
                task_id = ""
                revoked_at = 0.0
                headers = {**bearer(caller), "Accept": "text/event-stream"}
                url = f"{gateway.url}/a2a/a2a-revoked"
                async with http.stream("POST", url, json=body, headers=headers) as stream:
                    assert stream.status_code == 200
                    async for line in stream.aiter_lines():
                        if not line.startswith("data:"):
                            continue
                        event = json.loads(line[5:])
                        if not task_id:  # the first event: the task, then revoke the token
                            task_id = event["result"]["task"]["id"]
                            d = await http.delete(
                                f"{gateway.url}/reach/admin/tokens/{caller_id}",
                                headers=bearer(admin),
                            )
                            assert d.status_code == 200, d.text
                            revoked_at = time.monotonic()
                            continue
                        after.append(event)
                ended_in = time.monotonic() - revoked_at
                assert after, "no event after the revocation"
                assert "revoked" in str(after[-1].get("error")), after[-1]
                states = [
                    e["result"]["statusUpdate"]["status"]["state"]  # type: ignore[index]
                    for e in after
                    if "statusUpdate" in (e.get("result") or {})  # type: ignore[operator]
                ]
                assert not set(states) & set(FINAL), states
                assert ended_in < 5, ended_in  # the task runs 6 s; a poll is at most 2 s

                async def ended() -> bool:  # the task went on without its stream
                    got = await http.get(
                        f"{gateway.url}/reach/requests/{task_id}", headers=bearer(admin)
                    )
                    return got.json().get("status") == "success"

                await wait_until(ended, 30, every_s=0.2)
    finally:
        agent.proc.stop()
