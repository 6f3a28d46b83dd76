"""The A2A connector's pure parts: the result rule, what a task's state means, what SendMessage
carries, and cards refused before any connection (the live paths: tests/integration)."""

from __future__ import annotations

import pytest
from a2a.types import Artifact, Part, Task, TaskState, TaskStatus
from google.protobuf import json_format, struct_pb2

from connectors.a2a import (
    discovery_of,
    reply_of_get,
    reply_of_send,
    reply_of_task,
    result_of,
    rpc_error,
    send_request,
)
from reach.errors import AgentError, InvalidRequest
from reach.invocation import Endpoint
from tests.helpers import message

EP = Endpoint(instance_id="a1", capability="cap", protocol="a2a", address="http://x")


def data(value: object) -> Part:
    return Part(data=json_format.ParseDict(value, struct_pb2.Value()))


def test_one_data_object_is_the_result_anything_else_the_general_form() -> None:
    assert result_of([data({"a": 1.0, "b": [2.0, 2.5]})]) == {"a": 1, "b": [2, 2.5]}
    assert result_of([data([1, 2])]) == {"data": [[1, 2]]}
    assert result_of([]) == {}
    mixed = [
        Part(text="one"),
        Part(text="two"),
        data({"k": "v"}),
        Part(url="https://x/y.png", media_type="image/png", filename="y.png"),
        Part(raw=b"\x00\x01"),
    ]
    assert result_of(mixed) == {
        "text": "one\ntwo",
        "data": [{"k": "v"}],
        "files": [
            {"url": "https://x/y.png", "filename": "y.png", "media_type": "image/png"},
            {"raw": "AAE="},
        ],
    }


def task(state: int, *parts: Part, words: str = "") -> Task:
    status = TaskStatus(state=state)  # type: ignore[arg-type]
    if words:
        status.message.parts.append(Part(text=words))
    return Task(id="t1", context_id="c1", status=status, artifacts=[Artifact(parts=list(parts))])


def test_each_task_state_means_one_thing() -> None:
    working = reply_of_task(task(TaskState.TASK_STATE_WORKING), EP, "http://x/", 1 << 20)
    assert working.status == "accepted"
    assert working.follow == {
        "task_id": "t1",
        "context_id": "c1",
        "url": "http://x/",
        "state": "working",
    }
    done = reply_of_task(task(TaskState.TASK_STATE_COMPLETED, data({"x": 1})), EP, "u", 1 << 20)
    assert done.result == {"x": 1}
    auth = reply_of_task(task(TaskState.TASK_STATE_AUTH_REQUIRED, words="log in"), EP, "u", 99)
    assert auth.status == "input_required"
    assert auth.result == {
        "task_id": "t1",
        "context_id": "c1",
        "state": "auth-required",
        "message": "log in",
    }
    with pytest.raises(AgentError) as rejected:
        reply_of_task(task(TaskState.TASK_STATE_REJECTED, words="no"), EP, "u", 99)
    assert rejected.value.fault is not None
    assert rejected.value.fault.type == "task_rejected"
    with pytest.raises(AgentError, match=r"negotiated|larger|bytes"):
        reply_of_task(task(TaskState.TASK_STATE_COMPLETED, data({"x": "y" * 100})), EP, "u", 50)
    with pytest.raises(AgentError, match="neither a message nor a task"):
        reply_of_send({}, EP, "u", 99)
    with pytest.raises(AgentError, match="is not an A2A"):
        reply_of_send({"task": {"artifacts": "x"}}, EP, "u", 99)


def test_send_message_carries_the_payload_the_header_and_a_follow_up_s_ids() -> None:
    msg = message("ask", {"name": "Ada", "_a2a": {"task_id": "t1", "context_id": "c1"}})
    params = send_request(msg)
    sent = params["message"]
    assert sent["messageId"] == f"{msg.header.request_id}:2"
    assert sent["parts"] == [{"data": {"name": "Ada"}}]
    assert sent["taskId"] == "t1"
    assert sent["contextId"] == "c1"
    assert sent["metadata"]["reach"]["operation"] == "ask"
    assert sent["metadata"]["reach"]["idempotency_key"] == "key-1"
    assert params["configuration"] == {"returnImmediately": True}


