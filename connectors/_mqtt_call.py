"""One MQTT request's translation: its address (`split_address`), its PUBLISH properties
(`request_properties`), what the broker's PUBACK means (`puback_error`), what the agent's reply
means (`answer_of`, through the table every protocol shares, `connectors._answers`), and the one
place aiomqtt's and paho's exceptions become Reach errors (`reach_error`). The contract they
follow is docs/protocols/mqtt.md; `connectors.mqtt` sends and waits.
"""

from __future__ import annotations

import contextlib
import functools
import math
from collections.abc import Iterator

import aiomqtt
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties
from paho.mqtt.reasoncodes import ReasonCode

from agent_reach_proto import wire
from agent_reach_proto.wire import MQTT_DEFAULT_PORT, MQTT_OPERATION, MQTT_STATUS
from connectors._address import check_characters, check_host, check_port, refuse
from connectors._answers import reply_for_status, too_large
from reach.errors import (
    AgentError,
    DeadlineExceeded,
    InternalError,
    ReachError,
    TransportError,
)
from reach.invocation import Endpoint
from reach.messages import Message, Reply

# Reach announces wire.MQTT_MAX_PACKET_BYTES, far above any negotiated limit, so that an
# oversized reply still arrives and becomes a clear agent_error; only beyond it does the broker
# drop a reply (and the request times out).
MAX_ERROR_BODY_BYTES = 64 * 1024
# PUBACK reason codes (MQTT 5, 3.4.2.1). 0x10: the broker took the request, and no one had
# subscribed to its topic. Failures are 0x80 and up; these two say the very packet is one the
# broker will never take, so sending it again is pointless.
NO_MATCHING_SUBSCRIBERS = 0x10
PUBACK_FINAL = frozenset({0x90, 0x99})  # Topic name invalid, Payload format invalid


# -- addresses ------------------------------------------------------------------------------------


@functools.lru_cache(maxsize=1024)
def split_address(address: str) -> tuple[str, int, str]:
    """`mqtt://host[:port]/topic` -> (host as written in a URL, port, topic), or
    `InvalidRequest` naming what is wrong."""
    check_characters(address)
    scheme, sep, rest = address.partition("://")
    if not sep or scheme.lower() != "mqtt":
        raise refuse(address, "an MQTT address is mqtt://<broker-host>:<port>/<request topic>")
    authority, _, topic = rest.partition("/")
    if "@" in authority:
        raise refuse(address, "userinfo (user@host) is not allowed")
    host, port = authority, str(MQTT_DEFAULT_PORT)
    colon = authority.rfind(":")
    if colon > authority.rfind("]"):
        host, port = authority[:colon], authority[colon + 1 :]
    if not topic:
        raise refuse(address, "no request topic (mqtt://host:port/<topic>)")
    if "+" in topic or "#" in topic:
        raise refuse(address, "the request topic may not hold the wildcards + or #")
    if topic.startswith("$"):
        raise refuse(address, "topics starting with $ are the broker's own")
    return check_host(address, host), check_port(address, port), topic


def broker_of(host: str, port: int) -> str:
    return f"{host}:{port}"


# -- the wire -------------------------------------------------------------------------------------


def new_properties(packet_type: int) -> Properties:
    return Properties(packet_type)  # type: ignore[no-untyped-call]  # paho leaves it untyped


def request_properties(
    message: Message, reply_topic: str, correlation: bytes, timeout_s: float
) -> Properties:
    """The MQTT 5 properties of a request PUBLISH (docs/protocols/mqtt.md)."""
    h = message.header
    props = new_properties(PacketTypes.PUBLISH)
    props.ResponseTopic = reply_topic
    props.CorrelationData = correlation
    props.ContentType = message.metadata.content_type
    props.MessageExpiryInterval = max(1, math.ceil(timeout_s))
    props.UserProperty = [(MQTT_OPERATION, h.operation), *wire.metadata(h)]
    return props


def user_properties(props: Properties | None) -> list[tuple[str, str]]:
    pairs = getattr(props, "UserProperty", None) if props is not None else None
    return [(str(k), str(v)) for k, v in pairs] if pairs else []


def reply_status(endpoint: Endpoint, props: Properties | None) -> int:
    """The HTTP-style status a reply carries, or a final `AgentError` if it carries none."""
    said = next((v for k, v in user_properties(props) if k == MQTT_STATUS), None)
    if said is None or not said.isascii() or not said.isdigit() or not 100 <= int(said) <= 599:
        shown = "none" if said is None else repr(said[:40])
        raise AgentError(
            f"agent {endpoint.instance_id} answered an MQTT reply without a valid status "
            f"user property (got {shown})",
            retryable=False,
        )
    return int(said)


def answer_of(endpoint: Endpoint, reply: aiomqtt.Message, limit: int) -> Reply:
    """The Reply an agent's MQTT reply stands for, or the typed error it stands for."""
    status = reply_status(endpoint, reply.properties)
    raw = bytes(reply.payload)
    if status == 200 and len(raw) > limit:
        raise too_large(endpoint, str(len(raw)), limit)
    if status != 200:
        raw = raw[:MAX_ERROR_BODY_BYTES]
    return reply_for_status(endpoint, status, raw, limit)


def reach_error(exc: BaseException, broker: str) -> ReachError:
    """The one place aiomqtt's and paho's exceptions become Reach errors.

    Whether a failure is retryable is whether sending the same request again could succeed.
    """
    if isinstance(exc, ReachError):
        return exc
    if isinstance(exc, TimeoutError):
        return DeadlineExceeded(f"no answer through the MQTT broker {broker} in time")
    if isinstance(exc, aiomqtt.MqttReentrantError):
        return InternalError(f"MQTT connector misused aiomqtt for {broker}: {exc!r}")
    if isinstance(exc, aiomqtt.MqttError):  # connect refused or timed out, no connection, ...
        return TransportError(f"cannot reach the MQTT broker {broker}: {exc!r}")
    if isinstance(exc, ValueError):  # paho refusing a topic, payload or property (and Unicode)
        return TransportError(
            f"cannot send this request through the MQTT broker {broker}: {exc!r}",
            retryable=False,
        )
    if isinstance(exc, OSError):
        return TransportError(f"cannot reach the MQTT broker {broker}: {exc!r}")
    return InternalError(f"MQTT connector failed for {broker}: {exc!r}")


def puback_error(code: ReasonCode, topic: str, broker: str) -> TransportError | None:
    """What the broker's PUBACK to a request means: None when an agent may have it, else the
    error the request fails with at once.

    "No matching subscribers" means the request reached no agent (its agent is away, or has not
    subscribed again yet after a broker restart): retryable, and safe to retry whatever the
    operation, since nothing ran. A refusal (0x80 and up) is retryable too unless it is about the
    packet itself.
    """
    value = int(code.value)
    if value == NO_MATCHING_SUBSCRIBERS:
        return TransportError(f"no agent subscribed to {topic} at the MQTT broker {broker}")
    if value < 0x80:
        return None
    return TransportError(
        f"the MQTT broker {broker} refused the request to {topic}: {code.getName()} "
        f"(PUBACK reason code 0x{value:02x})",
        retryable=value not in PUBACK_FINAL,
    )


@contextlib.contextmanager
def map_mqtt_exceptions(broker: str) -> Iterator[None]:
    try:
        yield
    except ReachError:
        raise
    except (aiomqtt.MqttError, ValueError, OSError, TimeoutError) as exc:
        raise reach_error(exc, broker) from exc
