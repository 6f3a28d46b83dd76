"""The MQTT connector's and server's pure decisions: addresses, properties, statuses, errors."""

from __future__ import annotations

import math
import re
from typing import Any

import aiomqtt
import aiomqtt.exceptions
import paho.mqtt.client as paho_mqtt
import pytest
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties
from paho.mqtt.reasoncodes import ReasonCode

from agent_reach_sdk.servers import server_class
from agent_reach_sdk.servers.mqtt import MqttAgentServer, request_topic
from agent_reach_sdk.wire import Answer, Inbound
from connectors import load
from connectors.mqtt import (
    AckedPublisher,
    MqttConnector,
    answer_of,
    map_mqtt_exceptions,
    new_properties,
    paho_client,
    puback_error,
    reach_error,
    reply_status,
    request_properties,
    user_properties,
)
from reach.errors import (
    AgentError,
    DeadlineExceeded,
    InternalError,
    InvalidRequest,
    ReachError,
    TransportError,
)
from reach.invocation import Endpoint
from reach.messages import Header, Message

ENDPOINT = Endpoint(
    instance_id="a1", capability="cap", protocol="mqtt", address="mqtt://127.0.0.1:1883/t"
)


# -- addresses ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("address", "normalized"),
    [
        (
            "mqtt://127.0.0.1:1883/reach/agents/a1/requests",
            "mqtt://127.0.0.1:1883/reach/agents/a1/requests",
        ),
        ("mqtt://broker.internal/agents/x", "mqtt://broker.internal:1883/agents/x"),
        ("MQTT://Broker.Example.COM:2883/T/x", "mqtt://broker.example.com:2883/T/x"),
        ("mqtt://[::1]/reach/a", "mqtt://[::1]:1883/reach/a"),
        ("mqtt://[0:0::1]:1884/a/b/", "mqtt://[::1]:1884/a/b/"),
        ("mqtt://mosquitto_1:1883/a//b", "mqtt://mosquitto_1:1883/a//b"),
    ],
)
def test_an_mqtt_address_is_normalized_with_its_port_written_out(
    address: str, normalized: str
) -> None:
    assert MqttConnector.check_address(address) == normalized
    assert MqttConnector.check_address(normalized) == normalized


@pytest.mark.parametrize(
    ("address", "why"),
    [
        ("", "empty"),
        ("127.0.0.1:1883", "mqtt://<broker-host>"),
        ("127.0.0.1:1883/topic", "mqtt://<broker-host>"),
        ("http://127.0.0.1:1883/topic", "mqtt://<broker-host>"),
        ("mqtts://127.0.0.1:8883/topic", "mqtt://<broker-host>"),
        ("mqtt://127.0.0.1:1883", "no request topic"),
        ("mqtt://127.0.0.1:1883/", "no request topic"),
        ("mqtt://127.0.0.1:1883/a/+/requests", "wildcards"),
        ("mqtt://127.0.0.1:1883/a/#", "wildcards"),
        ("mqtt://127.0.0.1:1883/$SYS/broker", "broker's own"),
        ("mqtt://127.0.0.1:99999/t", "port"),
        ("mqtt://127.0.0.1:/t", "port"),
        ("mqtt://:1883/t", "no host"),
        ("mqtt://user@127.0.0.1:1883/t", "userinfo"),
        ("mqtt://127.0.0.1:1883/a topic", "spaces or control characters"),
        ("mqtt://127.0.0.1:1883/thé", "not ASCII"),
        ("mqtt://bad_host!:1883/t", "not a hostname"),
        ("mqtt://::1:1883/t", "brackets"),
        ("mqtt://127.0.0.1:1883/" + "t" * 3000, "longer than"),
    ],
)
def test_an_address_the_connector_cannot_call_is_refused_at_join(address: str, why: str) -> None:
    with pytest.raises(InvalidRequest) as err:
        MqttConnector.check_address(address)
    assert why in err.value.message


def test_the_connector_and_the_server_are_found_by_protocol_name() -> None:
    assert load("mqtt") is MqttConnector
    assert server_class("mqtt") is MqttAgentServer
    assert MqttAgentServer.default_address == "127.0.0.1:1883"


async def _dispatch(request: Inbound) -> Answer:
    return Answer(200, {})


