"""The answer cache: a request delivered twice is run once (R8).

Activities run at least once, so a request can arrive again (a worker crashed between the
agent's answer and the workflow recording it), or twice at once. A delivery of a request that is
running waits for that run's answer; one of a request answered lately gets the answer as it was
sent. The memory is bounded twice: at most `remember` answers and `remember_bytes` bytes of them
as sent, the oldest forgotten first; an answer bigger than `remember_bytes` on its own is not
remembered at all. Only successes (200) and acceptances (202) are kept: an error may not recur.

Synchronous steps around the dispatcher's one await of the handler, so a call costs no more
awaits than it did when all this lived in the dispatcher.
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from collections.abc import Awaitable, Container

from agent_reach_sdk.wire import Answer, error_answer

DEFAULT_REMEMBER_BYTES = 16 * 1024 * 1024


class AnswerCache:
    __slots__ = ("_inflight", "_recent", "_recent_size", "_remember", "_remember_bytes", "_stuck")

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

    def earlier(self, request_id: str) -> Answer | Awaitable[Answer] | None:
        """What an earlier delivery of `request_id` answers: its answer, the answer of the run
        in progress to wait for, or None when this delivery is the one to run."""
        cached = self._recent.get(request_id)
        if cached is not None:
            return cached
        running = self._inflight.get(request_id)
        if running is not None:
            return asyncio.shield(running)
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

    def cancelled(self, request_id: str, future: asyncio.Future[Answer]) -> None:
        """The run was cancelled (its caller left, the agent is stopping): a duplicate waiting
        on it was not, and gets an answer that says to send it again."""
        future.set_result(
            error_answer(
                503, "agent_error", "the delivery this one waited on was cancelled", retryable=True
            )
        )
        self._inflight.pop(request_id, None)

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
