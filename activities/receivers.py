"""A bulkhead for callback receivers: at most `PER_RECEIVER` callback POSTs in flight from one
worker to one receiver host, and at most `AT_ONCE` in all.

A POST holds one of the worker's activity slots (and one of the callback client's connections)
for as long as the receiver keeps it open, up to `callback.attempt_timeout_s`, and those are
shared with every other caller's callbacks and with task following. A receiver that accepts and
never answers, given enough callbacks, held them all: another caller's callback to a healthy
receiver waited 24.5 s behind 120 such POSTs (attempt timeout 30 s), and the wait grows with the
backlog. Past the bound an attempt is not sent: it fails at once, retryable, and is tried again
on the delivery's backoff, so the slot goes back to everyone else.

Hung receivers on many hosts could still hold every slot: with 16 on each of 8 hosts, a sync
call to an A2A agent whose task Reach follows (a regular activity on the same worker) ended 504
at its 10 s deadline, never followed. `AT_ONCE` keeps a part of the slots for everything else.

The host is the URL's as written (a name or an IP literal), without its port: one host's ports
are one receiver. Names that resolve to the same address count apart, so one caller's hung
receivers on a few names (a wildcard DNS name has any number) still took all `AT_ONCE`: another
caller's callback then waited 28 s (attempt timeout 30 s), refused busy. `PER_CALLER` keeps
the other half for other callers (by the request's caller: its token's principal, or the
X-Reach-Caller it named when tokens are off).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from urllib.parse import urlsplit

from temporalio import activity
from temporalio.exceptions import ApplicationError

from reach.security.redact import safe_url

# A quarter of a worker's activity slots (the SDK's default is 100), and far more than a fast
# receiver needs: 16 POSTs of 10 ms each deliver 1,600 callbacks a second.
PER_RECEIVER = 16
# Of the worker's 100 activity slots (the SDK's default; Reach sets no other), those callback
# POSTs may hold at once: the rest are task following's and cancels'.
AT_ONCE = 64
# Of those, what one caller's callbacks may hold at once.
PER_CALLER = AT_ONCE // 2


def receiver_of(url: str) -> str:
    """The receiver a callback URL names: its host, lowercased ("" when it has none)."""
    try:
        return (urlsplit(url).hostname or "").lower()
    except ValueError:
        return ""


class ReceiverSlots:
    """The callback POSTs in flight from this worker, counted per receiver host."""

    def __init__(
        self, per_receiver: int = PER_RECEIVER, at_once: int = AT_ONCE, per_caller: int = PER_CALLER
    ) -> None:
        self.per_receiver = per_receiver
        self.at_once = at_once
        self.per_caller = per_caller
        self._in_flight: dict[str, int] = {}
        self._by_caller: dict[str, int] = {}
        self._total = 0

    def in_flight(self, url: str) -> int:
        return self._in_flight.get(receiver_of(url), 0)

    @contextlib.contextmanager
    def taken(self, url: str, caller: str | None = None) -> Iterator[None]:
        """Hold one of the receiver's slots while the POST runs; when all are held (its own,
        its caller's or the worker's), a retryable `callback_busy` failure (nothing was sent)."""
        host, who = receiver_of(url), caller or ""
        held, mine = self._in_flight.get(host, 0), self._by_caller.get(who, 0)
        if held >= self.per_receiver:
            busy = f"{held} POSTs to {host} are already in flight from this worker"
        elif mine >= self.per_caller:
            busy = f"{mine} POSTs of this caller's callbacks are already in flight"
        elif self._total >= self.at_once:
            busy = f"{self._total} callback POSTs are already in flight from this worker"
        else:
            busy = None
        if busy is not None:
            raise ApplicationError(
                f"callback {safe_url(url)} not sent: {busy} (receivers slow to answer); "
                "tried again",
                {"attempt": activity.info().attempt},
                type="callback_busy",
            )
        self._in_flight[host] = held + 1
        self._by_caller[who] = mine + 1
        self._total += 1
        try:
            yield
        finally:
            self._total -= 1
            _less(self._in_flight, host)
            _less(self._by_caller, who)


def _less(counts: dict[str, int], key: str) -> None:
    left = counts[key] - 1
    if left:
        counts[key] = left
    else:
        del counts[key]
