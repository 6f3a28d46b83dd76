"""The hosts an agent runs in: `run()` (the process, until a signal) and `start()` (a thread).

Both only drive the runtime's own `astart`/`astop`; what joining and serving mean is the
runtime's business, not theirs.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import threading
from collections.abc import Callable, Coroutine
from contextlib import AbstractAsyncContextManager
from typing import Any

log = logging.getLogger("agent_reach_sdk")

LOG_FORMAT = "%(asctime)s %(levelname)s [%(request_id)s] %(message)s"

Step = Callable[[], Coroutine[Any, Any, None]]


def run(serve: Step) -> None:
    """`serve()` on a new event loop, with the SDK's log format; Ctrl-C ends it quietly."""
    logging.basicConfig(level=logging.INFO, format=LOG_FORMAT)
    # httpx logs each request at INFO: a line per heartbeat, every few seconds, saying nothing
    # the SDK's own lines do not (a failed heartbeat is its WARNING). Unless set otherwise.
    requests = logging.getLogger("httpx")
    if requests.level == logging.NOTSET:
        requests.setLevel(logging.WARNING)
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(serve())


async def serve_until_signalled(
    runtime: AbstractAsyncContextManager[Any], serving: Callable[[], tuple[object, ...]]
) -> None:
    """Inside `async with runtime` until SIGINT or SIGTERM; `serving()` gives the capability,
    protocol and address for the log line once it is known (after the start)."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    installed = []
    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError, RuntimeError, ValueError):
            loop.add_signal_handler(sig, stop.set)
            installed.append(sig)
    try:
        async with runtime:
            log.info("serving %s over %s at %s (Ctrl-C to leave)", *serving())
            await stop.wait()
            log.info("leaving Reach: no new requests; finishing those in flight")
    finally:
        for sig in installed:
            loop.remove_signal_handler(sig)


class ThreadHost:
    """An event loop of its own in a daemon thread, for plain (non-asyncio) scripts."""

    __slots__ = ("_loop", "_thread")

    def __init__(self) -> None:
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None

    def start(self, astart: Step, astop: Step, name: str) -> None:
        """Run `astart()` in the thread and return once it has (raising what it raised); the
        loop then serves until `stop()`, which runs `astop()` there."""
        if self._thread is not None:
            raise RuntimeError("already started")
        started = threading.Event()
        failure: list[BaseException] = []

        def run() -> None:
            loop = asyncio.new_event_loop()
            self._loop = loop
            try:
                loop.run_until_complete(astart())
            except BaseException as exc:
                failure.append(exc)
                started.set()
                return
            started.set()
            loop.run_forever()
            loop.run_until_complete(astop())
            loop.close()

        self._thread = threading.Thread(target=run, name=name, daemon=True)
        self._thread.start()
        started.wait()
        if failure:
            self._thread = None
            raise failure[0]

    def stop(self) -> None:
        if self._thread is None or self._loop is None:
            return
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)
        self._thread = None
