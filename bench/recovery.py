"""How long a request waits after the gateway running it is SIGKILLed, per engine setting.

One Temporal dev server; per setting, a gateway without a worker (where the agent joins), a
`worker.py` (the survivor) and an agent; per round a gateway with the invoke worker (eager start
runs the request there) that is SIGKILLed mid-request. Two cases:

- `mid-call`: killed while its first workflow task runs the call (a local activity): the task
  has to time out (`temporal.workflow_task_timeout_s`) before the survivor takes it;
- `sticky`: killed while the request waits for the agent's late answer (202): the answer's
  workflow task is scheduled on the dead worker's sticky queue and waits there
  (`temporal.sticky_schedule_to_start_s`) before the survivor may take it.

Recovery is the time from the SIGKILL to the callback, less what the agent itself still had to
do (the rest of its `--delay-ms`). `python bench/recovery.py [--rounds 3] [--json out.json]`;
docs/operations.md (Recovery after a SIGKILL) holds the figures.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from gateway_api.devserver import DevServer, free_port  # noqa: E402
from tests.helpers import (  # noqa: E402
    Agent,
    CallbackReceiver,
    GatewayProcess,
    Stack,
    Worker,
    stop_spawned,
    wait_until,
)

DELAY_MS = 300  # the agent's own time per call
SETTINGS: dict[str, dict[str, str]] = {
    "task 10 s, sticky 10 s (SDK defaults)": {"task": "10", "sticky": "10"},
    "task 2 s, sticky 10 s": {"task": "2", "sticky": "10"},
    "task 10 s, sticky 1 s": {"task": "10", "sticky": "1"},
    "task 2 s, sticky 1 s": {"task": "2", "sticky": "1"},
    "task 1 s, sticky 1 s": {"task": "1", "sticky": "1"},
    "task 2 s, sticky 2 s (Reach's defaults)": {"task": "2", "sticky": "2"},
}


async def one_round(
    http: httpx.AsyncClient, stack: Stack, case: str, ledger: Path, receiver: CallbackReceiver
) -> float:
    doomed = await GatewayProcess(stack, f"doomed-{uuid.uuid4().hex[:6]}").ready()
    rid = f"req-{uuid.uuid4().hex}"
    before = len(receiver.received)
    r = await http.post(
        f"{doomed.url}/reach/invoke",
        json={
            "request_id": rid,
            "target": f"rec-{case}",
            "operation": "query",
            "payload": {"text": "survive"},
            "timeout_ms": 60_000,
            "callback": receiver.url,
        },
    )
    assert r.status_code == 202, r.text

    def called() -> bool:
        return ledger.exists() and rid in ledger.read_text()

    await wait_until(called, 20, every_s=0.005)
    called_at = time.monotonic()
    if case == "sticky":
        # The first workflow task has completed once the call was answered 202.
        async def waiting() -> bool:
            got = await http.get(f"{doomed.url}/reach/requests/{rid}")
            return got.status_code == 200 and got.json().get("status") == "running"

        await wait_until(waiting, 10, every_s=0.01)
    killed_at = time.monotonic()
    doomed.proc.kill()
    await receiver.wait(before + 1, timeout_s=60)
    done_at = time.monotonic()
    agent_left = max(0.0, called_at + DELAY_MS / 1000 - killed_at)
    return done_at - killed_at - agent_left


async def measure(
    server: str, tmp: Path, name: str, s: dict[str, str], rounds: int
) -> dict[str, object]:
    extra = {
        "REACH_TEMPORAL__WORKFLOW_TASK_TIMEOUT_S": s["task"],
        "REACH_TEMPORAL__STICKY_SCHEDULE_TO_START_S": s["sticky"],
        "REACH_TEMPORAL__WORKFLOW_SANDBOX": "false",
    }
    out: dict[str, list[float]] = {}
    async with httpx.AsyncClient(trust_env=False, timeout=30) as http:
        for case in ("mid-call", "sticky"):
            stack = Stack(
                temporal=server,
                tmp=Path(tempfile.mkdtemp(dir=tmp)),
                task_queue=f"tq-{uuid.uuid4().hex[:12]}",
                registry="redis",
                key_prefix=f"bench-{uuid.uuid4().hex[:8]}",
                heartbeat_timeout=30.0,
                extra=extra,
            )
            api = GatewayProcess(stack, "api", worker=False)
            survivor = Worker(stack)
            await asyncio.gather(api.ready(), survivor.ready())
            ledger = stack.tmp / "ledger.txt"
            flags = ["--delay-ms", str(DELAY_MS), "--ledger", str(ledger)]
            if case == "sticky":
                flags.append("--defer")
            await Agent(api, f"rec-{case}-01", f"rec-{case}", *flags).ready()
            async with CallbackReceiver() as receiver:
                out[case] = [
                    await one_round(http, stack, case, ledger, receiver) for _ in range(rounds)
                ]
            stop_spawned(0)
    row: dict[str, object] = {"setting": name, **out}
    print(
        f"{name:40s}"
        + "".join(
            f"  {case}: median {statistics.median(v):5.2f} s (max {max(v):5.2f})"
            for case, v in out.items()
        ),
        flush=True,
    )
    return row


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--only", help="run only the settings whose name contains this")
    parser.add_argument("--json", type=Path, help="write the figures here")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmpdir:
        tmp = Path(tmpdir)
        server = DevServer(str(tmp / "t.db"), free_port(), None, log_file=tmp / "server.log")
        server.start()
        try:
            rows = [
                await measure(server.address, tmp, name, s, args.rounds)
                for name, s in SETTINGS.items()
                if not args.only or args.only in name
            ]
        finally:
            stop_spawned(0)
            server.stop()
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    asyncio.run(main())
