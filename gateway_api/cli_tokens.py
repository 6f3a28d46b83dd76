"""`reach tokens …`: issue, list and revoke tokens straight in the token store (R18).

The store is the one the gateways read (the tokens file with the memory registry, Redis with
the redis registry), so a change reaches every gateway within a second, with no gateway
involved and no admin token needed: whoever runs this can already write the store. The admin
API (`/reach/admin/tokens`) does the same over HTTP.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from reach.config import ReachSettings
    from reach.security.tokens import Kind, TokenRecord

_DURATION = re.compile(r"^(\d+(?:\.\d+)?)([smhd]?)$")
_UNIT_S = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86_400}


def duration_s(text: str) -> float:
    """`90`, `90s`, `15m`, `12h`, `30d` -> seconds."""
    found = _DURATION.match(text.strip())
    if not found or float(found.group(1)) <= 0:
        raise argparse.ArgumentTypeError(f"{text!r}: a duration like 3600, 15m, 12h or 30d")
    return float(found.group(1)) * _UNIT_S[found.group(2)]


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    tokens = sub.add_parser("tokens", help="issue, list and revoke access tokens (R18)")
    what = tokens.add_subparsers(dest="tokens_command", required=True)
    new = what.add_parser("issue", help="issue a token; its secret is printed once")
    new.add_argument("--principal", required=True, help="the caller's or agent's name")
    kind = new.add_mutually_exclusive_group()
    kind.add_argument("--agent", action="store_true", help="an agent token (Join, heartbeat)")
    kind.add_argument("--admin", action="store_true", help="an admin token (the admin API)")
    new.add_argument(
        "--capability",
        action="append",
        default=[],
        metavar="NAME",
        help="with --agent: a capability it may serve (repeat; * for any)",
    )
    new.add_argument("--ttl", type=duration_s, help="expires after e.g. 12h or 30d")
    new.add_argument("--note", help="a note shown in lists")
    new.add_argument("--json", action="store_true", help="machine-readable output")
    listing = what.add_parser("list", help="every token, without secrets")
    listing.add_argument("--json", action="store_true")
    revoke = what.add_parser("revoke", help="revoke a token by id (every gateway within 1 s)")
    revoke.add_argument("token_id")
    secret = what.add_parser(
        "webhook-secret", help="the secret a caller verifies its signed callbacks with"
    )
    secret.add_argument("caller")


def main(settings: ReachSettings, args: argparse.Namespace) -> int:
    import asyncio

    return asyncio.run(_main(settings, args))


async def _main(settings: ReachSettings, args: argparse.Namespace) -> int:
    # Here, not above: the parser is built from this module, and `reach --help` should not
    # wait for the token store and its Redis client (issue 26).
    from reach.security.audit import AuditLog
    from reach.security.guard import token_store
    from reach.security.tokens import issue
    from reach.security.webhooks import caller_secret
    from reach.store import create_store

    if args.tokens_command == "webhook-secret":
        if settings.security.webhook_key is None:
            print(
                "error: security.webhook_key is not set: callbacks are sent unsigned",
                file=sys.stderr,
            )
            return 1
        print(caller_secret(settings.security.webhook_key.get_secret_value(), args.caller))
        return 0
    store = create_store(settings.registry) if settings.registry.type == "redis" else None
    tokens = token_store(settings, store)
    where = tokens_home(settings)
    audit = AuditLog(settings.audit)
    try:
        if args.tokens_command == "issue":
            kind: Kind = "agent" if args.agent else "admin" if args.admin else "caller"
            try:
                secret, record = issue(
                    args.principal, kind, args.capability, ttl_s=args.ttl, note=args.note
                )
            except ValueError as exc:
                print(f"error: {exc}", file=sys.stderr)
                return 2
            first = settings.auth.mode == "auto" and not await tokens.load()
            await tokens.save(record)
            audit.record(
                "token_issued",
                principal="cli",
                token_id=record.id,
                subject=record.principal,
                kind=record.kind,
                capabilities=record.capabilities,
            )
            if args.json:
                print(json.dumps({"token": secret, "record": _view(record)}))
            else:
                print(f"token {record.id} for {record.principal} ({record.kind})")
                print(f"  {secret}")
                print("store it now: it is not shown again (only its hash is kept)")
                print(f"kept in {where}")
            if first:
                print(first_token_warning(settings), file=sys.stderr)
            return 0
        if args.tokens_command == "list":
            records = sorted(await tokens.load(), key=lambda r: r.created_at)
            if args.json:
                print(json.dumps([_view(r) for r in records], indent=1))
            else:
                _table(records, where)
            return 0
        try:
            record = await tokens.revoke(args.token_id)
        except LookupError as exc:
            print(f"error: {exc.args[0]}", file=sys.stderr)
            return 1
        audit.record("token_revoked", principal="cli", token_id=record.id)
        print(f"revoked token {record.id} of {record.principal} (in {where})")
        return 0
    finally:
        audit.flush_now()
        if store is not None:
            await store.aclose()


def first_token_warning(settings: ReachSettings) -> str:
    """What the first token does in `auth.mode: auto`, said when it is issued."""
    timeout = settings.registry.heartbeat_timeout
    return f"""
warning: this is the first token, so tokens are now required (auth.mode auto closes the door
  once one exists, and revoking it does not reopen it). Every gateway on this token store now
  refuses requests without a valid token (401): callers need a caller token, agents an agent
  token. Agents that joined without a token get 401 on their next heartbeat and are evicted
  {timeout:g} s later (registry.heartbeat_timeout). Give each one a token and restart it with it:
    reach tokens issue --principal NAME --agent --capability CAPABILITY
    REACH_AGENT_TOKEN=<token> python my_agent.py     (or AgentRuntime(..., token=...))
  `reach up` does this for its own demo agents."""


def _view(record: TokenRecord) -> dict[str, object]:
    out = record.model_dump(mode="json", exclude={"sha256"})
    out["state"] = record.state(time.time())
    return out


def tokens_home(settings: ReachSettings) -> str:
    """Where this command reads and writes tokens, as the gateway does (`token_store`)."""
    if settings.registry.type == "redis":
        return "Redis (registry.redis_url; every gateway on it)"
    path = Path(settings.auth.tokens_file)
    return f"{path.absolute()} (auth.tokens_file)"


def _table(records: list[TokenRecord], where: str) -> None:
    if not records:
        print(f"no tokens in {where} (auth.mode auto: the gateway is open, on loopback only)")
        return
    print(f"tokens in {where}")
    now = time.time()
    rows = [("ID", "PRINCIPAL", "KIND", "CAPABILITIES", "STATE", "EXPIRES")]
    for r in records:
        expires = (
            time.strftime("%Y-%m-%d %H:%M", time.localtime(r.expires_at)) if r.expires_at else "-"
        )
        caps = ",".join(r.capabilities) or "-"
        rows.append((r.id, r.principal, r.kind, caps, r.state(now), expires))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    for row in rows:
        print("  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip())
