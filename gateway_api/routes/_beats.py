"""`POST /reach/heartbeats`: a batched heartbeat's body, read entry by entry so that a bad
entry is refused alone (its result names it), never the batch."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, Field, TypeAdapter, ValidationError

from reach import acceptance
from reach.acceptance import describe_validation_error
from reach.errors import InvalidRequest, PayloadTooLarge, ReachError
from reach.limits import MAX_CHECKS_BYTES, Limits
from reach.messages import InstanceId
from reach.registry import MAX_HEARTBEAT_BATCH, BeatEntry, BeatOutcome, HealthReport, check_batch

_INSTANCE_ID: TypeAdapter[str] = TypeAdapter(InstanceId)


class BatchEntry(HealthReport):
    """One instance's heartbeat in a batch: its report, and who it is."""

    instance_id: InstanceId
    session: str | None = Field(
        default=None,
        description="The Join's session (Ack.session, X-Reach-Session on a single heartbeat): "
        "refused with instance_replaced once another process has joined under the same id.",
    )


class EntryError(BaseModel):
    type: str
    message: str


class EntryResult(BaseModel):
    """One entry's answer: `status` and `heartbeat_interval` when recorded, else `error`."""

    instance_id: str | None
    status: str | None = None
    heartbeat_interval: float | None = None
    error: EntryError | None = None


class BatchResults(BaseModel):
    results: list[EntryResult] = Field(description="One per entry, in the entries' order.")
    recorded: int
    refused: int


BatchBody = list[BatchEntry]
"""The body's OpenAPI: a JSON array of at most MAX_HEARTBEAT_BATCH entries."""


def read_batch(raw: bytes, limits: Limits) -> list[BeatEntry | EntryResult]:
    """Each entry as a heartbeat to record, or its refusal. The body as a whole is refused
    only when it is not a JSON array, is past the body limit, or holds too many entries."""
    if len(raw) > limits.max_body_bytes:
        raise PayloadTooLarge(f"body is {len(raw)} bytes; the limit is {limits.max_body_bytes}")
    data = acceptance.parse_json(raw, what="body")
    if not isinstance(data, list):
        raise InvalidRequest(
            "body must be a JSON array of heartbeats, each an object with instance_id "
            "(and session, status, checks, inflight as a single heartbeat has)"
        )
    check_batch(len(data))
    return [_entry(n, item, limits) for n, item in enumerate(data)]


def _entry(n: int, item: Any, limits: Limits) -> BeatEntry | EntryResult:
    instance_id = item.get("instance_id") if isinstance(item, dict) else None
    try:
        if not isinstance(item, dict):
            raise InvalidRequest(f"body.{n} must be a JSON object")
        values = dict(item)
        if "instance_id" not in values:
            raise InvalidRequest(f"body.{n}.instance_id: Field required")
        try:
            _INSTANCE_ID.validate_python(values.pop("instance_id"))
        except ValidationError as exc:
            where = f"body.{n}.instance_id"
            raise InvalidRequest(describe_validation_error(exc, root=where)) from None
        session = values.pop("session", None)
        if session is not None and not isinstance(session, str):
            raise InvalidRequest(f"body.{n}.session: Input should be a valid string")
        try:
            report = HealthReport.model_validate(values, strict=True)
        except ValidationError as exc:
            wrong = describe_validation_error(exc).split("; ")
            raise InvalidRequest("; ".join(f"body.{n}.{part}" for part in wrong)) from None
        acceptance.check_json(
            report.checks,
            what=f"body.{n}.checks",
            limit=MAX_CHECKS_BYTES,
            max_depth=limits.max_depth,
        )
        return BeatEntry(str(instance_id), report, session)
    except ReachError as exc:
        named = instance_id if isinstance(instance_id, str) else None
        return refused(named, exc)


def refused(instance_id: str | None, exc: ReachError) -> EntryResult:
    error = EntryError(type=exc.type, message=exc.message)
    return EntryResult(instance_id=instance_id, error=error)


def results_of(read: list[BeatEntry | EntryResult], outcomes: list[BeatOutcome]) -> BatchResults:
    """The answer: the refused entries' results where they were, the others' outcomes."""
    went = iter(outcomes)
    results: list[EntryResult] = []
    for item in read:
        if isinstance(item, EntryResult):
            results.append(item)
            continue
        outcome = next(went)
        if isinstance(outcome, ReachError):
            results.append(refused(item.instance_id, outcome))
        else:
            results.append(
                EntryResult(
                    instance_id=outcome.instance_id,
                    status=outcome.status,
                    heartbeat_interval=outcome.heartbeat_interval,
                )
            )
    refused_count = sum(1 for result in results if result.error is not None)
    return BatchResults(
        results=results, recorded=len(results) - refused_count, refused=refused_count
    )


__all__ = ["MAX_HEARTBEAT_BATCH", "BatchBody", "BatchResults", "read_batch", "results_of"]
