"""The reliability suite's MCP server (the `mcp` package), registered by URL: its ledger records
every tool call as the SDK agents' do (tests/reliability/agent.py), one JSON line each.

    python -m tests.reliability.mcp_server --port PORT --instance NAME --ledger FILE

Tools: `read` (readOnlyHint: Reach may retry it) and `write` (neither read-only nor idempotent:
never retried without a key). Each writes its line (the request id, attempt and key Reach sent
in `_meta`) with one O_APPEND write before it sleeps `delay_ms`, and answers
`{"instance_id", "n"}`. `McpLedgerServer` starts one and SIGKILLs and restarts it on its port.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx
from mcp.server.mcpserver import Context, MCPServer
from mcp_types import ToolAnnotations

if TYPE_CHECKING:  # the server process imports none of the tests' helpers
    from tests.helpers import Proc


def build(instance: str, ledger: Path) -> Any:
    server: Any = MCPServer(name=f"reliability-{instance}", version="1.0.0")
    fd = os.open(ledger, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)

    def record(op: str, ctx: Context) -> None:
        meta: dict[str, Any] = dict(ctx.request_context.meta or {})
        line = {
            "request_id": meta.get("x-reach-request-id"),
            "idempotency_key": meta.get("idempotency-key"),
            "attempt": meta.get("x-reach-attempt"),
            "instance": instance,
            "op": op,
            "t": time.time(),
        }
        os.write(fd, (json.dumps(line) + "\n").encode())

    @server.tool(description="Read (no effect).", annotations=ToolAnnotations(readOnlyHint=True))
    async def read(ctx: Context, n: int = 0, delay_ms: int = 20) -> dict[str, Any]:
        record("read", ctx)
        await asyncio.sleep(delay_ms / 1000)
        return {"instance_id": instance, "n": n}

    @server.tool(
        description="Write (not idempotent).",
        annotations=ToolAnnotations(readOnlyHint=False, idempotentHint=False),
    )
    async def write(ctx: Context, n: int = 0, delay_ms: int = 20) -> dict[str, Any]:
        record("write", ctx)
        await asyncio.sleep(delay_ms / 1000)
        return {"instance_id": instance, "n": n}

    return server.streamable_http_app()


def main() -> None:
    p = argparse.ArgumentParser(description="reliability ledger MCP server")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--instance", required=True)
    p.add_argument("--ledger", type=Path, required=True)
    args = p.parse_args()
    import uvicorn

    app = build(args.instance, args.ledger)
    print(f"mcp ledger server {args.instance} on {args.port}", flush=True)
    uvicorn.run(app, host="127.0.0.1", port=args.port, log_level="warning")


class McpLedgerServer:
    """One ledger MCP server process on a port of its own, kept across restarts."""

    def __init__(self, tmp: Path, ledgers: Path, instance: str = "rel-mcp-00") -> None:
        from tests.helpers import free_port

        self.tmp = tmp
        self.instance = instance
        self.ledger = ledgers / f"{instance}.jsonl"
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}/mcp"
        self.proc: Proc | None = None

    def start(self) -> McpLedgerServer:
        from tests.helpers import spawn

        args = [sys.executable, "-m", "tests.reliability.mcp_server", "--port", str(self.port)]
        args += ["--instance", self.instance, "--ledger", str(self.ledger)]
        self.proc = spawn(args, {}, self.tmp / f"{self.instance}.log")
        return self

    async def ready(self, timeout_s: float = 60.0) -> McpLedgerServer:
        """Until its endpoint answers (a GET without a session: any HTTP answer will do)."""
        deadline = time.monotonic() + timeout_s
        async with httpx.AsyncClient(trust_env=False) as client:
            while time.monotonic() < deadline:
                assert self.proc is not None
                if self.proc.popen.poll() is not None:
                    raise RuntimeError(f"MCP server exited:\n{self.proc.own_output()}")
                try:
                    await client.get(self.url, timeout=1)
                    return self
                except httpx.HTTPError:
                    await asyncio.sleep(0.05)
        raise TimeoutError(f"MCP server {self.instance} not ready")

    async def restart(self) -> None:
        """SIGKILL, then the same port: the gateways' probes find it again."""
        assert self.proc is not None
        self.proc.kill()
        self.proc.popen.wait()
        await self.start().ready()


if __name__ == "__main__":
    main()
