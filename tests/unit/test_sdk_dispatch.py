"""The agent SDK's dispatch in one process, no server: what a handler sees and what a caller gets
when a deadline runs, when an operation is registered again, and when the agent is cancelled."""

from __future__ import annotations

import asyncio
import contextvars
import inspect
import threading
import time
from collections.abc import Coroutine
from typing import Any

import pytest

from agent_reach_sdk import AgentRuntime, RequestContext
from agent_reach_sdk.wire import Inbound

USER: contextvars.ContextVar[str | None] = contextvars.ContextVar("user", default=None)


def inbound(request_id: str, operation: str = "whoami", **headers: str) -> Inbound:
    deadline = str(int(time.time() * 1000) + 10_000)
    base = {"x-reach-request-id": request_id, "x-reach-deadline-ms": deadline}
    return Inbound(operation, {**base, **headers}, b"{}")


@pytest.mark.parametrize("deadline", [True, False])
async def test_a_context_variable_a_handler_sets_stays_with_its_request(deadline: bool) -> None:
    # A keep-alive connection's requests are dispatched one after another in one task.
    runtime = AgentRuntime("cap", instance_id="cap-01")

    @runtime.operation("whoami")
    async def whoami(payload: dict[str, Any], ctx: RequestContext) -> dict[str, Any]:
        if ctx.caller != "anonymous":
            USER.set(ctx.caller)
        return {"user": USER.get()}

    seen = []
    for n, caller in enumerate(["alice", None, None]):
        request = inbound(f"r{n}", **({"x-reach-caller": caller} if caller else {}))
        if not deadline:
            headers = {k: v for k, v in request.headers.items() if k != "x-reach-deadline-ms"}
            request = Inbound(request.operation, headers, request.body)
        answer = await runtime.dispatch(request)
        assert answer.status == 200
        assert answer.body is not None
        seen.append(answer.body["user"])
    assert seen == ["alice", None, None]
    assert USER.get() is None


async def test_an_operation_registered_again_is_called_as_the_new_function_asks() -> None:
    runtime = AgentRuntime("cap", instance_id="cap-01")

    @runtime.operation("op")
    def first(payload: dict[str, Any], ctx: RequestContext) -> dict[str, Any]:
        return {"by": "first", "request": ctx.request_id}

    assert (await runtime.dispatch(inbound("a", "op"))).body == {"by": "first", "request": "a"}

    @runtime.operation("op")
    async def second(payload: dict[str, Any]) -> dict[str, Any]:
        return {"by": "second"}

    assert (await runtime.dispatch(inbound("b", "op"))).body == {"by": "second"}


async def test_a_cancelled_request_ends_even_when_its_handler_swallows_the_cancel() -> None:
    runtime = AgentRuntime("cap", instance_id="cap-01")
    started = asyncio.Event()

    @runtime.operation("stubborn")
    async def stubborn(payload: dict[str, Any]) -> dict[str, Any]:
        started.set()
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            return {"swallowed": True}
        return {"slept": True}

    task = asyncio.create_task(runtime.dispatch(inbound("r-cancel", "stubborn")))
    await started.wait()
    task.cancel()  # the agent shutting down, the caller gone
    with pytest.raises(asyncio.CancelledError):
        await task
    assert runtime.remembered == (0, 0)  # no answer kept for a re-delivery to find


async def test_a_handler_past_its_deadline_is_answered_as_a_timeout() -> None:
    runtime = AgentRuntime("cap", instance_id="cap-01")

    @runtime.operation("slow")
    async def slow(payload: dict[str, Any]) -> dict[str, Any]:
        await asyncio.sleep(5)
        return {}

    soon = str(int(time.time() * 1000) + 100)
    answer = await runtime.dispatch(inbound("r-slow", "slow", **{"x-reach-deadline-ms": soon}))
    assert answer.status == 504
    assert answer.body is not None
    assert answer.body["error"]["type"] == "timeout"


async def test_a_deadline_that_is_no_time_is_refused_by_name() -> None:
    runtime = AgentRuntime("cap", instance_id="cap-01")

    @runtime.operation("op")
    async def op(payload: dict[str, Any]) -> dict[str, Any]:
        return {"ran": True}

    for bad in ("1" + "0" * 313, "-5", "99999999999999999999"):
        answer = await runtime.dispatch(
            inbound(f"r-{bad[:4]}", "op", **{"x-reach-deadline-ms": bad})
        )
        assert answer.status == 400, bad
        assert answer.body is not None
        assert "X-Reach-Deadline-Ms" in answer.body["error"]["message"]
    assert runtime.executed == 0


