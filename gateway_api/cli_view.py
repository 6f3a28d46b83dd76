"""`reach invoke`, `reach agents`, `reach capabilities`, `reach config check`: the gateway's API
from a terminal.

Tables in a terminal (rich), plain aligned columns when piped, `--json` for scripts. Every
command but `config check` talks to a gateway (`--gateway`, default the configured one) with
the token of `--token` or `$REACH_TOKEN`. Exit codes: 0 done, 1 the request or the call failed
(the message says why), 2 bad arguments, 3 the gateway cannot be reached.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import httpx

from reach.config import ConfigError, ReachSettings, config_file
from reach.messages import new_request_id
from reach.settings_checks import load_checked_settings

COMMANDS = frozenset({"invoke", "agents", "capabilities", "config"})
TOKEN_ENV = "REACH_TOKEN"
EXIT_FAILED, EXIT_USAGE, EXIT_UNREACHABLE = 1, 2, 3
CONNECT_TIMEOUT_S = 5.0
# A sync invoke answers by its deadline; this much more before the CLI gives up waiting.
INVOKE_GRACE_S = 30.0
HEALTH_STYLE = {"ok": "green", "degraded": "yellow", "unhealthy": "bold red"}
STATUS_STYLE = {
    "success": "green",
    "accepted": "cyan",
    "running": "cyan",
    "error": "bold red",
    "timeout": "bold red",
}


class Failed(Exception):
    """A clear one-line (or few-line) error for stderr, and the exit code that goes with it."""

    def __init__(self, message: str, code: int = EXIT_FAILED) -> None:
        super().__init__(message)
        self.code = code


class NoAnswer(Failed):
    """The gateway took the call and did not answer in time."""


# ---------------------------------------------------------------------------------------------
# arguments


def gateway_options() -> argparse.ArgumentParser:
    """--gateway, --token and --json: every command that talks to the gateway takes them."""
    gateway = argparse.ArgumentParser(add_help=False)
    gateway.add_argument(
        "--gateway", metavar="URL", help="the gateway's URL (default: the configured one)"
    )
    gateway.add_argument(
        "--token", help=f"a bearer token when the gateway requires one (default: ${TOKEN_ENV})"
    )
    gateway.add_argument("--json", action="store_true", help="machine-readable output")
    return gateway


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    gateway = gateway_options()

    inv = sub.add_parser(
        "invoke",
        parents=[gateway],
        help="invoke a capability and print the result",
        description="Invoke CAPABILITY's OPERATION through the gateway and print the envelope. "
        "Exit 0 on success (or accepted, with --callback), 1 on error or timeout.",
    )
    inv.add_argument("capability")
    inv.add_argument("operation")
    body = inv.add_mutually_exclusive_group()
    body.add_argument("--payload", metavar="JSON", help="the payload object, e.g. '{\"top_k\": 2}'")
    body.add_argument("--payload-file", metavar="FILE", help="read the payload from FILE (- stdin)")
    inv.add_argument("--timeout-ms", type=int, metavar="MS", help="the request's deadline")
    inv.add_argument("--callback", metavar="URL", help="answer 202 at once; POST the result here")
    inv.add_argument("--request-id", metavar="ID", help="a RequestID (generated when absent)")
    inv.add_argument("--idempotency-key", metavar="KEY")
    inv.add_argument("--routing-key", metavar="KEY", help="for consistent_hash routing")

    agents = sub.add_parser(
        "agents",
        parents=[gateway],
        help="registered instances: protocol, health, checks, in-flight, last heartbeat",
    )
    agents.add_argument("capability", nargs="?", help="only this capability")

    sub.add_parser("capabilities", parents=[gateway], help="capabilities and instance counts")

    config = sub.add_parser("config", help="check a configuration file")
    what = config.add_subparsers(dest="config_command", required=True)
    check = what.add_parser(
        "check",
        help="validate reach.yaml (and REACH_* variables) without starting anything",
        description="Validate the configuration as the gateway would load it: the file named "
        "by --config, else $REACH_CONFIG, else ./reach.yaml, with REACH_* variables applied. "
        "Exit 0 and a summary when valid; 1 and the field at fault when not.",
    )
    check.add_argument("--config", dest="check_config", metavar="FILE", help="the file to check")
    check.add_argument("--json", action="store_true", help="machine-readable output")


def main(settings: ReachSettings | None, args: argparse.Namespace) -> int:
    """Run one of `COMMANDS`. `settings` may be None for `config check` (it loads its own)."""
    try:
        if args.command == "config":
            return check_config(args)
        assert settings is not None
        api = Api(
            args.gateway or settings.gateway_url,
            args.token or os.environ.get(TOKEN_ENV) or None,
        )
        with api:
            if args.command == "invoke":
                return cmd_invoke(api, args)
            if args.command == "agents":
                return cmd_agents(api, args)
            return cmd_capabilities(api, args)
    except Failed as exc:
        print(f"error: {exc}", file=sys.stderr)
        return exc.code
    except KeyboardInterrupt:
        return 130


# ---------------------------------------------------------------------------------------------
# the HTTP side


def _reason(exc: httpx.TransportError) -> str:
    text = str(exc) or type(exc).__name__
    lowered = text.lower()
    if "refused" in lowered:
        return "connection refused"
    if isinstance(exc, httpx.TimeoutException):
        return "no answer in time"
    if "name or service not known" in lowered or "nodename nor servname" in lowered:
        return "unknown host"
    return text


class Api:
    """A small synchronous client of the gateway's API that turns every failure into `Failed`
    with the fix named."""

    def __init__(self, base_url: str, token: str | None) -> None:
        self.base_url = base_url.rstrip("/")
        headers = {"Accept": "application/json", "User-Agent": "reach-cli"}
        if token:
            headers["Authorization"] = f"Bearer {token}"
        self.has_token = bool(token)
        # trust_env off: a proxy from the environment must not stand between the CLI and a
        # gateway on this machine (the usual case).
        self._client = httpx.Client(
            base_url=self.base_url,
            headers=headers,
            trust_env=False,
            timeout=httpx.Timeout(30.0, connect=CONNECT_TIMEOUT_S),
        )

    def __enter__(self) -> Api:
        return self

    def __exit__(self, *exc: object) -> None:
        self._client.close()

    def request(
        self,
        method: str,
        path: str,
        *,
        body: dict[str, Any] | None = None,
        read_timeout_s: float | None = 30.0,
        ok: Sequence[int] = (200,),
    ) -> tuple[int, dict[str, Any]]:
        """(HTTP status, JSON body). A status outside `ok` that is not an envelope the caller
        wants raises `Failed`; envelopes (invoke, request status) come back as they are."""
        timeout = httpx.Timeout(read_timeout_s, connect=CONNECT_TIMEOUT_S)
        try:
            response = self._client.request(method, path, json=body, timeout=timeout)
        except httpx.ReadTimeout:
            raise NoAnswer(
                f"the gateway at {self.base_url} accepted the call but did not answer within "
                f"{read_timeout_s:g}s"
            ) from None
        except httpx.TransportError as exc:
            raise Failed(
                f"cannot reach the gateway at {self.base_url}: {_reason(exc)} — start it with "
                "`reach up` (or `reach gateway`) or set --gateway",
                EXIT_UNREACHABLE,
            ) from None
        try:
            data = response.json()
        except ValueError:
            data = None
        if not isinstance(data, dict):
            kind = response.headers.get("content-type", "no content type")
            raise Failed(
                f"{self.base_url}{path} did not answer as a Reach gateway (HTTP "
                f"{response.status_code}, {kind}) — check --gateway"
            )
        if response.status_code == 401:
            raise Failed(self._unauthorized(data))
        if response.status_code == 403:
            raise Failed(f"forbidden: {_error_text(data)}")
        if response.status_code not in ok:
            raise Failed(_error_text(data) + _hint(response.status_code, path))
        return response.status_code, data

    def _unauthorized(self, data: dict[str, Any]) -> str:
        if self.has_token:
            return (
                f"the gateway refused the token ({_error_text(data)}) — set REACH_TOKEN or "
                "--token to a valid one (reach tokens list; reach tokens issue --principal NAME)"
            )
        return (
            "the gateway requires a token — set REACH_TOKEN (or --token) to one from "
            "`reach tokens issue --principal NAME`"
        )


def _error_text(data: dict[str, Any]) -> str:
    error = data.get("error")
    if isinstance(error, dict):
        text = f"{error.get('type', 'error')}: {error.get('message', '')}"
        agent = error.get("agent")
        if isinstance(agent, dict):
            text += f" (agent: {agent.get('type', '?')}: {agent.get('message', '')})"
        return clean(text)
    detail = data.get("detail")
    return clean(str(detail if detail is not None else data))


def _hint(status: int, path: str) -> str:
    if status == 404 and path.startswith("/reach/capabilities/"):
        return " — `reach capabilities` lists the known ones"
    if status == 404 and path.endswith("/timeline"):
        return " — `reach requests` lists recent ones"
    return ""


def clean(text: str) -> str:
    """Agent-provided text made safe for a terminal: control characters (escape sequences
    that could rewrite the screen) are shown escaped, not sent."""
    return "".join(
        ch if ch.isprintable() or ch == " " else ch.encode("unicode_escape").decode("ascii")
        for ch in text
    )


# ---------------------------------------------------------------------------------------------
# output


def _styled_console(stream: Any) -> Any:
    """A rich Console on `stream` when it is a terminal (None: plain output)."""
    if not stream.isatty():
        return None
    from rich.console import Console  # only when drawing for a person

    return Console(file=stream, highlight=False)


def print_table(
    headers: Sequence[str],
    rows: Sequence[Sequence[str]],
    styles: Sequence[dict[str, str] | None] | None = None,
    *,
    title: str | None = None,
    wrap: str | None = None,
    console: Any = None,
) -> None:
    """A table: rich in a terminal (colours from `styles`, per column: value -> style; only
    the column named `wrap` folds when the terminal is narrow, the others are clipped), plain
    aligned columns otherwise (stable for grep and awk)."""
    rows = [[clean(cell) for cell in row] for row in rows]
    console = console if console is not None else _styled_console(sys.stdout)
    if console is not None:
        from rich import box
        from rich.table import Table
        from rich.text import Text

        table = Table(box=box.SIMPLE_HEAD, title=title, title_justify="left", pad_edge=False)
        for header in headers:
            folds = header == wrap
            table.add_column(header, no_wrap=not folds, overflow="fold" if folds else "ellipsis")
        for row in rows:
            cells = []
            for i, cell in enumerate(row):
                style = (styles[i] or {}).get(cell, "") if styles and i < len(styles) else ""
                cells.append(Text(cell, style=style))  # Text: no markup read from the data
            table.add_row(*cells)
        console.print(table)
        return
    if title:
        print(title)
    widths = [len(h) for h in headers]
    for row in rows:
        widths = [max(w, len(cell)) for w, cell in zip(widths, row, strict=True)]
    for row in [list(headers), *rows]:
        print("  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip())


def print_json(data: Any) -> None:
    """JSON with every non-ASCII character escaped: agent-written text never reaches the
    terminal as control or bidi characters."""
    print(json.dumps(data, indent=2, ensure_ascii=True))


def age(seconds: float) -> str:
    """0.4s, 12s, 3m05s, 2h14m, 3d02h: how long ago."""
    seconds = max(0.0, seconds)
    if seconds < 10:
        return f"{seconds:.1f}s"
    if seconds < 60:
        return f"{seconds:.0f}s"
    minutes, secs = divmod(int(seconds), 60)
    if minutes < 60:
        return f"{minutes}m{secs:02d}s"
    hours, minutes = divmod(minutes, 60)
    if hours < 24:
        return f"{hours}h{minutes:02d}m"
    days, hours = divmod(hours, 24)
    return f"{days}d{hours:02d}h"


def compact(value: Any, limit: int = 48) -> str:
    """`checks` on one line: k=v pairs, long values clipped."""
    if isinstance(value, dict):
        text = " ".join(
            f"{k}={json.dumps(v, ensure_ascii=False) if not isinstance(v, str) else v}"
            for k, v in value.items()
        )
    else:
        text = json.dumps(value, ensure_ascii=False)
    text = text or "-"
    return text if len(text) <= limit else text[: limit - 1] + "…"


@contextlib.contextmanager
def progress(message: str) -> Iterator[None]:
    """A spinner on stderr while something waits, only when stderr is a terminal."""
    console = _styled_console(sys.stderr)
    if console is None:
        yield
        return
    from rich.text import Text

    with console.status(Text(message), spinner="dots"):
        yield


# ---------------------------------------------------------------------------------------------
# commands


def _payload(args: argparse.Namespace) -> dict[str, Any]:
    if args.payload_file:
        source = "--payload-file -" if args.payload_file == "-" else args.payload_file
        try:
            text = (
                sys.stdin.read()
                if args.payload_file == "-"
                else Path(args.payload_file).read_text(encoding="utf-8")
            )
        except OSError as exc:
            raise Failed(f"cannot read {args.payload_file}: {exc.strerror}", EXIT_USAGE) from None
    elif args.payload is not None:
        source, text = "--payload", args.payload
    else:
        return {}
    try:
        payload = json.loads(text)
    except ValueError as exc:
        raise Failed(f"{source} is not valid JSON: {exc}", EXIT_USAGE) from None
    if not isinstance(payload, dict):
        raise Failed(f'{source} must be a JSON object, e.g. \'{{"text": "hi"}}\'', EXIT_USAGE)
    return payload


def cmd_invoke(api: Api, args: argparse.Namespace) -> int:
    payload = _payload(args)
    # The RequestID is chosen here, so that an interrupted wait can still name the request.
    request_id = args.request_id or new_request_id()
    body: dict[str, Any] = {
        "request_id": request_id,
        "target": args.capability,
        "operation": args.operation,
        "payload": payload,
    }
    for key in ("timeout_ms", "callback", "idempotency_key", "routing_key"):
        value = getattr(args, key)
        if value is not None:
            body[key] = value
    # The gateway answers a sync invoke by its deadline; without one, wait as long as it takes.
    read_timeout = args.timeout_ms / 1000 + INVOKE_GRACE_S if args.timeout_ms else None
    label = f"{args.capability}.{args.operation}"
    try:
        with progress(f"waiting for {label} ({request_id})"):
            status, data = api.request(
                "POST",
                "/reach/invoke",
                body=body,
                read_timeout_s=read_timeout,
                ok=(200, 202, 404, 409, 413, 422, 429, 502, 503, 504),
            )
    except KeyboardInterrupt:
        print(
            f"\nstopped waiting; request {request_id} goes on in Reach — look it up with "
            f"`reach trace {request_id}`",
            file=sys.stderr,
        )
        return 130
    except NoAnswer as exc:
        more = f"; request {request_id} may still run: reach trace {request_id}"
        raise Failed(f"{exc}{more}") from None
    outcome = str(data.get("status", "error"))
    good = outcome in ("success", "accepted")
    if args.json:
        print_json(data)
        return 0 if good else EXIT_FAILED
    rid = data.get("request_id") or request_id
    facts = [outcome, str(rid), label]
    if data.get("instance_id"):
        facts.append(f"instance {data['instance_id']}")
    if data.get("duration_ms") is not None:
        facts.append(f"{data['duration_ms']} ms")
    attempts = data.get("attempts") or []
    if len(attempts) > 1:
        facts.append(f"{len(attempts)} attempts")
    if data.get("replayed_from"):
        facts.append(f"replayed from {data['replayed_from']}")
    line = clean("  ".join(facts))
    if good:
        print(line)
        if outcome == "accepted":
            print(f"the result will be POSTed to {args.callback}; status: reach trace {rid}")
        else:
            print_json(data.get("result"))
        return 0
    print(line, file=sys.stderr)
    # 504 with status running: the deadline passed without a verdict; the request goes on.
    hint = f" — no verdict yet; look later: reach trace {rid}" if outcome == "running" else ""
    print(f"error: {_error_text(data)} (HTTP {status}){hint}", file=sys.stderr)
    return EXIT_FAILED


def _capability_names(api: Api) -> list[str]:
    _, data = api.request("GET", "/reach/capabilities")
    return sorted(str(c["name"]) for c in data.get("capabilities", []))


def cmd_capabilities(api: Api, args: argparse.Namespace) -> int:
    _, data = api.request("GET", "/reach/capabilities")
    if args.json:
        print_json(data)
        return 0
    caps = sorted(data.get("capabilities", []), key=lambda c: str(c["name"]))
    if not caps:
        print(f"no capabilities registered at {api.base_url}")
        return 0
    rows = []
    for c in caps:
        state = "ok" if c["routable"] else "no instance" if not c["instances"] else "unroutable"
        rows.append([str(c["name"]), str(c["instances"]), str(c["routable"]), state])
    print_table(
        ["CAPABILITY", "INSTANCES", "ROUTABLE", "STATE"],
        rows,
        [None, None, None, {"ok": "green", "no instance": "yellow", "unroutable": "bold red"}],
    )
    return 0


def cmd_agents(api: Api, args: argparse.Namespace) -> int:
    names = [args.capability] if args.capability else _capability_names(api)
    details = []
    for name in names:
        # A listed capability may be forgotten before its turn: left out, not an error.
        status, detail = api.request(
            "GET", f"/reach/capabilities/{name}", ok=(200,) if args.capability else (200, 404)
        )
        if status == 200:
            details.append(detail)
    now = time.time()
    instances: list[dict[str, Any]] = []
    for detail in details:
        counted = (detail.get("routing") or {}).get("inflight") or {}
        for record in detail.get("instances", []):
            view = dict(record)
            view["reach_inflight"] = int(counted.get(record["instance_id"], 0))
            view["last_heartbeat_age_s"] = round(now - float(record["last_seen"]), 3)
            instances.append(view)
    if args.json:
        print_json({"instances": instances, "capabilities": details})
        return 0
    if not instances:
        where = f"capability {args.capability}" if args.capability else api.base_url
        print(f"no instances registered for {where}")
        return 0
    rows = [
        [
            str(i["capability"]),
            str(i["instance_id"]),
            str(i["protocol"]),
            str(i["address"]),
            str(i["status"]),
            compact(i.get("checks") or {}),
            str(i["reach_inflight"]),
            f"{age(i['last_heartbeat_age_s'])} ago",
            age(now - float(i["joined_at"])),
        ]
        for i in sorted(instances, key=lambda i: (i["capability"], i["instance_id"]))
    ]
    print_table(
        [
            "CAPABILITY",
            "INSTANCE",
            "PROTOCOL",
            "ADDRESS",
            "HEALTH",
            "CHECKS",
            "IN-FLIGHT",
            "LAST HEARTBEAT",
            "UP",
        ],
        rows,
        [None, None, None, None, HEALTH_STYLE],
        wrap="CHECKS",
    )
    for detail in details:
        note = _policy_note(detail)
        if note:
            print(clean(f"{detail['name']}: {note}"))
    return 0


def _policy_note(detail: dict[str, Any]) -> str:
    """One line of what routing and policy do to the capability now, when it is not plain."""
    parts = []
    breaker = (detail.get("policy") or {}).get("breaker") or {}
    if breaker.get("status") not in (None, "closed"):
        parts.append(f"breaker {breaker['status']} (retry in {breaker.get('retry_after_s', 0)}s)")
    ejected = (detail.get("policy") or {}).get("ejected") or {}
    if ejected:
        parts.append("ejected " + ", ".join(f"{k} ({v:.0f}s)" for k, v in ejected.items()))
    return "; ".join(parts)


# ---------------------------------------------------------------------------------------------
# config check


def check_config(args: argparse.Namespace) -> int:
    path = args.check_config or getattr(args, "config", None)
    try:
        file_path = config_file(path)
        settings = load_checked_settings(file_path)
    except ConfigError as exc:
        if args.json:
            print_json({"ok": False, "error": str(exc)})
        else:
            print(f"error: {exc}", file=sys.stderr)
        return EXIT_FAILED
    source = str(file_path) if file_path else "defaults (no reach.yaml here)"
    overridden = sorted(k for k in os.environ if k.startswith("REACH_") and k != TOKEN_ENV)
    if args.json:
        print_json(
            {
                "ok": True,
                "file": str(file_path) if file_path else None,
                "env": overridden,
                "settings": settings.model_dump(mode="json"),
            }
        )
        return 0
    print(f"OK: {source} is valid")
    for key, value in summary(settings):
        print(f"  {key:<14}{value}")
    if overridden:
        print(f"  {'environment':<14}{', '.join(overridden)}")
    return 0


def summary(s: ReachSettings) -> list[tuple[str, str]]:
    caps = ", ".join(f"{name} ({c.mode})" for name, c in sorted(s.capabilities.items()))
    enc = s.security.encryption
    return [
        ("gateway", f"{s.gateway_url} (gRPC front: {_grpc(s)})"),
        (
            "registry",
            f"{s.registry.type}, heartbeat every {s.registry.heartbeat_interval:g}s, evicted "
            f"after {s.registry.heartbeat_timeout:g}s",
        ),
        (
            "temporal",
            f"{s.temporal.address} namespace {s.temporal.namespace}, task queue "
            f"{s.temporal.task_queue} (TEMPORAL_ADDRESS overrides the address)",
        ),
        (
            "policy",
            f"timeout {s.policy.default_timeout_ms} ms, {s.policy.default_retry} retries, "
            f"{len(s.policy.capabilities)} capability and {len(s.policy.operations)} "
            "operation overrides",
        ),
        ("routing", f"{s.routing.strategy}"),
        ("capabilities", caps or "none configured (all inline, default routing)"),
        ("auth", f"{s.auth.mode}, {len(s.rules)} rules"),
        ("audit", s.audit.sink if s.audit.sink in ("none", "stdout") else s.audit.file),
        (
            "security",
            f"mTLS {'on' if s.security.tls.enabled else 'off'}, history encryption "
            f"{'on (key ' + str(enc.active_key) + ')' if enc.enabled else 'off'}, callbacks "
            f"{'signed' if s.security.webhook_key else 'unsigned'}",
        ),
    ]


def _grpc(s: ReachSettings) -> str:
    port = s.transport.ports.get("grpc", 7601)
    return "off" if port < 0 else "any free port" if port == 0 else str(port)
