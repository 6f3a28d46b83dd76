"""The A2A front (`gateway_api/a2a_front.py`) through the a2a-sdk's own client (JSON-RPC
binding), against real gateway, SDK agent and Temporal processes, with tokens required: the
card, a blocking and a returnImmediately send, a stream, GetTask from a second gateway,
ListTasks (the caller's own), CancelTask, and every refusal as the JSON-RPC error it is."""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass
from typing import Any

import httpx
import pytest
from a2a.client import ClientConfig, ClientFactory
from a2a.client.client import Client
from a2a.client.errors import A2AClientError
from a2a.types import (
    CancelTaskRequest,
    DeleteTaskPushNotificationConfigRequest,
    GetTaskPushNotificationConfigRequest,
    GetTaskRequest,
    ListTaskPushNotificationConfigsRequest,
    ListTasksRequest,
    Message,
    Part,
    Role,
    SendMessageRequest,
    StreamResponse,
    SubscribeToTaskRequest,
    Task,
    TaskPushNotificationConfig,
    TaskState,
)
from a2a.utils.errors import (
    TaskNotCancelableError,
    TaskNotFoundError,
    UnsupportedOperationError,
)
from google.protobuf import json_format
from google.protobuf.struct_pb2 import Struct, Value
from temporalio.api.enums.v1 import PendingActivityState
from temporalio.client import Client as TemporalClient

from reach.security.tokens import FileTokenStore, issue, mirror_path
from tests.a2a_agents import A2AAgentProcess
from tests.conftest import new_stack
from tests.helpers import Agent, CallbackReceiver, GatewayProcess, Worker, wait_until

pytestmark = pytest.mark.integration

FAST, SLOW = "a2a-fast", "a2a-slow"
BEHIND = "a2a-behind"  # an A2A agent (tests/a2a_agents.py) registered by URL
QUEUED = "a2a-queued"  # a capability in queue mode
COMPLETED = TaskState.TASK_STATE_COMPLETED
WEBHOOK_KEY = f"test-master-{uuid.uuid4().hex}"


@dataclass
class Front:
    a: GatewayProcess
    b: GatewayProcess  # no worker: it only reads, from Temporal
    tokens: dict[str, str]
    behind: A2AAgentProcess
    temporal: str


def bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


@pytest.fixture(scope="module")
async def front(
    temporal_server: str, tmp_path_factory: pytest.TempPathFactory, module_redis_prefix: str
) -> AsyncIterator[Front]:
    """Two gateways of one deployment (one Redis registry, one Temporal): B runs no worker."""
    tmp = tmp_path_factory.mktemp("a2a-front")
    stack = new_stack(
        temporal_server,
        tmp,
        registry="redis",
        key_prefix=module_redis_prefix,
        extra={
            "REACH_SECURITY__WEBHOOK_KEY": WEBHOOK_KEY,
            # A worker of its own serves its queue (`worker.py --capability`).
            "REACH_CAPABILITIES": json.dumps({QUEUED: {"mode": "queue"}}),
        },
    )
    # With a shared registry, each host also reads the tokens in its mirror file.
    store = FileTokenStore(mirror_path(tmp / "tokens.json", module_redis_prefix))
    tokens: dict[str, str] = {}
    people: list[tuple[str, str, list[str]]] = [
        ("orchestrator", "caller", []),
        ("other", "caller", []),
        ("kr", "agent", ["*"]),
    ]
    for name, kind, caps in people:
        token, record = issue(name, kind, caps)  # type: ignore[arg-type]
        store.write(record)
        tokens[name] = token
    a = GatewayProcess(stack, "a")
    b = GatewayProcess(stack, "b", worker=False)
    try:
        await a.ready()
        await b.ready()
        env = {"REACH_AGENT_TOKEN": tokens["kr"]}
        agents = [
            Agent(a, "a2a-fast-1", FAST, env=env),
            Agent(a, "a2a-slow-1", SLOW, "--delay-ms", "2500", env=env),
            Agent(a, "a2a-queued-1", QUEUED, "--delay-ms", "5000", env=env),
        ]
        behind = A2AAgentProcess(tmp, "behind")
        queue_worker = Worker(stack, "--capability", QUEUED)
        for agent in agents:
            await agent.ready()
        await behind.ready()
        await queue_worker.ready()
        async with httpx.AsyncClient(trust_env=False, headers=bearer(tokens["kr"])) as http:
            joined = await http.post(
                f"{a.url}/reach/agents",
                json={"capability": BEHIND, "protocol": "a2a", "service_address": behind.url},
            )
            assert joined.status_code == 200, joined.text
        yield Front(a, b, tokens, behind, temporal_server)
    finally:
        a.proc.stop()
        b.proc.stop()


