"""Reach's agent wire contract in code: every name a request and its answer carry, per protocol.

The one home of these names: the agent SDK (`agent_reach_sdk.wire`, `agent_reach_sdk.servers`)
and Reach's side (`connectors`, the gateway's error envelope and gRPC front, the callback
activity) import them from here, so the two ends cannot drift apart. The prose, what each name
means and what an agent written without the SDK implements, is one page per protocol:

- HTTP: `docs/protocols/http.md`
- gRPC: `docs/protocols/grpc.md`
- WebSocket: `docs/protocols/websocket.md`
- MQTT 5: `docs/protocols/mqtt.md`

Every protocol carries the same request metadata under the same lower-case names (`REQUEST_ID`
... `TRACEPARENT`): as gRPC metadata keys, as the keys of a WebSocket request frame's `headers`,
as MQTT 5 user properties. HTTP sends them as headers spelled `HTTP_*` (HTTP header names are
case-insensitive; an agent reads them in any case).

This module imports the standard library only: every agent loads it, including one that never
speaks MQTT, so the MQTT helpers at the end import aiomqtt and paho when first called.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import socket
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    import aiomqtt
    import paho.mqtt.client as paho_mqtt

# -- the request's metadata, one set of names on every protocol -----------------------------------

REQUEST_ID = "x-reach-request-id"  # always; a re-delivery repeats it
CALLER = "x-reach-caller"  # always
ATTEMPT = "x-reach-attempt"  # always: 1, 2, ...
DEADLINE_MS = "x-reach-deadline-ms"  # when set: absolute, Unix epoch milliseconds
IDEMPOTENCY_KEY = "idempotency-key"  # when set
TRACEPARENT = "traceparent"  # when set: W3C trace context
CONTEXT_ID = "x-reach-context-id"  # when set: the conversation's first RequestID
METADATA_NAMES = (
    REQUEST_ID,
    CALLER,
    ATTEMPT,
    DEADLINE_MS,
    IDEMPOTENCY_KEY,
    TRACEPARENT,
    CONTEXT_ID,
)

# -- HTTP ------------------------------------------------------------------------------------------

HTTP_REQUEST_ID = "X-Reach-Request-Id"
HTTP_CALLER = "X-Reach-Caller"
HTTP_ATTEMPT = "X-Reach-Attempt"
HTTP_DEADLINE_MS = "X-Reach-Deadline-Ms"
HTTP_IDEMPOTENCY_KEY = "Idempotency-Key"
HTTP_TRACEPARENT = "traceparent"
HTTP_CONTEXT_ID = "X-Reach-Context-Id"
# The HTTP spelling of each metadata name (the same names, lower-cased, are METADATA_NAMES).
HTTP_HEADERS = {
    REQUEST_ID: HTTP_REQUEST_ID,
    CALLER: HTTP_CALLER,
    ATTEMPT: HTTP_ATTEMPT,
    DEADLINE_MS: HTTP_DEADLINE_MS,
    IDEMPOTENCY_KEY: HTTP_IDEMPOTENCY_KEY,
    TRACEPARENT: HTTP_TRACEPARENT,
    CONTEXT_ID: HTTP_CONTEXT_ID,
}
# Reach calls `POST {service_address}/reach/{operation}`.
HTTP_PATH_PREFIX = "/reach/"
# A callback Reach POSTs to a caller carries the request id (HTTP_REQUEST_ID, which every
# gateway response carries too) and which delivery attempt this is.
HTTP_DELIVERY_ATTEMPT = "X-Reach-Delivery-Attempt"
# An agent's heartbeat names the session its Join was given (the Ack's `session`), so a process
# whose instance_id another process joined since is told so (409) instead of keeping that one's
# record alive.
HTTP_SESSION = "X-Reach-Session"

# -- gRPC ------------------------------------------------------------------------------------------

# The agent's service (protos/agent_reach_proto/agent.proto) and its one method.
GRPC_AGENT_SERVICE = "reach.agent.v1.Agent"
GRPC_INVOKE_METHOD = f"/{GRPC_AGENT_SERVICE}/Invoke"
# An agent's trailing metadata on a failure: its answer's HTTP-style status (three digits), its
# own error type, and "false" when another attempt cannot help.
GRPC_STATUS = "x-reach-status"
GRPC_ERROR_TYPE = "x-reach-error-type"
GRPC_RETRYABLE = "x-reach-retryable"
# The gateway's gRPC front (`reach.v1.Reach`, protos/agent_reach_proto/gateway.proto): the
# caller's or agent's token, the error envelope of a refusal (JSON in a binary trailer), and
# gRPC's own retry pushback.
GRPC_AUTHORIZATION = "authorization"
GRPC_ERROR_BIN = "x-reach-error-bin"
GRPC_RETRY_PUSHBACK_MS = "grpc-retry-pushback-ms"

# -- WebSocket frames ------------------------------------------------------------------------------

WS_DEFAULT_PATH = "/reach"  # where Reach connects for a `host:port` address
# Keys of a frame; a request frame also has WS_OPERATION, WS_HEADERS (METADATA_NAMES) and
# WS_PAYLOAD, a reply frame WS_STATUS and WS_BODY.
WS_TYPE = "type"
WS_REQUEST_ID = "request_id"
WS_OPERATION = "operation"
WS_HEADERS = "headers"
WS_PAYLOAD = "payload"
WS_STATUS = "status"
WS_BODY = "body"
# Values of WS_TYPE (another string is reserved for extensions).
WS_REQUEST = "request"
WS_REPLY = "reply"

# A RequestID (reach.messages.REQUEST_ID_PATTERN) named in a frame that could not be parsed.
_REQUEST_ID_IN_TEXT = re.compile(rb'"request_id"\s*:\s*"([A-Za-z0-9][A-Za-z0-9._:-]{0,127})"')

# -- MQTT 5 ----------------------------------------------------------------------------------------

MQTT_DEFAULT_PORT = 1883
# User properties beside METADATA_NAMES: the request's operation, and the reply's HTTP-style
# status in decimal.
MQTT_OPERATION = "operation"
MQTT_STATUS = "status"
# Reach's reply topics: `reach/replies/<random id>`, one per Reach process.
MQTT_REPLY_PREFIX = "reach/replies/"
# The Maximum Packet Size both ends announce when they connect: far above any negotiated limit,
# so an oversized message still arrives and becomes a clear error; only past it does the broker
# drop one.
MQTT_MAX_PACKET_BYTES = 64 * 1024 * 1024
MQTT_KEEPALIVE_S = 30
MQTT_CONNECT_TIMEOUT_S = 5.0


# -- helpers ---------------------------------------------------------------------------------------


class RequestHeader(Protocol):
    """What the metadata is made of (`reach.messages.Header` has these, among others)."""

    @property
    def request_id(self) -> str: ...
    @property
    def caller(self) -> str: ...
    @property
    def attempt(self) -> int: ...
    @property
    def deadline_ms(self) -> int | None: ...
    @property
    def idempotency_key(self) -> str | None: ...
    @property
    def traceparent(self) -> str | None: ...
    @property
    def context_id(self) -> str | None: ...


def metadata(header: RequestHeader) -> list[tuple[str, str]]:
    """The request's metadata under the lower-case names, in METADATA_NAMES order, each
    optional entry only when the request has it."""
    pairs = [
        (REQUEST_ID, header.request_id),
        (CALLER, header.caller),
        (ATTEMPT, str(header.attempt)),
    ]
    if header.deadline_ms is not None:
        pairs.append((DEADLINE_MS, str(header.deadline_ms)))
    if header.idempotency_key:
        pairs.append((IDEMPOTENCY_KEY, header.idempotency_key))
    if header.traceparent:
        pairs.append((TRACEPARENT, header.traceparent))
    if header.context_id:
        pairs.append((CONTEXT_ID, header.context_id))
    return pairs


def http_headers(header: RequestHeader) -> dict[str, str]:
    """`metadata(header)` as HTTP headers, under their HTTP spellings."""
    return {HTTP_HEADERS[name]: value for name, value in metadata(header)}


def request_id_in(data: bytes) -> str | None:
    """The one RequestID named in the text of a WebSocket frame that could not be parsed, if
    any: with it, that request can be answered (or failed) rather than left to its deadline."""
    found = set(_REQUEST_ID_IN_TEXT.findall(data))
    return found.pop().decode("ascii") if len(found) == 1 else None


# The MQTT helpers are the one place outside `connectors.mqtt`'s publisher that reaches past
# aiomqtt's public API (pinned: aiomqtt 2.5 on paho-mqtt 2.2; tests/unit/test_connector_mqtt.py
# checks the assumptions): `aiomqtt.Client._client` is the paho client it drives, and aiomqtt
# has no public handle on it.


def paho_client(client: aiomqtt.Client) -> paho_mqtt.Client:
    """The paho client inside an aiomqtt client."""
    return client._client


def mqtt_client(host: str, port: int, identifier: str) -> aiomqtt.Client:
    """An MQTT 5 client as both ends of the contract connect: clean start and no session
    expiry (nothing should outlive the connection at the broker), MQTT_MAX_PACKET_BYTES
    announced, TCP_NODELAY. Connect it with `mqtt_connected`."""
    import aiomqtt
    from paho.mqtt.packettypes import PacketTypes
    from paho.mqtt.properties import Properties

    props = Properties(PacketTypes.CONNECT)  # type: ignore[no-untyped-call]  # paho: untyped
    props.MaximumPacketSize = MQTT_MAX_PACKET_BYTES
    props.SessionExpiryInterval = 0
    client = aiomqtt.Client(
        host,
        port,
        identifier=identifier,
        protocol=aiomqtt.ProtocolVersion.V5,
        clean_start=True,
        keepalive=MQTT_KEEPALIVE_S,
        timeout=MQTT_CONNECT_TIMEOUT_S,
        properties=props,
        # A request or reply is one small packet: Nagle and delayed ACKs would add ~40 ms.
        socket_options=((socket.IPPROTO_TCP, socket.TCP_NODELAY, 1),),
    )
    # Many requests (or replies) in flight at once is normal, not a leak to warn about.
    client.pending_calls_threshold = 1 << 30
    return client


def _drop(client: aiomqtt.Client) -> None:
    """Close the socket a failed or cancelled connect left open.

    aiomqtt 2.5 keeps it after a CONNACK that never came (or a cancelled connect), with its
    reader still registered; paho's own `disconnect()` closes it on the loop's next write.
    """
    paho = paho_client(client)
    if paho.socket() is not None:
        paho.disconnect()


@contextlib.asynccontextmanager
async def mqtt_connected(client: aiomqtt.Client) -> AsyncIterator[aiomqtt.Client]:
    """`async with client`, except that a connect that fails or is cancelled leaves no socket
    behind (the cancelled connect runs to its end, at most the client's timeout, first)."""
    entering = asyncio.ensure_future(client.__aenter__())
    try:
        await asyncio.shield(entering)
    except asyncio.CancelledError:
        with contextlib.suppress(Exception):
            await entering
            await client.__aexit__(None, None, None)
        _drop(client)
        raise
    except Exception:
        _drop(client)
        raise
    try:
        yield client
    except BaseException as exc:
        await client.__aexit__(type(exc), exc, exc.__traceback__)
        raise
    else:
        await client.__aexit__(None, None, None)


async def mqtt_subscribe(client: aiomqtt.Client, topic: str) -> None:
    """Subscribe with QoS 1, or raise `aiomqtt.MqttError` when the broker refuses.

    Retained messages are not sent: a request or a reply is meant once, when it is published,
    and a retained one on a topic of ours is stale or forged."""
    import aiomqtt
    from paho.mqtt.subscribeoptions import SubscribeOptions

    options = SubscribeOptions(qos=1, retainHandling=SubscribeOptions.RETAIN_DO_NOT_SEND)
    granted = await client.subscribe(topic, options=options)
    if any(getattr(code, "value", code) >= 0x80 for code in granted):
        raise aiomqtt.MqttError(f"the broker refused the subscription to {topic}: {granted}")
