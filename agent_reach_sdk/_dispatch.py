"""The dispatcher: the operations an agent serves, and how one request becomes one answer.

Every protocol server hands it the same `Inbound` and sends back the `Answer` (agent_reach_sdk.
wire). In order: the operation is looked up (404 if not served), an earlier delivery of the same
RequestID answers instead (the answer cache), the metadata is read into a `RequestContext`, the
handler runs under the request's deadline (the deadline keeper), and its result is checked: a
result that is not standard JSON or larger than the `max_message_bytes` negotiated at Join is
not sent (Reach could not carry it) and the caller gets a typed error instead.

The hot path: one await of the handler's task per call, no other task, nothing re-computed that
registration could work out once.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import functools
import inspect
import json
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from pydantic import BaseModel, ValidationError

from agent_reach_sdk import _schema, wire
from agent_reach_sdk._answers import AnswerCache
from agent_reach_sdk._deadlines import LATEST_DEADLINE_MS, DeadlineKeeper, DeadlinePassed
from agent_reach_sdk.context import Deferred, RequestContext, current_request_id
from agent_reach_sdk.tracing import traced_dispatch
from agent_reach_sdk.wire import Answer, Inbound, error_answer
from reach.limits import MAX_DEPTH
from reach.messages import MAX_TIMEOUT_MS

log = logging.getLogger("agent_reach_sdk")

OperationFunc = Callable[..., Any]

# The most X-Reach-Attempt can be: Reach's retries are bounded far below it (policy allows ten),
# so a larger number (or one under 1) is not Reach's, and is refused rather than handed on.
MAX_ATTEMPT = 1_000_000


class OperationError(Exception):
    """Raise from an operation to answer with a typed error instead of a result."""

    def __init__(self, message: str, *, type: str = "agent_error", status: int = 422) -> None:
        """`status` is HTTP-style and decides whether Reach may retry: 429 and 5xx yes, other
        4xx no, 504 is a timeout. Only 400-599 say that the same way on every protocol."""
        if not 400 <= status <= 599:
            raise ValueError(f"OperationError status must be 400-599, not {status}")
        super().__init__(message)
        self.message = message
        self.type = type
        self.status = status


class Dispatcher:
    def __init__(
        self,
        *,
        capability: str,
        instance_id: str,
        protocol: str,
        max_message_bytes: int,
        answers: AnswerCache,
        deadlines: DeadlineKeeper,
    ) -> None:
        # Each operation with how it is called, worked out once at registration rather than per
        # call; one entry, so a dispatch never pairs a re-registered function with an old shape.
        self.calls: dict[str, tuple[OperationFunc, Shape]] = {}
        self.declared: dict[str, dict[str, Any]] = {}  # only operations that declare something
        self.max_message_bytes = max_message_bytes  # the negotiated one, once joined
        self.executed = 0  # operations actually run (re-deliveries answered from memory excluded)
        self.tracer: Any = None  # an OpenTelemetry Tracer when tracing is on
        self._answers = answers
        self._deadlines = deadlines
        self._span_attributes = {
            "reach.capability": capability,
            "reach.instance_id": instance_id,
            "reach.protocol": protocol,
        }

    # -- registration ---------------------------------------------------------------------------

    def operation(
        self,
        name: str,
        *,
        idempotent: bool | None = None,
        timeout_ms: int | None = None,
        input_schema: dict[str, Any] | None = None,
        description: str | None = None,
    ) -> Callable[[OperationFunc], OperationFunc]:
        if idempotent is not None and not isinstance(idempotent, bool):
            raise TypeError(f"idempotent must be a bool or None, not {idempotent!r}")
        if timeout_ms is not None and (
            isinstance(timeout_ms, bool)
            or not isinstance(timeout_ms, int)
            or not 1 <= timeout_ms <= MAX_TIMEOUT_MS
        ):
            raise ValueError(
                f"timeout_ms must be an integer from 1 to {MAX_TIMEOUT_MS} (24 h), not "
                f"{timeout_ms!r}"
            )
        declared: dict[str, Any] = {}
        if idempotent is not None:
            declared["idempotent"] = idempotent
        if timeout_ms is not None:
            declared["timeout_ms"] = timeout_ms

        if input_schema is not None:
            _schema.checked(input_schema, name)
        if description is not None and not isinstance(description, str):
            raise TypeError(f"description must be a string or None, not {description!r}")

        def register(func: OperationFunc) -> OperationFunc:
            shape = Shape.of(func)
            said = dict(declared)
            annotation = _schema.payload_annotation(func)
            shape.model = _schema.model_of(annotation)
            schema = input_schema if input_schema is not None else _schema.schema_of(annotation)
            if schema is not None:
                said["input_schema"] = _schema.checked(schema, name)
            about = description if description is not None else _schema.description_of(func)
            if about:
                said["description"] = about[: _schema.MAX_DESCRIPTION_CHARS]
            self.calls[name] = (func, shape)
            if said:
                self.declared[name] = said
            else:
                self.declared.pop(name, None)
            return func

        return register

    @property
    def operations(self) -> list[str]:
        return sorted(self.calls)

    def join_operations(self) -> list[str | dict[str, Any]]:
        """The Join body's `operations`: a plain name, or an object with what it declares."""
        return [
            {"name": name, **self.declared[name]} if name in self.declared else name
            for name in self.operations
        ]

    # -- serving --------------------------------------------------------------------------------

    async def dispatch(self, request: Inbound) -> Answer:
        """Answer one request, whatever protocol it came by; with tracing on, in a server span
        that continues the request's traceparent."""
        if self.tracer is not None:
            return await traced_dispatch(self.tracer, request, self._answer, self._span_attributes)
        return await self._answer(request)

    async def _answer(self, request: Inbound) -> Answer:
        name = request.operation
        call = self.calls.get(name)
        if call is None:
            return error_answer(404, "invalid_request", f"operation {name!r} is not served here")
        request_id = request.headers.get(wire.REQUEST_ID) or f"local-{time.time_ns()}"
        answers = self._answers
        earlier = answers.earlier(request_id, request.headers.get(wire.ATTEMPT, ""))
        if earlier is not None:
            return earlier if isinstance(earlier, Answer) else await earlier
        future = answers.begin(request_id)
        try:
            answer = await self._execute(call, name, request_id, request)
        except asyncio.CancelledError:
            answers.cancelled(
                request_id,
                future,
                may_have_run=self._once_only(name, request),
                attempt=request.headers.get(wire.ATTEMPT, ""),
            )
            raise
        except BaseException as exc:
            answers.failed(request_id, future, exc)
            raise
        answers.answered(request_id, future, answer)
        return answer

    def _once_only(self, name: str, request: Inbound) -> bool:
        """A run of `name` must not be repeated: not declared idempotent, and no idempotency
        key for the handler to recognise a repeat by."""
        if self.declared.get(name, {}).get("idempotent") is True:
            return False
        return not request.headers.get(wire.IDEMPOTENCY_KEY)

    async def _execute(
        self, call: tuple[OperationFunc, Shape], name: str, request_id: str, request: Inbound
    ) -> Answer:
        h = request.headers
        try:
            deadline = int(h[wire.DEADLINE_MS]) if h.get(wire.DEADLINE_MS) else None
        except ValueError:
            return error_answer(400, "invalid_request", "X-Reach-Deadline-Ms is an integer")
        attempt = _attempt(h.get(wire.ATTEMPT))
        if attempt is None:
            return error_answer(
                400,
                "invalid_request",
                f"X-Reach-Attempt is an integer from 1 to {MAX_ATTEMPT}, not "
                f"{h.get(wire.ATTEMPT, '')[:40]!r}",
            )
        if deadline is not None and not 0 <= deadline <= LATEST_DEADLINE_MS:
            return error_answer(
                400,
                "invalid_request",
                "X-Reach-Deadline-Ms is milliseconds since the Unix epoch, "
                f"0 to {LATEST_DEADLINE_MS}",
            )
        ctx = RequestContext(
            request_id=request_id,
            operation=name,
            caller=h.get(wire.CALLER, "anonymous"),
            attempt=attempt,
            deadline_ms=deadline,
            idempotency_key=h.get(wire.IDEMPOTENCY_KEY),
            headers=dict(h),
            context_id=h.get(wire.CONTEXT_ID),
        )
        try:
            payload = json.loads(request.body or b"{}")
        except ValueError:
            return error_answer(400, "invalid_request", "body is not JSON")
        except RecursionError:
            # Deeper than the decoder goes: the same body fails the same way every time.
            return error_answer(
                422,
                "invalid_request",
                f"the payload is nested too deeply (Reach sends at most {MAX_DEPTH} levels)",
                retryable=False,
            )
        if not isinstance(payload, dict):
            # The wire contract's payload is an object on every protocol; a handler is never
            # handed a list, a string or null to trip over.
            return error_answer(
                422,
                "invalid_request",
                f"the payload must be a JSON object, not {_json_kind(payload)}",
                retryable=False,
            )
        remaining = (deadline / 1000 - time.time()) if deadline is not None else None
        if remaining is not None and remaining <= 0:
            return error_answer(504, "timeout", "the request's deadline passed before it started")
        func, shape = call
        if shape.model is not None:
            try:
                payload = shape.model.model_validate(payload)
            except ValidationError as exc:
                return error_answer(422, "invalid_request", _invalid_payload(exc), retryable=False)
        token = current_request_id.set(request_id)
        try:
            self.executed += 1
            result = await self._deadlines.run(
                request_id, shape.call(func, payload, ctx), remaining
            )
        except DeadlinePassed:
            log.warning("operation %s passed its deadline", name)
            return error_answer(504, "timeout", "the operation passed the request's deadline")
        except OperationError as exc:
            return error_answer(exc.status, exc.type, exc.message)
        except Exception as exc:
            log.exception("operation %s failed", name)
            return error_answer(500, "agent_error", f"{type(exc).__name__}: {exc}")
        finally:
            current_request_id.reset(token)
        if isinstance(result, Deferred):
            return Answer(202, {"request_id": request_id, "status": "accepted"})
        return self._checked(name, result)

    def _checked(self, name: str, result: Any) -> Answer:
        """The handler's result as an answer Reach can carry, else the error that says why."""
        if isinstance(result, BaseModel):
            result = result.model_dump(mode="json")
        if not isinstance(result, dict):
            result = {"value": result}
        answer = Answer(200, result)
        try:
            size = len(answer.content())
        except (TypeError, ValueError) as exc:
            log.error("operation %s returned a result that is not standard JSON: %s", name, exc)
            return error_answer(500, "agent_error", f"the result is not standard JSON: {exc}")
        except RecursionError:
            log.error("operation %s returned a result nested too deeply to encode", name)
            return error_answer(
                500,
                "agent_error",
                f"the result of {name} is nested too deeply to encode (at most {MAX_DEPTH} levels)",
                retryable=False,
            )
        if size > self.max_message_bytes:
            log.error(
                "operation %s returned %d bytes, more than the negotiated max_message_bytes %d;"
                " not sent",
                name,
                size,
                self.max_message_bytes,
            )
            return error_answer(
                500,
                "result_too_large",
                f"the result of {name} is {size} bytes > negotiated {self.max_message_bytes}",
                retryable=False,
            )
        return answer