def message(payload: dict[str, Any] | None = None, **metadata: Any) -> SendMessageRequest:
    data = Struct()
    data.update(payload or {"text": "Temporal workflow history", "top_k": 1})
    msg = Message(
        message_id=uuid.uuid4().hex,
        role=Role.ROLE_USER,
        parts=[Part(data=Value(struct_value=data))],
    )
    msg.metadata.update({"operation": "query", **metadata})
    return SendMessageRequest(message=msg)


async def client_of(
    gateway: GatewayProcess, capability: str, token: str, **config: Any
) -> tuple[Client, httpx.AsyncClient]:
    http = httpx.AsyncClient(headers=bearer(token), timeout=30, trust_env=False)
    factory = ClientFactory(ClientConfig(httpx_client=http, **config))
    return await factory.create_from_url(f"{gateway.url}/a2a/{capability}"), http


async def events_of(client: Client, request: SendMessageRequest) -> list[StreamResponse]:
    return [event async for event in client.send_message(request)]


def result_of(task: Task) -> dict[str, Any]:
    [artifact] = task.artifacts
    return json_format.MessageToDict(artifact.parts[0].data)  # type: ignore[no-any-return]


async def rpc(
    gateway: GatewayProcess,
    body: Any,
    capability: str = FAST,
    token: str | None = None,
    raw: bytes | None = None,
) -> httpx.Response:
    headers = {"A2A-Version": "1.0", **(bearer(token) if token else {})}
    async with httpx.AsyncClient(trust_env=False, timeout=30) as http:
        if raw is not None:
            return await http.post(
                f"{gateway.url}/a2a/{capability}",
                content=raw,
                headers={**headers, "Content-Type": "application/json"},
            )
        return await http.post(f"{gateway.url}/a2a/{capability}", json=body, headers=headers)


async def test_cards_name_the_operations_the_binding_and_the_bearer_scheme(front: Front) -> None:
    token = front.tokens["orchestrator"]
    async with httpx.AsyncClient(trust_env=False, headers=bearer(token)) as http:
        card = (await http.get(f"{front.a.url}/a2a/{FAST}/.well-known/agent-card.json")).json()
        whole = (await http.get(f"{front.a.url}/.well-known/agent-card.json")).json()
        unknown = await http.get(f"{front.a.url}/a2a/nobody-here/.well-known/agent-card.json")
    skills = {s["id"]: s for s in card["skills"]}
    assert {"query", "create", "generate"} <= set(skills)
    [interface] = card["supportedInterfaces"]
    assert interface["url"] == f"{front.a.url}/a2a/{FAST}"
    assert interface["protocolBinding"] == "JSONRPC"
    assert card["securitySchemes"]["bearer"]["httpAuthSecurityScheme"]["scheme"] == "Bearer"
    assert card["securityRequirements"] == [{"schemes": {"bearer": {}}}]
    assert card["capabilities"]["streaming"] is True
    assert {FAST, SLOW} <= {s["id"] for s in whole["skills"]}
    assert unknown.status_code == 404
    assert unknown.json()["error"]["type"] == "unknown_capability"


async def test_blocking_send_answers_the_completed_task(front: Front) -> None:
    client, http = await client_of(front.a, FAST, front.tokens["orchestrator"], streaming=False)
    async with aclosing(http):
        [event] = await events_of(client, message())
    task = event.task
    assert task.status.state == COMPLETED, task
    assert result_of(task)["passages"][0]["score"] >= 1, result_of(task)
    reach = json_format.MessageToDict(task.metadata)["reach"]
    assert reach["status"] == "success"
    assert reach["request_id"] == task.id
    assert task.context_id == task.id


