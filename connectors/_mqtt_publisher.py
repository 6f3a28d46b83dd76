"""QoS 1 publishing that hands back the broker's PUBACK reason code (`AckedPublisher`), for the
MQTT connector: why it matters is "No matching subscribers" in docs/protocols/mqtt.md.
"""

from __future__ import annotations

import asyncio
from typing import Any, cast

import aiomqtt
import paho.mqtt.client as paho_mqtt
from paho.mqtt.properties import Properties
from paho.mqtt.reasoncodes import ReasonCode

from agent_reach_proto.wire import paho_client

# The one place the MQTT connector relies on aiomqtt's internals (pinned: aiomqtt 2.5.1 on paho-mqtt
# 2.2; tests/unit/ and tests/integration/test_connector_mqtt.py check each assumption, so an
# upgrade that breaks one fails there, not in production):
#   - `aiomqtt.Client._client` is the paho client it drives; aiomqtt has no public handle on it
#     (`agent_reach_proto.wire.paho_client`, shared with the connect helpers and the SDK).
#   - aiomqtt drives paho's socket from the event loop (add_reader/add_writer), so paho's
#     callbacks run on the loop's thread, inside its read handler: never during `publish()`.
#   - aiomqtt installs its own `on_publish` (callback API version 2) in its constructor and
#     ignores the reason code it is given; `AckedPublisher` chains in front of it.
# Everything used on the paho client itself is paho's public API: `publish()` returning
# `MQTTMessageInfo` (`rc`, `mid`), the `on_publish` property, `socket()`, `disconnect()`.


class AckedPublisher:
    """QoS 1 publishing that hands back the broker's PUBACK reason code.

    aiomqtt's `publish` waits for the PUBACK but drops its reason code, so a request no agent
    is subscribed to (PUBACK 0x10 "No matching subscribers") would look delivered, and its
    caller would wait for the deadline. This publishes through paho, keeps the `mid` paho hands
    back, and takes the reason code for that `mid` in `on_publish`. One per aiomqtt client:
    message ids are per connection.
    """

    def __init__(self, client: aiomqtt.Client) -> None:
        self.client = client
        self._paho = paho_client(client)
        self._acks: dict[int, asyncio.Future[ReasonCode]] = {}
        # aiomqtt's own, called after ours so that its `publish` (unused here) keeps working.
        self._chained = cast("paho_mqtt.CallbackOnPublish_v2 | None", self._paho.on_publish)
        self._paho.on_publish = self._on_publish

    def _on_publish(
        self,
        paho: paho_mqtt.Client,
        userdata: Any,
        mid: int,
        reason_code: ReasonCode,
        properties: Properties,
    ) -> None:
        ack = self._acks.pop(mid, None)
        if ack is not None and not ack.done():
            ack.set_result(reason_code)
        if self._chained is not None:
            self._chained(paho, userdata, mid, reason_code, properties)

    def publish(self, topic: str, payload: bytes, props: Properties) -> asyncio.Future[ReasonCode]:
        """Send a QoS 1 PUBLISH; the future resolves to the PUBACK's reason code (cancel it to
        stop waiting). Raises as aiomqtt's `publish` does: `MqttCodeError` when paho cannot
        send (not connected, queue full), `ValueError` for a topic or payload it refuses."""
        info = self._paho.publish(topic, payload, qos=1, retain=False, properties=props)
        if info.rc != paho_mqtt.MQTT_ERR_SUCCESS:
            raise aiomqtt.MqttCodeError(info.rc, "Could not publish message")
        mid = info.mid
        ack: asyncio.Future[ReasonCode] = asyncio.get_running_loop().create_future()
        self._acks[mid] = ack

        def forget(_: asyncio.Future[ReasonCode]) -> None:
            if self._acks.get(mid) is ack:
                del self._acks[mid]

        ack.add_done_callback(forget)
        return ack

    def waiting(self) -> int:
        """How many PUBACKs are awaited."""
        return len(self._acks)