@pytest.mark.parametrize(
    ("advertise", "address"),
    [
        ("127.0.0.1:1883", "mqtt://127.0.0.1:1883/{topic}"),
        ("mqtt://broker.internal", "mqtt://broker.internal:1883/{topic}"),
        ("mqtt://broker.internal:2883", "mqtt://broker.internal:2883/{topic}"),
        ("[::1]:1884", "mqtt://[::1]:1884/{topic}"),
    ],
)
def test_the_server_advertises_the_broker_and_its_request_topic(
    advertise: str, address: str
) -> None:
    server = MqttAgentServer(
        _dispatch, listen=advertise, advertise=advertise, instance_id="a-1", max_body_bytes=1024
    )
    assert re.fullmatch(r"reach/agents/a-1/[0-9a-f]{8}/requests", server.topic)
    assert server.service_address == address.format(topic=server.topic)
    assert MqttConnector.check_address(server.service_address) == server.service_address


def test_two_processes_with_one_instance_id_never_share_a_request_topic() -> None:
    """On a shared topic both would run every request (the broker fans out)."""
    one, two = (
        MqttAgentServer(
            _dispatch,
            listen="127.0.0.1:1883",
            advertise="127.0.0.1:1883",
            instance_id="a-1",
            max_body_bytes=1024,
        )
        for _ in range(2)
    )
    assert one.topic != two.topic
    assert request_topic("a-1") == "reach/agents/a-1/requests"


# -- the request's properties ---------------------------------------------------------------------


def prop(props: Properties, name: str) -> Any:
    """A property as read back (paho sets them as attributes it does not declare)."""
    return getattr(props, name)


def _message(**header: object) -> Message:
    fields: dict[str, object] = {
        "request_id": "req-1",
        "caller": "tester",
        "target": "cap",
        "operation": "search",
        **header,
    }
    return Message(header=Header(**fields), payload={"q": "x"})


def test_a_request_carries_its_metadata_as_mqtt5_properties() -> None:
    message = _message(
        attempt=3,
        deadline_ms=1_700_000_000_123,
        idempotency_key="key 1",
        traceparent="00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
    )
    props = request_properties(message, "reach/replies/abc", b"req-1/7", 2.1)
    # What goes on the wire, read back as an agent's MQTT library would.
    wire = new_properties(PacketTypes.PUBLISH)
    wire.unpack(props.pack())  # type: ignore[no-untyped-call]
    assert prop(wire, "ResponseTopic") == "reach/replies/abc"
    assert prop(wire, "CorrelationData") == b"req-1/7"
    assert prop(wire, "ContentType") == "application/json"
    assert prop(wire, "MessageExpiryInterval") == 3  # seconds left, rounded up
    assert user_properties(wire) == [
        ("operation", "search"),
        ("x-reach-request-id", "req-1"),
        ("x-reach-caller", "tester"),
        ("x-reach-attempt", "3"),
        ("x-reach-deadline-ms", "1700000000123"),
        ("idempotency-key", "key 1"),
        ("traceparent", "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"),
    ]


def test_metadata_that_is_not_set_is_not_sent() -> None:
    props = request_properties(_message(), "reach/replies/abc", b"req-1/1", 0.05)
    assert (
        prop(props, "MessageExpiryInterval") == 1
    )  # never 0: that would mean "never expires" to none
    names = [name for name, _ in user_properties(props)]
    assert names == ["operation", "x-reach-request-id", "x-reach-caller", "x-reach-attempt"]


@pytest.mark.parametrize("timeout_s", [0.001, 1.0, 1.0001, 59.5, 3600.0])
def test_the_expiry_is_the_remaining_time_rounded_up(timeout_s: float) -> None:
    props = request_properties(_message(), "r", b"c", timeout_s)
    assert prop(props, "MessageExpiryInterval") == max(1, math.ceil(timeout_s))


# -- the reply ------------------------------------------------------------------------------------


def _reply(status: str | None, payload: bytes = b"{}", *more: tuple[str, str]) -> aiomqtt.Message:
    props = new_properties(PacketTypes.PUBLISH)
    props.CorrelationData = b"req-1/1"
    pairs = [*more, *([("status", status)] if status is not None else [])]
    if pairs:
        props.UserProperty = pairs
    return aiomqtt.Message("reach/replies/abc", payload, 1, False, 1, props)


@pytest.mark.parametrize("status", ["200", "202", "404", "599", "100"])
def test_a_valid_status_is_read(status: str) -> None:
    assert reply_status(ENDPOINT, _reply(status).properties) == int(status)


def test_the_first_status_counts_and_other_properties_are_ignored() -> None:
    reply = _reply("200", b"{}", ("trace", "x"), ("status", "503"))
    assert reply_status(ENDPOINT, reply.properties) == 503


