"""Recording a call's progress and log messages (`reach.progress`) in the shared policy state
while it runs.

The connector hands each progress notification and log message to the sink this sets for the
call; the notes
are bounded (`reach.progress.MAX_NOTES`) and written at most every `WRITE_EVERY_S`, one write
at a time, off the call's path (a store that is slow or down delays or drops the record, never
the call), and once more when the call ends. A call that reports nothing writes nothing.

The recorder also holds the call's questions (`reach.asks.Questions`): what the agent asks
mid-call, relayed to the caller through the MCP front's stream when it can answer, given up
when the call ends.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Iterable, Iterator
from typing import Any

from reach import asks, progress
from reach.config import SECRET_KEY_NAMES
from reach.errors import ReachError
from reach.invocation import CallInput
from reach.policy.state import PolicyState

log = logging.getLogger("reach.activities")


class Recorder:
    """One call's record: `note` and `log` from the connector (sync), `close` at the call's
    end. `keys`: the secret key names a log message's data is redacted by (the audit's)."""

    def __init__(
        self, state: PolicyState, inp: CallInput, keys: Iterable[str] = SECRET_KEY_NAMES
    ) -> None:
        header = inp.message.header
        self.state = state
        self.key = progress.progress_key(header.request_id)
        now_ms = time.time() * 1000
        until_ms = max(header.deadline_ms or 0, now_ms + inp.timeout_ms)
        self.ttl_s = (until_ms - now_ms) / 1000 + progress.KEPT_S
        self.record = progress.ProgressLog(header.attempt, time.time, keys)
        self.written = 0  # changes counted in the last write
        self.last_write = 0.0  # loop time
        self.writing: asyncio.Task[None] | None = None
        # What the agent asks mid-call, relayed to the caller when it can answer (`reach.asks`).
        until_s = min(header.deadline_ms or until_ms, now_ms + inp.timeout_ms) / 1000
        self.questions = asks.Questions(
            state, header.request_id, header.caller, header.attempt, until_s
        )

    def note(self, params: dict[str, Any]) -> None:
        if self.record.add(params):
            self._changed()

    def log(self, params: dict[str, Any]) -> None:
        if self.record.add_log(params):
            self._changed()

    def _changed(self) -> None:
        loop = asyncio.get_running_loop()
        if self.writing is None and loop.time() - self.last_write >= progress.WRITE_EVERY_S:
            self.writing = loop.create_task(self._write())

    async def _write(self) -> None:
        self.last_write = asyncio.get_running_loop().time()
        count, encoded = self.record.changes, self.record.encode()
        try:
            await self.state.put(self.key, encoded, self.ttl_s)
            self.written = count
        except ReachError as exc:
            log.debug("progress of %s not recorded: %s", self.key, exc.message)
        finally:
            self.writing = None

    async def close(self) -> None:
        """The last notes written (the store's trouble is logged, not raised); a question
        still waiting for its answer is given up."""
        self.questions.close()
        if self.writing is not None:
            with contextlib.suppress(Exception):
                await self.writing
        if self.record.changes > self.written:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._write(), 2.0)


_NOTHING = contextlib.nullcontext()


def recording(recorder: Recorder | None) -> contextlib.AbstractContextManager[None]:
    """The connector's `reach.progress.report` goes to `recorder` within this block, and its
    questions to the recorder's (`reach.asks.QUESTIONS`) (None: nowhere, at no cost: most
    calls)."""
    return _NOTHING if recorder is None else _recording(recorder)


@contextlib.contextmanager
def _recording(recorder: Recorder) -> Iterator[None]:
    token = progress.SINK.set(recorder)
    asking = asks.QUESTIONS.set(recorder.questions)
    try:
        yield
    finally:
        asks.QUESTIONS.reset(asking)
        progress.SINK.reset(token)
