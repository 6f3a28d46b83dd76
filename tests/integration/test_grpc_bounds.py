"""The gRPC front's bounds (issue 25), against a real gateway: past
`transport.grpc_max_concurrent_rpcs` calls in flight a call ends UNAVAILABLE with the 503
envelope naming the setting and a retry pushback, and room comes back as calls end; open
Heartbeat streams have as much room of their own, and one idle for a heartbeat timeout ends;
past `transport.grpc_max_connections` a new connection is closed as it is accepted. The HTTP
port's own bounds are test_bounded_door's."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import grpc
import grpc.aio
import pytest

from agent_reach_proto import gateway_pb2 as pb
from tests.conftest import new_stack
from tests.helpers import GatewayProcess, wait_until
from tests.integration.test_grpc_front import front_address

pytestmark = pytest.mark.integration

JOIN = "/reach.v1.Reach/Join"
HEARTBEAT = "/reach.v1.Reach/Heartbeat"
INVOKE = "/reach.v1.Reach/Invoke"


def channel(address: str) -> grpc.aio.Channel:
    # A connection of its own (channels to one address would otherwise share one).
    return grpc.aio.insecure_channel(address, options=[("grpc.use_local_subchannel_pool", 1)])


def refusal(err: grpc.aio.AioRpcError) -> dict[str, Any]:
    assert err.code() is grpc.StatusCode.UNAVAILABLE, err
    trailing = dict(err.trailing_metadata() or ())
    assert trailing["grpc-retry-pushback-ms"] == "1000"
    envelope: dict[str, Any] = json.loads(trailing["x-reach-error-bin"])
    assert envelope["error"]["type"] == "unavailable"
    return envelope


async def test_calls_streams_and_connections_past_the_front_bounds_are_refused(
    temporal_server: str, tmp_path: Path, capability: str
) -> None:
    stack = new_stack(
        temporal_server,
        tmp_path,
        extra={
            "REACH_TRANSPORT__GRPC_MAX_CONCURRENT_RPCS": "2",
            "REACH_TRANSPORT__GRPC_MAX_CONNECTIONS": "2",
            "REACH_REGISTRY__HEARTBEAT_INTERVAL": "1",
            "REACH_REGISTRY__HEARTBEAT_TIMEOUT": "6",
        },
    )
    # No worker: an invoke waits (in flight on the front) until it is cancelled.
    async with GatewayProcess(stack, "grpc-bounds", worker=False) as gateway:
        address = front_address(gateway)
        async with channel(address) as first:
            beats = first.stream_stream(
                HEARTBEAT,
                request_serializer=pb.HeartbeatRequest.SerializeToString,
                response_deserializer=pb.HeartbeatAck.FromString,
            )
            join = first.unary_unary(
                JOIN,
                request_serializer=pb.JoinRequest.SerializeToString,
                response_deserializer=pb.JoinAck.FromString,
            )
            invoke = first.unary_unary(
                INVOKE,
                request_serializer=pb.InvokeRequest.SerializeToString,
                response_deserializer=pb.InvokeResponse.FromString,
            )
            request = pb.JoinRequest(
                capability=capability,
                instance_id=f"{capability}-01",
                protocol="http",
                service_address="127.0.0.1:9",
            )
            assert (await join(request, timeout=10)).instance_id == f"{capability}-01"

            # Two calls in flight fill the calls' room: a third is refused before it is read.
            waiting = [
                invoke(pb.InvokeRequest(target=capability, operation="q", timeout_ms=60_000))
                for _ in range(2)
            ]
            await wait_until(lambda: _refused(join, request), timeout_s=20)  # both in flight
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await join(request, timeout=10)
            said = refusal(refused.value)["error"]["message"]
            assert "2 calls in flight" in said
            assert "transport.grpc_max_concurrent_rpcs = 2" in said
            for call in waiting:
                call.cancel()
            await wait_until(lambda: _joins(join, request), timeout_s=20)  # room again

            # Heartbeat streams have a room of their own: two fill it, a Join still passes.
            streams = [beats(), beats()]
            for stream in streams:  # both held open on the gateway
                await stream.write(pb.HeartbeatRequest(instance_id="nobody"))
                assert (await stream.read()).error_type == "unknown_instance"
            third = beats()
            with pytest.raises(grpc.aio.AioRpcError) as full:
                await third.read()
            assert "2 Heartbeat streams open" in refusal(full.value)["error"]["message"]
            assert (await join(request, timeout=10)).instance_id == f"{capability}-01"
            await streams[0].done_writing()
            assert await streams[0].read() is grpc.aio.EOF

            # A stream that reports nothing for a heartbeat timeout is ended.
            with pytest.raises(grpc.aio.AioRpcError) as idle:
                await streams[1].read()
            assert idle.value.code() is grpc.StatusCode.DEADLINE_EXCEEDED
            assert "registry.heartbeat_timeout" in (idle.value.details() or "")

            # The second connection is the most: a third is closed as it is accepted.
            async with channel(address) as second, channel(address) as third_conn:
                health = "/grpc.health.v1.Health/Check"
                ok = second.unary_unary(health)
                await ok(b"", timeout=10)
                with pytest.raises(grpc.aio.AioRpcError) as closed:
                    await third_conn.unary_unary(health)(b"", timeout=10)
                assert closed.value.code() is grpc.StatusCode.UNAVAILABLE


async def _refused(join: Any, request: pb.JoinRequest) -> bool:
    return not await _joins(join, request)


async def _joins(join: Any, request: pb.JoinRequest) -> bool:
    try:
        await join(request, timeout=10)
    except grpc.aio.AioRpcError:
        return False
    return True
