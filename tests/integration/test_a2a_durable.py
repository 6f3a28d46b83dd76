"""A2A agents called through a real gateway and the dev server: an immediate answer, a long task
followed durably to its end, input-required and a follow-up, the agent's failure, the deadline
(CancelTask), an agent killed mid-task, and a gateway SIGKILLed while following a task."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.a2a_agents import A2AAgentProcess
from tests.conftest import new_stack
from tests.helpers import CallbackReceiver, GatewayProcess, Worker, rid, wait_until

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
async def agent(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[A2AAgentProcess]:
    proc = A2AAgentProcess(tmp_path_factory.mktemp("a2a"), "durable")
    try:
        yield await proc.ready()
    finally:
        proc.proc.stop()


async def register(http: httpx.AsyncClient, gateway: GatewayProcess, url: str, cap: str) -> None:
    r = await http.post(
        f"{gateway.url}/reach/agents",
        json={
            "capability": cap,
            "instance_id": f"{cap}-a2a",
            "protocol": "a2a",
            "service_address": url,
        },
    )
    assert r.status_code == 200, r.text


@pytest.fixture(scope="module")
async def cap(gateway: GatewayProcess, agent: A2AAgentProcess) -> str:
    name = "a2a-durable"
    async with httpx.AsyncClient(trust_env=False, timeout=30) as http:
        await register(http, gateway, agent.url, name)
    return name


async def call(
    http: httpx.AsyncClient,
    gateway: GatewayProcess,
    cap: str,
    operation: str,
    payload: dict[str, Any],
    **body: Any,
) -> httpx.Response:
    return await http.post(
        f"{gateway.url}/reach/invoke",
        json={"target": cap, "operation": operation, "payload": payload, **body},
    )


async def test_an_immediate_answer(
    http: httpx.AsyncClient, gateway: GatewayProcess, cap: str
) -> None:
    r = await call(http, gateway, cap, "echo", {"q": "hi", "n": 2})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["status"] == "success"
    assert body["result"] == {"echo": {"q": "hi", "n": 2}}
    assert body["instance_id"] == f"{cap}-a2a"


async def test_a_long_task_is_followed_to_completion(
    http: httpx.AsyncClient, gateway: GatewayProcess, cap: str, agent: A2AAgentProcess
) -> None:
    before = (await agent.counts())["counts"].get("slow", 0)
    r = await call(http, gateway, cap, "slow", {"seconds": 1.5}, timeout_ms=20_000)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["status"] == "success"
    assert body["result"] == {"text": "all done", "data": [{"done": True, "seconds": 1.5}]}
    assert body["duration_ms"] >= 1500
    assert [a["outcome"] for a in body["attempts"]] == ["accepted"]
    assert (await agent.counts())["counts"]["slow"] == before + 1


async def test_input_required_and_a_follow_up_that_continues_the_task(
    http: httpx.AsyncClient, gateway: GatewayProcess, cap: str
) -> None:
    r = await call(http, gateway, cap, "ask", {})
    assert r.status_code == 200, r.text
    asked = r.json()
    assert asked["status"] == "input_required"
    assert asked["result"]["state"] == "input-required"
    assert asked["result"]["message"] == "What is your name?"
    ids = {k: asked["result"][k] for k in ("task_id", "context_id")}
    r = await call(http, gateway, cap, "ask", {"name": "Ada", "_a2a": ids})
    assert r.status_code == 200, r.text
    assert r.json()["result"] == {"hello": "Ada"}
    # What the request's record says afterwards, read again.
    got = await http.get(f"{gateway.url}/reach/requests/{asked['request_id']}")
    assert got.json()["status"] == "input_required"


async def test_a_follow_up_continues_only_its_own_caller_s_task(
    http: httpx.AsyncClient, gateway: GatewayProcess, cap: str, agent: A2AAgentProcess
) -> None:
    """Another caller naming Alice's task (or only its context) is refused before anything is
    sent: the agent cannot tell Reach's callers apart, Reach can."""
    alice, mallory = {"X-Reach-Caller": "alice"}, {"X-Reach-Caller": "mallory"}
    ask = {"target": cap, "operation": "ask"}
    r = await http.post(f"{gateway.url}/reach/invoke", json={**ask, "payload": {}}, headers=alice)
    assert r.json()["status"] == "input_required", r.text
    task = {k: r.json()["result"][k] for k in ("task_id", "context_id")}
    sent = (await agent.counts())["counts"]["ask"]
    for ids in (task, {"context_id": task["context_id"]}, {"task_id": task["task_id"]}):
        payload = {"name": "mallory", "_a2a": ids}
        r = await http.post(
            f"{gateway.url}/reach/invoke", json={**ask, "payload": payload}, headers=mallory
        )
        assert r.status_code == 403, r.text
        assert r.json()["error"]["type"] == "forbidden"
        assert "another caller's task" in r.json()["error"]["message"]
    assert (await agent.counts())["counts"]["ask"] == sent  # nothing reached the agent
    payload = {"name": "Alice", "_a2a": task}
    r = await http.post(
        f"{gateway.url}/reach/invoke", json={**ask, "payload": payload}, headers=alice
    )
    assert r.json()["result"] == {"hello": "Alice"}, r.text


