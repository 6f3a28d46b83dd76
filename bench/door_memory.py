"""What invokes in flight cost the gateway in memory, and what the door's admission bound holds.

    python bench/door_memory.py                       # bound off, then 32 MiB (the default)
    python bench/door_memory.py --sizes 1048576 --concurrency 50 --bounds 0 8388608
    python bench/door_memory.py --bounds              # the gateway's own default (old code)

One Temporal dev server; for each `--bounds` value (transport.max_inflight_bytes, 0: none) a
fresh gateway (`reach gateway`, memory registry, invoke worker inside, unsandboxed as production
runs it) and a knowledge-retriever agent, all on loopback. For each body size and concurrency,
`--rounds` bursts of that many synchronous invokes at once (a payload of words of about that
size); the gateway's resident memory is sampled every 10 ms from /proc/<pid>/status. Columns:

  base RSS    the gateway's RSS before the burst (after a smaller burst of the same size)
  peak RSS    the highest sample during the bursts
  per MiB     (peak - base) / MiB of request bodies in flight at once (admitted ones only)
  ok / 503    answered 200 / refused 503 unavailable (past transport.max_inflight_bytes)

Then the small-invoke hot path per gateway: p50 and p95 of `--small` sequential 1 KiB invokes,
which the admission step must not move. Prints Markdown tables.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from gateway_api.devserver import DevServer, free_port  # noqa: E402

MIB = 1024 * 1024
WORDS = ["durable", "retries", "route", "capability", "instance", "gateway", "temporal", "beat"]


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


class Sampler:
    """The highest RSS of `pid` seen while running, sampled on a thread every 10 ms."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, rss_bytes(self.pid))
            self._stop.wait(0.01)

    def __enter__(self) -> Sampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, rss_bytes(self.pid))


def body_of(size: int) -> bytes:
    """An invoke whose body is about `size` bytes: a text of words (the agent ranks it)."""
    words, n, i = [], 0, 0
    target = max(0, size - 160)
    while n < target:
        word = WORDS[i % len(WORDS)]
        words.append(word)
        n += len(word) + 1
        i += 1
    request = {
        "target": "bench-mem",
        "operation": "query",
        "payload": {"text": " ".join(words), "top_k": 1},
        "timeout_ms": 60_000,
    }
    return json.dumps(request, separators=(",", ":")).encode()


def spawn(args: list[str], env: dict[str, str], log: Path) -> subprocess.Popen[bytes]:
    with log.open("ab") as out:
        return subprocess.Popen(args, env=env, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT)


async def wait_ready(url: str, capability: str, timeout_s: float = 90) -> None:
    deadline = time.monotonic() + timeout_s
    async with httpx.AsyncClient(trust_env=False) as client:
        while time.monotonic() < deadline:
            try:
                r = await client.get(f"{url}/reach/capabilities", timeout=1)
                names = {c["name"]: c["routable"] for c in r.json()["capabilities"]}
                if names.get(capability, 0) >= 1:
                    return
            except (httpx.HTTPError, ValueError, KeyError):
                pass
            await asyncio.sleep(0.2)
    raise TimeoutError(f"{url}: {capability} never routable")


async def burst(client: httpx.AsyncClient, url: str, body: bytes, n: int) -> tuple[int, int, int]:
    """n invokes at once: (ok, refused 503, other)."""

    async def one() -> int:
        r = await client.post(
            f"{url}/reach/invoke", content=body, headers={"content-type": "application/json"}
        )
        return r.status_code

    codes = await asyncio.gather(*(one() for _ in range(n)))
    ok = sum(c == 200 for c in codes)
    refused = sum(c == 503 for c in codes)
    return ok, refused, len(codes) - ok - refused


async def small_latency(client: httpx.AsyncClient, url: str, calls: int) -> tuple[float, float]:
    body = body_of(1024)
    samples = []
    for _ in range(calls):
        start = time.perf_counter()
        r = await client.post(
            f"{url}/reach/invoke", content=body, headers={"content-type": "application/json"}
        )
        samples.append((time.perf_counter() - start) * 1000)
        assert r.status_code == 200, r.text
    samples.sort()
    return statistics.median(samples), samples[int(0.95 * (len(samples) - 1))]


@dataclass
class Row:
    bound: str
    concurrency: int
    body: int
    base: int
    peak: int
    per_mib: float
    ok: int
    refused: int
    other: int


