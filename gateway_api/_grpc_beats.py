"""The gRPC front's heartbeat reports (`reach.v1.Reach/Heartbeat`): one report as the HTTP
heartbeat's path and body, and a batched report (`HeartbeatRequest.batch`) as
`POST /reach/heartbeats`, each entry checked and answered on its own."""

from __future__ import annotations

from typing import Any

from pydantic import TypeAdapter, ValidationError

from agent_reach_proto import gateway_pb2 as pb
from gateway_api.grpc_wire import json_text, refusal_of
from gateway_api.services.agents import Agents
from reach import acceptance
from reach.acceptance import describe_validation_error
from reach.errors import InvalidRequest, ReachError
from reach.limits import Limits
from reach.messages import InstanceId
from reach.registry import Beat, BeatEntry, check_batch
from reach.security.tokens import Principal

_INSTANCE_ID: TypeAdapter[str] = TypeAdapter(InstanceId)


def entry_of(report: pb.HeartbeatRequest, limits: Limits) -> BeatEntry:
    """One report as the HTTP heartbeat's path and body (refusals named as there)."""
    instance_id = report.instance_id
    try:
        _INSTANCE_ID.validate_python(instance_id)
    except ValidationError as exc:
        raise InvalidRequest(describe_validation_error(exc, root="instance_id")) from None
    fields: dict[str, Any] = {"inflight": report.inflight}
    if report.status:
        fields["status"] = report.status
    if report.checks_json:
        fields["checks"] = json_text(report.checks_json, "checks_json")
    # No body to measure: gRPC refused any message past the body limit before it was read,
    # and the checks are measured (and their encodability checked) on their own.
    health = acceptance.health_report_values(fields, b"", limits)
    session = report.session if report.HasField("session") else None
    return BeatEntry(instance_id, health, session)


async def batch_ack(
    batch: pb.HeartbeatRequest, agents: Agents, agent: Principal | None, limits: Limits
) -> pb.HeartbeatAck:
    """A batched report: each entry checked and recorded on its own, one ack per entry."""
    try:
        check_batch(len(batch.batch))
        if batch.instance_id or batch.status or batch.checks_json or batch.inflight:
            raise InvalidRequest(
                "a batched heartbeat (batch set) leaves instance_id, status, checks_json "
                "and inflight empty: each entry carries its own"
            )
    except Exception as exc:
        return refused_ack("", exc)
    acks: list[pb.HeartbeatAck | None] = []
    entries: list[BeatEntry] = []
    for report in batch.batch:
        try:
            if report.batch:
                raise InvalidRequest("a batched heartbeat's entry has no batch of its own")
            entries.append(entry_of(report, limits))
            acks.append(None)
        except Exception as exc:
            acks.append(refused_ack(report.instance_id, exc))
    try:
        outcomes = await agents.heartbeats(entries, agent)
    except Exception as exc:  # the store failed: the whole batch is refused
        return refused_ack("", exc)
    went = zip(entries, outcomes, strict=True)
    answers = []
    for ack in acks:
        if ack is None:
            entry, outcome = next(went)
            if isinstance(outcome, ReachError):
                ack = refused_ack(entry.instance_id, outcome)
            else:
                ack = beat_ack(outcome)
        answers.append(ack)
    return pb.HeartbeatAck(batch=answers)


def refused_ack(instance_id: str, exc: Exception) -> pb.HeartbeatAck:
    error = refusal_of(exc, "Heartbeat", None).envelope["error"]
    return pb.HeartbeatAck(
        instance_id=instance_id, error_type=error["type"], message=error["message"]
    )


def beat_ack(beat: Beat) -> pb.HeartbeatAck:
    return pb.HeartbeatAck(
        instance_id=beat.instance_id,
        status=beat.status,
        heartbeat_interval=beat.heartbeat_interval,
    )