def test_a_conversation_is_the_agents_context_unless_a_follow_up_names_its_task() -> None:
    msg = message("echo", {"x": 1})
    msg.header.context_id = "req-first"
    sent = send_request(msg)["message"]
    assert sent["contextId"] == "req-first"
    assert "taskId" not in sent
    assert sent["metadata"]["reach"]["context_id"] == "req-first"
    answer = message("ask", {"name": "Ada", "_a2a": {"task_id": "t1", "context_id": "c1"}})
    answer.header.context_id = "req-first"
    sent = send_request(answer)["message"]
    assert (sent["taskId"], sent["contextId"]) == ("t1", "c1")  # the agent's own task
    only_task = message("ask", {"_a2a": {"task_id": "t1"}})
    only_task.header.context_id = "req-first"
    assert "contextId" not in send_request(only_task)["message"]  # the task's is the agent's
    assert "contextId" not in send_request(message("echo", {}))["message"]


def test_json_rpc_errors_keep_the_agent_s_words_and_only_internal_is_retried() -> None:
    internal = rpc_error({"code": -32603, "message": "db down"}, "agent a1 refused SendMessage")
    assert internal.retryable
    assert internal.fault is not None
    assert internal.fault.type == "internal_error"
    params = rpc_error({"code": -32602, "message": "bad"}, "w")
    assert not params.retryable
    assert rpc_error("nonsense", "w").fault is None


async def test_a_card_that_is_not_json_is_refused_naming_it() -> None:
    with pytest.raises(InvalidRequest, match="is not JSON"):
        await discovery_of("http://x", b"<html>", None, None)
    with pytest.raises(InvalidRequest, match="is not a JSON object"):
        await discovery_of("http://x", b"[1]", None, None)


def test_the_common_answer_is_read_as_the_sdk_reads_it_and_anything_odd_by_the_sdk() -> None:
    answer = {"message": {"messageId": "m", "role": "ROLE_AGENT", "parts": [{"data": {"n": 2.0}}]}}
    assert reply_of_send(answer, EP, "u", 99).result == {"n": 2}
    texts = {"message": {"messageId": "m", "parts": [{"text": "hi"}, {"text": "there"}]}}
    assert reply_of_send(texts, EP, "u", 99).result == {"text": "hi\nthere"}
    odd = {"message": {"messageId": 5, "parts": [{"data": {"n": 2}}]}}
    with pytest.raises(AgentError, match="is not an A2A"):
        reply_of_send(odd, EP, "u", 99)
    with pytest.raises(AgentError, match="not standard JSON"):
        reply_of_send({"message": {"parts": [{"data": {"n": float("nan")}}]}}, EP, "u", 99)


def test_a_get_task_answer_about_another_task_is_refused_its_outcome_unknown() -> None:
    asked = json_format.MessageToDict(task(TaskState.TASK_STATE_COMPLETED, data({"x": 1})))
    assert reply_of_get(asked, EP, "u", 1 << 20, "t1").result == {"x": 1}
    other = {**asked, "id": "someone-elses"}  # a lying agent: its result would be this one's
    with pytest.raises(AgentError, match="about another task") as refused:
        reply_of_get(other, EP, "u", 1 << 20, "t1")
    assert refused.value.outcome_unknown
    assert not refused.value.retryable


def test_a_task_id_past_1024_characters_is_refused() -> None:
    # Its follow handle is in every look's input and result: ~2 MB of history a look for a 1 MB id.
    long = Task(
        id="t" * 1025, context_id="c1", status=TaskStatus(state=TaskState.TASK_STATE_WORKING)
    )
    with pytest.raises(AgentError, match="over 1024 characters"):
        reply_of_task(long, EP, "u", 1 << 20)
    long.context_id, long.id = long.id, "t1"
    with pytest.raises(AgentError, match="over 1024 characters"):
        reply_of_task(long, EP, "u", 1 << 20)