async def measure(
    args: argparse.Namespace, env: dict[str, str], tmp: Path, bound: int | None
) -> tuple[list[Row], float, float]:
    """One fresh gateway (and agent) with `bound` as transport.max_inflight_bytes (None: the
    gateway's default; omit on code without the setting): its rows and small-invoke p50, p95."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    env = dict(env, REACH_LISTEN_PORT=str(port))
    env["REACH_TEMPORAL__TASK_QUEUE"] = f"bench-mem-{uuid.uuid4().hex[:6]}"
    label = "default" if bound is None else ("off" if bound == 0 else f"{bound / MIB:g} MiB")
    if bound is not None:
        env["REACH_TRANSPORT__MAX_INFLIGHT_BYTES"] = str(bound)
    procs: list[subprocess.Popen[bytes]] = []
    try:
        gateway = spawn(
            [sys.executable, "-m", "gateway_api", "gateway"], env, tmp / f"gw-{port}.log"
        )
        procs.append(gateway)
        agent_cmd = [
            sys.executable,
            str(ROOT / "examples/knowledge_retriever.py"),
            "--reach",
            url,
            "--capability",
            "bench-mem",
            "--instance-id",
            f"bench-mem-{port}",
        ]
        procs.append(spawn(agent_cmd, env, tmp / f"agent-{port}.log"))
        await wait_ready(url, "bench-mem")
        limits = httpx.Limits(max_connections=max(args.concurrency) + 4)
        rows = []
        async with httpx.AsyncClient(trust_env=False, limits=limits, timeout=120) as client:
            await burst(client, url, body_of(1024), 8)  # warm-up: imports, caches, pools
            p50, p95 = await small_latency(client, url, args.small)
            for size in args.sizes:
                body = body_of(size)
                for n in args.concurrency:
                    await burst(client, url, body, min(n, 4))
                    base = rss_bytes(gateway.pid)
                    ok = refused = other = most_admitted = 0
                    with Sampler(gateway.pid) as sampler:
                        for _ in range(args.rounds):
                            a, b, c = await burst(client, url, body, n)
                            ok, refused, other = ok + a, refused + b, other + c
                            most_admitted = max(most_admitted, a)
                    # Admitted at once: at most the bound's worth (ok counts later rounds too).
                    at_once = min(most_admitted, n)
                    if bound:
                        at_once = min(at_once, max(1, bound // len(body)))
                    inflight_mib = at_once * len(body) / MIB
                    per = (sampler.peak - base) / MIB / inflight_mib if inflight_mib else 0.0
                    rows.append(
                        Row(label, n, len(body), base, sampler.peak, per, ok, refused, other)
                    )
        return rows, p50, p95
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()


async def main(args: argparse.Namespace) -> None:
    tmp = Path(tempfile.mkdtemp(prefix="reach-bench-mem-"))
    server = DevServer(str(tmp / "temporal.db"), free_port(), None, log_file=tmp / "temporal.log")
    server.start()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("REACH_", "TEMPORAL_"))}
    env.update(
        TEMPORAL_ADDRESS=server.address,
        REACH_TRANSPORT__PORTS__GRPC="-1",
        REACH_CONFIG=str(ROOT / "reach.yaml"),
        REACH_AUTH__TOKENS_FILE=str(tmp / "tokens.json"),
        REACH_AUDIT__FILE=str(tmp / "audit.jsonl"),
    )
    bounds: list[int | None] = list(args.bounds) or [None]
    rows: list[Row] = []
    hot: list[tuple[str, float, float]] = []
    try:
        for bound in bounds:
            found, p50, p95 = await measure(args, env, tmp, bound)
            rows += found
            hot.append((found[0].bound if found else str(bound), p50, p95))
    finally:
        server.stop()
    print(
        "\n| max_inflight_bytes | concurrency | body | base RSS | peak RSS | per MiB | ok | 503 |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(
            f"| {r.bound} | {r.concurrency} | {r.body / 1024:.0f} KiB | {r.base / MIB:.0f} MiB "
            f"| {r.peak / MIB:.0f} MiB | {r.per_mib:.1f} | {r.ok} | {r.refused} |"
            + (f" ({r.other} other)" if r.other else "")
        )
    print(f"\n| max_inflight_bytes | small invoke p50 | p95 |  ({args.small} sequential, 1 KiB)")
    print("|---|---:|---:|")
    for label, p50, p95 in hot:
        print(f"| {label} | {p50:.2f} ms | {p95:.2f} ms |")


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[64 * 1024, MIB - 4096])
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 10, 50])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--small", type=int, default=300, help="sequential 1 KiB invokes")
    parser.add_argument(
        "--bounds",
        type=int,
        nargs="*",
        default=[0, 32 * MIB],
        help="transport.max_inflight_bytes of each gateway measured in turn (0: no bound); "
        "--bounds with no value: the gateway's default, for code without the setting",
    )
    return parser.parse_args(argv)


if __name__ == "__main__":
    asyncio.run(main(parse()))