async def test_a_resend_with_the_same_request_id_is_the_same_task(front: Front) -> None:
    client, http = await client_of(front.a, FAST, front.tokens["orchestrator"], streaming=False)
    chosen = f"req-a2a-{uuid.uuid4().hex[:12]}"
    async with aclosing(http):
        [first] = await events_of(client, message(request_id=chosen))
        [again] = await events_of(client, message(request_id=chosen))
    assert first.task.id == again.task.id == chosen
    assert result_of(first.task) == result_of(again.task)
    assert result_of(again.task)["request_id"] == chosen  # the agent ran it once, as it


async def test_return_immediately_then_get_task_from_another_gateway(front: Front) -> None:
    token = front.tokens["orchestrator"]
    client, http = await client_of(front.a, SLOW, token, streaming=False, polling=True)
    reader, http_b = await client_of(front.b, SLOW, token, streaming=False)
    async with aclosing(http), aclosing(http_b):
        [event] = await events_of(client, message())
        assert event.task.status.state == TaskState.TASK_STATE_SUBMITTED
        task_id = event.task.id
        working = await reader.get_task(GetTaskRequest(id=task_id))
        assert working.status.state == TaskState.TASK_STATE_WORKING

        async def done() -> bool:
            task = await reader.get_task(GetTaskRequest(id=task_id))
            return task.status.state == COMPLETED

        await wait_until(done, 20, every_s=0.3)
        task = await reader.get_task(GetTaskRequest(id=task_id))
        assert result_of(task)["instance_id"] == "a2a-slow-1"
        # Another caller is told the task does not exist.
        other, http_o = await client_of(front.b, SLOW, front.tokens["other"], streaming=False)
        async with aclosing(http_o):
            with pytest.raises(TaskNotFoundError):
                await other.get_task(GetTaskRequest(id=task_id))


async def test_stream_tells_routed_running_and_done(front: Front) -> None:
    client, http = await client_of(front.a, SLOW, front.tokens["orchestrator"], streaming=True)
    async with aclosing(http):
        events = await events_of(client, message())
    first, *updates, last = events
    assert first.task.status.state == TaskState.TASK_STATE_SUBMITTED
    working = [u.status_update for u in updates if u.HasField("status_update")]
    kinds = [json_format.MessageToDict(w.status.message.parts[1].data)["kind"] for w in working]
    assert "instance_chosen" in kinds, kinds
    assert "sent" in kinds, kinds
    assert all(w.status.state == TaskState.TASK_STATE_WORKING for w in working)
    [artifact] = [u.artifact_update for u in updates if u.HasField("artifact_update")]
    assert json_format.MessageToDict(artifact.artifact.parts[0].data)["passages"]
    assert last.status_update.status.state == COMPLETED
    assert last.status_update.task_id == first.task.id


async def test_list_tasks_is_the_callers_own(front: Front) -> None:
    mine, http = await client_of(front.a, FAST, front.tokens["orchestrator"], streaming=False)
    theirs, http_o = await client_of(front.a, FAST, front.tokens["other"], streaming=False)
    async with aclosing(http), aclosing(http_o):
        [event] = await events_of(theirs, message())
        other_id = event.task.id
        [event] = await events_of(mine, message())
        my_id = event.task.id

        async def listed() -> bool:
            answer = await mine.list_tasks(ListTasksRequest(page_size=100))
            return my_id in {t.id for t in answer.tasks}

        await wait_until(listed, 15, every_s=0.3)
        answer = await mine.list_tasks(ListTasksRequest(page_size=100))
    ids = {t.id for t in answer.tasks}
    assert other_id not in ids
    assert all(t.status.state != TaskState.TASK_STATE_UNSPECIFIED for t in answer.tasks)


