"""`reach` — the command line.

reach up        the whole stack in the foreground: Temporal dev server, gateway + invoke worker,
                two demo knowledge-retriever agents (memory registry). Ctrl-C stops it all.
reach gateway   the gateway alone (with its invoke worker), against an existing Temporal.
reach worker    a worker alone (same as `python worker.py`).
reach certs     a development CA for mTLS to agents: `certs init`, `certs issue --agent ID`.
reach invoke | agents | capabilities | config check   the API from a terminal (cli_view).
reach trace ID | requests   a request's timeline, the recent requests (cli_ops).

The parser is built from modules that import the standard library only, and each command
imports what it needs when it runs: `reach --help`, `reach agents` and `reach trace` start
without the settings model, Temporal, the app or httpx (issue 26; bench/cli_start.py measures
it, tests/unit/test_cli_start.py checks what the parser loads).
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Coroutine, Sequence
from typing import TYPE_CHECKING, Any, NoReturn

from gateway_api import cli_certs, cli_ops, cli_tokens, cli_view
from gateway_api.cli_address import CONFIG_ENV_VAR

if TYPE_CHECKING:
    from pathlib import Path

    from reach.config import ReachSettings

KEEP_ALIVE_S = 75  # as nginx's default (transport.http_keep_alive_s's)
GIVE_UP_GRACE_S = 30.0  # how long the gateway may take to stop once Temporal is gone for good
Announce = Callable[[], Coroutine[Any, Any, None]]


async def _serve(
    settings: ReachSettings,
    *,
    run_worker: bool = True,
    announce: Announce | None = None,
    give_up_after_s: float | None = None,
) -> None:
    """Connect to Temporal first (a clear error, no traceback), then serve. With
    `give_up_after_s`, stop with ConnectionError once Temporal has not answered that long
    (`gateway_api.watchdog`; `reach up` restarts its own dev server instead)."""
    # Imported here: the light commands (tokens, requests, trace, ...) start without them.
    import asyncio

    import uvicorn

    from gateway_api.app import create_app
    from gateway_api.http_limits import bounded_h11
    from reach.config import config_file
    from reach.process import exit_now
    from worker import connect_temporal

    client = await connect_temporal(settings, wait_s=settings.temporal.connect_wait_s)
    config = uvicorn.Config(
        create_app(
            settings, client, run_worker=run_worker, config_path=config_file(), own_process=True
        ),
        host=settings.listen_host,
        port=settings.listen_port,
        log_config=None,
        access_log=False,
        lifespan="on",
        # Not httptools, even when installed: it answers a header it cannot parse with a bare
        # 400 before the app sees it, where h11 lets the door answer in the envelope (422); and
        # uvicorn's httptools protocol sets no limit on the header section (h11: 16 KiB), and
        # answers a malformed pipelined request before the one ahead of it.
        # h11 with a deadline for each request to arrive and a cap on connections (slowloris).
        http=bounded_h11(settings.transport),
        # Longer than clients keep an idle connection (httpx 5 s, aiohttp 15 s), so that they
        # close it first: with uvicorn's 5 s, a client reusing a pooled connection as the
        # server closed it read "cannot write request body" (bench/invoke.py, 64 in flight).
        timeout_keep_alive=settings.transport.http_keep_alive_s,
        # A backstop past the synchronous waits' own bound (steps/wait.py): whatever still
        # holds a connection then (a client that never reads its answer) does not hold the stop.
        timeout_graceful_shutdown=int(settings.transport.drain_s) + 5,
    )
    server = uvicorn.Server(config)
    gone: list[str] = []

    def give_up(message: str) -> None:
        gone.append(message)
        server.should_exit = True
        # A shutdown stuck on the missing server must not turn the loud exit into a hang.
        asyncio.get_running_loop().call_later(GIVE_UP_GRACE_S, exit_now, 1, f"error: {message}")

    tasks = [asyncio.create_task(announce())] if announce else []
    if give_up_after_s is not None:
        from gateway_api.watchdog import watch_temporal

        tasks.append(asyncio.create_task(watch_temporal(client, give_up_after_s, give_up)))
    try:
        await server.serve()
    finally:
        for task in tasks:
            task.cancel()
    if gone:
        raise ConnectionError(gone[0])


def _gateway_ports(settings: ReachSettings) -> list[tuple[int, str, str, str]]:
    """The gateway's HTTP and gRPC ports, both on `listen_host`, with the settings that move
    them (`devserver.require_all_free`)."""
    from gateway_api.grpc_front import grpc_port

    wanted = [
        (
            settings.listen_port,
            "gateway",
            "reach.listen_port / REACH_LISTEN_PORT",
            settings.listen_host,
        )
    ]
    port = grpc_port(settings)
    if port:  # 0 binds any free port, None is no gRPC front
        wanted.append(
            (
                port,
                "gateway gRPC front",
                "reach.transport.ports.grpc / REACH_TRANSPORT__PORTS__GRPC (-1: off)",
                settings.listen_host,
            )
        )
    return wanted


def cmd_gateway(settings: ReachSettings, *, run_worker: bool) -> None:
    from gateway_api.devserver import require_all_free
    from reach.process import run

    require_all_free(_gateway_ports(settings))
    bound = settings.temporal.connect_wait_s
    run(_serve(settings, run_worker=run_worker, give_up_after_s=bound), settings)


def _banner(
    settings: ReachSettings,
    ui_port: int | None,
    agents: int,
    log_dir: Path,
    tokens_required: bool = False,
) -> str:
    import json

    from gateway_api.grpc_front import grpc_port

    url = settings.gateway_url
    ui = f"http://127.0.0.1:{ui_port}" if ui_port else "(headless)"
    port = grpc_port(settings)
    host = "127.0.0.1" if settings.listen_host in ("0.0.0.0", "::") else settings.listen_host
    grpc_line = (
        f"\n    gRPC front   {host}:{port}   (reach.v1.Reach, health, reflection)" if port else ""
    )
    example = json.dumps(
        {
            "target": "knowledge-retriever",
            "operation": "query",
            "payload": {"text": "durable retries", "top_k": 2},
            "timeout_ms": 3000,
        }
    )
    token_note = auth = ""
    if tokens_required:  # a token exists: an invoke without one is 401
        token_note = (
            "  (tokens are required here: `reach tokens issue --principal me`, then "
            "export REACH_TOKEN=<its token>)"
        )
        auth = '\n      -H "Authorization: Bearer $REACH_TOKEN" \\'
    return f"""
  Agent-Reach is up.
    gateway      {url}      (OpenAPI: {url}/docs){grpc_line}
    temporal UI  {ui}
    worker       in the gateway process, task queue {settings.temporal.task_queue}
    agents       {agents} x knowledge-retriever (logs in {log_dir}/)
    supervised   the dev server and agents restart when they exit (1 s, 2 s, 4 s ... 30 s apart)

  Try:{token_note}
    curl -s -X POST {url}/reach/invoke -H 'Content-Type: application/json' \\{auth}
      -d '{example}'

  Ctrl-C stops everything; requests stay in {settings.temporal.dev_server.db_filename}.
