"""The gRPC front's bounds (issue 25), against a real gateway: past
`transport.grpc_max_concurrent_rpcs` calls in flight (an open Heartbeat stream is one) a call
ends UNAVAILABLE with the 503 envelope naming the setting and a retry pushback, and room comes
back as calls end; past `transport.grpc_max_connections` a new connection is closed as it is
accepted. The HTTP port's own bounds are test_bounded_door's."""

from __future__ import annotations

import json
from pathlib import Path

import grpc
import grpc.aio
import pytest

from agent_reach_proto import gateway_pb2 as pb
from tests.conftest import new_stack
from tests.helpers import GatewayProcess
from tests.integration.test_grpc_front import front_address

pytestmark = pytest.mark.integration

JOIN = "/reach.v1.Reach/Join"
HEARTBEAT = "/reach.v1.Reach/Heartbeat"


def channel(address: str) -> grpc.aio.Channel:
    # A connection of its own (channels to one address would otherwise share one).
    return grpc.aio.insecure_channel(address, options=[("grpc.use_local_subchannel_pool", 1)])


async def test_calls_and_connections_past_the_front_bounds_are_refused(
    temporal_server: str, tmp_path: Path, capability: str
) -> None:
    stack = new_stack(
        temporal_server,
        tmp_path,
        extra={
            "REACH_TRANSPORT__GRPC_MAX_CONCURRENT_RPCS": "2",
            "REACH_TRANSPORT__GRPC_MAX_CONNECTIONS": "2",
        },
    )
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
            streams = [beats(), beats()]
            for stream in streams:  # both held open on the gateway
                await stream.write(pb.HeartbeatRequest(instance_id="nobody"))
                assert (await stream.read()).error_type == "unknown_instance"

            request = pb.JoinRequest(
                capability=capability,
                instance_id=f"{capability}-01",
                protocol="http",
                service_address="127.0.0.1:9",
            )
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await join(request, timeout=10)
            assert refused.value.code() is grpc.StatusCode.UNAVAILABLE
            trailing = dict(refused.value.trailing_metadata() or ())
            envelope = json.loads(trailing["x-reach-error-bin"])
            assert envelope["error"]["type"] == "unavailable"
            assert "transport.grpc_max_concurrent_rpcs = 2" in envelope["error"]["message"]
            assert trailing["grpc-retry-pushback-ms"] == "1000"

            await streams[0].done_writing()
            assert await streams[0].read() is grpc.aio.EOF
            ack = await join(request, timeout=10)  # room again
            assert ack.instance_id == f"{capability}-01"

            # The second connection is the most: a third is closed as it is accepted.
            async with channel(address) as second, channel(address) as third:
                health = "/grpc.health.v1.Health/Check"
                ok = second.unary_unary(health)
                await ok(b"", timeout=10)
                with pytest.raises(grpc.aio.AioRpcError) as closed:
                    await third.unary_unary(health)(b"", timeout=10)
                assert closed.value.code() is grpc.StatusCode.UNAVAILABLE
            await streams[1].done_writing()
