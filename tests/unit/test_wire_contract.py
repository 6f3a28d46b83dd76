"""The agent wire contract has one home, `agent_reach_proto.wire`, that both ends import.

Pinned here: every name as it goes on the wire (changing one breaks every agent written without
the SDK), that the SDK's servers and Reach's connectors use the very objects of that module, that
no module of either end spells a contract name of its own, and that the MQTT connect helper is
one copy, over a real socket.
"""

from __future__ import annotations

import ast
import asyncio
import json
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import aiomqtt.exceptions
import pytest
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties

import agent_reach_sdk.wire as sdk_wire
import connectors.grpc as grpc_connector
import connectors.http as http_connector
import connectors.mqtt as mqtt_connector
import connectors.websocket as ws_connector
from agent_reach_proto import agent_pb2, wire
from agent_reach_sdk.servers import grpc as grpc_server
from agent_reach_sdk.servers import http as http_server
from agent_reach_sdk.servers import mqtt as mqtt_server
from agent_reach_sdk.servers import websocket as ws_server
from reach.messages import Header, Message, dumps

ROOT = Path(__file__).resolve().parents[2]

# As each name goes on the wire: the contract, written out once more on purpose.
PINNED = {
    "REQUEST_ID": "x-reach-request-id",
    "CALLER": "x-reach-caller",
    "ATTEMPT": "x-reach-attempt",
    "DEADLINE_MS": "x-reach-deadline-ms",
    "IDEMPOTENCY_KEY": "idempotency-key",
    "TRACEPARENT": "traceparent",
    "CONTEXT_ID": "x-reach-context-id",
    "HTTP_REQUEST_ID": "X-Reach-Request-Id",
    "HTTP_CALLER": "X-Reach-Caller",
    "HTTP_ATTEMPT": "X-Reach-Attempt",
    "HTTP_DEADLINE_MS": "X-Reach-Deadline-Ms",
    "HTTP_IDEMPOTENCY_KEY": "Idempotency-Key",
    "HTTP_TRACEPARENT": "traceparent",
    "HTTP_CONTEXT_ID": "X-Reach-Context-Id",
    "HTTP_PATH_PREFIX": "/reach/",
    "HTTP_DELIVERY_ATTEMPT": "X-Reach-Delivery-Attempt",
    "HTTP_SESSION": "X-Reach-Session",
    "GRPC_AGENT_SERVICE": "reach.agent.v1.Agent",
    "GRPC_INVOKE_METHOD": "/reach.agent.v1.Agent/Invoke",
    "GRPC_STATUS": "x-reach-status",
    "GRPC_ERROR_TYPE": "x-reach-error-type",
    "GRPC_RETRYABLE": "x-reach-retryable",
    "GRPC_AUTHORIZATION": "authorization",
    "GRPC_ERROR_BIN": "x-reach-error-bin",
    "GRPC_RETRY_PUSHBACK_MS": "grpc-retry-pushback-ms",
    "WS_DEFAULT_PATH": "/reach",
    "WS_TYPE": "type",
    "WS_REQUEST_ID": "request_id",
    "WS_OPERATION": "operation",
    "WS_HEADERS": "headers",
    "WS_PAYLOAD": "payload",
    "WS_STATUS": "status",
    "WS_BODY": "body",
    "WS_REQUEST": "request",
    "WS_REPLY": "reply",
    "MQTT_OPERATION": "operation",
    "MQTT_STATUS": "status",
    "MQTT_REPLY_PREFIX": "reach/replies/",
    "MQTT_DEFAULT_PORT": 1883,
    "MQTT_MAX_PACKET_BYTES": 64 * 1024 * 1024,
}

# The modules of both ends that speak the contract (runtime.py included: it reads the metadata).
SPEAKERS = [
    *sorted((ROOT / "agent_reach_sdk").rglob("*.py")),
    *sorted((ROOT / "connectors").glob("*.py")),
    ROOT / "activities" / "invoke.py",
    ROOT / "gateway_api" / "errors.py",
    *sorted((ROOT / "gateway_api").glob("grpc_*.py")),  # the gRPC front and its wire
]
# Strings distinctive enough that, written out anywhere in code, they are a second copy.
DISTINCTIVE = {
    value.lower()
    for value in PINNED.values()
    if isinstance(value, str) and ("-" in value or "/" in value or value == "traceparent")
}


