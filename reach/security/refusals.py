"""The requests this gateway refused at the door once they had a RequestID, kept a while so
that `reach trace` (GET /reach/requests/{id}/timeline) can say the request was refused and
why, instead of only "no request with id": a refused request never started, so Temporal has
no history of it. What the audit trail records, held in memory: the most recent
`MAX_KEPT` refusals for `KEEP_S`, on the gateway that refused them.

A RequestID is the caller's own (another caller's use of it is refused, never attached), so a
refusal is kept under its caller and its RequestID: a second caller refused under the same id
keeps its own record beside the first's, and each caller's trace reads its own. An admin (or
anyone, when tokens are not required) reads the latest of them.
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
    """(caller, RequestID) -> that caller's last refusal under it, oldest dropped first."""

    def __init__(self, max_kept: int = MAX_KEPT, keep_s: float = KEEP_S) -> None:
        self.max_kept = max_kept
        self.keep_s = keep_s
        self._kept: OrderedDict[tuple[str, str], Refusal] = OrderedDict()
        self._callers: dict[str, list[str]] = {}  # RequestID -> its callers, latest last

    def note(
        self, request_id: str, caller: str, status: int, error_type: str, message: str
    ) -> None:
        kept, key = self._kept, (caller, request_id)
        if kept.pop(key, None) is not None:
            self._callers[request_id].remove(caller)
        kept[key] = Refusal(caller, status, error_type, message, time.time())
        self._callers.setdefault(request_id, []).append(caller)
        while len(kept) > self.max_kept:
            self._forget(*kept.popitem(last=False)[0])

    def get(self, request_id: str, reader: Principal | None = None) -> Refusal | None:
        """The refusal `reader` may see, if still kept: with tokens required, its own caller's
        (an admin: the latest of any caller's), as for the request itself."""
        callers = self._callers.get(request_id)
        if not callers:
            return None
        if reader is not None and reader.kind != "admin":
            caller = reader.name if reader.name in callers else None
        else:
            caller = callers[-1]
        if caller is None:
            return None
        refusal = self._kept[(caller, request_id)]
        if time.time() - refusal.at > self.keep_s:
            del self._kept[(caller, request_id)]
            self._forget(caller, request_id)
            return None
        return refusal

    def _forget(self, caller: str, request_id: str) -> None:
        callers = self._callers.get(request_id)
        if callers is not None:
            callers.remove(caller)
            if not callers:
                del self._callers[request_id]
