"""How the registry keeps an instance in a store record: three fields, so that a heartbeat
writes only the health part and reads only the brief one."""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass

from reach.registry.models import HealthStatus, InstanceRecord
from reach.store import Record

log = logging.getLogger("reach.registry")

HEALTH_FIELDS = frozenset({"status", "checks", "inflight", "last_seen"})
"""What a heartbeat writes; the rest of a record is what the last join wrote."""

JOIN, HEALTH, BRIEF = "join", "health", "brief"
BRIEF_FIELDS = ("principal", "session", "address", "heartbeat_interval")
"""What a heartbeat reads of the join part, stored apart (`BRIEF`) so a heartbeat parses a
few dozen bytes, not the whole declaration."""


def fields_of(record: InstanceRecord) -> dict[str, str]:
    return {
        JOIN: record.model_dump_json(exclude=set(HEALTH_FIELDS)),
        HEALTH: record.model_dump_json(include=set(HEALTH_FIELDS)),
        BRIEF: json.dumps({name: getattr(record, name) for name in BRIEF_FIELDS}),
    }


@dataclass(frozen=True, slots=True)
class Beat:
    """What a heartbeat's answer needs of the instance it refreshed."""

    instance_id: str
    capability: str
    status: HealthStatus
    inflight: int
    heartbeat_interval: float


@dataclass(frozen=True, slots=True)
class Brief:
    principal: str | None
    session: str | None
    address: str
    heartbeat_interval: float
    status: str  # the health status the record held


def parse_whole(stored: Record) -> InstanceRecord:
    """The stored record parsed; raises what an unreadable one raises."""
    values = json.loads(stored.fields[JOIN]) | json.loads(stored.fields[HEALTH])
    return InstanceRecord.model_validate(values)


_STATUS_PREFIXES = ('{"status": "', '{"status":"')
"""How the health part begins as Reach writes it (json.dumps, pydantic): the status is read
from there without parsing the rest (the checks may be kilobytes)."""

_briefs: dict[str, tuple[str | None, str | None, str, float]] = {}
MAX_BRIEFS = 50_000
"""Brief fields parsed, by their text: a brief changes only at a Join, and every heartbeat
reads one, so most are parsed once (the cache is emptied when full)."""


def status_of(health: str) -> str:
    """A health part's status, read from its head when Reach wrote it."""
    for prefix in _STATUS_PREFIXES:
        if health.startswith(prefix):
            end = health.find('"', len(prefix))
            if end > 0:
                return health[len(prefix) : end]
    return str(json.loads(health).get("status", "ok"))


def _brief_values(raw: str) -> tuple[str | None, str | None, str, float]:
    found = _briefs.get(raw)
    if found is None:
        brief = json.loads(raw)
        found = (
            brief["principal"],
            brief["session"],
            brief["address"],
            float(brief["heartbeat_interval"]),
        )
        if len(_briefs) >= MAX_BRIEFS:
            _briefs.clear()
        _briefs[raw] = found
    return found


def brief_of(stored: Record) -> Brief | None:
    """The heartbeat's view of a stored record (None: unreadable). A record written before the
    brief field existed is parsed whole, once per heartbeat, as it was."""
    try:
        status = status_of(stored.fields[HEALTH])
        raw = stored.fields.get(BRIEF)
        if raw is None:
            record = parse_whole(stored)
            return Brief(
                record.principal,
                record.session,
                record.address,
                record.heartbeat_interval,
                str(status),
            )
        return Brief(*_brief_values(raw), status)
    except (KeyError, TypeError, ValueError, AttributeError):
        log.exception("unreadable instance record %s ignored", stored)
        return None
