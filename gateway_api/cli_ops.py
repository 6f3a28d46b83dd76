"""`reach trace <request_id>` and `reach requests`: a request's timeline and the recent requests,
read from the gateway's API (`GET /reach/requests/{id}/timeline`, `GET /reach/requests`).

A table in a terminal, plain aligned columns when piped, `--json` for scripts. The gateway is
`--gateway` (default: the configured one) and the token `--token` or `$REACH_TOKEN`. Exit codes:
0 done, 1 the call failed (the message says why), 2 bad arguments, 3 no gateway there.
"""

from __future__ import annotations

import argparse
import os
import sys
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any
from urllib.parse import quote, urlencode

from gateway_api.cli_view import (
    TOKEN_ENV,
    Api,
    Failed,
    clean,
    gateway_options,
    gateway_url,
    print_json,
    print_table,
)

if TYPE_CHECKING:
    from reach.config import ReachSettings

COMMANDS = frozenset({"trace", "requests"})
STATUSES = ("running", "success", "error", "timeout", "input_required", "canceled")
# reach.listing.MAX_LIMIT, which the gateway enforces; copied because reach.listing loads
# pydantic, and the parser (`reach --help`) must not (tests/unit/test_cli_start.py: equal).
MAX_LIMIT = 500


def _since(text: str) -> str:
    from reach.listing import since_delta  # only when --since is given

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
    common = gateway_options()

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


def main(settings: ReachSettings | None, args: argparse.Namespace) -> int:
    """Run one of `COMMANDS`; the gateway as `cli_view.gateway_url` finds it."""
    token = args.token or os.environ.get(TOKEN_ENV) or None
    try:
        with Api(gateway_url(settings, args), token) as api:
            if args.command == "trace":
                path = f"/reach/requests/{quote(args.request_id, safe='')}/timeline"
                _, data = api.request("GET", path)
                if args.json:
                    print_json(data)
                else:
                    print_timeline(data)
                return 0
            params = {
                key: getattr(args, key)
                for key in ("capability", "operation", "status", "caller", "since", "limit")
                if getattr(args, key) is not None
            }
            query = f"?{urlencode(params)}" if params else ""
            _, data = api.request("GET", f"/reach/requests{query}")
            if args.json:
                print_json(data)
            else:
                print_requests(data.get("requests") or [])
            return 0
    except Failed as exc:
        print(f"error: {exc}", file=sys.stderr)
        return exc.code


def safe(text: Any) -> str:
    """Text from the gateway (agents' words among it) without terminal control sequences."""
    return clean(str(text))


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
    print_table(["OFFSET".rjust(widths), "EVENT", "DETAIL"], rows, wrap="DETAIL")


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
    print_table(
        ["REQUEST ID", "STATUS", "CAPABILITY.OPERATION", "CALLER", "INSTANCE", "STARTED", "TOOK"],
        rows,
    )
