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
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

import httpx

from tests.helpers import SPAWNED, stop_spawned
from tests.reliability.faults import Cluster, ledger_rows
from tests.reliability.ledger import Fault, Report, recovery
from tests.reliability.load import Call, Load, plan


@dataclass
class Options:
    requests: int = 1000
    rate: float | None = 10.0
    short: bool = False
    soak_s: float = 0.0
    seed: int = 25
    tmp: Path | None = None


def schedule(cluster: Cluster, short: bool) -> list[tuple[str, Callable[[], Awaitable[None]]]]:
    """The faults, in order; the short run keeps every kind, with shorter outages."""
    down = 2.0 if short else 3.0
    receiver_s = 8.0 if short else 30.0
    http_agent = 0  # rel-http-00
    grpc_agent = cluster.agents_per_protocol  # rel-grpc-00
    faults: list[tuple[str, Callable[[], Awaitable[None]]]] = [
        ("SIGKILL gateway 0 (restarted)", lambda: cluster.kill_gateway(0)),
        ("SIGKILL worker (restarted)", cluster.kill_worker),
        ("SIGKILL agent rel-grpc-00 (restarted)", lambda: cluster.kill_agent(grpc_agent)),
        ("SIGSTOP agent rel-http-00 (5 s)", lambda: cluster.stop_agent(http_agent, 5.0)),
        (f"callback receiver down {receiver_s:.0f} s", lambda: cluster.receiver_down(receiver_s)),
        (f"SIGKILL Redis ({down:.0f} s down)", lambda: cluster.kill_redis(down)),
        ("SIGKILL gateway 1 (restarted)", lambda: cluster.kill_gateway(1)),
        (f"SIGKILL Temporal ({down:.0f} s down, same db)", lambda: cluster.kill_temporal(down)),
    ]
    if not short:
        agent = 2 * cluster.agents_per_protocol + 1  # rel-websocket-01
        faults.insert(3, ("SIGKILL agent rel-websocket-01 (restarted)",
                          lambda: cluster.kill_agent(agent)))  # fmt: skip
        faults.insert(5, ("SIGKILL MCP server (restarted)", cluster.kill_mcp))
    return faults


async def inject(
    plan_: list[tuple[str, Callable[[], Awaitable[None]]]], start: float, spacing: float
) -> list[Fault]:
    done: list[Fault] = []
    for i, (name, act) in enumerate(plan_):
        await asyncio.sleep(max(0.0, start + (i + 1) * spacing - time.monotonic()))
        fault = Fault(name, time.monotonic())
        done.append(fault)
        print(f"  fault: {name}", flush=True)
        await act()
        fault.back = time.monotonic()
    return done


async def measure_max(cluster: Cluster, load: Load, seconds: float = 15.0) -> float:
    """Sync reads, closed loop, 16 at a time, for `seconds`: the successes a second."""
    calls = [c for c in plan(4000, seed=7) if c.op == "read"]
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
    mark = len(SPAWNED)  # stop only the processes this run starts (a pytest session has more)
    print(f"reliability: starting the stack in {tmp}", flush=True)
    began = time.monotonic()
    try:
        await cluster.start()
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
        calls: list[Call] = plan(count, opts.seed)
        faults = schedule(cluster, opts.short)
        duration = count / rate
        if opts.soak_s:  # the faults again and again, one every ~20 s
            faults = faults * max(1, int(duration / (20 * len(faults))))
        spacing = duration / (len(faults) + 2)  # the last leaves load after it
        print(f"  {count} requests at {rate:.1f}/s, {len(faults)} faults", flush=True)
        start = time.monotonic()
        until = start + opts.soak_s if opts.soak_s else None
        _, injected = await asyncio.gather(
            load.run(calls, rate, until=until), inject(faults, start, spacing)
        )
        calls = [c for c in calls if c.sent_at]  # a soak's time may end before its plan
        sent_s = time.monotonic() - start
        print(f"  sent {len(calls)} in {sent_s:.0f} s ({len(calls) / sent_s:.1f}/s)", flush=True)
        print("  drain", flush=True)
        await load.drain(calls, 90.0 if opts.short else 240.0)
        asyncs = {f"msg_{c.request_id}" for c in calls if c.mode == "async" and c.final}
        deadline = time.monotonic() + (30.0 if opts.short else 90.0)
        while time.monotonic() < deadline:
            if asyncs <= {w for w, _, _ in cluster.receiver.deliveries}:
                break
            await asyncio.sleep(0.5)
        runs = Counter(str(row["request_id"]) for row in ledger_rows(cluster))
        recovery(injected, load.successes, [t for _, _, t in cluster.receiver.deliveries])
        wall = time.monotonic() - began
        report = Report(calls, runs, cluster.receiver.deliveries, injected, wall, load.seen)
        report.check()
    finally:
        await cluster.stop()
        stop_spawned(mark)
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
        opts.requests, opts.rate = min(a.requests, 150), a.rate or 5.0
    elif a.soak:
        opts.soak_s = a.duration
    elif opts.rate is None:
        opts.rate = 10.0
    sys.exit(asyncio.run(run(opts)))


if __name__ == "__main__":
    main()
