"""The one module that leans on the Temporal SDK's internals, each with its fallback.

- `started_here`: whether `start_workflow` started the workflow or attached to a running one
  (the start response the SDK keeps on the handle); fallback: "started".
- `eagerly_started`: whether the start carried the first workflow task to this process's
  worker (a flag the SDK keeps on the handle); fallback: not eager, so the result is
  long-polled.
- `Finishes.attach`: the worker's bridge to its core (below); fallback: nothing is watched and
  every result is long-polled.

Nowhere else in the project reads a private name of the SDK (tests/unit/test_layout.py); the
tests named below fail on an SDK upgrade that changes one, while production falls back.

## A request's result straight from the worker in this process, once Temporal has recorded it

A gateway that runs the invoke worker starts each request eagerly: its first workflow task runs
here, and for nearly every synchronous invoke that one task calls the agent and completes the
workflow. The usual way to learn the result is a long poll of the workflow's history
(`handle.result()`): one more RPC per request, the server reading the history back, and the SDK
decoding the response — about 3 ms of CPU per call across the server and the gateway on a
2-core box, a tenth of all a durable invoke costs.

This module learns it where it is already known. It watches the invoke worker's activations and
completions at the SDK's bridge to its core:

- a completion that carries `complete_workflow_execution` holds the result payload, exactly as
  it is written to history (already through the payload codec); one that carries
  `fail_workflow_execution` for an error or timeout holds it as the failure's one detail
  (`reach.outcome`);
- core then evicts the run from its cache with reason `WORKFLOW_EXECUTION_ENDING` only once the
  server accepted that workflow task completion ("we sent the WFT completion to server
  successfully", in core's protocol): the workflow is closed, the result durable.

Only then is the waiting request answered from here. Anything else sends it back to the long
poll at once: another eviction reason (the server refused the completion because a signal or an
update came in, a workflow task timed out, the cache was full, the worker is stopping), a run
that ends failed (other than with its error or timeout) or cancelled, a start that was not
eager (the task may run in another gateway), a second request with the same RequestID waiting
at the same time.

A run still going after 10 s (or the worker's sticky schedule-to-start timeout or the starts'
workflow task timeout, if either is longer: `temporal.sticky_schedule_to_start_s`,
`temporal.workflow_task_timeout_s`) is long-polled too. A run leaves this worker unseen only
when a later task of it waited that sticky timeout for this worker and went to another; a task
of it that timed out here is seen (its completion is refused, and core evicts the run for
another reason). A synchronous call is one task, so the wait outlasts those timeouts: were it
as short as they are (2 s by default), every call slower than that would pay the long poll:
under load, calls take longer, and long-polling the slow ones would make each call dearer just
when the box has least to spare (a 2 s wait did, at 64 in flight here).

The bridge is the SDK's internal layer; tests/integration/test_finishes.py runs every path
above against a real server, so an SDK upgrade that changes it fails there, not in production.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from temporalio.api.common.v1 import Payload
from temporalio.bridge.proto.workflow_activation import RemoveFromCache, WorkflowActivation
from temporalio.bridge.proto.workflow_completion import WorkflowActivationCompletion
from temporalio.client import WorkflowHandle
from temporalio.worker import Worker

from reach.outcome import FAILED_OUTCOME

log = logging.getLogger("reach.gateway")

_ENDING = RemoveFromCache.EvictionReason.WORKFLOW_EXECUTION_ENDING
# The SDK's default sticky schedule-to-start timeout, for a worker that does not say its own.
_STICKY_S = 10.0
# The least a run may go on before its result is long-polled instead (see above).
_LONG_POLL_AFTER_S = 10.0


class Finish:
    """One request's wait: resolves to its result payload, or to None (long-poll instead)."""

    __slots__ = ("future", "run_ids", "timer", "workflow_id")

    def __init__(self, workflow_id: str, future: asyncio.Future[Payload | None]) -> None:
        self.workflow_id = workflow_id
        self.future = future
        self.timer: asyncio.TimerHandle | None = None
        self.run_ids: list[str] = []  # its runs seen here (more than one after a reset)

    def settle(self, payload: Payload | None) -> None:
        if not self.future.done():
            self.future.set_result(payload)

    async def result(self, handle: WorkflowHandle[Any, Any]) -> Payload | None:
        """The result payload if this process recorded it; None: ask `handle` (long poll)."""
        if not eagerly_started(handle):
            return None
        return await self.future


