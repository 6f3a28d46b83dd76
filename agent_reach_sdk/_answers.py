"""The answer cache: a request delivered twice is run once (R8).

Activities run at least once, so a request can arrive again (a worker crashed between the
agent's answer and the workflow recording it), or twice at once. A delivery of a request that is
running waits for that run's answer; one of a request answered lately gets the answer as it was
sent. The memory is bounded twice: at most `remember` answers and `remember_bytes` bytes of them
as sent, the oldest forgotten first; an answer bigger than `remember_bytes` on its own is not
remembered at all. Only successes (200) and acceptances (202) are kept: an error may not recur.

A run cut off mid-handler (its connection dropped, its caller left) may have done its work: for
an operation not declared idempotent and carrying no idempotency key, a re-delivery of the same
attempt (a worker that died and ran it again) is told so (`CUT_OFF`, not retryable) instead of
run again. A later attempt is Reach's own decision that a retry is safe, and runs. The marks
are bounded like the answers.

Synchronous steps around the dispatcher's one await of the handler, so a call costs no more
awaits than it did when all this lived in the dispatcher.
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from collections.abc import Awaitable, Container

from agent_reach_sdk.wire import Answer, error_answer

DEFAULT_REMEMBER_BYTES = 16 * 1024 * 1024

# What a delivery of a request whose earlier run was cut off mid-handler is answered, when that
# run may have done what must not be done twice: not run again, and not retryable.
CUT_OFF = error_answer(
    502,
    "agent_error",
    "an earlier delivery of this request was cut off while its handler ran: it may have run, "
    "so it is not run again (the operation is not declared idempotent and has no idempotency "
    "key)",
    retryable=False,
)


class AnswerCache:
    __slots__ = (
        "_cut",
        "_inflight",
        "_recent",
        "_recent_size",
        "_remember",
        "_remember_bytes",
        "_stuck",
    )

    def __init__(
        self,
        remember: int = 4096,
        remember_bytes: int = DEFAULT_REMEMBER_BYTES,
        *,
        still_running: Container[str] = (),
    ) -> None:
        """`still_running`: RequestIDs whose handler was given up on but has not ended (the
        deadline keeper's); a re-delivery of one is told to come back instead of run beside it."""
        self._remember = remember
        self._remember_bytes = remember_bytes
        self._recent: OrderedDict[str, Answer] = OrderedDict()
        self._recent_size = 0  # bytes of the remembered answers, as sent
        self._inflight: dict[str, asyncio.Future[Answer]] = {}
        self._stuck = still_running
        # Runs cut off that may have run: RequestID -> the attempt that was cut off.
        self._cut: OrderedDict[str, str] = OrderedDict()

    def earlier(self, request_id: str, attempt: str = "") -> Answer | Awaitable[Answer] | None:
        """What an earlier delivery of `request_id` answers: its answer, the answer of the run
        in progress to wait for, or None when this delivery is the one to run."""
        cached = self._recent.get(request_id)
        if cached is not None:
            return cached
        running = self._inflight.get(request_id)
        if running is not None:
            return asyncio.shield(running)
        if self._cut.get(request_id, None) == attempt:
            return CUT_OFF
        if request_id in self._stuck:
            return error_answer(
                503,
                "agent_error",
                "an earlier delivery of this request is still running past its deadline",
                retryable=True,
            )
        return None

    def begin(self, request_id: str) -> asyncio.Future[Answer]:
        """This delivery runs `request_id`: duplicates from now on wait for the future."""
        future: asyncio.Future[Answer] = asyncio.get_running_loop().create_future()
        self._inflight[request_id] = future
        return future

    def answered(self, request_id: str, future: asyncio.Future[Answer], answer: Answer) -> None:
        future.set_result(answer)
        self._inflight.pop(request_id, None)
        if answer.status in (200, 202):
            self._keep(request_id, answer)

    def cancelled(
        self,
        request_id: str,
        future: asyncio.Future[Answer],
        *,
        may_have_run: bool = False,
        attempt: str = "",
    ) -> None:
        """The run was cancelled (its caller left, the agent is stopping): a duplicate waiting
        on it was not, and gets an answer that says to send it again, or, when the run may
        have done what a second one must not (`may_have_run`), that it may have run."""
        self._inflight.pop(request_id, None)
        if may_have_run:
            self._cut[request_id] = attempt
            while len(self._cut) > self._remember:
                self._cut.popitem(last=False)
            future.set_result(CUT_OFF)
            return
        future.set_result(
            error_answer(
                503, "agent_error", "the delivery this one waited on was cancelled", retryable=True
            )
        )

    def failed(self, request_id: str, future: asyncio.Future[Answer], exc: BaseException) -> None:
        future.set_exception(exc)
        future.exception()  # mark retrieved: a waiting duplicate sees it, nobody else must
        self._inflight.pop(request_id, None)

    def _keep(self, request_id: str, answer: Answer) -> None:
        size = len(answer.content())
        if size > self._remember_bytes:
            return  # it would push out everything else and still not fit
        old = self._recent.pop(request_id, None)
        if old is not None:
            self._recent_size -= len(old.content())
        self._recent[request_id] = answer
        self._recent_size += size
        while len(self._recent) > self._remember or self._recent_size > self._remember_bytes:
            _, dropped = self._recent.popitem(last=False)
            self._recent_size -= len(dropped.content())

    @property
    def running(self) -> int:
        """Requests being run now (the health report's `inflight`)."""
        return len(self._inflight)

    @property
    def remembered(self) -> tuple[int, int]:
        """How many answers the memory holds, and their bytes as sent."""
        return len(self._recent), self._recent_size
