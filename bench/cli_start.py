"""How long the `reach` command line takes to start: wall time of whole commands, each run in a
fresh process, the way a person runs them (issue 26: the goal is at most 0.3 s for `reach
--help`, `reach agents` and `reach trace`).

    make bench-cli                                  # or: python bench/cli_start.py [--runs 20]
    git worktree add /tmp/cli-before <commit>       # then, to compare with that code:
    python bench/cli_start.py --before /tmp/cli-before

Commands (the `reach` console script of this venv; `python -m gateway_api` for the first):

  python -c pass               the interpreter alone (with this venv's site): the floor
  python -m gateway_api --help
  reach agents --help
  reach trace --help
  reach agents                 the configured gateway (reach.yaml, REACH_LISTEN_PORT) on a port
                               where nothing listens: it must fail with its usual error, exit 3
  reach trace REQUEST_ID       the same, through --gateway

Each tree's code is what PYTHONPATH names (this checkout, and `--before`'s), run from an empty
directory so neither finds the other; the runs alternate between trees and commands, so that a
change in the machine's load falls on both. One warm-up run each first (bytecode, page cache).
Prints a Markdown table: median and p90 per command, and the load average, since on a shared
machine every number moves with it.
"""

from __future__ import annotations

import argparse
import math
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
GOAL_S = 0.3
UNREACHABLE = "error: cannot reach the gateway at"


@dataclass
class Command:
    name: str
    argv: list[str]
    code: int = 0  # the exit code every run must end with
    stderr: str = ""  # and a text its stderr must hold
    env: dict[str, str] = field(default_factory=dict)
    floor: bool = False  # a reference row, not a command of the CLI


def dead_port() -> int:
    """A port where nothing listens (bound and closed again: free a moment later)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def commands() -> list[Command]:
    python = sys.executable
    script = Path(python).with_name("reach")
    reach = [str(script)] if script.is_file() else [python, "-m", "gateway_api"]
    port = dead_port()
    return [
        Command("python -c pass", [python, "-c", "pass"], floor=True),
        Command("python -m gateway_api --help", [python, "-m", "gateway_api", "--help"]),
        Command("reach agents --help", [*reach, "agents", "--help"]),
        Command("reach trace --help", [*reach, "trace", "--help"]),
        Command(
            "reach agents (nothing listens)",
            [*reach, "agents"],
            code=3,
            stderr=f"{UNREACHABLE} http://127.0.0.1:{port}: connection refused",
            env={"REACH_LISTEN_PORT": str(port)},
        ),
        Command(
            "reach trace ID (nothing listens)",
            [*reach, "trace", "req-bench", "--gateway", f"http://127.0.0.1:{port}"],
            code=3,
            stderr=UNREACHABLE,
        ),
    ]


def run_once(command: Command, tree: Path, cwd: str) -> float:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("REACH_", "TEMPORAL_"))}
    env.update(PYTHONPATH=str(tree), REACH_CONFIG=str(tree / "reach.yaml"), **command.env)
    started = time.perf_counter()
    done = subprocess.run(command.argv, env=env, cwd=cwd, capture_output=True, text=True)
    took = time.perf_counter() - started
    if done.returncode != command.code or command.stderr not in done.stderr:
        raise SystemExit(
            f"{command.name} ({tree}): exit {done.returncode}, wanted {command.code} and "
            f"{command.stderr!r} on stderr; stderr:\n{done.stderr}"
        )
    return took


def p90(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[max(0, math.ceil(0.9 * len(ordered)) - 1)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=15, help="runs per command and tree")
    parser.add_argument(
        "--before", type=Path, help="a checkout of earlier code to compare with (a worktree)"
    )
    args = parser.parse_args()
    trees = {"now": ROOT}
    if args.before:
        trees["before"] = args.before.resolve()
    cmds = commands()
    times: dict[tuple[str, str], list[float]] = {(c.name, t): [] for c in cmds for t in trees}
    load_start = os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as cwd:
        for command in cmds:
            for tree in trees.values():
                run_once(command, tree, cwd)  # warm-up
        for _ in range(args.runs):
            for command in cmds:
                for label, tree in trees.items():
                    times[command.name, label].append(run_once(command, tree, cwd))
    load_end = os.getloadavg()[0]

    head = "| command | median | p90 |"
    rule = "|---|---:|---:|"
    if "before" in trees:
        head += " before: median | before: p90 |"
        rule += "---:|---:|"
    print(
        f"\nCLI start-up, {args.runs} runs each in a fresh process (wall time; {os.cpu_count()} "
        f"cores, load average {load_start:.1f} at the start, {load_end:.1f} at the end)\n"
    )
    print(head + f" ≤ {GOAL_S} s |")
    print(rule + ":---:|")
    for command in cmds:
        now = times[command.name, "now"]
        row = f"| {command.name} | {statistics.median(now):.3f} s | {p90(now):.3f} s |"
        if "before" in trees:
            before = times[command.name, "before"]
            row += f" {statistics.median(before):.3f} s | {p90(before):.3f} s |"
        verdict = "" if command.floor else "yes" if statistics.median(now) <= GOAL_S else "no"
        print(f"{row} {verdict} |")
    print(
        "\nThe floor (`python -c pass`) is what any command pays before its first import; on a "
        "loaded machine both it and the rest grow, so compare the columns within one run."
    )


if __name__ == "__main__":
    main()