async def test_cancel_task_ends_the_request_cancelled(front: Front) -> None:
    token = front.tokens["orchestrator"]
    client, http = await client_of(front.a, SLOW, token, streaming=False, polling=True)
    reader, http_b = await client_of(front.b, SLOW, token, streaming=False)
    async with aclosing(http), aclosing(http_b):
        [event] = await events_of(client, message(timeout_ms=20000))
        task_id = event.task.id
        cancelled = await reader.cancel_task(CancelTaskRequest(id=task_id))
        assert cancelled.status.state == TaskState.TASK_STATE_CANCELED, cancelled
        again = await reader.get_task(GetTaskRequest(id=task_id))
        assert again.status.state == TaskState.TASK_STATE_CANCELED
        with pytest.raises(TaskNotCancelableError, match="already ended"):
            await reader.cancel_task(CancelTaskRequest(id=task_id))
        async with httpx.AsyncClient(trust_env=False, headers=bearer(token)) as plain:
            status = (await plain.get(f"{front.a.url}/reach/requests/{task_id}")).json()
    assert status["error"]["type"] == "request_closed"
    assert status["error"]["message"].startswith("the request was cancelled"), status


async def started(front: Front, request_id: str, activity: str) -> bool:
    """Whether a worker is running an `activity` of the request's workflow (Temporal's pending
    activities: the history records a start only when the activity ends)."""
    client = await TemporalClient.connect(front.temporal)
    described = await client.get_workflow_handle(request_id).describe()
    return any(
        pending.activity_type.name == activity
        and pending.state == PendingActivityState.PENDING_ACTIVITY_STATE_STARTED
        for pending in described.raw_description.pending_activities
    )


def reach_error(task: Task) -> dict[str, Any]:
    return json_format.MessageToDict(task.metadata)["reach"]["error"]  # type: ignore[no-any-return]


async def test_a_queue_mode_task_cancelled_mid_call_ends_canceled(front: Front) -> None:
    """Its call is an activity on the capability's queue, taken by that worker: the cancel
    ends the request canceled, its outcome unknown (the agent had it)."""
    token = front.tokens["orchestrator"]
    client, http = await client_of(front.a, QUEUED, token, streaming=False, polling=True)
    async with aclosing(http):
        [event] = await events_of(client, message(timeout_ms=20000))
        rid = event.task.id
        await wait_until(lambda: started(front, rid, "reach.call"), 15, every_s=0.1)
        cancelled = await client.cancel_task(CancelTaskRequest(id=rid))
    assert cancelled.status.state == TaskState.TASK_STATE_CANCELED, cancelled
    error = reach_error(cancelled)
    assert error["type"] == "request_closed", error
    assert error["outcome_unknown"] is True, error
    assert "was cancelled (CancelTask from orchestrator" in error["message"], error


def error_of(response: httpx.Response) -> dict[str, Any]:
    body = response.json()
    assert "result" not in body, body
    return body["error"]  # type: ignore[no-any-return]


async def test_tokens_missing_or_bad_are_401_with_the_bearer_challenge(front: Front) -> None:
    send = {"jsonrpc": "2.0", "id": 1, "method": "GetTask", "params": {"id": "req-x"}}
    for token in (None, "not-a-token"):
        answer = await rpc(front.a, send, token=token)
        assert answer.status_code == 401
        assert answer.headers["WWW-Authenticate"].startswith("Bearer")
        error = error_of(answer)
        assert error["code"] == -32000
        assert error["data"][0]["reason"] == "REACH_UNAUTHORIZED"
    client, http = await client_of(front.a, FAST, front.tokens["orchestrator"], streaming=False)
    http.headers["Authorization"] = "Bearer wrong"
    async with aclosing(http):
        with pytest.raises(A2AClientError, match="401"):
            await events_of(client, message())