def test_every_name_is_pinned() -> None:
    assert {name: getattr(wire, name) for name in PINNED} == PINNED
    assert wire.METADATA_NAMES == (
        wire.REQUEST_ID,
        wire.CALLER,
        wire.ATTEMPT,
        wire.DEADLINE_MS,
        wire.IDEMPOTENCY_KEY,
        wire.TRACEPARENT,
        wire.CONTEXT_ID,
    )
    # HTTP spells the same names, case aside.
    assert {k: v.lower() for k, v in wire.HTTP_HEADERS.items()} == {
        n: n for n in wire.METADATA_NAMES
    }


def test_the_grpc_names_are_the_protos() -> None:
    service = agent_pb2.DESCRIPTOR.services_by_name["Agent"]
    assert service.full_name == wire.GRPC_AGENT_SERVICE
    assert f"/{service.full_name}/{service.methods[0].name}" == wire.GRPC_INVOKE_METHOD


@pytest.mark.parametrize(
    ("used", "home"),
    [
        # The SDK: what the runtime reads, and what each server sends and reads.
        (sdk_wire.REQUEST_ID, wire.REQUEST_ID),
        (sdk_wire.CALLER, wire.CALLER),
        (sdk_wire.ATTEMPT, wire.ATTEMPT),
        (sdk_wire.DEADLINE_MS, wire.DEADLINE_MS),
        (sdk_wire.IDEMPOTENCY_KEY, wire.IDEMPOTENCY_KEY),
        (sdk_wire.TRACEPARENT, wire.TRACEPARENT),
        (sdk_wire.METADATA_NAMES, wire.METADATA_NAMES),
        (http_server.PREFIX, wire.HTTP_PATH_PREFIX),
        (grpc_server.SERVICE, wire.GRPC_AGENT_SERVICE),
        (grpc_server.STATUS, wire.GRPC_STATUS),
        (grpc_server.ERROR_TYPE, wire.GRPC_ERROR_TYPE),
        (grpc_server.RETRYABLE, wire.GRPC_RETRYABLE),
        (ws_server.DEFAULT_PATH, wire.WS_DEFAULT_PATH),
        (mqtt_server.OPERATION, wire.MQTT_OPERATION),
        (mqtt_server.STATUS, wire.MQTT_STATUS),
        (mqtt_server.DEFAULT_PORT, wire.MQTT_DEFAULT_PORT),
        # Reach's connectors, under their older names.
        (http_connector.HEADER_REQUEST_ID, wire.HTTP_REQUEST_ID),
        (http_connector.HEADER_CALLER, wire.HTTP_CALLER),
        (http_connector.HEADER_ATTEMPT, wire.HTTP_ATTEMPT),
        (http_connector.HEADER_DEADLINE, wire.HTTP_DEADLINE_MS),
        (grpc_connector.METHOD, wire.GRPC_INVOKE_METHOD),
        (grpc_connector.MD_REQUEST_ID, wire.REQUEST_ID),
        (grpc_connector.MD_CALLER, wire.CALLER),
        (grpc_connector.MD_ATTEMPT, wire.ATTEMPT),
        (grpc_connector.MD_DEADLINE, wire.DEADLINE_MS),
        (grpc_connector.MD_IDEMPOTENCY_KEY, wire.IDEMPOTENCY_KEY),
        (grpc_connector.MD_TRACEPARENT, wire.TRACEPARENT),
        (grpc_connector.MD_STATUS, wire.GRPC_STATUS),
        (grpc_connector.MD_ERROR_TYPE, wire.GRPC_ERROR_TYPE),
        (grpc_connector.MD_RETRYABLE, wire.GRPC_RETRYABLE),
        (ws_connector.DEFAULT_PATH, wire.WS_DEFAULT_PATH),
        (ws_connector.HEADER_REQUEST_ID, wire.REQUEST_ID),
        (ws_connector.HEADER_CALLER, wire.CALLER),
        (ws_connector.HEADER_ATTEMPT, wire.ATTEMPT),
        (ws_connector.HEADER_DEADLINE, wire.DEADLINE_MS),
        (ws_connector.HEADER_IDEMPOTENCY_KEY, wire.IDEMPOTENCY_KEY),
        (ws_connector.HEADER_TRACEPARENT, wire.TRACEPARENT),
        (ws_connector.request_id_in, wire.request_id_in),
        (mqtt_connector.OPERATION, wire.MQTT_OPERATION),
        (mqtt_connector.STATUS, wire.MQTT_STATUS),
        (mqtt_connector.REPLY_PREFIX, wire.MQTT_REPLY_PREFIX),
        (mqtt_connector.REQUEST_ID, wire.REQUEST_ID),
        (mqtt_connector.CALLER, wire.CALLER),
        (mqtt_connector.ATTEMPT, wire.ATTEMPT),
        (mqtt_connector.DEADLINE_MS, wire.DEADLINE_MS),
        (mqtt_connector.IDEMPOTENCY_KEY, wire.IDEMPOTENCY_KEY),
        (mqtt_connector.TRACEPARENT, wire.TRACEPARENT),
        (mqtt_connector.paho_client, wire.paho_client),
    ],
)
def test_both_ends_use_the_contracts_own_objects(used: object, home: object) -> None:
    assert used is home


