"""The A2A front's agent cards, built as the SDK's `AgentCard` (and so checked by its schema):

- one per capability, at `/a2a/{capability}/.well-known/agent-card.json`: a skill per
  operation its instances serve (routable ones first: their declarations' descriptions), the
  JSON-RPC binding at `/a2a/{capability}`, and Reach's bearer tokens as its security scheme;
- one for the gateway, at `/.well-known/agent-card.json`: a skill per capability, naming its
  card, and each capability's binding among the interfaces.

Both show only what the caller's rules let it call (`Allowed`), as the MCP front's tools/list.

URLs are the gateway's public URL (`public_url`, else its listen address), never the request's
Host header.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from a2a.types import (
    AgentCapabilities,
    AgentCard,
    AgentInterface,
    AgentSkill,
    HTTPAuthSecurityScheme,
    SecurityRequirement,
    SecurityScheme,
)
from a2a.utils.constants import AGENT_CARD_WELL_KNOWN_PATH, PROTOCOL_VERSION_1_0, TransportProtocol

import reach
from reach.registry.models import InstanceRecord
from reach.security.guard import Guard

PREFIX = "/a2a"
BEARER = "bearer"
INPUT_MODES = ["application/json", "text/plain"]
# (capability, operation) -> may the caller call it: its rules, as the door decides them.
Allowed = Callable[[str, str], bool]
OUTPUT_MODES = ["application/json"]


def binding_url(base: str, capability: str) -> str:
    return f"{base}{PREFIX}/{capability}"


def card_url(base: str, capability: str) -> str:
    return f"{binding_url(base, capability)}{AGENT_CARD_WELL_KNOWN_PATH}"


def _interface(base: str, capability: str) -> AgentInterface:
    return AgentInterface(
        url=binding_url(base, capability),
        protocol_binding=TransportProtocol.JSONRPC,
        protocol_version=PROTOCOL_VERSION_1_0,
    )


def _common(card: AgentCard, tokens_required: bool) -> AgentCard:
    card.version = reach.__version__
    card.capabilities.CopyFrom(
        AgentCapabilities(streaming=True, push_notifications=True, extended_agent_card=False)
    )
    card.security_schemes[BEARER].CopyFrom(
        SecurityScheme(
            http_auth_security_scheme=HTTPAuthSecurityScheme(
                scheme="Bearer",
                description="A Reach token (`reach tokens issue`); its principal is the caller",
            )
        )
    )
    if tokens_required:
        requirement = SecurityRequirement()
        requirement.schemes[BEARER].SetInParent()
        card.security_requirements.append(requirement)
    card.default_input_modes.extend(INPUT_MODES)
    card.default_output_modes.extend(OUTPUT_MODES)
    return card


def allowed_for(guard: Guard | None, caller: str) -> Allowed | None:
    """What the caller's rules let it call, as the door decides it (None: no rules)."""
    if guard is None or not len(guard.rules):
        return None
    rules = guard.rules
    return lambda capability, operation: rules.decide(caller, capability, operation).allowed


def operations_of(
    instances: Sequence[InstanceRecord], capability: str = "", allowed: Allowed | None = None
) -> dict[str, str]:
    """Operation -> its description, over the routable instances (else all): the first
    description any of them declares. With `allowed`, only the operations of `capability`
    the caller may call (a denied caller learns nothing of what exists)."""
    serving = [i for i in instances if i.routable] or list(instances)
    found: dict[str, str] = {}
    for instance in serving:
        for name in instance.operations:
            declared = instance.declared.get(name)
            described = declared.description if declared is not None else None
            if not found.get(name) and described:
                found[name] = described
            found.setdefault(name, "")
    if allowed is not None:
        found = {name: text for name, text in found.items() if allowed(capability, name)}
    return dict(sorted(found.items()))


def capability_card(
    base: str,
    capability: str,
    instances: Sequence[InstanceRecord],
    tokens_required: bool,
    allowed: Allowed | None = None,
) -> AgentCard:
    operations = operations_of(instances, capability, allowed)
    card = AgentCard(
        name=capability,
        description=f"Capability {capability!r} through Agent-Reach: each message is one "
        f"durable request to one of its {len(instances)} instance(s); the skill is the "
        "message's metadata `operation`, or the only one",
    )
    card.supported_interfaces.append(_interface(base, capability))
    for name, description in operations.items():
        card.skills.append(
            AgentSkill(
                id=name,
                name=name,
                description=description or f"{capability}.{name}",
                tags=[capability],
                input_modes=INPUT_MODES,
                output_modes=OUTPUT_MODES,
            )
        )
    return _common(card, tokens_required)


def gateway_card(base: str, capabilities: Sequence[str], tokens_required: bool) -> AgentCard:
    card = AgentCard(
        name="Agent-Reach",
        description="An Agent-Reach gateway: every capability it routes is an A2A agent of "
        "its own (a skill here); call one through its own card's interface",
    )
    for capability in capabilities:
        card.supported_interfaces.append(_interface(base, capability))
        card.skills.append(
            AgentSkill(
                id=capability,
                name=capability,
                description=f"Capability {capability!r}: its card is {card_url(base, capability)}",
                tags=["capability"],
            )
        )
    return _common(card, tokens_required)
