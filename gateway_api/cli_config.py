"""`reach config check`: the configuration validated as the gateway would load it, without a
gateway (exit 0 and a summary when valid, 1 and the field at fault when not).
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import TYPE_CHECKING

from gateway_api.cli_api import EXIT_FAILED, TOKEN_ENV
from gateway_api.cli_output import print_json
from gateway_api.cli_tokens import tokens_home

if TYPE_CHECKING:
    from reach.config import ReachSettings


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
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


def check_config(args: argparse.Namespace) -> int:
    # Here, not above: the parser is built from this module, and `reach --help` should not
    # wait for the settings model (issue 26).
    from reach.config import ConfigError, config_file
    from reach.settings_checks import load_checked_settings

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
        ("auth", f"{s.auth.mode}, {len(s.rules)} rules, tokens in {tokens_home(s)}"),
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