def _literals(path: Path) -> list[tuple[int, str]]:
    """Every string constant in the module's code (docstrings are prose, not code)."""
    tree = ast.parse(path.read_text(), str(path))
    docstrings = {
        id(node.body[0].value)
        for node in ast.walk(tree)
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef)
        and node.body
        and isinstance(node.body[0], ast.Expr)
        and isinstance(node.body[0].value, ast.Constant)
    }
    return [
        (node.lineno, node.value)
        for node in ast.walk(tree)
        if isinstance(node, ast.Constant)
        and isinstance(node.value, str)
        and id(node) not in docstrings
    ]


@pytest.mark.parametrize("path", SPEAKERS, ids=lambda p: str(p.relative_to(ROOT)))
def test_no_module_of_either_end_spells_a_contract_name_itself(path: Path) -> None:
    copies = [(line, text) for line, text in _literals(path) if text.lower() in DISTINCTIVE]
    assert not copies, f"use agent_reach_proto.wire instead of {copies}"


@pytest.mark.parametrize(
    "path", sorted((ROOT / "gateway_api").glob("grpc_*.py")), ids=lambda p: p.name
)
def test_the_grpc_fronts_metadata_keys_are_the_contracts(path: Path) -> None:
    # Read, not imported: the front is checked by its own tests; here only where its keys come
    # from (`authorization` is too plain a word for the scan above).
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id.endswith("_KEY") for t in node.targets
        ):
            assert not isinstance(node.value, ast.Constant), ast.unparse(node)