def _invalid_payload(exc: ValidationError) -> str:
    """A payload that does not fit the handler's model, in the words a refusal uses."""
    first = exc.errors()[0]
    where = ".".join(str(part) for part in first["loc"]) or "payload"
    more = f" (and {exc.error_count() - 1} more)" if exc.error_count() > 1 else ""
    return f"payload.{where}: {first['msg']}{more}"


def _attempt(value: str | None) -> int | None:
    """X-Reach-Attempt as a number (1 when absent), None when it is not one Reach sends."""
    if not value:
        return 1
    try:
        attempt = int(value)
    except ValueError:
        return None
    return attempt if 1 <= attempt <= MAX_ATTEMPT else None


def _json_kind(value: object) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int | float):
        return "a number"
    if isinstance(value, list):
        return "an array"
    return "a string" if isinstance(value, str) else type(value).__name__


class Shape:
    """How an operation is called: with the context or without, on the loop or in a thread,
    with the payload as it came or validated into the pydantic model the handler takes."""

    __slots__ = ("is_async", "model", "takes_ctx")

    def __init__(self, takes_ctx: bool, is_async: bool) -> None:
        self.takes_ctx = takes_ctx
        self.is_async = is_async
        self.model: type[BaseModel] | None = None

    @classmethod
    def of(cls, func: OperationFunc) -> Shape:
        # An object (not a class) whose __call__ is a coroutine function is awaited too.
        is_async = inspect.iscoroutinefunction(func) or (
            not inspect.isclass(func)
            and inspect.iscoroutinefunction(getattr(func, "__call__", None))  # noqa: B004
        )
        return cls(len(inspect.signature(func).parameters) >= 2, is_async)

    async def call(self, func: OperationFunc, payload: Any, ctx: RequestContext) -> Any:
        args = (payload, ctx) if self.takes_ctx else (payload,)
        try:
            if self.is_async:
                return await func(*args)
            result = await _in_daemon_thread(func, *args)
            if inspect.isawaitable(result):  # a plain function that hands back a coroutine
                return await result
            return result
        except (KeyboardInterrupt, SystemExit, GeneratorExit) as exc:
            # The handler's own, not the process's (run() takes signals on the loop): as an
            # Exception it is the request's error instead of the event loop's end.
            raise RuntimeError(f"the handler raised {type(exc).__name__}") from exc


