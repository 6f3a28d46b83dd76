"""`reach invoke`, `reach agents`, `reach capabilities`, `reach config check`: the gateway's API
from a terminal.

Tables in a terminal (rich), plain aligned columns when piped, `--json` for scripts. Every
command but `config check` talks to a gateway (`--gateway`, default the configured one) with
the token of `--token` or `$REACH_TOKEN`. Exit codes: 0 done, 1 the request or the call failed
(the message says why), 2 bad arguments, 3 the gateway cannot be reached.

This module holds the commands on the gateway; the client and its errors are `cli_api`, the
tables and JSON `cli_output`, `config check` `cli_config`. Their public names stay importable
from here, where `cli_ops` and scripts have always found them.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gateway_api import cli_agents, cli_config
from gateway_api.cli_api import (
    CONNECT_TIMEOUT_S,
    EXIT_FAILED,
    EXIT_UNREACHABLE,
    EXIT_USAGE,
    TOKEN_ENV,
    Api,
    Failed,
    NoAnswer,
    clean,
    error_text,
    gateway_options,
)
from gateway_api.cli_config import check_config, summary
from gateway_api.cli_output import (
    HEALTH_STYLE,
    STATUS_STYLE,
    age,
    compact,
    print_json,
    print_table,
    progress,
)

if TYPE_CHECKING:
    from reach.config import ReachSettings

__all__ = [
    "COMMANDS",
    "CONNECT_TIMEOUT_S",
    "EXIT_FAILED",
    "EXIT_UNREACHABLE",
    "EXIT_USAGE",
    "HEALTH_STYLE",
    "INVOKE_GRACE_S",
    "STATUS_STYLE",
    "TOKEN_ENV",
    "Api",
    "Failed",
    "NoAnswer",
    "add_parser",
    "age",
    "check_config",
    "clean",
    "cmd_agents",
    "cmd_capabilities",
    "cmd_invoke",
    "compact",
    "gateway_options",
    "gateway_url",
    "main",
    "print_json",
    "print_table",
    "progress",
    "summary",
]

COMMANDS = frozenset({"invoke", "agents", "capabilities", "config"})
# A sync invoke answers by its deadline; this much more before the CLI gives up waiting.
INVOKE_GRACE_S = 30.0


# ---------------------------------------------------------------------------------------------
# arguments


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
    inv.add_argument(
        "--context-id",
        metavar="ID",
        help="go on with a conversation: the RequestID of one of its requests",
    )

    agents = sub.add_parser(
        "agents",
        parents=[gateway],
        help="registered instances: protocol, health, checks, in-flight, last heartbeat; "
        "add PROTOCOL URL --capability NAME, remove ID (instances registered by URL)",
        usage="reach agents [CAPABILITY] | add {a2a|mcp} URL --capability NAME "
        "[--instance-id ID] | remove ID",
    )
    agents.add_argument("capability", nargs="?", help="only this capability")
    cli_agents.add_arguments(agents)

    sub.add_parser("capabilities", parents=[gateway], help="capabilities and instance counts")

    cli_config.add_parser(sub)


def main(settings: ReachSettings | None, args: argparse.Namespace) -> int:
    """Run one of `COMMANDS`. Without `settings` (what `reach` passes) the gateway is
    `--gateway`, else the configured one read from the file and the environment alone
    (`cli_address`); `config check` loads its own."""
    try:
        if args.command == "config":
            return check_config(args)
        api = Api(
            gateway_url(settings, args),
            args.token or os.environ.get(TOKEN_ENV) or None,
        )
        with api:
            if args.command == "invoke":
                return cmd_invoke(api, args)
            if args.command == "agents" and (args.capability in cli_agents.ACTIONS or args.words):
                return cli_agents.main(api, args)
            if args.command == "agents":
                return cmd_agents(api, args)
            return cmd_capabilities(api, args)
    except Failed as exc:
        print(f"error: {exc}", file=sys.stderr)
        return exc.code
    except KeyboardInterrupt:
        return 130


def gateway_url(settings: ReachSettings | None, args: argparse.Namespace) -> str:
    """`--gateway`, else the settings' gateway, else the configured one (without loading the
    settings model: `cli_address`)."""
    if args.gateway:
        return str(args.gateway)
    if settings is not None:
        return settings.gateway_url
    from gateway_api.cli_address import configured_gateway_url

    return configured_gateway_url(getattr(args, "config", None))


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
    if args.request_id:
        request_id = args.request_id
    else:
        from reach.messages import new_request_id  # the one format; it loads pydantic

        request_id = new_request_id()
    body: dict[str, Any] = {
        "request_id": request_id,
        "target": args.capability,
        "operation": args.operation,
        "payload": payload,
    }
    for key in ("timeout_ms", "callback", "idempotency_key", "routing_key", "context_id"):
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
    error = data.get("error")
    if outcome == "timeout" and isinstance(error, dict) and error.get("outcome_unknown"):
        # Sent and never answered: it may have run, and a repeat may run it again; the
        # envelope's own words say when one is harmless (its key, its operation).
        hint = (
            f" — it may have run: look (reach trace {rid}) before sending it again; to wait "
            "longer: --timeout-ms MS"
        )
        if getattr(args, "idempotency_key", None):
            # The key keeps this timeout: the same key with a longer --timeout-ms replays it.
            hint = (
                f" — it may have run: look (reach trace {rid}) before sending it again; its "
                "idempotency key keeps this timeout, so a longer --timeout-ms needs a new "
                "--idempotency-key, and only once the trace shows it did not run"
            )
    elif outcome == "timeout":
        # Without --timeout-ms the deadline is the operation's or policy.default_timeout_ms (5 s).
        hint = " — never sent; to wait longer: --timeout-ms MS"
    print(f"error: {error_text(data)} (HTTP {status}){hint}", file=sys.stderr)
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