async def test_the_agent_s_failure_and_its_cancel(
    http: httpx.AsyncClient, gateway: GatewayProcess, cap: str
) -> None:
    r = await call(http, gateway, cap, "fail", {})
    assert r.status_code == 502, r.text
    error = r.json()["error"]
    assert error["type"] == "agent_error"
    assert error["agent"] == {"type": "task_failed", "message": "I cannot do fail"}
    r = await call(http, gateway, cap, "cancel", {})
    assert r.status_code == 200, r.text
    assert r.json()["status"] == "canceled"
    assert r.json()["result"]["message"] == "I changed my mind"


async def test_the_deadline_cancels_the_task(
    http: httpx.AsyncClient, gateway: GatewayProcess, cap: str, agent: A2AAgentProcess
) -> None:
    before = (await agent.counts())["counts"].get("canceled", 0)
    r = await call(http, gateway, cap, "slow", {"seconds": 30}, timeout_ms=1500)
    assert r.status_code == 504, r.text
    error = r.json()["error"]
    assert error["outcome_unknown"] is True
    assert "CancelTask was sent" in error["message"]
    assert (await agent.counts())["counts"]["canceled"] == before + 1


async def test_an_agent_killed_mid_task_gives_an_honest_outcome(
    http: httpx.AsyncClient, gateway: GatewayProcess, tmp_path: Path
) -> None:
    doomed = await A2AAgentProcess(tmp_path, "doomed").ready()
    await register(http, gateway, doomed.url, "a2a-doomed")
    request_id = rid()
    pending = http.post(
        f"{gateway.url}/reach/invoke",
        json={
            "request_id": request_id,
            "target": "a2a-doomed",
            "operation": "slow",
            "payload": {"seconds": 30},
            "timeout_ms": 4000,
        },
    )
    task = asyncio.ensure_future(pending)

    async def working() -> bool:
        return (await doomed.counts())["counts"].get("slow", 0) == 1

    await wait_until(working, 10, every_s=0.05)
    doomed.proc.kill()
    r = await task
    assert r.status_code == 504, r.text
    error = r.json()["error"]
    # The task was sent and never seen to end: nobody knows whether it ran.
    assert error["outcome_unknown"] is True
    assert "CancelTask failed" in error["message"]


@pytest.mark.slow  # ~20 s: three processes, and Temporal's wait before another worker takes over
async def test_a_gateway_sigkilled_while_following_a_task_never_sends_it_again(
    temporal_server: str, tmp_path: Path, http: httpx.AsyncClient
) -> None:
    stack = new_stack(temporal_server, tmp_path)
    doomed = GatewayProcess(stack, "doomed")  # the door and the worker the call runs in
    survivor = Worker(stack)  # follows the task after the crash
    agent = A2AAgentProcess(tmp_path, "patient")
    await doomed.ready()
    await survivor.ready()
    await agent.ready()
    await register(http, doomed, agent.url, "a2a-patient")
    async with CallbackReceiver() as receiver:
        request_id = rid()
        r = await http.post(
            f"{doomed.url}/reach/invoke",
            json={
                "request_id": request_id,
                "target": "a2a-patient",
                "operation": "slow",
                "payload": {"seconds": 3},
                "timeout_ms": 60_000,
                "callback": receiver.url,
            },
        )
        assert r.status_code == 202, r.text

        async def following() -> bool:
            got = await http.get(f"{doomed.url}/reach/requests/{request_id}")
            attempts = got.json().get("attempts") or []
            return bool(attempts) and attempts[0]["outcome"] == "accepted"

        await wait_until(following, 10, every_s=0.05)
        doomed.proc.kill()  # SIGKILL while following the task
        await receiver.wait(1, timeout_s=45)
        assert len(receiver.received) == 1, survivor.proc.output()
        _, body = receiver.received[0]
        assert body["status"] == "success", body
        assert body["result"]["data"] == [{"done": True, "seconds": 3}]
    counts = (await agent.counts())["counts"]
    assert counts["total"] == 1  # the agent's own count: one message, ever
    assert counts["subscribed"] >= 1  # followed by its stream (the card says it streams)


