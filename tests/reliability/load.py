"""The callers: mixed requests sent as a careful client sends them, then the drain.

A client repeats a request under the same RequestID (which attaches, never runs it twice) when
it has no answer: the connection failed, the gateway was unavailable (503) or refused for now
(429, 503 no_instance / circuit_open: Retry-After). Every verdict is read back from Reach
afterwards (`GET /reach/requests/{id}`), so the ledger is checked against what Reach reports.
"""

from __future__ import annotations

import asyncio
import itertools
import random
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import httpx

from tests.reliability.faults import PROTOCOLS

CALLER = "reliability"
FINAL = {"success", "error", "timeout", "canceled", "input_required"}


@dataclass
class Call:
    n: int
    request_id: str
    protocol: str
    op: str  # read (idempotent) or write (not)
    mode: str  # sync or async (with a callback)
    key: str | None  # idempotency_key, writes only
    delay_ms: int = 20  # how long the agent takes (after its ledger line)
    sent_at: float = 0.0
    accepted: bool = False  # Reach said it had it (200, 202, 504 running) or a read found it
    answer: dict[str, Any] | None = None  # the final envelope a sync call was answered
    final: dict[str, Any] | None = None  # the final envelope read back after the drain
    never_accepted: bool = False  # read back: Reach has no such request
    done_at: float | None = None  # when the client learnt the verdict
    repeats: int = 0

    @property
    def keyless_write(self) -> bool:
        return self.op == "write" and self.key is None


def plan(
    count: int, seed: int, protocols: Sequence[str] = (*PROTOCOLS, "mcp", "a2a"), start: int = 0
) -> list[Call]:
    """`count` calls: sync and async, reads, keyed and keyless writes, over `protocols`: the
    SDK ones in turn, and one in ten to each capability registered by URL (mcp, a2a)."""
    rng = random.Random(seed)
    kinds = [
        ("read", "sync", False, 30),
        ("write", "sync", False, 15),
        ("write", "sync", True, 10),
        ("read", "async", False, 15),
        ("write", "async", False, 15),
        ("write", "async", True, 15),
    ]
    weights = [w for *_, w in kinds]
    sdk = [p for p in protocols if p in PROTOCOLS]
    by_url = {9: "mcp", 4: "a2a"}  # n % 10
    calls = []
    for n in range(start, start + count):
        op, mode, keyed, _ = rng.choices(kinds, weights)[0]
        rid = f"rel-{seed}-{n:05d}-{rng.getrandbits(32):08x}"
        key = f"key-{rid}" if keyed else None
        delay = rng.choice((20, 20, 20, 300, 1500))  # some long enough for a fault mid-call
        protocol = sdk[n % len(sdk)]
        if by_url.get(n % 10) in protocols:
            protocol = by_url[n % 10]
        calls.append(Call(n, rid, protocol, op, mode, key, delay))
    return calls


