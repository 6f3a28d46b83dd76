"""Revocation that sticks (issue 25): a token revoked while its holder is connected stops
working on that connection too, not only on the next one."""

from __future__ import annotations

from pathlib import Path

import grpc
import httpx
import pytest

from agent_reach_proto import gateway_pb2 as pb
from tests.conftest import new_stack
from tests.helpers import GatewayProcess, wait_until
from tests.integration.test_auth import bearer, issue_cli
from tests.integration.test_grpc_front import front_address

pytestmark = pytest.mark.integration


async def test_a_revoked_agent_token_ends_its_open_heartbeat_stream(
    temporal_server: str, tmp_path: Path, http: httpx.AsyncClient, capability: str
) -> None:
    """It was checked once, at stream open: acknowledged `ok` for 50 s after the revocation,
    past the heartbeat timeout, and the instance still routed."""
    stack = new_stack(temporal_server, tmp_path)
    admin, _ = issue_cli(stack, "--principal", "ops", "--admin")
    agent_token, agent_id = issue_cli(
        stack, "--principal", "kr", "--agent", "--capability", capability
    )
    async with GatewayProcess(stack, "revoke") as gateway:
        metadata = (("authorization", f"Bearer {agent_token}"),)
        instance = f"{capability}-01"
        async with grpc.aio.insecure_channel(front_address(gateway)) as channel:
            join = channel.unary_unary(
                "/reach.v1.Reach/Join",
                request_serializer=pb.JoinRequest.SerializeToString,
                response_deserializer=pb.JoinAck.FromString,
            )
            await join(
                pb.JoinRequest(
                    capability=capability,
                    instance_id=instance,
                    protocol="http",
                    service_address="127.0.0.1:9",
                ),
                metadata=metadata,
            )
            beats = channel.stream_stream(
                "/reach.v1.Reach/Heartbeat",
                request_serializer=pb.HeartbeatRequest.SerializeToString,
                response_deserializer=pb.HeartbeatAck.FromString,
            )
            stream = beats(metadata=metadata)
            await stream.write(pb.HeartbeatRequest(instance_id=instance))
            ack = await stream.read()
            assert ack.status == "ok", ack

            r = await http.delete(
                f"{gateway.url}/reach/admin/tokens/{agent_id}", headers=bearer(admin)
            )
            assert r.status_code == 200, r.text

            ended: list[grpc.StatusCode] = []

            async def stream_ended() -> bool:
                try:
                    await stream.write(pb.HeartbeatRequest(instance_id=instance))
                    answer = await stream.read()
                except grpc.aio.AioRpcError as exc:
                    ended.append(exc.code())
                    return True
                assert answer is not grpc.aio.EOF
                assert answer.status == "ok", answer  # acked until the revocation is seen
                return False

            await wait_until(stream_ended, 10, every_s=0.2)
            assert ended == [grpc.StatusCode.UNAUTHENTICATED]
