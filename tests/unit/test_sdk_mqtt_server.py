"""The SDK's MQTT server, through the machine's Mosquitto, with requests no Reach would send: the
answer names what is wrong, and the handler never runs (issue 25). Topics of the test's own."""

from __future__ import annotations

import asyncio
import json
import socket
import uuid
from collections.abc import AsyncIterator
from typing import Any

import aiomqtt
import pytest
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties
from paho.mqtt.subscribeoptions import SubscribeOptions

from agent_reach_sdk import AgentRuntime
from agent_reach_sdk.servers.mqtt import MqttAgentServer

pytestmark = pytest.mark.integration

BROKER = ("127.0.0.1", 1883)


class Agent:
    """A runtime's dispatch behind an `MqttAgentServer`, and a client that calls it by hand."""

    def __init__(self) -> None:
        self.prefix = f"sdk-mqtt-test-{uuid.uuid4().hex[:10]}"
        self.runtime = AgentRuntime("cap", protocol="mqtt", instance_id=self.prefix)
        self.ran: list[object] = []
        self.runtime.operation("echo")(self.ran.append)
        self.server = MqttAgentServer(
            self.runtime.dispatch,
            listen="127.0.0.1:1883",
            advertise="127.0.0.1:1883",
            instance_id=self.prefix,
            max_body_bytes=1 << 20,
        )
        self.replies = f"{self.prefix}/replies"

    async def call(self, payload: bytes, timeout_s: float = 10.0) -> tuple[int, Any]:
        """Publish one request for `echo`; its reply's status and body."""
        client = aiomqtt.Client(*BROKER, protocol=aiomqtt.ProtocolVersion.V5)
        async with client:
            await client.subscribe(self.replies, options=SubscribeOptions(qos=1))
            props = Properties(PacketTypes.PUBLISH)  # type: ignore[no-untyped-call]
            props.ResponseTopic = self.replies
            props.CorrelationData = b"c-1"
            props.UserProperty = [("operation", "echo"), ("x-reach-request-id", "r-mqtt")]
            await client.publish(self.server.topic, payload, qos=1, properties=props)
            async with asyncio.timeout(timeout_s):
                async for message in client.messages:
                    pairs = dict(getattr(message.properties, "UserProperty", None) or [])
                    return int(pairs["status"]), json.loads(bytes(message.payload))  # type: ignore[arg-type]
        raise AssertionError("no reply")


@pytest.fixture
async def agent() -> AsyncIterator[Agent]:
    with socket.socket() as s:
        s.settimeout(0.5)
        if s.connect_ex(BROKER) != 0:
            pytest.fail("Mosquitto is not answering on 127.0.0.1:1883 (see the env skill)")
    a = Agent()
    await a.server.start()
    try:
        yield a
    finally:
        await a.server.close(0.5)


@pytest.mark.parametrize(
    ("payload", "kind"), [(b"[1, 2]", "an array"), (b'"just text"', "a string"), (b"7", "a number")]
)
async def test_a_payload_that_is_not_an_object_is_refused_and_the_handler_not_run(
    agent: Agent, payload: bytes, kind: str
) -> None:
    status, body = await agent.call(payload)
    assert status == 422
    assert body["error"] == {
        "type": "invalid_request",
        "message": f"the payload must be a JSON object, not {kind}",
        "retryable": False,
    }
    assert agent.ran == []


async def test_a_payload_nested_too_deeply_is_a_final_invalid_request_not_a_500(
    agent: Agent,
) -> None:
    status, body = await agent.call(b'{"a":' * 20_000 + b"1" + b"}" * 20_000)
    assert status == 422
    assert body["error"]["type"] == "invalid_request"
    assert body["error"]["retryable"] is False
    assert "nested too deeply" in body["error"]["message"]
    assert agent.ran == []
    status, body = await agent.call(b'{"fine": [1]}')
    assert (status, agent.ran) == (200, [{"fine": [1]}])
