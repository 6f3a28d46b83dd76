"""The numbers behind what Reach accepts, and where each comes from (see `reach.acceptance`).

A leaf module: configuration validates against these, the acceptance rules enforce them.
"""

from __future__ import annotations

from dataclasses import dataclass

TEMPORAL_PAYLOAD_LIMIT_BYTES = 2 * 1024 * 1024  # Temporal's `limit.blobSize.error` default
ENVELOPE_RESERVE_BYTES = 64 * 1024  # ids, URLs, error text around a payload in one blob
DEFAULT_MAX_MESSAGE_BYTES = 1024 * 1024
BODY_OVERHEAD_BYTES = 64 * 1024
# pydantic's JSON decoder stops at 200 levels, and a payload sits up to three levels down in
# Reach's own messages; 64 leaves room and is deeper than any real document.
MAX_DEPTH = 64
MAX_CHECKS_BYTES = 16 * 1024  # a heartbeat's self-check report


def max_message_ceiling(payload_limit_bytes: int) -> int:
    """The largest `max_message_bytes` a Temporal payload limit can carry."""
    return payload_limit_bytes - ENVELOPE_RESERVE_BYTES


@dataclass(frozen=True)
class Limits:
    """What one gateway enforces, derived from its settings."""

    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES
    max_depth: int = MAX_DEPTH

    @property
    def max_body_bytes(self) -> int:
        # JSON escapes make a body up to six times what it decodes to ("\u0001" is 6 for 1,
        # "\u00e9" 6 for 2): a payload within the limit always fits, however it was escaped.
        return 6 * self.max_message_bytes + BODY_OVERHEAD_BYTES
