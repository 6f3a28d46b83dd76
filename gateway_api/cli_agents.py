"""`reach agents add PROTOCOL URL --capability NAME [--instance-id ID]` and `reach agents
remove ID`: register an A2A agent or an MCP server by its URL, and remove one
(`docs/instances-by-url.md`). `reach agents [CAPABILITY]` lists instances (`cli_view`).

Standard library only at import (the CLI's start-up, issue 26); the client is `cli_api`.
"""

from __future__ import annotations

import argparse
from typing import Any

from gateway_api.cli_api import EXIT_USAGE, Api, Failed, clean
from gateway_api.cli_output import print_json

ACTIONS = frozenset({"add", "remove"})


def add_arguments(agents: argparse.ArgumentParser) -> None:
    """What `add` and `remove` take, beside the listing's optional CAPABILITY."""
    agents.add_argument("words", nargs="*", help=argparse.SUPPRESS)
    agents.add_argument(
        "--capability",
        dest="serves",
        metavar="NAME",
        help="add: the capability the instance serves",
    )
    agents.add_argument(
        "--instance-id", metavar="ID", help="add: its instance id (default: derived from the URL)"
    )


def main(api: Api, args: argparse.Namespace) -> int:
    if args.capability == "add":
        return cmd_add(api, args)
    if args.capability == "remove":
        return cmd_remove(api, args)
    raise Failed("usage: reach agents [CAPABILITY] | add ... | remove ID", EXIT_USAGE)


def cmd_add(api: Api, args: argparse.Namespace) -> int:
    if len(args.words) != 2 or not args.serves:
        raise Failed(
            "usage: reach agents add {a2a|mcp} URL --capability NAME [--instance-id ID]",
            EXIT_USAGE,
        )
    protocol, url = args.words
    body: dict[str, Any] = {"protocol": protocol, "service_address": url, "capability": args.serves}
    if args.instance_id:
        body["instance_id"] = args.instance_id
    _, ack = api.request("POST", "/reach/agents", body=body)
    if args.json:
        print_json(ack)
        return 0
    operations = [str(op.get("name")) for op in ack.get("operations") or []]
    print(
        clean(
            f"registered {ack.get('instance_id')} ({protocol} at {ack.get('address', url)}) "
            f"for {ack.get('capability')}: {len(operations)} operation(s)"
            + (f": {', '.join(operations)}" if operations else "")
        )
    )
    details = ack.get("details") or {}
    if details:
        print(clean("details: " + ", ".join(f"{k}={v}" for k, v in sorted(details.items()))))
    print(
        clean(
            f"probed every {ack.get('heartbeat_interval')}s; "
            f"remove: reach agents remove {ack.get('instance_id')}"
        )
    )
    return 0


def cmd_remove(api: Api, args: argparse.Namespace) -> int:
    if len(args.words) != 1:
        raise Failed("usage: reach agents remove ID", EXIT_USAGE)
    (instance_id,) = args.words
    api.request("DELETE", f"/reach/agents/{instance_id}", ok=(204,))
    if args.json:
        print_json({"removed": instance_id})
    else:
        print(clean(f"removed {instance_id}"))
    return 0
