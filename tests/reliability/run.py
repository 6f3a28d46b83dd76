"""`make reliability` (full), the short run in `make test`, and `make soak`.

    python -m tests.reliability.run                      # 1,000 requests, every fault
    python -m tests.reliability.run --short              # ~150 requests, shorter faults
    python -m tests.reliability.run --soak [--rate R]    # 10 min at 80% of the measured max

Prints the Markdown table and exits 1 if an invariant is broken (the violations are listed
under it, and the processes' logs are kept in --tmp).
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import time
import uuid
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

import httpx

from tests.helpers import SPAWNED, stop_spawned
from tests.reliability.faults import Cluster, ledger_rows
from tests.reliability.ledger import Fault, Report, brief, recovery
from tests.reliability.load import CALLER, Call, Load, plan


@dataclass
class Options:
    requests: int = 1000
    rate: float | None = 10.0
    short: bool = False
    soak_s: float = 0.0
    seed: int = 25
    tmp: Path | None = None


Act = Callable[[], Awaitable[None]]
Step = list[tuple[str, Act]]  # faults done together (staggered), each until what it broke is back


def schedule(cluster: Cluster, load: Load, short: bool) -> tuple[list[Step], Following | None]:
    """The faults, in steps. The full run does one at a time, spread over the load. The short
    run does every kind once, with short outages, in two steps: Redis and Temporal (never
    while a gateway starts); then the processes that have a peer (a gateway, the worker, an
    agent) with the agent SIGSTOP and the callback receiver down, all together (the requests
    that Temporal's restart held up end while the gateway restarts)."""
    grpc, http = "rel-grpc-00", "rel-http-00"
    if short:
        return [
            [
                ("SIGKILL Redis (1 s down)", lambda: cluster.kill_redis(1.0)),
                ("SIGKILL Temporal (1 s down, same db)", lambda: cluster.kill_temporal(1.0)),
            ],
            [
                ("SIGKILL gateway 0 (restarted)", lambda: cluster.kill_gateway(0)),
                ("SIGKILL worker (restarted)", cluster.kill_worker),
                (f"SIGKILL agent {grpc} (restarted)", lambda: cluster.kill_agent(grpc)),
                (f"SIGSTOP agent {http} (4 s)", lambda: cluster.stop_agent(http, 4.0)),
                ("callback receiver down 4 s", lambda: cluster.receiver_down(4.0)),
            ],
        ], None  # fmt: skip
    following = Following(cluster, load)
    faults: list[tuple[str, Act]] = [
        ("SIGKILL gateway 0 (restarted)", lambda: cluster.kill_gateway(0)),
        ("SIGKILL worker (restarted)", cluster.kill_worker),
        ("SIGKILL agent rel-grpc-00 (restarted)", lambda: cluster.kill_agent("rel-grpc-00")),
        ("SIGKILL agent rel-websocket-01 (restarted)",
         lambda: cluster.kill_agent("rel-websocket-01")),
        ("SIGSTOP agent rel-http-00 (8 s)", lambda: cluster.stop_agent("rel-http-00", 8.0)),
        ("SIGKILL MCP server (restarted)", cluster.kill_mcp),
        ("SIGKILL A2A agent (restarted, its tasks forgotten)", cluster.kill_a2a),
        ("SIGKILL gateway 0 while an A2A task is followed", following.kill_gateway),
        ("callback receiver down 30 s", lambda: cluster.receiver_down(30.0)),
        ("SIGKILL Redis (3 s down)", lambda: cluster.kill_redis(3.0)),
        ("SIGKILL gateway 1 (restarted)", lambda: cluster.kill_gateway(1)),
        ("SIGKILL Temporal (3 s down, same db)", lambda: cluster.kill_temporal(3.0)),
    ]  # fmt: skip
    return [[fault] for fault in faults], following


class Following:
    """A sync keyless A2A write whose task works 4 s, sent to gateway 0; once the agent has it
    and the request follows the task (the timeline shows its `follow_task` look), gateway 0 is
    SIGKILLed. The client repeats on gateway 1 (same RequestID): the request must succeed, the
    agent's ledger showing one execution (the task's id is in the history: never sent again)."""

    def __init__(self, cluster: Cluster, load: Load) -> None:
        self.cluster = cluster
        self.load = load
        self.calls: list[Call] = []
        self.sends: list[asyncio.Task[None]] = []
        self.seen_following: list[bool] = []

    async def kill_gateway(self) -> None:
        n = 90_000 + len(self.calls)
        call = Call(n, f"rel-follow-{n}-{uuid.uuid4().hex[:8]}", "a2a", "write", "sync", None, 4000)
        self.calls.append(call)
        http = httpx.AsyncClient(trust_env=False)

        async def send() -> None:
            async with http:
                await self.load.send(http, call, first=0)

        self.sends.append(asyncio.create_task(send()))
        self.seen_following.append(await self._followed(call.request_id, 30.0))
        await self.cluster.kill_gateway(0)

    async def _followed(self, request_id: str, timeout_s: float) -> bool:
        """Until the ledger has the message and the timeline a look at its task; False when
        the time is up first (the kill goes ahead, and the report says so)."""
        url = f"{self.cluster.gateways[1].url}/reach/requests/{request_id}/timeline"
        deadline = time.monotonic() + timeout_s
        async with httpx.AsyncClient(trust_env=False, timeout=5) as http:
            while time.monotonic() < deadline:
                ran = any(r["request_id"] == request_id for r in ledger_rows(self.cluster))
                if ran:
                    try:
                        r = await http.get(url, headers={"X-Reach-Caller": CALLER})
                        if "follow" in r.text:
                            return True
                    except httpx.HTTPError:
                        pass
                await asyncio.sleep(0.1)
        return False

    def notes(self, runs: Counter[str]) -> list[str]:
        return [
            f"A2A task followed across gateway 0's SIGKILL ({c.request_id}, killed "
            f"{'while following' if seen else 'before the follow was seen'}): read back "
            f"{brief(c.final)}; the agent ran it {runs[c.request_id]}x"
            for c, seen in zip(self.calls, self.seen_following, strict=False)
        ]


async def inject(steps: list[Step], start: float, spacing: float, stagger: float) -> list[Fault]:
    """Step i at `start + (i + 1) * spacing` at the earliest, and not before the step before it
    is back; the faults of one step `stagger` seconds apart."""
    done: list[Fault] = []

    async def one(name: str, act: Act, after: float) -> None:
        await asyncio.sleep(after)
        fault = Fault(name, time.monotonic())
        done.append(fault)
        print(f"  fault: {name}", flush=True)
        await act()
        fault.back = time.monotonic()

    for i, step in enumerate(steps):
        await asyncio.sleep(max(0.0, start + (i + 1) * spacing - time.monotonic()))
        await asyncio.gather(*(one(n, a, j * stagger) for j, (n, a) in enumerate(step)))
    return done


async def measure_max(cluster: Cluster, load: Load, seconds: float = 15.0) -> float:
    """Sync reads, closed loop, 16 at a time, for `seconds`: the successes a second."""
    calls = [c for c in plan(4000, 7, cluster.protocols) if c.op == "read"]
    for c in calls:
        c.mode, c.delay_ms = "sync", 20  # Reach's rate, not the slow calls'
        c.request_id = "max-" + c.request_id
    it = iter(calls)
    ok = 0
    stop = time.monotonic() + seconds
    async with httpx.AsyncClient(trust_env=False) as http:

        async def loop() -> None:
            nonlocal ok
            for call in it:
                if time.monotonic() > stop:
                    return
                await load.send(http, call)
                ok += bool(call.answer and call.answer.get("status") == "success")

        await asyncio.gather(*(loop() for _ in range(16)))
    return ok / seconds


async def run(opts: Options) -> int:
    tmp = opts.tmp or Path(tempfile.mkdtemp(prefix="reach-reliability-"))
    cluster = Cluster(tmp)
    if opts.short:  # two instances only where a fault takes one away; MCP, not A2A
        cluster.per_protocol = {"http": 2, "grpc": 2, "websocket": 1, "mqtt": 1}
        cluster.alone, cluster.with_a2a = ("rel-grpc-00", "rel-http-00"), False
    mark = len(SPAWNED)  # stop only the processes this run starts (a pytest session has more)
    print(f"reliability: starting the stack in {tmp}", flush=True)
    began = time.monotonic()
    phases: dict[str, float] = {}
    try:
        await cluster.start()
        phases["start"] = time.monotonic() - began
        ports = cluster.gateway_ports
        load = Load(lambda: [f"http://127.0.0.1:{p}" for p in ports], cluster.receiver.url)
        if opts.short:
            load.timeout_ms, load.give_up_s = 60_000, 90.0  # a busy box: no deadline
        rate = opts.rate
        if rate is None:
            top = await measure_max(cluster, load)
            load.seen.clear()
            load.successes.clear()
            rate = max(1.0, 0.8 * top)
            print(f"  measured max {top:.1f} req/s (sync reads, 16 at a time); at {rate:.1f}")
        count = int(rate * opts.soak_s) if opts.soak_s else opts.requests
        calls: list[Call] = plan(count, opts.seed, cluster.protocols)
        steps, following = schedule(cluster, load, opts.short)
        duration = count / rate
        if opts.soak_s:  # the faults again and again, one every ~20 s
            steps = steps * max(1, int(duration / (20 * len(steps))))
        # The short run: its faults as soon as each step is back, its load until the last is
        # back and a little after (the plan is only a cap); the others: spread over the plan.
        spacing = 1.0 if opts.short else duration / (len(steps) + 2)
        enough = asyncio.Event() if opts.short else None
        print(f"  up to {count} requests at {rate:.1f}/s, {len(steps)} fault steps", flush=True)
        start = time.monotonic()
        until = start + opts.soak_s if opts.soak_s else None

        async def faults() -> list[Fault]:
            done = await inject(steps, start, spacing, stagger=0.5)
            if enough is not None:
                await asyncio.sleep(1.0)  # sync requests after the last fault: its recovery
                enough.set()
            return done

        _, injected = await asyncio.gather(
            load.run(calls, rate, until=until, enough=enough), faults()
        )
        extra = following.calls if following is not None else []
        await asyncio.gather(*(following.sends if following is not None else []))
        calls = [c for c in calls + extra if c.sent_at]  # a soak's time may end before its plan
        sent_s = time.monotonic() - start
        phases["load"] = sent_s
        print(f"  sent {len(calls)} in {sent_s:.0f} s ({len(calls) / sent_s:.1f}/s)", flush=True)
        print("  drain", flush=True)
        mark_drain = time.monotonic()
        await load.drain(calls, 90.0 if opts.short else 240.0)
        asyncs = {f"msg_{c.request_id}" for c in calls if c.mode == "async" and c.final}
        deadline = time.monotonic() + (30.0 if opts.short else 90.0)
        while time.monotonic() < deadline:
            if asyncs <= {w for w, _, _ in cluster.receiver.deliveries}:
                break
            await asyncio.sleep(0.2)
        phases["drain"] = time.monotonic() - mark_drain
        runs = Counter(str(row["request_id"]) for row in ledger_rows(cluster))
        recovery(injected, load.successes, [t for _, _, t in cluster.receiver.deliveries])
        wall = time.monotonic() - began
        report = Report(calls, runs, cluster.receiver.deliveries, injected, wall, load.seen)
        report.check()
        if following is not None:
            report.notes += following.notes(runs)
        slow = sorted((c for c in calls if c.done_at), key=lambda c: c.sent_at - (c.done_at or 0))
        report.notes.append(
            "slowest sync answers (s from the first send): "
            + ", ".join(f"{c.request_id} {(c.done_at or 0) - c.sent_at:.1f}" for c in slow[:4])
        )
        cpu = cluster.cpu()
        report.notes.append(
            "CPU seconds of the processes at the end: "
            + ", ".join(f"{k} {v:.1f}" for k, v in cpu.items())
        )
    finally:
        mark_stop = time.monotonic()
        await cluster.stop()
        stop_spawned(mark)
        phases["stop"] = time.monotonic() - mark_stop
    report.notes.append(
        "phases (s): " + ", ".join(f"{k} {v:.1f}" for k, v in phases.items())
        + " (start: " + ", ".join(f"{k} {v:.1f}" for k, v in cluster.phases.items()) + ")"
    )  # fmt: skip
    table = report.table()
    print(table)
    (tmp / "report.md").write_text(table + "\n")
    everything = ["# broken invariants", *report.violations, "# not succeeded"]
    (tmp / "verdicts.txt").write_text("\n".join(everything + report.not_succeeded) + "\n")
    if report.violations:
        print(f"\n{len(report.violations)} invariant(s) broken (all: {tmp}/verdicts.txt):")
        for v in report.violations[:50]:
            print(f"- {v}")
        return 1
    print(f"\nall invariants hold (logs in {tmp})")
    return 0


def main() -> None:
    p = argparse.ArgumentParser(description="Reach's fault-injection suite (issue 25)")
    p.add_argument("--requests", type=int, default=1000)
    p.add_argument("--rate", type=float, default=None, help="requests a second")
    p.add_argument("--short", action="store_true", help="the short run make test does")
    p.add_argument("--soak", action="store_true", help="10 minutes at 80%% of the measured max")
    p.add_argument("--duration", type=float, default=600.0, help="the soak's seconds")
    p.add_argument("--seed", type=int, default=25)
    p.add_argument("--tmp", type=Path, default=None, help="where logs and ledgers go")
    a = p.parse_args()
    opts = Options(requests=a.requests, rate=a.rate, seed=a.seed, tmp=a.tmp, short=a.short)
    if a.short:
        opts.requests, opts.rate = min(a.requests, 200), a.rate or 10.0
    elif a.soak:
        opts.soak_s = a.duration
    elif opts.rate is None:
        opts.rate = 10.0
    sys.exit(asyncio.run(run(opts)))


if __name__ == "__main__":
    main()