async def test_a_handler_that_ignores_its_deadline_does_not_hold_up_the_answer() -> None:
    runtime = AgentRuntime("cap", instance_id="cap-01")
    finished = asyncio.Event()

    @runtime.operation("stubborn")
    async def stubborn(payload: dict[str, Any]) -> dict[str, Any]:
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            await asyncio.sleep(0.5)  # cleaning up, long after the deadline
        finished.set()
        return {"late": True}

    soon = str(int(time.time() * 1000) + 100)
    started = time.monotonic()
    answer = await runtime.dispatch(inbound("r-late", "stubborn", **{"x-reach-deadline-ms": soon}))
    assert answer.status == 504
    assert time.monotonic() - started < 0.4
    await asyncio.wait_for(finished.wait(), 2)
    assert runtime.remembered == (0, 0)


async def test_a_timeout_the_handler_raises_is_its_own_error_not_the_deadline() -> None:
    runtime = AgentRuntime("cap", instance_id="cap-01")

    @runtime.operation("downstream")
    async def downstream(payload: dict[str, Any]) -> dict[str, Any]:
        raise TimeoutError("the index did not answer")

    answer = await runtime.dispatch(inbound("r-down", "downstream"))
    assert answer.status == 500
    assert answer.body is not None
    assert answer.body["error"]["message"] == "TimeoutError: the index did not answer"


class AsyncCallable:
    async def __call__(self, payload: dict[str, Any], ctx: RequestContext) -> dict[str, Any]:
        await asyncio.sleep(0)
        return {"called": ctx.operation}


async def test_callables_that_are_coroutines_in_disguise_are_awaited() -> None:
    runtime = AgentRuntime("cap", instance_id="cap-01")
    runtime.operation("instance")(AsyncCallable())

    async def work(payload: dict[str, Any]) -> dict[str, Any]:
        return {"called": "wrapped"}

    def wrapper(payload: dict[str, Any]) -> Any:  # a plain function handing back a coroutine
        return work(payload)

    runtime.operation("wrapped")(wrapper)
    assert (await runtime.dispatch(inbound("r-i", "instance"))).body == {"called": "instance"}
    assert (await runtime.dispatch(inbound("r-w", "wrapped"))).body == {"called": "wrapped"}


async def test_a_deadline_of_zero_has_passed_it_is_not_no_deadline() -> None:
    runtime = AgentRuntime("cap", instance_id="cap-01")

    @runtime.operation("op")
    async def op(payload: dict[str, Any]) -> dict[str, Any]:
        return {"ran": True}

    answer = await runtime.dispatch(inbound("r-zero", "op", **{"x-reach-deadline-ms": "0"}))
    assert answer.status == 504
    assert runtime.executed == 0


@pytest.mark.parametrize("raised", [SystemExit, KeyboardInterrupt, asyncio.CancelledError])
@pytest.mark.parametrize("is_async", [True, False])
async def test_a_handler_raising_what_ends_a_process_is_its_request_error(
    raised: type[BaseException], is_async: bool
) -> None:
    if raised is asyncio.CancelledError and not is_async:
        pytest.skip("a thread does not raise asyncio's cancellation")
    runtime = AgentRuntime("cap", instance_id="cap-01")

    async def async_op(payload: dict[str, Any]) -> dict[str, Any]:
        raise raised()

    def sync_op(payload: dict[str, Any]) -> dict[str, Any]:
        raise raised()

    runtime.operation("op")(async_op if is_async else sync_op)
    for request_id in ("r-1", "r-2"):  # the loop lives on: a second request is served
        answer = await runtime.dispatch(inbound(request_id, "op"))
        assert answer.status == 500
        assert answer.body is not None
        assert answer.body["error"]["type"] == "agent_error"


