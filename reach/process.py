"""How a Reach process runs and ends: its event loop, its logging, its exit.

Kept apart from `worker` (which loads Temporal, the connectors and the activities) so that the
command line's light commands (`reach tokens`, `reach requests`, `reach trace`, ...) start
without loading what only a gateway or a worker needs.
"""

from __future__ import annotations

import asyncio
import gc
import os
import sys
from collections.abc import Callable, Coroutine
from typing import Any, Literal, NoReturn, TypeVar

from reach.config import ConfigError, ReachSettings, TelemetrySettings
from reach.telemetry import tracing
from reach.telemetry.logs import setup_logging

T = TypeVar("T")

# The collector once start-up is over (`settle_heap`). Measured on a gateway at 16 calls in
# flight (bench/invoke.py, reach inline), over ~2,400 calls: by default it spent 578 ms and
# paused the process for ~100 ms in each of its full collections, which walk the ~150k objects
# start-up leaves behind; with those frozen and a first generation of 2,000 it spent 306 ms,
# and its longest pause was 13 ms.
GC_THRESHOLD = (2000, 10, 10)


def loop_factory(choice: Literal["auto", "uvloop", "asyncio"]) -> Callable[[], Any] | None:
    """The event loop a gateway or worker runs on (`event_loop` in reach.yaml): uvloop when it
    is installed and not refused, else the standard library's (None)."""
    if choice == "asyncio":
        return None
    try:
        import uvloop
    except ImportError:
        if choice == "uvloop":
            raise ConfigError(
                "event_loop: uvloop is not installed (pip install uvloop), or set it to auto"
            ) from None
        return None
    return uvloop.new_event_loop


def run(main: Coroutine[Any, Any, T], settings: ReachSettings) -> T:
    """`asyncio.run`, on the event loop `settings.event_loop` names."""
    with asyncio.Runner(loop_factory=loop_factory(settings.event_loop)) as runner:
        return runner.run(main)


def configure_logging(verbose: bool = False, telemetry: TelemetrySettings | None = None) -> None:
    """The main log, and heartbeats apart and sampled (R25): `reach.telemetry.logs`. Called
    again once the settings are loaded, for `telemetry.logs_format` and the sampling."""
    setup_logging(telemetry, verbose=verbose)


def settle_heap() -> None:
    """Called once a long-running process has started (gateway, worker): what start-up built
    (modules, settings, clients) moves to the collector's permanent generation, never scanned
    again, and the collector runs less often. Process-wide, so never from a library call."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(*GC_THRESHOLD)


def exit_now(code: int, message: str | None = None) -> NoReturn:
    """Leave without interpreter teardown.

    Once the Temporal SDK's native runtime has started, the interpreter can abort in its
    teardown (PyGILState_Release; a known SDK issue), turning a clean exit into SIGABRT.
    """
    if message:
        print(message, file=sys.stderr)
    tracing.shutdown()  # the spans still buffered (no atexit handler runs after os._exit)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