async def test_malformed_json_rpc_is_each_a_clear_error(front: Front) -> None:
    token = front.tokens["orchestrator"]
    get = {"jsonrpc": "2.0", "id": 7, "method": "GetTask", "params": {"id": "req-none"}}
    cases: list[tuple[Any, bytes | None, str, int, str]] = [
        (None, b"{not json", FAST, -32700, "Invalid JSON"),
        ([get], None, FAST, -32600, "batch"),
        ({**get, "jsonrpc": "1.0"}, None, FAST, -32600, "jsonrpc"),
        ({**get, "method": "tasks/get"}, None, FAST, -32601, "tasks/get"),
        ({**get, "params": {"id": "req-x", "bogus": 1}}, None, FAST, -32602, "bogus"),
        ({**get, "params": {"id": 5}}, None, FAST, -32602, "id field"),
        ({**get, "method": "SendMessage", "params": {}}, None, FAST, -32602, "message"),
        ({**get, "params": {"id": "not a request id!"}}, None, FAST, -32602, "not a task id"),
        (get, None, FAST, -32001, "req-none"),
        (
            {**get, "method": "SendMessage", "params": {"message": message_json(None)}},
            None,
            FAST,
            -32602,
            "serves",  # several operations, none named: they are listed
        ),
        (
            {**get, "method": "SendMessage", "params": {"message": message_json("query")}},
            None,
            "nobody-here",
            -32000,
            "nobody-here",
        ),
    ]
    for body, raw, capability, code, words in cases:
        answer = await rpc(front.a, body, capability, token, raw=raw)
        assert answer.status_code == 200, (body, answer.text)
        error = error_of(answer)
        assert error["code"] == code, (body, error)
        assert words in error["message"], (body, error)
    answer = await rpc(front.a, get, token=token)
    assert error_of(answer)["data"][0]["reason"] == "TASK_NOT_FOUND"
    # An operation the agent does not serve is the agent's answer: a failed task, its words.
    send = {**get, "method": "SendMessage", "params": {"message": message_json("nope")}}
    task = (await rpc(front.a, send, token=token)).json()["result"]["task"]
    assert task["status"]["state"] == "TASK_STATE_FAILED"
    assert "not served" in task["status"]["message"]["parts"][0]["text"]


def message_json(operation: str | None) -> dict[str, Any]:
    msg: dict[str, Any] = {
        "messageId": uuid.uuid4().hex,
        "role": "ROLE_USER",
        "parts": [{"text": "hello"}],
    }
    if operation is not None:
        msg["metadata"] = {"operation": operation}
    return msg


async def test_subscribe_from_another_gateway_follows_the_task_to_its_end(front: Front) -> None:
    token = front.tokens["orchestrator"]
    client, http = await client_of(front.a, SLOW, token, streaming=False, polling=True)
    reader, http_b = await client_of(front.b, SLOW, token, streaming=True)
    async with aclosing(http), aclosing(http_b):
        [event] = await events_of(client, message())
        events = [e async for e in reader.subscribe(SubscribeToTaskRequest(id=event.task.id))]
    first, *_, last = events
    assert first.task.status.state == TaskState.TASK_STATE_WORKING
    assert last.status_update.status.state == COMPLETED


async def test_a_push_config_is_the_requests_callback(front: Front) -> None:
    client, http = await client_of(front.a, FAST, front.tokens["orchestrator"], streaming=False)
    async with CallbackReceiver() as receiver, aclosing(http):
        request = message()
        request.configuration.task_push_notification_config.url = receiver.url
        [event] = await events_of(client, request)
        task_id = event.task.id
        assert event.task.status.state == COMPLETED  # blocking: it waited for the end
        await receiver.wait(1)
        [(headers, envelope)] = receiver.received
        assert envelope["request_id"] == task_id
        assert headers["webhook-id"] == f"msg_{task_id}"  # signed, as Reach's callbacks are
        assert headers["webhook-signature"].startswith("v1,")
        config = await client.get_task_push_notification_config(
            GetTaskPushNotificationConfigRequest(task_id=task_id, id="callback")
        )
        assert config.url == receiver.url
        listed = await client.list_task_push_notification_configs(
            ListTaskPushNotificationConfigsRequest(task_id=task_id)
        )
        assert [c.url for c in listed.configs] == [receiver.url]
        with pytest.raises(UnsupportedOperationError, match="cannot be removed"):
            await client.delete_task_push_notification_config(
                DeleteTaskPushNotificationConfigRequest(task_id=task_id, id="callback")
            )
        with pytest.raises(UnsupportedOperationError, match="fixed when it starts"):
            await client.create_task_push_notification_config(
                TaskPushNotificationConfig(task_id=task_id, url=f"{receiver.url}/other")
            )