async def test_a_redelivery_while_the_given_up_handler_runs_is_told_to_come_back() -> None:
    runtime = AgentRuntime("cap", instance_id="cap-01")
    runs = []
    release = asyncio.Event()

    @runtime.operation("stubborn")
    async def stubborn(payload: dict[str, Any], ctx: RequestContext) -> dict[str, Any]:
        runs.append(ctx.request_id)
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            await release.wait()  # a long cleanup
        return {"late": True}

    soon = str(int(time.time() * 1000) + 100)
    first = await runtime.dispatch(inbound("r-o", "stubborn", **{"x-reach-deadline-ms": soon}))
    assert first.status == 504
    again = await runtime.dispatch(inbound("r-o", "stubborn"))
    assert again.status == 503
    assert again.body is not None
    assert again.body["error"]["retryable"] is True
    assert runs == ["r-o"]  # not run twice at once
    release.set()
    await wait_for_empty(runtime)
    later = await runtime.dispatch(inbound("r-o", "stubborn", **{"x-reach-deadline-ms": soon}))
    assert later.status == 504  # (its deadline has passed by now: refused before it starts)
    assert runs == ["r-o"]


async def wait_for_empty(runtime: AgentRuntime) -> None:
    for _ in range(100):
        if not runtime._overdue:
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"still overdue: {runtime._overdue}")


async def test_a_duplicate_waiting_on_a_cancelled_delivery_is_answered() -> None:
    runtime = AgentRuntime("cap", instance_id="cap-01")
    started = asyncio.Event()

    @runtime.operation("slow", idempotent=True)  # else it may have run (the next test)
    async def slow(payload: dict[str, Any]) -> dict[str, Any]:
        started.set()
        await asyncio.sleep(30)
        return {}

    first = asyncio.create_task(runtime.dispatch(inbound("r-c", "slow")))
    await started.wait()
    duplicate = asyncio.create_task(runtime.dispatch(inbound("r-c", "slow")))
    await asyncio.sleep(0.01)
    first.cancel()
    answer = await duplicate
    assert answer.status == 503
    assert answer.body is not None
    assert answer.body["error"]["retryable"] is True


class AsyncCallableClass:
    """A class as a handler: constructing it is the call (in a thread), whatever its __call__."""

    def __init__(self, payload: dict[str, Any]) -> None:
        self.payload = payload

    async def __call__(self) -> None:  # never reached: the instance is the result
        return None


async def test_a_class_with_an_async_call_is_constructed_not_awaited() -> None:
    runtime = AgentRuntime("cap", instance_id="cap-01")
    runtime.operation("make")(AsyncCallableClass)
    answer = await runtime.dispatch(inbound("r-k", "make"))
    assert answer.status == 500  # an instance is not JSON, said so; not "can't be awaited"
    assert answer.body is not None
    assert "not standard JSON" in answer.body["error"]["message"]


# -- what Reach never sends (issue 25) ------------------------------------------------------------


@pytest.mark.parametrize("bad", ["0", "-1", "1000001", "9" * 40, "second"])
async def test_an_attempt_out_of_range_is_refused_naming_the_header(bad: str) -> None:
    runtime = AgentRuntime("cap", instance_id="cap-01")

    @runtime.operation("op")
    async def op(payload: dict[str, Any], ctx: RequestContext) -> dict[str, Any]:
        return {"attempt": ctx.attempt}

    answer = await runtime.dispatch(inbound(f"r-{bad[:6]}", "op", **{"x-reach-attempt": bad}))
    assert answer.status == 400
    assert answer.body is not None
    assert answer.body["error"]["type"] == "invalid_request"
    assert "X-Reach-Attempt" in answer.body["error"]["message"]
    assert "X-Reach-Deadline-Ms" not in answer.body["error"]["message"]
    assert runtime.executed == 0
    for good in ("1", "11", "1000000"):
        answer = await runtime.dispatch(inbound(f"r-{good}", "op", **{"x-reach-attempt": good}))
        assert answer.body == {"attempt": int(good)}


@pytest.mark.parametrize(
    ("body", "kind"),
    [(b"[1, 2]", "an array"), (b'"text"', "a string"), (b"42", "a number"), (b"null", "null")],
)
async def test_a_payload_that_is_not_an_object_is_refused_before_the_handler(
    body: bytes, kind: str
) -> None:
    runtime = AgentRuntime("cap", instance_id="cap-01")
    ran: list[object] = []
    runtime.operation("op")(ran.append)
    request = inbound("r-kind", "op")
    answer = await runtime.dispatch(Inbound("op", request.headers, body))
    assert answer.status == 422
    assert answer.error == {
        "type": "invalid_request",
        "message": f"the payload must be a JSON object, not {kind}",
        "retryable": False,
    }
    assert ran == []
    assert runtime.executed == 0