@dataclass
class Load:
    urls: Callable[[], list[str]]  # the gateways now (a restarted one keeps its port)
    callback: str
    timeout_ms: int = 45_000
    give_up_s: float = 120.0  # a client stops repeating after this; the drain reads the rest
    successes: list[tuple[float, float]] = field(default_factory=list)  # (sent, done)
    seen: Counter[str] = field(default_factory=Counter)  # answers that made the client repeat
    _turn: itertools.count[int] = field(default_factory=itertools.count)

    def body(self, call: Call) -> dict[str, Any]:
        body: dict[str, Any] = {
            "request_id": call.request_id,
            "target": f"rel-{call.protocol}",
            "operation": call.op,
            "payload": {"n": call.n, "delay_ms": call.delay_ms},
            "timeout_ms": self.timeout_ms,
        }
        if call.mode == "async":
            body["callback"] = self.callback
        if call.key is not None:
            body["idempotency_key"] = call.key
        return body

    async def send(self, http: httpx.AsyncClient, call: Call, first: int | None = None) -> None:
        """Until Reach has it; `first`: the gateway tried first (else the next in turn)."""
        call.sent_at = time.monotonic()
        body = self.body(call)
        while time.monotonic() - call.sent_at < self.give_up_s:
            urls = self.urls()
            turn = next(self._turn) if first is None else first
            url, first = urls[turn % len(urls)], None
            try:
                r = await http.post(
                    f"{url}/reach/invoke",
                    json=body,
                    headers={"X-Reach-Caller": CALLER},
                    timeout=self.timeout_ms / 1000 + 20,
                )
            except httpx.HTTPError as e:
                self.seen[type(e).__name__] += 1
                call.repeats += 1
                await asyncio.sleep(0.3)
                continue
            envelope = r.json() if r.headers.get("content-type", "").startswith("app") else {}
            error = (envelope.get("error") or {}).get("type")
            if r.status_code in (429, 503) or (r.status_code == 500 and error == "internal"):
                self.seen[f"{r.status_code} {error}"] += 1
                call.repeats += 1
                await asyncio.sleep(min(2.0, float(r.headers.get("Retry-After", "0.5"))))
                continue
            if r.status_code == 202 or envelope.get("status") == "running":
                call.accepted = True
                return
            call.answer = envelope
            call.accepted = r.status_code < 400 or envelope.get("status") in FINAL
            call.done_at = time.monotonic()
            if envelope.get("status") == "success":
                self.successes.append((call.sent_at, call.done_at))
            return

    async def run(
        self,
        calls: list[Call],
        rate: float,
        concurrency: int = 48,
        until: float | None = None,
        enough: asyncio.Event | None = None,
    ) -> None:
        """Send `calls` at `rate` a second (open loop), at most `concurrency` in flight; none
        after `until` (monotonic: a soak is bounded in time, a busy stack sends fewer) or once
        `enough` is set (the short run: its faults are done and back)."""
        room = asyncio.Semaphore(concurrency)
        start = time.monotonic()
        limits = httpx.Limits(max_connections=concurrency * 2, max_keepalive_connections=8)
        async with httpx.AsyncClient(trust_env=False, limits=limits) as http:

            async def one(call: Call) -> None:
                try:
                    await self.send(http, call)
                finally:
                    room.release()

            tasks = []
            for i, call in enumerate(calls):
                await asyncio.sleep(max(0.0, start + i / rate - time.monotonic()))
                await room.acquire()
                late = until is not None and time.monotonic() > until
                if late or (enough is not None and enough.is_set()):
                    room.release()
                    break
                tasks.append(asyncio.create_task(one(call)))
            await asyncio.gather(*tasks)

    async def drain(self, calls: list[Call], deadline_s: float) -> None:
        """Read every request's verdict back until each is final or gone, or the time is up."""
        deadline = time.monotonic() + deadline_s
        pending = list(calls)
        async with httpx.AsyncClient(trust_env=False, timeout=10) as http:
            while pending and time.monotonic() < deadline:
                left = []
                for batch in range(0, len(pending), 32):
                    chunk = pending[batch : batch + 32]
                    done = await asyncio.gather(*(self._read(http, c) for c in chunk))
                    left += [c for c, ok in zip(chunk, done, strict=True) if not ok]
                pending = left
                if pending:
                    await asyncio.sleep(0.3)

    async def _read(self, http: httpx.AsyncClient, call: Call) -> bool:
        urls = self.urls()
        try:
            r = await http.get(
                f"{urls[call.n % len(urls)]}/reach/requests/{call.request_id}",
                headers={"X-Reach-Caller": CALLER},
            )
        except httpx.HTTPError:
            return False
        if r.status_code == 404 and (r.json().get("error") or {}).get("type") == "unknown_request":
            call.never_accepted = True
            return True
        if r.status_code >= 500 and r.json().get("status") not in FINAL:
            return False
        envelope = r.json()
        if envelope.get("status") in FINAL:
            call.final = envelope
            call.accepted = True
            return True
        call.accepted = call.accepted or envelope.get("status") in ("accepted", "running")
        return False