async def test_the_front_in_front_of_an_a2a_agent_asks_for_input_and_takes_the_follow_up(
    front: Front,
) -> None:
    client, http = await client_of(front.a, BEHIND, front.tokens["orchestrator"], streaming=False)
    async with aclosing(http):
        [echoed] = await events_of(client, message({"x": 1}, operation="echo"))
        assert echoed.task.status.state == COMPLETED
        assert result_of(echoed.task) == {"echo": {"x": 1}}
        [asked] = await events_of(client, message({"x": 1}, operation="ask"))
        status = asked.task.status
        assert status.state == TaskState.TASK_STATE_INPUT_REQUIRED, asked
        assert status.message.parts[0].text == "What is your name?"
        ids = json_format.MessageToDict(status.message.parts[1].data)
        follow_up = {"name": "Ada", "_a2a": {k: ids[k] for k in ("task_id", "context_id")}}
        [greeted] = await events_of(client, message(follow_up, operation="ask"))
    assert greeted.task.status.state == COMPLETED, greeted
    assert result_of(greeted.task) == {"hello": "Ada"}


async def test_a_message_naming_a_task_that_asks_for_input_continues_it(front: Front) -> None:
    client, http = await client_of(front.a, BEHIND, front.tokens["orchestrator"], streaming=False)
    async with aclosing(http):
        [asked] = await events_of(client, message({}, operation="ask"))
        assert asked.task.status.state == TaskState.TASK_STATE_INPUT_REQUIRED
        follow_up = message({"name": "Bob"})
        follow_up.message.task_id = asked.task.id
        del follow_up.message.metadata["operation"]  # the asking task's own
        [greeted] = await events_of(client, follow_up)
        assert greeted.task.status.state == COMPLETED, greeted
        assert result_of(greeted.task) == {"hello": "Bob"}
        assert greeted.task.id != asked.task.id  # a new request, a new RequestID
        done = message({"name": "Eve"})
        done.message.task_id = greeted.task.id
        with pytest.raises(UnsupportedOperationError, match="only a task that asks for input"):
            await events_of(client, done)


async def test_a_stream_follows_an_a2a_agents_long_task(front: Front) -> None:
    client, http = await client_of(front.a, BEHIND, front.tokens["orchestrator"], streaming=True)
    async with aclosing(http):
        events = await events_of(client, message({"seconds": 1}, operation="slow"))
    first, *updates, last = events
    assert first.task.status.state == TaskState.TASK_STATE_SUBMITTED
    assert any(u.HasField("status_update") for u in updates)
    [artifact] = [u.artifact_update for u in updates if u.HasField("artifact_update")]
    # Two artifacts at the agent (a data part, a text part): Reach's result rule joins them.
    result = json_format.MessageToDict(artifact.artifact.parts[0].data)
    assert result["data"][0]["done"] is True, result
    assert last.status_update.status.state == COMPLETED


async def test_cancel_task_while_following_an_a2a_agents_task_cancels_the_agents_task(
    front: Front,
) -> None:
    token = front.tokens["orchestrator"]
    before = (await front.behind.counts())["counts"]
    client, http = await client_of(front.a, BEHIND, token, streaming=False, polling=True)
    async with aclosing(http):
        [event] = await events_of(client, message({"seconds": 30}, operation="slow"))
        rid = event.task.id
        # Followed: the call came back with the agent's task, and a look at it was taken.
        await wait_until(lambda: started(front, rid, "reach.follow_task"), 15, every_s=0.1)
        cancelled = await client.cancel_task(CancelTaskRequest(id=rid))
    assert cancelled.status.state == TaskState.TASK_STATE_CANCELED, cancelled
    error = reach_error(cancelled)
    assert "CancelTask was sent for its task" in error["message"], error
    after = (await front.behind.counts())["counts"]
    assert after["slow"] == before.get("slow", 0) + 1  # sent once
    assert after.get("canceled", 0) == before.get("canceled", 0) + 1  # and told to stop