"""


# How long `reach up` waits for the demo agents before it says it is still waiting (they join
# in about 5 s on a loaded 2-core box).
ANNOUNCE_PATIENCE_S = 15.0


async def _announce_when_ready(
    settings: ReachSettings,
    ui_port: int | None,
    agents: int,
    log_dir: Path,
    headers: Callable[[], dict[str, str]],
) -> None:
    """The banner, once the demo agents are routable (read with their token, if they hold one:
    with tokens required an anonymous read is 401). Until then it waits, and says so once
    after `ANNOUNCE_PATIENCE_S`: it gave up silently after 60 s, the banner never shown."""
    import asyncio
    import contextlib
    import time

    import httpx

    said = False
    started = time.monotonic()
    async with httpx.AsyncClient(base_url=settings.gateway_url, trust_env=False) as client:
        while True:
            with contextlib.suppress(httpx.HTTPError, ValueError, KeyError, TypeError):
                r = await client.get("/reach/capabilities", headers=headers())
                caps = {c["name"]: c["routable"] for c in r.json()["capabilities"]}
                if r.status_code == 200 and caps.get("knowledge-retriever", 0) >= agents:
                    required = bool(headers())  # the demo agents hold a token only then
                    print(_banner(settings, ui_port, agents, log_dir, required), flush=True)
                    return
            waited = time.monotonic() - started
            if not said and waited >= ANNOUNCE_PATIENCE_S:
                said = True
                print(
                    f"\n  still waiting for the {agents} demo agents to join "
                    f"({waited:.0f} s so far); the gateway is up at {settings.gateway_url}. "
                    f"The lines above say why a Join is refused; the agents' own logs are in "
                    f"{log_dir}/\n",
                    flush=True,
                )
            await asyncio.sleep(0.1)


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def cmd_up(settings: ReachSettings, *, demo: bool) -> None:
    import signal
    from pathlib import Path

    from gateway_api.devserver import DevServer, InUse, require_all_free
    from reach.process import run

    dev = settings.temporal.dev_server
    ui_port = None if dev.headless else dev.ui_port
    wanted = _gateway_ports(settings)
    wanted.append(
        (
            dev.port,
            "Temporal dev server",
            "reach.temporal.dev_server.port / REACH_TEMPORAL__DEV_SERVER__PORT",
            "127.0.0.1",
        )
    )
    if ui_port:
        wanted.append(
            (
                ui_port,
                "Temporal UI",
                "reach.temporal.dev_server.ui_port / REACH_TEMPORAL__DEV_SERVER__UI_PORT",
                "127.0.0.1",
            )
        )
    server = DevServer(
        dev.db_filename,
        dev.port,
        ui_port,
        log_file=Path(dev.db_filename).parent / "logs" / "temporal.log",
        retention_hours=dev.retention_hours,
    )
    # Every port in use and the database at once, not one per attempt; the database's lock is
    # held from here until this process ends (and by the dev server it starts).
    refused: list[str] = []
    try:
        require_all_free(wanted)
    except InUse as exc:
        refused.append(str(exc))
    try:
        server.hold_database()
    except InUse as exc:
        refused.append(str(exc))
    if refused:
        server.release_database()
        raise InUse("\n".join(refused))
    state = Path(dev.db_filename).parent
    log_dir = state / "logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    # The all-in-one talks to its own dev server, whatever TEMPORAL_ADDRESS says.
    os.environ["TEMPORAL_ADDRESS"] = f"127.0.0.1:{dev.port}"
    settings = settings.model_copy(
        update={
            "temporal": settings.temporal.model_copy(update={"address": f"127.0.0.1:{dev.port}"})
        }
    )
    # uvicorn re-raises the signal it stopped on; SIGTERM's default action would kill this
    # process before it stops its children, so SIGTERM takes the Ctrl-C path instead.
    signal.signal(signal.SIGTERM, _interrupt)
    from gateway_api.supervisor import Up

    print(
        f"starting Temporal dev server on 127.0.0.1:{dev.port} ({dev.db_filename}) ...", flush=True
    )
    server.start()
    # From here on the dev server and the demo agents are supervised: restarted when they exit.
    up = Up(settings, server, log_dir, agents=2 if demo else 0)
    try:
        run(
            _serve(
                settings,
                announce=lambda: up.run(
                    lambda headers: _announce_when_ready(
                        settings, ui_port, len(up.agents), log_dir, headers
                    )
                ),
            ),
            settings,
        )
    finally:
        print("stopping agents and the Temporal dev server ...", flush=True)
        up.stop()
        print("stopped.", flush=True)


def cmd_certs(settings: ReachSettings, args: argparse.Namespace) -> int:
    """`reach certs init | issue`: the development CA (`gateway_api.cli_certs`)."""
    return cli_certs.cmd_certs(settings, args)


def build_parser() -> argparse.ArgumentParser:
    """Every command's arguments; built from modules that import the standard library only."""
    parser = argparse.ArgumentParser(prog="reach", description="Agent-Reach")
    parser.add_argument(
        "--config", help="path to reach.yaml (default: $REACH_CONFIG or ./reach.yaml)"
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logs, heartbeats too")
    sub = parser.add_subparsers(dest="command", required=True)
    up = sub.add_parser("up", help="the whole stack, in the foreground")
    up.add_argument("--no-demo", action="store_true", help="do not start the demo agents")
    gw = sub.add_parser("gateway", help="the gateway (with its invoke worker)")
    gw.add_argument(
        "--no-worker",
        action="store_true",
        help="API only: workflows run on separate `worker.py` processes (no eager start)",
    )
    worker = sub.add_parser("worker", help="a worker (see worker.py --help)")
    worker.add_argument("--capability", action="append", default=[], metavar="NAME")
    worker.add_argument("--invoke", action="store_true")
    cli_tokens.add_parser(sub)
    cli_certs.add_parser(sub)  # reach certs init | issue (mTLS, R18)
    cli_view.add_parser(sub)  # reach invoke | agents | capabilities | config check
    cli_ops.add_parser(sub)  # reach trace ID | requests
    return parser


# The commands that only call a gateway's API: they need the gateway's URL (cli_address) and
# none of the settings model, its checks or the logging set-up; nothing they run logs.
API_COMMANDS = (cli_view.COMMANDS - {"config"}) | cli_ops.COMMANDS


# The long-running processes; every other command prints an answer and exits.
PROCESS_COMMANDS = ("up", "gateway", "worker")
EXIT_BROKEN_PIPE = 141  # 128 + SIGPIPE, what the shell reports for `cmd | head` cut short


def main(argv: Sequence[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    if args.config:
        # The gateway re-reads this file when it changes (R26), as `reach --config` named it.
        os.environ[CONFIG_ENV_VAR] = args.config
    try:
        if args.command in API_COMMANDS:
            module = cli_view if args.command in cli_view.COMMANDS else cli_ops
            _exit(module.main(None, args))
        _exit(_run(args))
    except KeyboardInterrupt:
        pass
    except BrokenPipeError as exc:
        if args.command in PROCESS_COMMANDS:  # one of their sockets: said as before
            _exit(1, f"error: {exc}")
        # Whoever read the output stopped (`reach requests | head`): nobody to tell, nothing
        # left to write; it said `error: [Errno 32] Broken pipe` and exited 1. Exit as a tool
        # that SIGPIPE ended does for the shell (141), stdout pointed away so that the final
        # flush does not fail again.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        _exit(EXIT_BROKEN_PIPE)
    except Exception as exc:
        if _start_up_error(exc):
            _exit(1, f"error: {exc}")
        raise
    _exit(0)


def _run(args: argparse.Namespace) -> int:
    """The commands that load the settings: `config check` (its own way), tokens, certs, and
    the processes (up, gateway, worker)."""
    from reach.process import configure_logging
    from reach.settings_checks import load_checked_settings

    configure_logging(args.verbose)
    if args.command == "config":  # checks the file itself: before loading it
        return cli_view.main(None, args)
    settings = load_checked_settings(args.config)
    configure_logging(args.verbose, settings.telemetry)  # its format, the sampling
    if args.command == "tokens":
        return cli_tokens.main(settings, args)
    if args.command == "certs":
        return cmd_certs(settings, args)
    if args.command == "up":
        cmd_up(settings, demo=not args.no_demo)
    elif args.command == "gateway":
        cmd_gateway(settings, run_worker=not args.no_worker)
    else:
        import worker as worker_main

        extra = ["--invoke"] if args.invoke else []
        for cap in args.capability:
            extra += ["--capability", cap]
        if args.config:
            extra += ["--config", args.config]
        worker_main.main(extra)
    return 0


def _start_up_error(exc: Exception) -> bool:
    """An error a person fixes (said in one line, exit 1), not a bug (a traceback)."""
    if isinstance(exc, FileNotFoundError | ConnectionError):
        return True
    # Loaded already when one of theirs was raised; imported here so that the light commands
    # do not load them up front.
    from gateway_api.devserver import InUse
    from reach.config import ConfigError

    return isinstance(exc, ConfigError | InUse)


def _exit(code: int, message: str | None = None) -> NoReturn:
    """`reach.process.exit_now` (no interpreter teardown, spans flushed) once a command loaded
    it; the same exit without it for the light commands, which start no tracing."""
    if "reach.process" in sys.modules:
        from reach.process import exit_now

        exit_now(code, message)
    if message:
        print(message, file=sys.stderr)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
