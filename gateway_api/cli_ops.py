"""`reach trace <request_id>` and `reach requests`: a request's timeline and the recent requests,
read from the gateway's API (`GET /reach/requests/{id}/timeline`, `GET /reach/requests`).

A table in a terminal, plain aligned columns when piped, `--json` for scripts. The gateway is
`--gateway` (default: the configured one) and the token `--token` or `$REACH_TOKEN`. Exit codes:
0 done, 1 the call failed (the message says why), 2 bad arguments, 3 no gateway there.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from datetime import UTC, datetime
from typing import Any
from urllib.parse import quote

import httpx

from reach.config import ReachSettings
from reach.listing import MAX_LIMIT, since_delta

COMMANDS = frozenset({"trace", "requests"})
TOKEN_ENV = "REACH_TOKEN"
EXIT_FAILED, EXIT_USAGE, EXIT_UNREACHABLE = 1, 2, 3
STATUSES = ("running", "success", "error", "timeout")


class Failed(Exception):
    def __init__(self, message: str, code: int = EXIT_FAILED) -> None:
        super().__init__(message)
        self.code = code


def _since(text: str) -> str:
    try:
        since_delta(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


def _limit(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if not 1 <= value <= MAX_LIMIT:
        raise argparse.ArgumentTypeError(f"{text!r}: a number from 1 to {MAX_LIMIT}")
    return value


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument(
        "--gateway", metavar="URL", help="the gateway's URL (default: the configured one)"
    )
    common.add_argument(
        "--token", help=f"a bearer token when the gateway requires one (default: ${TOKEN_ENV})"
    )
    common.add_argument("--json", action="store_true", help="machine-readable output")

    trace = sub.add_parser(
        "trace",
        parents=[common],
        help="a request's timeline: accepted, instance chosen, attempts, result, callback",
        description="What happened to one request, from its workflow history, with offsets "
        "from acceptance (R16).",
    )
    trace.add_argument("request_id")

    requests = sub.add_parser(
        "requests",
        parents=[common],
        help="recent requests, newest first (filters combine)",
        description="Recent requests from Temporal's visibility, newest first. With tokens "
        "required, a non-admin token lists only its own requests.",
    )
    requests.add_argument("--capability", help="only this capability")
    requests.add_argument("--operation", help="only this operation")
    requests.add_argument("--status", choices=STATUSES, help="only requests in this state")
    requests.add_argument("--caller", help="only this caller's requests")
    requests.add_argument(
        "--since", type=_since, metavar="AGE", help="started at most this long ago: 90s, 10m, 2h"
    )
    requests.add_argument(
        "--limit", type=_limit, default=50, help=f"at most this many (default 50, max {MAX_LIMIT})"
    )


def main(settings: ReachSettings, args: argparse.Namespace) -> int:
    base = (args.gateway or settings.gateway_url).rstrip("/")
    token = args.token or os.environ.get(TOKEN_ENV) or None
    try:
        if args.command == "trace":
            path = f"/reach/requests/{quote(args.request_id, safe='')}/timeline"
            data = _get(base, token, path, {})
            if args.json:
                print(json.dumps(data, indent=2, ensure_ascii=True))
            else:
                print_timeline(data)
            return 0
        params = {
            key: getattr(args, key)
            for key in ("capability", "operation", "status", "caller", "since", "limit")
            if getattr(args, key) is not None
        }
        data = _get(base, token, "/reach/requests", params)
        if args.json:
            print(json.dumps(data, indent=2, ensure_ascii=True))
        else:
            print_requests(data.get("requests") or [])
        return 0
    except Failed as exc:
        print(f"error: {exc}", file=sys.stderr)
        return exc.code


def _get(base: str, token: str | None, path: str, params: dict[str, Any]) -> dict[str, Any]:
    headers = {"Accept": "application/json", "User-Agent": "reach-cli"}
    if token:
        headers["Authorization"] = f"Bearer {token}"
    try:
        # No proxy from the environment between the CLI and a gateway (usually on this host).
        with httpx.Client(trust_env=False, timeout=httpx.Timeout(30.0, connect=5.0)) as http:
            response = http.get(base + path, params=params, headers=headers)
    except httpx.TransportError as exc:
        raise Failed(
            f"cannot reach the gateway at {base}: {exc or type(exc).__name__} — is it running? "
            "`reach up` (or `reach gateway`), or set --gateway",
            EXIT_UNREACHABLE,
        ) from None
    try:
        data = response.json()
    except ValueError:
        data = None
    if not isinstance(data, dict):
        raise Failed(
            f"{base}{path} did not answer as a Reach gateway (HTTP {response.status_code}) — "
            "check --gateway"
        )
    if response.status_code == 200:
        return data
    message = _error_text(data)
    if response.status_code == 401:
        if token:
            raise Failed(
                f"the gateway refused the token ({message}) — set REACH_TOKEN to a valid one"
            )
        raise Failed(
            "the gateway requires a token — set REACH_TOKEN (or --token) to one from "
            "`reach tokens issue --principal NAME`"
        )
    if response.status_code == 404 and path.endswith("/timeline"):
        raise Failed(f"{message} (`reach requests` lists recent ones)")
    raise Failed(message)


def _error_text(data: dict[str, Any]) -> str:
    error = data.get("error")
    if isinstance(error, dict):
        return safe(f"{error.get('type', 'error')}: {error.get('message', '')}")
    return safe(str(data))


def safe(text: Any) -> str:
    """Text from the gateway (agents' words among it) without terminal control sequences."""
    return "".join(
        ch if ch.isprintable() else ch.encode("unicode_escape").decode("ascii") for ch in str(text)
    )


def _table(headers: list[str], rows: list[list[str]]) -> None:
    """Aligned columns; the last one runs to the end of the line."""
    widths = [len(h) for h in headers]
    for row in rows:
        widths = [max(w, len(cell)) for w, cell in zip(widths, row, strict=True)]
    for row in [headers, *rows]:
        cells = [cell.ljust(w) for cell, w in zip(row[:-1], widths, strict=False)]
        print("  ".join([*cells, row[-1]]).rstrip())


def offset(at_ms: Any) -> str:
    return f"+{int(at_ms):,} ms" if isinstance(at_ms, int | float) else "?"


def print_timeline(data: dict[str, Any]) -> None:
    accepted = data.get("accepted_at")
    when = f", accepted {safe(accepted)}" if accepted else ""
    print(f"request {safe(data.get('request_id'))}: {safe(data.get('status'))}{when}")
    events = data.get("events") or []
    if not events:
        print("no events yet")
        return
    rows = [
        [offset(e.get("at_ms")), safe(e.get("kind")), safe(e.get("summary"))]
        for e in events
        if isinstance(e, dict)
    ]
    widths = max(len(r[0]) for r in rows)
    rows = [[r[0].rjust(widths), r[1], r[2]] for r in rows]
    _table(["OFFSET".rjust(widths), "EVENT", "DETAIL"], rows)


def _age(started: Any) -> str:
    try:
        at = datetime.fromisoformat(str(started).replace("Z", "+00:00"))
    except ValueError:
        return "-"
    seconds = max(0.0, (datetime.now(UTC) - at).total_seconds())
    if seconds < 60:
        return f"{seconds:.0f}s ago"
    if seconds < 3600:
        return f"{seconds // 60:.0f}m ago"
    if seconds < 86_400:
        return f"{seconds // 3600:.0f}h ago"
    return f"{seconds // 86_400:.0f}d ago"


def _duration(ms: Any) -> str:
    if not isinstance(ms, int | float):
        return "-"
    return f"{ms:.0f} ms" if ms < 10_000 else f"{ms / 1000:.1f} s"


def print_requests(requests: list[dict[str, Any]]) -> None:
    if not requests:
        print("no requests (visibility lags a moment behind new ones)")
        return
    rows = [
        [
            safe(r.get("request_id")),
            safe(r.get("status")),
            safe(f"{r.get('capability') or '-'}.{r.get('operation') or '-'}"),
            safe(r.get("caller") or "-"),
            safe(r.get("instance") or "-"),
            _age(r.get("started_at")),
            _duration(r.get("duration_ms")),
        ]
        for r in requests
    ]
    _table(
        ["REQUEST ID", "STATUS", "CAPABILITY.OPERATION", "CALLER", "INSTANCE", "STARTED", "TOOK"],
        rows,
    )