async def test_list_tasks_pages_through_the_callers_own(front: Front) -> None:
    """pageToken/pageSize: a small page size, every task of the caller's once, over pages."""
    token = front.tokens["other"]
    client, http = await client_of(front.a, FAST, token, streaming=False)
    async with aclosing(http):
        sent = {(await events_of(client, message()))[0].task.id for _ in range(3)}

        async def paged() -> tuple[list[str], list[int], int]:
            ids: list[str] = []
            sizes: list[int] = []
            page_token = ""
            while True:
                answer = await client.list_tasks(
                    ListTasksRequest(page_size=2, page_token=page_token)
                )
                ids.extend(t.id for t in answer.tasks)
                sizes.append(len(answer.tasks))
                page_token = answer.next_page_token
                if not page_token:
                    return ids, sizes, answer.total_size

        async def all_listed() -> bool:
            return sent <= set((await paged())[0])

        await wait_until(all_listed, 15, every_s=0.3)
        ids, sizes, total = await paged()
        first = await client.list_tasks(ListTasksRequest(page_size=2))
    assert len(ids) == len(set(ids)), ids  # none twice
    assert len(sizes) >= 2, sizes
    assert max(sizes) <= 2, sizes
    assert total == len(ids), (total, ids)
    # A token pages only its own list: not another caller's, not a forged one.
    for bad, name in ((first.next_page_token, "orchestrator"), ("bm90IGEgdG9rZW4", "other")):
        body = {
            "jsonrpc": "2.0",
            "id": 1,
            "method": "ListTasks",
            "params": {"pageSize": 2, "pageToken": bad},
        }
        error = error_of(await rpc(front.a, body, token=front.tokens[name]))
        assert error["code"] == -32602, error
        assert "pageToken" in error["message"], error


async def test_list_filters_pick_input_required_and_canceled(front: Front) -> None:
    token = front.tokens["orchestrator"]
    asking, http = await client_of(front.a, BEHIND, token, streaming=False)
    slow, http_s = await client_of(front.a, SLOW, token, streaming=False, polling=True)
    async with (
        aclosing(http),
        aclosing(http_s),
        httpx.AsyncClient(trust_env=False, headers=bearer(token)) as plain,
    ):
        [asked] = await events_of(asking, message({}, operation="ask"))
        assert asked.task.status.state == TaskState.TASK_STATE_INPUT_REQUIRED
        [event] = await events_of(slow, message(timeout_ms=20000))
        cancelled = await slow.cancel_task(CancelTaskRequest(id=event.task.id))
        assert cancelled.status.state == TaskState.TASK_STATE_CANCELED
        cases = (
            (asking, TaskState.TASK_STATE_INPUT_REQUIRED, asked.task.id, "input_required"),
            (slow, TaskState.TASK_STATE_CANCELED, event.task.id, "canceled"),
        )
        for client, state, rid, status in cases:

            async def listed(client: Client = client, state: int = state, rid: str = rid) -> bool:
                answer = await client.list_tasks(ListTasksRequest(status=state, page_size=50))
                assert all(t.status.state == state for t in answer.tasks), answer
                return rid in {t.id for t in answer.tasks}

            await wait_until(listed, 15, every_s=0.3)
            rows = (await plain.get(f"{front.a.url}/reach/requests?status={status}")).json()
            assert rid in {r["request_id"] for r in rows["requests"]}, rows
            assert {r["status"] for r in rows["requests"]} == {status}, rows