async def test_a_payload_nested_past_the_decoder_is_a_final_invalid_request() -> None:
    runtime = AgentRuntime("cap", instance_id="cap-01")
    ran: list[object] = []
    runtime.operation("op")(ran.append)
    deep = b'{"a":' * 100_000 + b"1" + b"}" * 100_000
    answer = await runtime.dispatch(Inbound("op", inbound("r-deep", "op").headers, deep))
    assert answer.status == 422
    assert answer.error["type"] == "invalid_request"
    assert answer.error["retryable"] is False
    assert "nested too deeply" in answer.error["message"]
    assert ran == []


async def test_a_result_nested_past_the_encoder_is_a_final_error() -> None:
    runtime = AgentRuntime("cap", instance_id="cap-01")

    @runtime.operation("deep")
    def deep(payload: dict[str, Any]) -> dict[str, Any]:
        result: dict[str, Any] = {}
        for _ in range(100_000):
            result = {"a": result}
        return result

    answer = await runtime.dispatch(inbound("r-deep-result", "deep"))
    assert answer.status == 500
    assert answer.error["type"] == "agent_error"
    assert answer.error["retryable"] is False


async def test_a_coroutine_handed_back_after_the_deadline_is_closed_not_left_unawaited() -> None:
    runtime = AgentRuntime("cap", instance_id="cap-01")
    handed: list[Coroutine[Any, Any, Any]] = []
    ran = threading.Event()

    async def work() -> dict[str, Any]:
        ran.set()
        return {}

    def plain(payload: dict[str, Any]) -> Any:
        time.sleep(0.3)  # past the deadline below, in its own thread
        coroutine = work()
        handed.append(coroutine)
        return coroutine

    runtime.operation("plain")(plain)
    soon = str(int(time.time() * 1000) + 50)
    answer = await runtime.dispatch(inbound("r-coro", "plain", **{"x-reach-deadline-ms": soon}))
    assert answer.status == 504

    def closed() -> bool:
        return bool(handed) and inspect.getcoroutinestate(handed[0]) == inspect.CORO_CLOSED

    deadline = time.monotonic() + 5
    while not closed():
        assert time.monotonic() < deadline, "the coroutine was left unawaited"
        await asyncio.sleep(0.01)
    assert not ran.is_set()  # given up on: it never runs


@pytest.mark.parametrize(
    ("idempotent", "key", "runs_again"),
    [(None, "", False), (False, "", False), (True, "", True), (None, "k-1", True)],
)
async def test_a_run_cut_off_mid_handler_is_not_run_again_by_a_redelivery_of_its_attempt(
    idempotent: bool | None, key: str, runs_again: bool
) -> None:
    """The reliability soak saw a keyless write run twice by one agent: its first delivery was
    cancelled mid-handler (the gateway's connection dropped), the cache forgot it, and the
    re-delivery of the same attempt by the worker that took over ran the handler again."""
    runtime = AgentRuntime("cap", instance_id="cap-01")
    runs: list[str] = []
    entered = asyncio.Event()

    @runtime.operation("write", idempotent=idempotent)
    async def write(payload: dict[str, Any], ctx: RequestContext) -> dict[str, Any]:
        runs.append(ctx.request_id)
        entered.set()
        if len(runs) == 1:
            await asyncio.sleep(60)  # cut off here
        return {"runs": len(runs)}

    headers = {"x-reach-attempt": "1", **({"idempotency-key": key} if key else {})}
    first = asyncio.ensure_future(runtime.dispatch(inbound("w", "write", **headers)))
    await asyncio.wait_for(entered.wait(), 5)
    first.cancel()
    with pytest.raises(asyncio.CancelledError):
        await first
    await wait_for_empty(runtime)  # the handler has taken its cancellation
    again = await runtime.dispatch(inbound("w", "write", **headers))
    if runs_again:
        assert again.status == 200, again.body
        assert len(runs) == 2
    else:
        assert again.status == 502
        assert again.body is not None
        assert "may have run" in again.body["error"]["message"]
        assert again.body["error"]["retryable"] is False
        assert len(runs) == 1
        # A new attempt is Reach's own decision that a retry is safe: it runs.
        later = await runtime.dispatch(inbound("w", "write", **{**headers, "x-reach-attempt": "2"}))
        assert later.status == 200, later.body
        assert len(runs) == 2
