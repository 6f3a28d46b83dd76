"""The gRPC front's heartbeat reports (`reach.v1.Reach/Heartbeat`): one report as the HTTP
heartbeat's path and body, and a batched report (`HeartbeatRequest.batch`) as
`POST /reach/heartbeats`, each entry checked and answered on its own.

A stream's reports are read and acked with the reader/writer calls (no async generators on
either side), its idle bound is one timer per `heartbeat_timeout` rather than one per report
(`IdleWatch`), and a single report is read once per distinct message: an agent sends the
same bytes every interval while its health is the same, so the report as checked is kept by
its bytes (`single_entry`) and the next one costs a dictionary look-up. Each report is still
checked against the agent's token and recorded on its own.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import grpc
from pydantic import TypeAdapter, ValidationError

from agent_reach_proto import gateway_pb2 as pb
from gateway_api.grpc_idle import IdleWatch
from gateway_api.grpc_wire import json_text, parse, refusal_of
from gateway_api.services.agents import Agents
from reach import acceptance
from reach.acceptance import describe_validation_error
from reach.errors import InvalidRequest, ReachError
from reach.limits import Limits
from reach.messages import InstanceId
from reach.registry import Beat, BeatEntry, check_batch, kept
from reach.security.tokens import Principal

_INSTANCE_ID: TypeAdapter[str] = TypeAdapter(InstanceId)

MAX_KNOWN_REPORTS = 20_000
"""Single reports kept as checked, by their bytes (emptied when full)."""
_known: dict[bytes, BeatEntry] = {}
_known_limits: list[Limits] = []


def single_entry(raw: bytes, limits: Limits) -> BeatEntry | pb.HeartbeatAck:
    """A single report's entry (as `entry_of`), or its refusal as an ack, or `BATCHED` for a
    report with `batch` set (not kept: `batch_ack` reads it)."""
    if not _known_limits or _known_limits[0] is not limits:  # reconfigured: check again
        _known.clear()
        _known_limits[:] = [limits]
    entry = _known.get(raw)
    if entry is not None:
        return entry
    try:
        report = parse(pb.HeartbeatRequest, raw)
    except Exception as exc:
        return refused_ack("", exc)
    if report.batch:
        return BATCHED
    try:
        entry = kept(entry_of(report, limits))
    except Exception as exc:
        return refused_ack(report.instance_id, exc)
    if len(_known) >= MAX_KNOWN_REPORTS:
        _known.clear()
    _known[raw] = entry
    return entry


BATCHED = pb.HeartbeatAck()
"""`single_entry`'s answer for a batched report (handled by `batch_ack`)."""


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


async def serve_stream(
    context: grpc.aio.ServicerContext[bytes, pb.HeartbeatAck],
    idle_s: Callable[[], float],
    agent_of: Callable[[], Principal | None],
    ack_of: Callable[[bytes, Principal | None], Awaitable[pb.HeartbeatAck]],
) -> None:
    """A Heartbeat stream's reports, one ack each, until the agent closes it. `agent_of` checks
    the token again for every report (a revoked one ends the stream, UNAUTHENTICATED); a
    stream silent for `idle_s()` ends DEADLINE_EXCEEDED."""
    watch = IdleWatch(idle_s)
    try:
        while True:
            watch.waiting()
            try:
                raw = await context.read()
            except asyncio.CancelledError:
                task = asyncio.current_task()
                if not watch.expired or task is None or task.uncancel():
                    raise
                limit = idle_s()
                await context.abort(
                    grpc.StatusCode.DEADLINE_EXCEEDED,
                    f"no heartbeat report in {limit:g} s (registry.heartbeat_timeout): "
                    "the stream is closed; open a new one to report again",
                )
            watch.busy()
            if not isinstance(raw, bytes):  # grpc.aio.EOF: the agent closed its side
                return
            try:
                agent = agent_of()
            except ReachError as exc:
                await refusal_of(exc, "Heartbeat", None).end(context)
            await context.write(await ack_of(raw, agent))
    finally:
        watch.close()


async def single_ack(
    raw: bytes, agents: Agents, agent: Principal | None, limits: Limits
) -> pb.HeartbeatAck:
    """One report (single or batched) recorded and answered."""
    entry = single_entry(raw, limits)
    if entry is BATCHED:
        return await batch_ack(parse(pb.HeartbeatRequest, raw), agents, agent, limits)
    if isinstance(entry, pb.HeartbeatAck):
        return entry
    try:
        beat = (await agents.heartbeats((entry,), agent))[0]
    except Exception as exc:
        return refused_ack(entry.instance_id, exc)
    if isinstance(beat, ReachError):
        return refused_ack(entry.instance_id, beat)
    return beat_ack(beat)