async def test_a_conversation_keeps_its_context_across_follow_ups(front: Front) -> None:
    """A task asking for input, its answer (taskId and contextId), then a new message in the
    same context (contextId alone): one context, Reach's and the agent's, turn after turn;
    GetTask and ListTasks tell it; another caller cannot append to it."""
    token = front.tokens["orchestrator"]
    client, http = await client_of(front.a, BEHIND, token, streaming=False)
    async with aclosing(http):
        [asked] = await events_of(client, message({}, operation="ask"))
        assert asked.task.status.state == TaskState.TASK_STATE_INPUT_REQUIRED
        context = asked.task.context_id
        assert context == asked.task.id  # the conversation's first task names its context
        answer = message({"name": "Ada"})
        answer.message.task_id = asked.task.id
        answer.message.context_id = context
        del answer.message.metadata["operation"]
        [greeted] = await events_of(client, answer)
        assert greeted.task.status.state == COMPLETED, greeted
        assert result_of(greeted.task) == {"hello": "Ada"}
        assert greeted.task.context_id == context
        more = message({"more": 1}, operation="echo")
        more.message.context_id = context
        [echoed] = await events_of(client, more)
        assert echoed.task.status.state == COMPLETED, echoed
        assert echoed.task.context_id == context
        tasks = [asked.task.id, greeted.task.id, echoed.task.id]
        # The agent answered every turn in one context of its own: Reach's.
        seen = (await front.behind.counts())["contexts"]
        assert {seen[f"{task}:1"] for task in tasks} == {context}, seen
        got = await client.get_task(GetTaskRequest(id=greeted.task.id))
        assert got.context_id == context

        async def listed() -> bool:
            answer = await client.list_tasks(ListTasksRequest(context_id=context, page_size=100))
            return {t.id for t in answer.tasks} == set(tasks) and all(
                t.context_id == context for t in answer.tasks
            )

        await wait_until(listed, 15)
        # A task of the same context from another gateway says the same.
        reader, http_b = await client_of(front.b, BEHIND, token, streaming=False)
        async with aclosing(http_b):
            assert (await reader.get_task(GetTaskRequest(id=echoed.task.id))).context_id == context
    # Another caller: the context is not there for it, nor is its asking task; the agent is
    # sent nothing.
    before = (await front.behind.counts())["counts"]["total"]
    other, http_o = await client_of(front.a, BEHIND, front.tokens["other"], streaming=False)
    async with aclosing(http_o):
        intruder = message({}, operation="echo")
        intruder.message.context_id = context
        with pytest.raises(TaskNotFoundError, match="no request of yours"):
            await events_of(other, intruder)
        hijack = message({"name": "Mallory"})
        hijack.message.task_id = asked.task.id
        with pytest.raises(TaskNotFoundError):
            await events_of(other, hijack)
        made_up = message({}, operation="echo")
        made_up.message.context_id = f"ctx-{uuid.uuid4().hex}"  # one Reach never handed out
        with pytest.raises(TaskNotFoundError):
            await events_of(other, made_up)
    assert (await front.behind.counts())["counts"]["total"] == before


async def test_an_sdk_agent_is_told_the_conversation(front: Front) -> None:
    client, http = await client_of(front.a, FAST, front.tokens["orchestrator"], streaming=False)
    async with aclosing(http):
        [first] = await events_of(client, message())
        context = first.task.context_id
        assert context == first.task.id
        assert result_of(first.task)["context_id"] == context  # x-reach-context-id
        later = message()
        later.message.context_id = context
        [second] = await events_of(client, later)
    assert second.task.id != context
    assert second.task.context_id == context
    assert result_of(second.task)["context_id"] == context
    assert result_of(second.task)["request_id"] == second.task.id


async def test_invoke_continues_a_conversation_only_of_its_target(front: Front) -> None:
    """`context_id` in POST /reach/invoke: the door's check, whichever front asks."""
    token = front.tokens["orchestrator"]
    client, http = await client_of(front.a, FAST, token, streaming=False)
    async with aclosing(http):
        [first] = await events_of(client, message())
        context = first.task.context_id
        body = {"target": FAST, "operation": "query", "payload": {"text": "x"}}
        url = f"{front.a.url}/reach/invoke"
        joined = await http.post(url, json={**body, "context_id": context})
        assert joined.status_code == 200, joined.text
        assert joined.json()["result"]["context_id"] == context
        elsewhere = {**body, "target": SLOW, "context_id": context}
        wrong = await http.post(url, json=elsewhere)
        assert wrong.status_code == 422, wrong.text
        assert f"a conversation with {FAST!r}" in wrong.json()["error"]["message"]
    headers = bearer(front.tokens["other"])
    async with httpx.AsyncClient(trust_env=False, timeout=30, headers=headers) as other:
        refused = await other.post(url, json={**body, "context_id": context})
    assert refused.status_code == 404, refused.text
    assert refused.json()["error"]["type"] == "unknown_request"
