"""One trace from the caller to the agent's handler, collected from two processes (issue 11).

A gateway exporting its spans to a JSON-lines file (`telemetry.traces: file`) and demo agents
exporting theirs to another (`REACH_AGENT_TRACES=file:...`). The caller sends a W3C
traceparent; after one invoke, the spans of that trace id in both files must form ONE tree:

    caller's span (not exported: the caller's own)
      └ gateway SERVER span (POST /reach/invoke, or reach.v1.Reach/Invoke)
        ├ StartWorkflow:InvokeWorkflow (CLIENT)
        └ connector CLIENT span (connector.<protocol> query), the workflow carrying the
          │ gateway span's traceparent to it (none of Temporal's workflow or activity spans)
          └ agent SERVER span (reach.agent query), in the agent's process
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import secrets
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import httpx
import pytest

from agent_reach_proto import gateway_pb2 as pb
from reach.telemetry.tracing import read_spans
from tests.conftest import new_stack
from tests.helpers import Agent, GatewayProcess

pytestmark = pytest.mark.integration

LISTENING = re.compile(r"gRPC front listening on 127\.0\.0\.1:(\d+)")
# Called as regular activities on its own task queue (the gateway serves it: memory registry).
QUEUED = f"traced-queue-{uuid.uuid4().hex[:6]}"


@pytest.fixture(scope="module", params=["sandboxed", "unsandboxed"])
async def traced(
    request: pytest.FixtureRequest, temporal_server: str, tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[tuple[GatewayProcess, Path]]:
    """A gateway whose spans go to `gw-spans.jsonl` and whose logs are JSON lines (gRPC front
    on a free port); its workflow in the SDK's sandbox (as tests run it) and not (as
    production does)."""
    tmp = tmp_path_factory.mktemp("traced")
    spans = tmp / "gw-spans.jsonl"
    stack = new_stack(
        temporal_server,
        tmp,
        extra={
            "REACH_TELEMETRY__TRACES": "file",
            "REACH_TELEMETRY__FILE": str(spans),
            "REACH_TELEMETRY__LOGS_FORMAT": "json",
            "REACH_TEMPORAL__WORKFLOW_SANDBOX": str(request.param == "sandboxed").lower(),
            "REACH_CAPABILITIES": json.dumps({QUEUED: {"mode": "queue"}}),
        },
    )
    async with GatewayProcess(stack) as gateway:
        yield gateway, spans


async def traced_agent(
    gateway: GatewayProcess, capability: str, protocol: str, spans: Path
) -> Agent:
    return await Agent(
        gateway,
        f"{capability}-{protocol}",
        capability,
        "--protocol",
        protocol,
        env={"REACH_AGENT_TRACES": f"file:{spans}"},
    ).ready()


def new_traceparent() -> tuple[str, str, str]:
    """(traceparent, trace_id, the caller's span id), sampled."""
    trace_id, span_id = secrets.token_hex(16), secrets.token_hex(8)
    return f"00-{trace_id}-{span_id}-01", trace_id, span_id


async def spans_of(
    trace_id: str, gateway_file: Path, agent_file: Path, timeout_s: float = 20.0
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The trace's spans in each file, once the gateway's connector span and the agent's span
    are both written (files are written half a second after a span ends)."""
    deadline = time.monotonic() + timeout_s
    while True:
        gw = [s for s in read_spans(gateway_file) if s["trace_id"] == trace_id]
        agent = [s for s in read_spans(agent_file) if s["trace_id"] == trace_id]
        kinds = {s["kind"] for s in gw}
        if (
            agent
            and {"SERVER", "CLIENT"} <= kinds
            and any(s["name"].startswith("connector.") for s in gw)
        ):
            await asyncio.sleep(1.0)  # the last spans of the same batch window
            gw = [s for s in read_spans(gateway_file) if s["trace_id"] == trace_id]
            agent = [s for s in read_spans(agent_file) if s["trace_id"] == trace_id]
            return gw, agent
        if time.monotonic() > deadline:
            raise AssertionError(
                f"spans of {trace_id} not all written: gateway {gw}, agent {agent}"
            )
        await asyncio.sleep(0.2)


def one(spans: list[dict[str, Any]], name: str) -> dict[str, Any]:
    found = [s for s in spans if s["name"] == name]
    assert len(found) == 1, (name, [s["name"] for s in spans])
    return found[0]


def assert_one_tree(
    gateway_spans: list[dict[str, Any]],
    agent_spans: list[dict[str, Any]],
    caller_span: str,
    entrance: str,
    protocol: str,
) -> None:
    """The expected parents, and nothing in the trace hanging anywhere else."""
    server = one(gateway_spans, entrance)
    assert server["kind"] == "SERVER"
    assert server["parent_id"] == caller_span
    assert server["parent_remote"] is True
    start = one(gateway_spans, "StartWorkflow:InvokeWorkflow")
    assert start["kind"] == "CLIENT"
    assert start["parent_id"] == server["span_id"]
    connector = one(gateway_spans, f"connector.{protocol} query")
    assert connector["kind"] == "CLIENT"
    assert connector["parent_id"] == server["span_id"]
    # Temporal's workflow and activity spans (no duration of their own) are not made.
    assert [s["name"] for s in gateway_spans] == [
        s["name"] for s in gateway_spans if s in (server, start, connector)
    ]
    assert connector["attributes"]["reach.protocol"] == protocol
    (agent,) = agent_spans
    assert agent["name"] == "reach.agent query"
    assert agent["kind"] == "SERVER"
    assert agent["parent_id"] == connector["span_id"]
    assert agent["parent_remote"] is True
    assert agent["attributes"]["reach.request_id"] == connector["attributes"]["reach.request_id"]
    # One tree: a single span continues the caller's, every other one has its parent here.
    everything = gateway_spans + agent_spans
    ids = {s["span_id"] for s in everything}
    assert len(ids) == len(everything)
    assert [s["span_id"] for s in everything if s["parent_id"] == caller_span] == [
        server["span_id"]
    ]
    orphans = [s for s in everything if s["parent_id"] not in ids and s is not server]
    assert not orphans, orphans
    assert server["service"] == "agent-reach"
    assert agent["service"] != "agent-reach"  # the agent's own process


@pytest.mark.parametrize("protocol", ["http", "grpc", "websocket", "mqtt"])
async def test_one_tree_from_the_caller_to_the_agent(
    traced: tuple[GatewayProcess, Path],
    http: httpx.AsyncClient,
    capability: str,
    protocol: str,
    tmp_path: Path,
) -> None:
    gateway, gateway_file = traced
    agent_file = tmp_path / "agent-spans.jsonl"
    await traced_agent(gateway, capability, protocol, agent_file)
    traceparent, trace_id, caller_span = new_traceparent()
    r = await http.post(
        f"{gateway.url}/reach/invoke",
        json={"target": capability, "operation": "query", "payload": {"text": "durable"}},
        headers={"traceparent": traceparent},
    )
    assert r.status_code == 200, r.text
    gateway_spans, agent_spans = await spans_of(trace_id, gateway_file, agent_file)
    assert_one_tree(gateway_spans, agent_spans, caller_span, "POST /reach/invoke", protocol)
    server = one(gateway_spans, "POST /reach/invoke")
    assert server["attributes"]["reach.request_id"] == r.json()["request_id"]
    assert server["attributes"]["http.response.status_code"] == 200


async def test_the_grpc_front_continues_the_callers_trace(
    traced: tuple[GatewayProcess, Path], capability: str, tmp_path: Path
) -> None:
    gateway, gateway_file = traced
    agent_file = tmp_path / "agent-spans.jsonl"
    await traced_agent(gateway, capability, "http", agent_file)
    found = LISTENING.search(gateway.proc.output())
    assert found, gateway.proc.output()
    traceparent, trace_id, caller_span = new_traceparent()
    async with grpc.aio.insecure_channel(f"127.0.0.1:{found[1]}") as channel:
        invoke = channel.unary_unary(
            "/reach.v1.Reach/Invoke",
            request_serializer=pb.InvokeRequest.SerializeToString,
            response_deserializer=pb.InvokeResponse.FromString,
        )
        request_id = f"grpc-{uuid.uuid4().hex[:8]}"
        response = await invoke(
            pb.InvokeRequest(
                request_id=request_id,
                target=capability,
                operation="query",
                payload_json='{"text": "durable"}',
            ),
            metadata=(("traceparent", traceparent),),
        )
    assert response.status == "success"
    gateway_spans, agent_spans = await spans_of(trace_id, gateway_file, agent_file)
    assert_one_tree(gateway_spans, agent_spans, caller_span, "reach.v1.Reach/Invoke", "http")
    assert one(gateway_spans, "reach.v1.Reach/Invoke")["attributes"]["reach.request_id"] == (
        request_id
    )


async def test_without_a_traceparent_the_request_starts_its_own_trace(
    traced: tuple[GatewayProcess, Path], http: httpx.AsyncClient, capability: str, tmp_path: Path
) -> None:
    """A caller that sends none gets a new trace (sample_ratio 1.0), the agent still in it."""
    gateway, gateway_file = traced
    agent_file = tmp_path / "agent-spans.jsonl"
    await traced_agent(gateway, capability, "http", agent_file)
    r = await http.post(
        f"{gateway.url}/reach/invoke",
        json={"target": capability, "operation": "query", "payload": {}},
    )
    assert r.status_code == 200, r.text
    request_id = r.json()["request_id"]
    deadline = time.monotonic() + 20
    while True:
        agent = [
            s
            for s in read_spans(agent_file)
            if s["attributes"].get("reach.request_id") == request_id
        ]
        if agent or time.monotonic() > deadline:
            break
        await asyncio.sleep(0.2)
    assert len(agent) == 1, read_spans(agent_file)
    gateway_spans, agent_spans = await spans_of(agent[0]["trace_id"], gateway_file, agent_file)
    server = one(gateway_spans, "POST /reach/invoke")
    assert server["parent_id"] is None  # the root
    everything = gateway_spans + agent_spans
    ids = {s["span_id"] for s in everything}
    assert all(s["parent_id"] in ids for s in everything if s is not server)


async def test_json_logs_carry_the_request_and_its_trace(
    traced: tuple[GatewayProcess, Path], http: httpx.AsyncClient, capability: str, tmp_path: Path
) -> None:
    """The workflow's own decision ("giving up") is a JSON line naming the request and the
    caller's trace."""
    gateway, _ = traced
    await traced_agent(gateway, capability, "http", tmp_path / "agent-spans.jsonl")
    traceparent, trace_id, _ = new_traceparent()
    r = await http.post(
        f"{gateway.url}/reach/invoke",
        json={"target": capability, "operation": "fail", "payload": {"status": 422}},
        headers={"traceparent": traceparent},
    )
    assert r.status_code == 502, r.text
    request_id = r.json()["request_id"]

    def records() -> list[dict[str, Any]]:
        found = []
        for line in gateway.proc.output().splitlines():
            with contextlib.suppress(ValueError):
                found.append(json.loads(line))
        return [f for f in found if isinstance(f, dict) and f.get("request_id") == request_id]

    deadline = time.monotonic() + 10
    while not any("giving up" in f["message"] for f in records()):
        assert time.monotonic() < deadline, gateway.proc.output()[-3000:]
        await asyncio.sleep(0.2)
    (gave_up,) = [f for f in records() if "giving up" in f["message"]]
    assert gave_up["logger"] == "temporalio.workflow"
    assert gave_up["level"] == "INFO"
    assert gave_up["trace_id"] == trace_id
    assert re.fullmatch(r"[0-9a-f]{16}", gave_up["span_id"])


async def test_a_queue_mode_call_is_in_the_same_tree(
    traced: tuple[GatewayProcess, Path], http: httpx.AsyncClient, tmp_path: Path
) -> None:
    """A capability in queue mode: the call is a regular activity on reach-cap-<name>, which
    heartbeats; its spans hang in the same places."""
    gateway, gateway_file = traced
    agent_file = tmp_path / "agent-spans.jsonl"
    await traced_agent(gateway, QUEUED, "http", agent_file)
    traceparent, trace_id, caller_span = new_traceparent()
    r = await http.post(
        f"{gateway.url}/reach/invoke",
        json={"target": QUEUED, "operation": "query", "payload": {"text": "durable"}},
        headers={"traceparent": traceparent},
    )
    assert r.status_code == 200, r.text
    gateway_spans, agent_spans = await spans_of(trace_id, gateway_file, agent_file)
    assert_one_tree(gateway_spans, agent_spans, caller_span, "POST /reach/invoke", "http")
