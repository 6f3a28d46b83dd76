"""Step 1, identify: who calls, in which trace, with which idempotency key.

Every front hands the door its request's metadata as one mapping of lower-case names to the
first value of each (HTTP headers, gRPC metadata, an A2A or MCP front's equivalents), and
this one function reads it. The names are HTTP's, for every front:

- `authorization`: the bearer token; with tokens required, its principal is the caller;
- `x-reach-caller`: the caller's own name when tokens are off (with a token it may only repeat
  the token's principal);
- `traceparent`: W3C trace context, passed on to the agent unchanged;
- `idempotency-key`: an alias of the body's `idempotency_key` (the two must agree).

Which tokens invoke (`docs/security.md`): caller tokens, and admin tokens (as their principal,
under the same rules); an agent token registers and answers but does not call (403), so a
leaked agent token reaches only what it serves. An agent that also calls holds a caller token.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from agent_reach_proto import wire
from reach import acceptance
from reach.errors import Forbidden
from reach.security.auth import Auth

# The caller's side of the wire contract, as every front names it (lower case).
AUTHORIZATION = wire.GRPC_AUTHORIZATION
CALLER = wire.CALLER
TRACEPARENT = wire.TRACEPARENT
IDEMPOTENCY_KEY = wire.IDEMPOTENCY_KEY

Metadata = Mapping[str, str]


@dataclass(frozen=True, slots=True)
class Identity:
    caller: str
    traceparent: str | None = None
    idempotency_key: str | None = None  # the metadata's; the body may repeat it


def identify(metadata: Metadata, auth: Auth | None) -> Identity:
    """The request's identity from its metadata; 401/403/422 name what is wrong.

    `auth` None: a bare gateway without a token store (unit tests), where the caller is the
    name it gives itself."""
    claimed = acceptance.caller_header(metadata.get(CALLER))
    if auth is None:
        caller = claimed or "anonymous"
    else:
        principal = auth.caller(metadata.get(AUTHORIZATION), claimed)
        if principal.kind == "agent":
            raise Forbidden(
                f"token {principal.token_id} of {principal.name!r} is an agent token: it "
                "registers and answers, it does not invoke; an agent that calls others holds a "
                "caller token too (reach tokens issue --principal NAME)"
            )
        caller = principal.name
    return Identity(
        caller=caller,
        traceparent=acceptance.traceparent_header(metadata.get(TRACEPARENT)),
        idempotency_key=acceptance.idempotency_key_header(metadata.get(IDEMPOTENCY_KEY)),
    )