@pytest.mark.parametrize(
    "status", [None, "", "ok", "two hundred", "99", "600", " 200", "\uff12\uff10\uff10"]
)
def test_a_reply_without_a_valid_status_is_a_final_agent_error(status: str | None) -> None:
    with pytest.raises(AgentError) as err:
        reply_status(ENDPOINT, _reply(status).properties)
    assert not err.value.retryable
    assert "without a valid status" in err.value.message


def test_a_reply_without_properties_is_a_final_agent_error() -> None:
    bare = aiomqtt.Message("t", b"{}", 1, False, 1, None)
    with pytest.raises(AgentError):
        answer_of(ENDPOINT, bare, 4096)


def test_statuses_mean_what_the_shared_table_says() -> None:
    assert answer_of(ENDPOINT, _reply("200", b'{"a":1}'), 4096).result == {"a": 1}
    assert answer_of(ENDPOINT, _reply("200", b"[1]"), 4096).result == {"value": [1]}
    assert answer_of(ENDPOINT, _reply("202", b""), 4096).status == "accepted"
    with pytest.raises(DeadlineExceeded):
        answer_of(ENDPOINT, _reply("504"), 4096)
    with pytest.raises(AgentError) as busy:
        answer_of(ENDPOINT, _reply("503", b'{"error":{"type":"busy","message":"later"}}'), 4096)
    assert busy.value.retryable
    assert busy.value.fault is not None
    assert (busy.value.fault.type, busy.value.fault.status) == ("busy", 503)
    assert "answered 503" in busy.value.message
    with pytest.raises(AgentError) as missing:
        answer_of(ENDPOINT, _reply("404"), 4096)
    assert not missing.value.retryable


def test_a_result_over_the_limit_is_a_final_agent_error() -> None:
    exact = b'{"p":"' + b"x" * (4096 - 8) + b'"}'
    assert len(exact) == 4096
    assert answer_of(ENDPOINT, _reply("200", exact), 4096).status == "ok"
    with pytest.raises(AgentError) as err:
        answer_of(ENDPOINT, _reply("200", exact + b" "), 4096)
    assert not err.value.retryable
    assert "4097 bytes" in err.value.message


def test_an_error_body_is_read_only_as_far_as_it_is_needed() -> None:
    huge = b'{"error":{"type":"oom","message":"' + b"m" * (1 << 20) + b'"}}'
    with pytest.raises(AgentError) as err:
        answer_of(ENDPOINT, _reply("500", huge), 4096)
    assert err.value.retryable
    assert err.value.fault is not None
    assert len(err.value.fault.message) <= 1000


@pytest.mark.parametrize("body", [b'{"truncated": ', b"\xff\xfe", b'{"x": NaN}', b"<html>"])
def test_a_result_that_is_not_standard_json_is_not_retried(body: bytes) -> None:
    with pytest.raises(AgentError) as err:
        answer_of(ENDPOINT, _reply("200", body), 4096)
    assert not err.value.retryable
    assert "answered 200" in err.value.message


# -- exceptions -----------------------------------------------------------------------------------


def _aiomqtt_exceptions() -> list[Exception]:
    return [
        aiomqtt.MqttError("boom"),
        aiomqtt.MqttCodeError(4, "Could not publish message"),
        aiomqtt.exceptions.MqttConnectError(5),  # a refused CONNECT (not exported)
        aiomqtt.exceptions.MqttConnectError(ReasonCode(PacketTypes.CONNACK, identifier=0x87)),
        aiomqtt.MqttReentrantError("reentrant"),
    ]


def test_the_list_covers_aiomqtts_exception_tree() -> None:
    listed = {type(exc) for exc in _aiomqtt_exceptions()}
    exported = {
        obj
        for module in (aiomqtt, aiomqtt.exceptions)
        for obj in vars(module).values()
        if isinstance(obj, type) and issubclass(obj, aiomqtt.MqttError)
    }
    assert exported <= listed


def _expected(exc: BaseException) -> tuple[str, bool]:
    if isinstance(exc, aiomqtt.MqttReentrantError):
        return "internal", False
    if isinstance(exc, aiomqtt.MqttError | ConnectionRefusedError):
        return "transport_error", True
    if isinstance(exc, TimeoutError):
        return "timeout", False
    return "transport_error", False  # ValueError: paho refused the topic, payload or property


