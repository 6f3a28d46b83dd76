"""An A2A agent's card, read and checked: what `A2AConnector.discover` turns into a `Discovery`.

The card is fetched from `{base}/.well-known/agent-card.json` (at most `MAX_CARD_BYTES`, never
held whole past that), parsed as the a2a-sdk's `AgentCard`, and refused with an
`InvalidRequest` naming what is wrong: not JSON, not an object, wrong field types, no name, no
JSON-RPC interface, an interface URL that is not http(s), that downgrades an https card to
http, or that the address guard refuses (the forgery guard: a card may not send Reach to the
metadata address or the gateway's own network), skill ids that cannot be operation names or
appear twice. Reach only ever connects to the card's own URL and its JSON-RPC interface URL;
the other URLs a card may hold (provider, documentation, icon) are never fetched.
"""

from __future__ import annotations

import hashlib
import json
import re
from typing import Any

from a2a.types import AgentCard
from google.protobuf import json_format

from connectors._a2a_wire import A2A_VERSION
from connectors._address import check_http_address
from reach.errors import InvalidRequest, ReachError
from reach.registry.models import MAX_DESCRIPTION_CHARS, Discovery, OperationDeclaration
from reach.security.netguard import AddressGuard

CARD_PATH = "/.well-known/agent-card.json"
MAX_CARD_BYTES = 256 * 1024
MAX_SKILLS = 256
_OPERATION = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]{0,63}$")


def card_url(address: str) -> str:
    return address.rstrip("/") + CARD_PATH


def _refuse(address: str, why: str) -> InvalidRequest:
    return InvalidRequest(f"the agent card at {card_url(address)[:120]}: {why}")


def parse_card(address: str, data: Any) -> AgentCard:
    if not isinstance(data, dict):
        raise _refuse(address, "is not a JSON object")
    try:
        return json_format.ParseDict(data, AgentCard(), ignore_unknown_fields=True)
    except (json_format.ParseError, ValueError, TypeError) as exc:
        raise _refuse(address, f"is not an A2A AgentCard: {str(exc)[:300]}") from None


def rpc_interface(address: str, card: AgentCard) -> tuple[str, str]:
    """(URL, protocol version) of the card's JSON-RPC interface, checked by its syntax."""
    for interface in card.supported_interfaces:
        if interface.protocol_binding.upper() != "JSONRPC":
            continue
        version = interface.protocol_version
        if version and version.split(".")[0] != A2A_VERSION.split(".")[0]:
            raise _refuse(
                address, f"its JSON-RPC interface speaks A2A {version}; Reach speaks {A2A_VERSION}"
            )
        url = interface.url
        if "://" not in url:
            raise _refuse(address, f"JSON-RPC URL {url[:80]!r} is not an http(s) URL")
        try:
            normalized = check_http_address(url)
        except InvalidRequest as exc:
            raise _refuse(address, f"JSON-RPC URL: {exc.message}") from None
        if address.lower().startswith("https://") and not normalized.startswith("https://"):
            raise _refuse(address, f"JSON-RPC URL {url[:80]!r} downgrades https to http")
        return url, version  # as written: a path's trailing slash can matter to its server
    raise _refuse(address, "names no JSON-RPC interface (supportedInterfaces, protocolBinding)")


def operations_of(address: str, card: AgentCard) -> list[OperationDeclaration]:
    if len(card.skills) > MAX_SKILLS:
        raise _refuse(address, f"lists {len(card.skills)} skills; at most {MAX_SKILLS}")
    seen: set[str] = set()
    operations = []
    for skill in card.skills:
        if not _OPERATION.match(skill.id):
            raise _refuse(address, f"skill id {skill.id[:80]!r} cannot be an operation name")
        if skill.id in seen:
            raise _refuse(address, f"skill id {skill.id!r} appears twice")
        seen.add(skill.id)
        text = skill.description or skill.name
        operations.append(
            OperationDeclaration(name=skill.id, description=text[:MAX_DESCRIPTION_CHARS] or None)
        )
    return operations


async def discovery_of(
    address: str, raw: bytes, etag: str | None, guard: AddressGuard | None
) -> Discovery:
    """The Discovery a card's bytes describe, every URL Reach will call vetted."""
    try:
        data = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:
        raise _refuse(address, f"is not JSON: {str(exc)[:200]}") from None
    card = parse_card(address, data)
    if not card.name:
        raise _refuse(address, "has no name")
    url, version = rpc_interface(address, card)
    if guard is not None:
        try:
            await guard.check_url(url)
        except ReachError as exc:
            raise _refuse(address, f"JSON-RPC URL {url[:80]!r}: {exc.message}") from None
    canonical = json.dumps(data, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return Discovery(
        operations=operations_of(address, card),
        version=hashlib.sha256(canonical.encode()).hexdigest()[:16],
        etag=etag,
        details={
            "url": url,
            "name": card.name[:200],
            "protocol_version": version or A2A_VERSION,
            "streaming": card.capabilities.streaming,
            "push_notifications": card.capabilities.push_notifications,
        },
    )