def _functions(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    return {
        node.name
        for node in ast.walk(tree)
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
    }


def test_the_mqtt_connect_helpers_are_one_copy() -> None:
    helpers = {"paho_client", "mqtt_client", "mqtt_connected", "mqtt_subscribe", "_drop"}
    assert helpers <= _functions(ROOT / "agent_reach_proto" / "wire.py")
    for side in (ROOT / "connectors" / "mqtt.py", ROOT / "agent_reach_sdk/servers/mqtt.py"):
        source = side.read_text()
        assert not _functions(side) & (helpers | {"connected", "_new_client"}), side
        for used in ("wire.mqtt_client(", "wire.mqtt_connected(", "wire.mqtt_subscribe("):
            assert used in source, (side, used)
        # Nor does either reach into aiomqtt for its paho client: `wire.paho_client` does.
        reaches = [
            node.lineno
            for node in ast.walk(ast.parse(source))
            if isinstance(node, ast.Attribute)
            and node.attr == "_client"
            and not (isinstance(node.value, ast.Name) and node.value.id == "self")
        ]
        assert not reaches, (side, reaches)


def test_the_contract_module_stays_light() -> None:
    """Every agent loads it, so it must not pull in Reach, the gateway or a protocol library."""
    code = (
        "import sys, agent_reach_proto.wire; "
        "print(' '.join(sorted({m.split('.')[0] for m in sys.modules})))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    loaded = set(done.stdout.split())
    heavy = {"reach", "gateway_api", "connectors", "aiomqtt", "paho", "grpc", "google", "httpx"}
    assert not loaded & heavy


FULL = {"attempt": 2, "deadline_ms": 17, "idempotency_key": "k", "traceparent": "00-a-b-01"}


@pytest.mark.parametrize("header", [{}, FULL], ids=["bare", "full"])
def test_every_protocol_sends_the_same_metadata(header: dict[str, Any]) -> None:
    message = Message(
        header=Header(request_id="r1", caller="c", target="t", operation="op", **header)
    )
    sent = wire.metadata(message.header)
    assert [name for name, _ in sent] == [n for n in wire.METADATA_NAMES if n in dict(sent)]
    assert len(sent) == (6 if header else 3)
    assert grpc_connector.wire_metadata(message) == sent
    frame = ws_connector.request_frame(message)
    assert list(json.loads(frame)[wire.WS_HEADERS].items()) == sent
    props = mqtt_connector.request_properties(message, "reach/replies/x", b"r1/1", 1.0)
    assert mqtt_connector.user_properties(props) == [(wire.MQTT_OPERATION, "op"), *sent]
    http = http_connector.wire_headers(message)
    assert {k.lower(): v for k, v in http.items() if k != "Content-Type"} == dict(sent)
    assert set(http) - {"Content-Type"} <= set(wire.HTTP_HEADERS.values())


def test_a_reply_frame_is_spelled_with_the_contracts_keys() -> None:
    answer = sdk_wire.Answer(200, {"ok": 1})
    frame = ws_server.reply_frame("r1", answer)
    assert frame == dumps(
        {
            wire.WS_TYPE: wire.WS_REPLY,
            wire.WS_REQUEST_ID: "r1",
            wire.WS_STATUS: 200,
            wire.WS_BODY: {"ok": 1},
        }
    )


def test_a_frame_too_broken_to_parse_still_names_its_request() -> None:
    assert wire.request_id_in(b'{"request_id": "req-1", "payload": {') == "req-1"
    assert wire.request_id_in(b'{"request_id": "a", "x": {"request_id": "b"') is None
    assert wire.request_id_in(b"\xff\xfe") is None


async def _scripted_broker(
    connack_reason: int,
) -> tuple[asyncio.Server, int, asyncio.Future[bytes]]:
    """A socket that answers the first packet, a CONNECT, with a CONNACK of `connack_reason`
    and records the CONNECT; enough to watch one connect, not a broker."""
    connect: asyncio.Future[bytes] = asyncio.get_running_loop().create_future()

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        connect.set_result(await reader.read(4096))
        writer.write(bytes([0x20, 3, 0, connack_reason, 0]))  # CONNACK, no properties
        await writer.drain()
        await reader.read(4096)  # DISCONNECT, or the client closing
        writer.close()

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    return server, server.sockets[0].getsockname()[1], connect


async def test_both_ends_connect_alike_and_leave_no_socket_behind() -> None:
    server, port, connect = await _scripted_broker(0x00)
    async with server:
        client = wire.mqtt_client("127.0.0.1", port, identifier="reach-test-1")
        async with wire.mqtt_connected(client):
            sock = wire.paho_client(client).socket()
            assert isinstance(sock, socket.socket)
            assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) == 1
        packet = await connect
    assert wire.paho_client(client).socket() is None
    # CONNECT: type and length, "MQTT", level 5, flags, keepalive, then the properties.
    name_end = packet.index(b"MQTT") + 4
    level, flags = packet[name_end], packet[name_end + 1]
    keepalive = int.from_bytes(packet[name_end + 2 : name_end + 4], "big")
    props = Properties(PacketTypes.CONNECT)  # type: ignore[no-untyped-call]
    props.unpack(packet[name_end + 4 :])  # type: ignore[no-untyped-call]
    assert (level, flags & 0x02, keepalive) == (5, 0x02, wire.MQTT_KEEPALIVE_S)  # clean start
    assert getattr(props, "MaximumPacketSize", None) == wire.MQTT_MAX_PACKET_BYTES
    assert getattr(props, "SessionExpiryInterval", None) == 0
    assert packet.endswith(b"reach-test-1")


async def test_a_refused_connect_leaves_no_socket_behind() -> None:
    server, port, _ = await _scripted_broker(0x87)  # Not authorized
    async with server:
        client = wire.mqtt_client("127.0.0.1", port, identifier="reach-test-2")
        with pytest.raises(aiomqtt.exceptions.MqttConnectError):
            async with wire.mqtt_connected(client):
                pytest.fail("connected to a broker that refused")
    assert wire.paho_client(client).socket() is None