@pytest.mark.parametrize(
    "exc",
    [
        *_aiomqtt_exceptions(),
        ValueError("Invalid topic."),
        ValueError("Payload too large."),
        UnicodeEncodeError("utf-8", "\udcff", 0, 1, "surrogates not allowed"),
        ConnectionRefusedError(111, "refused"),
        TimeoutError(),
    ],
    ids=lambda e: type(e).__name__,
)
def test_every_library_exception_is_mapped_deliberately(exc: Exception) -> None:
    with pytest.raises(ReachError) as err, map_mqtt_exceptions("127.0.0.1:1883"):
        raise exc
    assert (err.value.type, err.value.retryable) == _expected(exc)
    assert err.value.__cause__ is exc


def test_reach_errors_pass_through_unchanged() -> None:
    original = TransportError("mine", retryable=False)
    with pytest.raises(TransportError) as err, map_mqtt_exceptions("127.0.0.1:1883"):
        raise original
    assert err.value is original
    assert reach_error(original, "b") is original


def test_an_unexpected_exception_is_reachs_internal_error() -> None:
    assert isinstance(reach_error(KeyError("x"), "b"), InternalError)


# -- the broker's PUBACK --------------------------------------------------------------------------


def puback(code: int) -> ReasonCode:
    return ReasonCode(PacketTypes.PUBACK, identifier=code)


def test_a_puback_that_says_the_request_was_taken_is_no_error() -> None:
    assert puback_error(puback(0x00), "reach/agents/a1/requests", "127.0.0.1:1883") is None


def test_no_matching_subscribers_is_a_retryable_transport_error_naming_the_topic() -> None:
    err = puback_error(puback(0x10), "reach/agents/a1/requests", "127.0.0.1:1883")
    assert isinstance(err, TransportError)
    assert err.retryable
    assert "no agent subscribed to reach/agents/a1/requests" in err.message
    assert "127.0.0.1:1883" in err.message


@pytest.mark.parametrize(
    ("code", "name", "retryable"),
    [
        (0x80, "Unspecified error", True),
        (0x83, "Implementation specific error", True),
        (0x87, "Not authorized", True),  # an ACL may change; the policy decides how long to try
        (0x91, "Packet identifier in use", True),
        (0x97, "Quota exceeded", True),
        (0x90, "Topic name invalid", False),  # the same packet, sent again, is refused again
        (0x99, "Payload format invalid", False),
    ],
)
def test_a_refusing_puback_fails_the_request_at_once(code: int, name: str, retryable: bool) -> None:
    err = puback_error(puback(code), "t/x", "127.0.0.1:1883")
    assert isinstance(err, TransportError)
    assert err.retryable is retryable
    assert f"refused the request to t/x: {name} (PUBACK reason code 0x{code:02x})" in err.message


# -- what the connector assumes about aiomqtt's internals (connectors.mqtt) --------------------


async def test_aiomqtt_drives_a_paho_client_and_handles_its_on_publish() -> None:
    client = aiomqtt.Client("127.0.0.1", 1, protocol=aiomqtt.ProtocolVersion.V5)
    paho = paho_client(client)
    assert isinstance(paho, paho_mqtt.Client)
    # aiomqtt's own callback: the one AckedPublisher must keep calling.
    assert paho.on_publish == client._on_publish


async def test_the_publisher_chains_in_front_of_aiomqtts_on_publish() -> None:
    client = aiomqtt.Client("127.0.0.1", 1, protocol=aiomqtt.ProtocolVersion.V5)
    paho = paho_client(client)
    seen: list[tuple[object, ...]] = []

    def before(*args: object) -> None:
        seen.append(args)

    paho.on_publish = before
    AckedPublisher(client)
    assert paho.on_publish is not before
    props = new_properties(PacketTypes.PUBACK)
    callback: Any = paho.on_publish
    callback(paho, None, 7, puback(0x10), props)  # a PUBACK for no publish of the publisher's
    assert seen == [(paho, None, 7, puback(0x10), props)]


async def test_publishing_without_a_connection_fails_as_aiomqtt_would() -> None:
    client = aiomqtt.Client("127.0.0.1", 1, protocol=aiomqtt.ProtocolVersion.V5)
    publisher = AckedPublisher(client)
    with pytest.raises(ReachError) as err, map_mqtt_exceptions("127.0.0.1:1"):
        publisher.publish("t/x", b"{}", new_properties(PacketTypes.PUBLISH))
    assert isinstance(err.value.__cause__, aiomqtt.MqttCodeError)
    assert (err.value.type, err.value.retryable) == ("transport_error", True)
    assert publisher.waiting() == 0
