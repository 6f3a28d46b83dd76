"""The requests this gateway refused at the door once they had a RequestID, kept a while so
that `reach trace` (GET /reach/requests/{id}/timeline) can say the request was refused and
why, instead of only "no request with id": a refused request never started, so Temporal has
no history of it. What the audit trail records, held in memory: the most recent
`MAX_KEPT` refusals for `KEEP_S`, on the gateway that refused them.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass

from reach.security.tokens import Principal

MAX_KEPT = 4096
KEEP_S = 3600.0


@dataclass(frozen=True, slots=True)
class Refusal:
    caller: str
    status: int
    error_type: str
    message: str
    at: float  # time.time()

    def story(self, request_id: str) -> str:
        when = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(self.at))
        return (
            f"request {request_id!r} was refused at the door at {when} and never started, so "
            f"it has no timeline: {self.status} {self.error_type}: {self.message}"
        )


class DoorRefusals:
    """RequestID -> the last refusal of it, oldest dropped first."""

    def __init__(self, max_kept: int = MAX_KEPT, keep_s: float = KEEP_S) -> None:
        self.max_kept = max_kept
        self.keep_s = keep_s
        self._kept: OrderedDict[str, Refusal] = OrderedDict()

    def note(
        self, request_id: str, caller: str, status: int, error_type: str, message: str
    ) -> None:
        kept = self._kept
        kept.pop(request_id, None)
        kept[request_id] = Refusal(caller, status, error_type, message, time.time())
        while len(kept) > self.max_kept:
            kept.popitem(last=False)

    def get(self, request_id: str, reader: Principal | None = None) -> Refusal | None:
        """The refusal, if still kept and `reader` may see it (with tokens required: its
        caller or an admin, as for the request itself)."""
        refusal = self._kept.get(request_id)
        if refusal is None:
            return None
        if time.time() - refusal.at > self.keep_s:
            del self._kept[request_id]
            return None
        if reader is not None and reader.kind != "admin" and reader.name != refusal.caller:
            return None
        return refusal
