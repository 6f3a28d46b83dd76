"""The numbers behind what Reach accepts, and where each comes from (see `reach.acceptance`).

A leaf module: configuration validates against these, the acceptance rules enforce them.
"""

from __future__ import annotations

from dataclasses import dataclass

TEMPORAL_PAYLOAD_LIMIT_BYTES = 2 * 1024 * 1024  # Temporal's `limit.blobSize.error` default
TEMPORAL_GRPC_LIMIT_BYTES = 4 * 1024 * 1024  # the largest gRPC message Temporal takes
# The most bytes of updates (late answers) in flight per workflow the embedded server allows
# (`history.maxInFlightUpdatePayloads`; Temporal's default is 20 MiB). A workflow task answers
# every admitted update with its payload inside one gRPC message, so this must stay far below it.
UPDATE_PAYLOADS_LIMIT_BYTES = 2 * 1024 * 1024
ENVELOPE_RESERVE_BYTES = 64 * 1024  # ids, URLs, error text around a payload in one blob
DEFAULT_MAX_MESSAGE_BYTES = 1024 * 1024
BODY_OVERHEAD_BYTES = 64 * 1024
# pydantic's JSON decoder stops at 200 levels, and a payload sits up to three levels down in
# Reach's own messages; 64 leaves room and is deeper than any real document.
MAX_DEPTH = 64
MAX_CHECKS_BYTES = 16 * 1024  # a heartbeat's self-check report


def max_message_ceiling(
    payload_limit_bytes: int, grpc_limit_bytes: int = TEMPORAL_GRPC_LIMIT_BYTES
) -> int:
    """The largest `max_message_bytes` Temporal can carry.

    One payload blob holds one message; one workflow task's completion can hold three (an
    accepted late answer, the callback delivery's input, and room for another), and a
    completion is one gRPC message.
    """
    return min(
        payload_limit_bytes - ENVELOPE_RESERVE_BYTES,
        (grpc_limit_bytes - ENVELOPE_RESERVE_BYTES) // 3,
    )


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