async def _in_daemon_thread(func: Callable[..., Any], *args: Any) -> Any:
    """Run a plain (blocking) handler in a thread of its own, with the caller's context (the
    RequestID for logs). A daemon thread, unlike `asyncio.to_thread`'s pool: a handler stuck
    past the shutdown grace cannot keep the process from exiting on SIGTERM."""
    loop = asyncio.get_running_loop()
    done: asyncio.Future[Any] = loop.create_future()
    context = contextvars.copy_context()

    def settle(outcome: Callable[[], None], result: object = None) -> None:
        if not done.done():
            outcome()
        else:  # given up on (its deadline, a shutdown) before the function returned
            _close_unawaited(result)

    def run() -> None:
        try:
            result = context.run(func, *args)
        except BaseException as exc:
            with contextlib.suppress(RuntimeError):  # the loop is gone: nobody waits
                loop.call_soon_threadsafe(settle, functools.partial(done.set_exception, exc))
        else:
            try:
                loop.call_soon_threadsafe(
                    settle, functools.partial(done.set_result, result), result
                )
            except RuntimeError:  # the loop is gone: nobody waits, nothing will run it
                _close_unawaited(result)

    threading.Thread(target=run, name="reach-handler", daemon=True).start()
    try:
        return await done
    except asyncio.CancelledError:
        # Cancelled just as the function's coroutine arrived: nobody awaits it now either.
        if done.done() and not done.cancelled() and done.exception() is None:
            _close_unawaited(done.result())
        raise


def _close_unawaited(value: object) -> None:
    """A coroutine a plain handler handed back that will never be awaited (the request was
    given up on first): closed, so it ends without the "never awaited" warning."""
    if inspect.iscoroutine(value):
        value.close()