async def test_follow_ups_stay_in_one_context_which_only_its_caller_may_append_to(
    http: httpx.AsyncClient, gateway: GatewayProcess, cap: str, agent: A2AAgentProcess
) -> None:
    """Three follow-ups of one conversation: each keeps the agent's context id; once its tasks
    completed, another caller naming that context (or a task of it) is still refused."""
    alice, mallory = {"X-Reach-Caller": "alice-ctx"}, {"X-Reach-Caller": "mallory-ctx"}
    ask = {"target": cap, "operation": "ask"}

    async def invoke(payload: dict[str, Any], who: dict[str, str]) -> httpx.Response:
        return await http.post(
            f"{gateway.url}/reach/invoke", json={**ask, "payload": payload}, headers=who
        )

    first = (await invoke({}, alice)).json()
    assert first["status"] == "input_required", first
    context = first["result"]["context_id"]
    # A second question in the same context (a new task of it), then its answer.
    second = (await invoke({"_a2a": {"context_id": context}}, alice)).json()
    assert second["status"] == "input_required", second
    assert second["result"]["context_id"] == context
    assert second["result"]["task_id"] != first["result"]["task_id"]
    ids = {k: second["result"][k] for k in ("task_id", "context_id")}
    third = (await invoke({"name": "Ada", "_a2a": ids}, alice)).json()
    assert third["result"] == {"hello": "Ada"}, third
    # The third follow-up keeps the context even when it names only the task.
    fourth = (await invoke({"_a2a": {"context_id": context}}, alice)).json()
    assert fourth["result"]["context_id"] == context, fourth
    only_task = {"name": "Bea", "_a2a": {"task_id": fourth["result"]["task_id"]}}
    fifth = (await invoke(only_task, alice)).json()
    assert fifth["result"] == {"hello": "Bea"}, fifth
    sent = (await agent.counts())["counts"]["ask"]
    for named in (
        {"context_id": context},
        {"task_id": second["result"]["task_id"]},
        {"task_id": first["result"]["task_id"], "context_id": context},
    ):
        r = await invoke({"name": "mallory", "_a2a": named}, mallory)
        assert r.status_code == 403, r.text
        assert "another caller's task" in r.json()["error"]["message"]
    assert (await agent.counts())["counts"]["ask"] == sent  # nothing reached the agent


async def test_the_context_of_an_answer_at_once_is_its_caller_s_only(
    http: httpx.AsyncClient, gateway: GatewayProcess, cap: str, agent: A2AAgentProcess
) -> None:
    """A message answered at once (or a task completed at once) still names the agent's
    context: another caller appending to it is refused, its own caller is not."""
    alice, mallory = {"X-Reach-Caller": "alice-once"}, {"X-Reach-Caller": "mallory-once"}
    echo = {"target": cap, "operation": "echo"}
    before = set((await agent.counts())["contexts"])
    r = await http.post(f"{gateway.url}/reach/invoke", json={**echo, "payload": {}}, headers=alice)
    assert r.json()["status"] == "success", r.text
    [context] = [c for m, c in (await agent.counts())["contexts"].items() if m not in before]
    sent = (await agent.counts())["counts"]["echo"]
    named = {"target": cap, "operation": "echo", "payload": {"_a2a": {"context_id": context}}}
    r = await http.post(f"{gateway.url}/reach/invoke", json=named, headers=mallory)
    assert r.status_code == 403, r.text
    assert "another caller's task" in r.json()["error"]["message"]
    assert (await agent.counts())["counts"]["echo"] == sent
    seen = set((await agent.counts())["contexts"])
    r = await http.post(f"{gateway.url}/reach/invoke", json=named, headers=alice)
    assert r.json()["status"] == "success", r.text
    contexts = (await agent.counts())["contexts"]
    assert [c for m, c in contexts.items() if m not in seen] == [context]  # appended to it
