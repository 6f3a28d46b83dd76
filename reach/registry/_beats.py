"""Heartbeats applied in batches: one store read (only when a session or an owner is to be
checked) and one store write for the whole batch, whatever its size. A single heartbeat is a
batch of one, so both take the same path and answer the same refusals."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field

from reach.errors import (
    Forbidden,
    InstanceReplaced,
    PayloadTooLarge,
    ReachError,
    UnknownInstance,
)
from reach.registry._records import HEALTH, Beat, brief_of
from reach.registry.models import HealthReport
from reach.store import Record

MAX_HEARTBEAT_BATCH = 1000
"""Entries one batched heartbeat may carry (a bigger batch is refused whole, 413)."""

BeatOutcome = Beat | ReachError
"""Each entry's answer: the refreshed instance, or the refusal of that entry alone."""


@dataclass(frozen=True, slots=True)
class BeatEntry:
    """One instance's heartbeat: its report and, when the agent knows it, the `session` its
    Join was acked with (proof that it still holds the instance_id)."""

    instance_id: str
    report: HealthReport
    session: str | None = None
    head: str | None = field(default=None, compare=False, repr=False)  # `kept`


def check_batch(size: int) -> None:
    if size > MAX_HEARTBEAT_BATCH:
        raise PayloadTooLarge(
            f"a batched heartbeat carries {size} entries, more than {MAX_HEARTBEAT_BATCH}; "
            "send them in several batches"
        )


def refusals(
    entries: Sequence[BeatEntry], stored: Sequence[Record | None], principal: str | None
) -> list[ReachError | None]:
    """What the records as read refuse, entry by entry (None: go on). `principal`: an agent
    token's name, which may beat only the instances it registered (as `Registry.owned`)."""
    out: list[ReachError | None] = []
    for entry, record in zip(entries, stored, strict=True):
        brief = brief_of(record) if record is not None else None
        if brief is None and record is not None and principal is not None:
            # Unreadable: who registered it cannot be checked, so no token's beat is let write
            # it (the check failed open: anyone's token refreshed it and wrote its health).
            out.append(
                Forbidden(
                    f"instance {entry.instance_id!r}: its record cannot be read, so the "
                    "principal that registered it cannot be checked"
                )
            )
        elif brief is None:  # not registered (or unreadable, no owner to check): the write
            out.append(None)  # answers unknown_instance
        elif principal is not None and brief.principal != principal:
            out.append(
                Forbidden(f"instance {entry.instance_id!r} was registered by another principal")
            )
        elif entry.session is not None and brief.session not in (None, entry.session):
            out.append(
                InstanceReplaced(
                    f"instance_id {entry.instance_id!r} was joined again by another process "
                    f"(at {brief.address}); this one no longer holds it. It may join again "
                    "once that one has left or expired, or use an instance_id of its own"
                )
            )
        else:
            out.append(None)
    return out


def health_head(report: HealthReport) -> str:
    """The health part a heartbeat writes, up to its time (`health_fields`)."""
    values = {"status": report.status, "checks": report.checks, "inflight": report.inflight}
    return json.dumps(values)[:-1] + ', "last_seen": '


def health_fields(entry: BeatEntry, now: float) -> dict[str, str]:
    """The record's health part a heartbeat writes: what json.dumps makes of its status,
    checks, inflight and last_seen, in that order."""
    head = entry.head if entry.head is not None else health_head(entry.report)
    return {HEALTH: f"{head}{now!r}}}"}


def kept(entry: BeatEntry) -> BeatEntry:
    """The entry with its health part made once, for a front that keeps entries to apply
    again (the same report every interval: its checks are encoded once, not per beat)."""
    if entry.head is not None:
        return entry
    return BeatEntry(entry.instance_id, entry.report, entry.session, health_head(entry.report))


def beat_of(entry: BeatEntry, previous: Record | None) -> tuple[BeatOutcome, str | None]:
    """The entry's answer from the record its write replaced, and the status it held before
    (None: no record, the answer is unknown_instance)."""
    before = brief_of(previous) if previous is not None else None
    if previous is None or before is None:
        refused = UnknownInstance(f"instance {entry.instance_id!r} is not registered; join again")
        return refused, None
    report = entry.report
    beat = Beat(
        entry.instance_id,
        previous.group,
        report.status,
        report.inflight,
        before.heartbeat_interval,
    )
    return beat, before.status
