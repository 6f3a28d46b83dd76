"""`reach certs …`: a development CA for mTLS between Reach and its agents (R18).

    reach certs init  [--dir DIR] [--trust-domain TD] [--days 365] [--force]
    reach certs issue --agent ID [--hours 24] [--dir DIR] [--trust-domain TD]

DIR defaults to the directory of `security.tls.ca_file` (.reach/certs) and TD to
`security.tls.trust_domain` (reach.local), so the files land where the configuration looks.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from reach.config import ReachSettings

# reach.security.certs' DEFAULT_CA_DAYS and DEFAULT_AGENT_HOURS, copied because that module
# loads the cryptography stack, and the parser (`reach --help`) must not (issue 26;
# tests/unit/test_cli_start.py checks they are equal).
DEFAULT_CA_DAYS = 365
DEFAULT_AGENT_HOURS = 24


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    certs = sub.add_parser("certs", help="a development CA and certificates for mTLS (R18)")
    what = certs.add_subparsers(dest="certs_command", required=True)
    init = what.add_parser("init", help="create the CA and Reach's own certificate")
    init.add_argument("--dir", help="where to write (default: security.tls.ca_file's directory)")
    init.add_argument("--trust-domain", help="default: security.tls.trust_domain")
    init.add_argument("--days", type=int, default=DEFAULT_CA_DAYS, help="validity (default 365)")
    init.add_argument("--force", action="store_true", help="replace an existing CA")
    issue = what.add_parser("issue", help="issue a short-lived certificate for an agent")
    issue.add_argument("--agent", required=True, metavar="ID", help="the agent's instance id")
    issue.add_argument(
        "--hours", type=float, default=DEFAULT_AGENT_HOURS, help="validity (default 24)"
    )
    issue.add_argument("--dir", help="the CA's directory (default: security.tls.ca_file's)")
    issue.add_argument("--trust-domain", help="default: security.tls.trust_domain")


def cmd_certs(settings: ReachSettings, args: argparse.Namespace) -> int:
    from reach.security.certs import (
        CertificateError,
        agent_server_name,
        agent_spiffe_id,
        expires_at,
        init_ca,
        issue_agent,
    )

    tls = settings.security.tls
    directory = Path(args.dir) if args.dir else Path(tls.ca_file).parent
    trust_domain = args.trust_domain or tls.trust_domain
    try:
        if args.certs_command == "init":
            files = init_ca(directory, trust_domain, args.days, force=args.force)
            print(f"CA certificate     {files.ca_cert}")
            print(f"CA key             {files.ca_key}  (keep it secret; only `issue` needs it)")
            print(f"Reach certificate  {files.reach_cert}")
            print(f"Reach key          {files.reach_key}")
            print(f"Reach identity     {files.reach_id}")
            print(
                "Turn mTLS on with security.tls.enabled: true (REACH_SECURITY__TLS__ENABLED=true)"
            )
            return 0
        cert, key = issue_agent(directory, args.agent, trust_domain, args.hours)
        print(f"agent certificate  {cert}")
        print(f"agent key          {key}")
        print(f"CA certificate     {directory / 'ca.pem'}")
        print(f"identity           {agent_spiffe_id(args.agent, trust_domain)}")
        print(f"server name        {agent_server_name(args.agent, trust_domain)}")
        print(f"valid until        {expires_at(cert):%Y-%m-%d %H:%M:%S} UTC")
        print(
            f"run the agent with REACH_AGENT_TLS_CERT={cert} REACH_AGENT_TLS_KEY={key} "
            f"REACH_AGENT_TLS_CA={directory / 'ca.pem'}"
        )
        return 0
    except (CertificateError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