class Finishes:
    """The requests this gateway waits on, and what its worker saw of their runs."""

    def __init__(
        self, long_poll_after_s: float | None = None, task_timeout_s: float = _STICKY_S
    ) -> None:
        # None: 10 s, or the attached worker's sticky schedule-to-start timeout or the starts'
        # workflow task timeout (`task_timeout_s`) if longer (see above).
        self.long_poll_after_s = long_poll_after_s
        self.task_timeout_s = task_timeout_s
        self._waiting: dict[str, Finish] = {}  # workflow id -> its wait
        self._runs: dict[str, Finish] = {}  # run id -> the wait of its workflow
        self._results: dict[str, Payload] = {}  # run id -> the result its completion carries

    # -- the worker's side ----------------------------------------------------------------------

    def attach(self, worker: Worker) -> None:
        """Watch `worker`'s workflow activations and completions (its bridge to core)."""
        if self.long_poll_after_s is None:
            sticky = worker.config().get("sticky_queue_schedule_to_start_timeout")
            sticky_s = sticky.total_seconds() if sticky else _STICKY_S
            self.long_poll_after_s = max(_LONG_POLL_AFTER_S, sticky_s, self.task_timeout_s)
        bridge = getattr(worker, "_bridge_worker", None)
        if bridge is None:  # an SDK without it: every result is long-polled
            log.warning("this Temporal SDK has no worker bridge to watch; long-polling results")
            return
        poll: Callable[[], Awaitable[WorkflowActivation]] = bridge.poll_workflow_activation
        complete: Callable[[WorkflowActivationCompletion], Awaitable[None]] = (
            bridge.complete_workflow_activation
        )

        # Watching never stands in the worker's way: a fault here costs the fast path only.
        async def watched_poll() -> WorkflowActivation:
            activation = await poll()
            if self._waiting or self._runs:
                try:
                    self._saw(activation)
                except Exception:
                    log.exception("reading an activation for results failed; long-polling")
                    self.close()
            return activation

        async def watched_complete(completion: WorkflowActivationCompletion) -> None:
            if completion.run_id in self._runs:
                try:
                    self._carries(completion)
                except Exception:
                    log.exception("reading a completion for results failed; long-polling")
                    self.close()
            try:
                await complete(completion)
            except BaseException:
                self._results.pop(completion.run_id, None)
                raise

        bridge.poll_workflow_activation = watched_poll
        bridge.complete_workflow_activation = watched_complete

    def _saw(self, activation: WorkflowActivation) -> None:
        run_id = activation.run_id
        for job in activation.jobs:
            kind = job.WhichOneof("variant")
            if kind == "initialize_workflow":
                wait = self._waiting.get(job.initialize_workflow.workflow_id)
                if wait is not None and not wait.future.done():
                    self._runs[run_id] = wait
                    wait.run_ids.append(run_id)
            elif kind == "remove_from_cache":
                wait = self._runs.pop(run_id, None)
                result = self._results.pop(run_id, None)
                if wait is not None:
                    ended = job.remove_from_cache.reason == _ENDING
                    wait.settle(result if ended else None)

    def _carries(self, completion: WorkflowActivationCompletion) -> None:
        if not completion.HasField("successful"):
            return
        for command in completion.successful.commands:
            if command.HasField("complete_workflow_execution"):
                self._results[completion.run_id] = command.complete_workflow_execution.result
            elif command.HasField("fail_workflow_execution"):
                # An error or timeout: the envelope is the failure's one detail (reach.outcome).
                failure = command.fail_workflow_execution.failure
                details = failure.application_failure_info.details.payloads
                if failure.application_failure_info.type == FAILED_OUTCOME and len(details) == 1:
                    self._results[completion.run_id] = details[0]

    # -- the gateway's side ---------------------------------------------------------------------

    def expect(self, workflow_id: str) -> Finish | None:
        """Start watching for `workflow_id`'s end, before its start is sent (its first task
        can run before the start call returns). None: someone here already waits on it."""
        if workflow_id in self._waiting:
            return None
        loop = asyncio.get_running_loop()
        wait = Finish(workflow_id, loop.create_future())
        wait.timer = loop.call_later(self.long_poll_after_s or _STICKY_S, wait.settle, None)
        self._waiting[workflow_id] = wait
        return wait

    def done(self, wait: Finish) -> None:
        """Stop watching (answered, long-polled, or the start attached to an older run)."""
        if self._waiting.get(wait.workflow_id) is wait:
            del self._waiting[wait.workflow_id]
        if wait.timer is not None:
            wait.timer.cancel()
        wait.settle(None)
        for run_id in wait.run_ids:
            if self._runs.get(run_id) is wait:
                del self._runs[run_id]
            self._results.pop(run_id, None)

    def close(self) -> None:
        """Everyone still waiting long-polls (the worker is stopping)."""
        for wait in list(self._waiting.values()):
            self.done(wait)


def eagerly_started(handle: WorkflowHandle[Any, Any]) -> bool:
    """Whether the start's response carried the first workflow task to this process's worker.

    The SDK keeps it on the handle; tests/integration/test_finishes.py guards the attribute.
    """
    return bool(getattr(handle, "__temporal_eagerly_started", False))


def started_here(handle: WorkflowHandle[Any, Any]) -> bool:
    """Whether `start_workflow` started this workflow or attached to a running one.

    The server says so in its start response (`started`), which the SDK keeps on the handle;
    tests/unit/test_public_api.py guards the attribute across SDK upgrades.
    """
    response = getattr(handle, "_start_workflow_response", None)
    return bool(getattr(response, "started", True))
