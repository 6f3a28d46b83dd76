"""MQTT 5 connector: requests and replies through a broker, paired by MQTT 5 properties.

The wire contract (what an agent written without the SDK implements: the address, the request
PUBLISH and its properties, what the broker's PUBACK means, the reply, what each status means,
malformed replies, timing and breaks) is `docs/protocols/mqtt.md`; its names, and the connect
helpers both ends use, are `agent_reach_proto.wire`'s. Here: `request_properties` builds a
request's properties, `puback_error` reads the PUBACK (0x10 "No matching subscribers": no agent
got it, a retryable `transport_error` at once), `answer_of` reads a reply through the table every
protocol shares (`connectors._answers`). The Correlation Data is `<request id>/<n>`, n unique per
call in the process, so a late reply to an earlier attempt cannot answer a later one.

Connections
-----------
One MQTT client per broker (`host:port`) per connector, kept in `connectors._pools.Pools`:
connected with MQTT 5, clean start and no session expiry (its reply topic is its own, so no
broker-side state should outlive it), subscribed with QoS 1 to its reply topic before any
request is sent. A task owns the client's `async with` and, after a break or a failed connect,
reconnects with backoff (0.1 s doubling to 5 s; at once when a request is waiting) and
re-subscribes. Counted per capability that has used the client: `reconnected` for each
connection re-established, `failed` for each failed connect and each break; a request whose
PUBACK says it went nowhere counts `failed` for its own capability; `opened`, `reused` and
`reclaimed` come from `Pools`. The client is closed when unused for
`transport.idle_timeout_s`. It belongs to no instance: `held()` is empty and an instance leaving
the registry closes nothing.

Brokers: ACLs (who may read and forge results), TCP_NODELAY at the broker (~40 ms a call
without it) and MQTT 5 are in `docs/protocols/mqtt.md`.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import itertools
import logging
import math
import secrets
from collections.abc import Iterator
from typing import Any, cast

import aiomqtt
import paho.mqtt.client as paho_mqtt
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties
from paho.mqtt.reasoncodes import ReasonCode

from agent_reach_proto import wire
from agent_reach_proto.wire import paho_client as paho_client
from connectors._address import check_characters, check_host, check_port, refuse
from connectors._answers import reply_for_status, too_large
from connectors._pools import ConnectionStats, Counter, Pools
from connectors.base import PooledConnector
from reach.config import SecuritySettings, TransportSettings
from reach.errors import (
    AgentError,
    DeadlineExceeded,
    InternalError,
    InvalidRequest,
    ReachError,
    TransportError,
)
from reach.invocation import Endpoint
from reach.messages import Message, Reply, dumps

log = logging.getLogger("connectors.mqtt")

DEFAULT_PORT = wire.MQTT_DEFAULT_PORT
REPLY_PREFIX = wire.MQTT_REPLY_PREFIX
OPERATION = wire.MQTT_OPERATION
STATUS = wire.MQTT_STATUS
# The contract's metadata names (the HTTP header names, lower case) under this module's names.
REQUEST_ID = wire.REQUEST_ID
CALLER = wire.CALLER
ATTEMPT = wire.ATTEMPT
DEADLINE_MS = wire.DEADLINE_MS
IDEMPOTENCY_KEY = wire.IDEMPOTENCY_KEY
TRACEPARENT = wire.TRACEPARENT

# Reach announces wire.MQTT_MAX_PACKET_BYTES, far above any negotiated limit, so that an
# oversized reply still arrives and becomes a clear agent_error; only beyond it does the broker
# drop a reply (and the request times out).
MAX_ERROR_BODY_BYTES = 64 * 1024
BACKOFF_FIRST_S = 0.1
BACKOFF_MAX_S = 5.0
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
    host, port = authority, str(DEFAULT_PORT)
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
    props.UserProperty = [(OPERATION, h.operation), *wire.metadata(h)]
    return props


def user_properties(props: Properties | None) -> list[tuple[str, str]]:
    pairs = getattr(props, "UserProperty", None) if props is not None else None
    return [(str(k), str(v)) for k, v in pairs] if pairs else []


def reply_status(endpoint: Endpoint, props: Properties | None) -> int:
    """The HTTP-style status a reply carries, or a final `AgentError` if it carries none."""
    said = next((v for k, v in user_properties(props) if k == STATUS), None)
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


# -- past aiomqtt's public API --------------------------------------------------------------------
#
# The one place this module relies on aiomqtt's internals (pinned: aiomqtt 2.5.1 on paho-mqtt
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


# -- one connection per broker --------------------------------------------------------------------


class BrokerLink:
    """One MQTT client to one broker, its reader, and the requests waiting for a reply.

    aiomqtt's client lives inside `async with`; the link's task owns that block and loops
    through connect, subscribe, read, break, back off, so a broken connection heals without
    anyone calling in.
    """

    def __init__(
        self,
        host: str,
        port: int,
        reply_topic: str,
        *,
        stats: ConnectionStats,
        protocol: str,
    ) -> None:
        self.host = host.strip("[]")
        self.port = port
        self.broker = broker_of(host, port)
        self.reply_topic = reply_topic
        self.stats = stats
        self.protocol = protocol
        self.pending: dict[bytes, asyncio.Future[aiomqtt.Message]] = {}
        self.capabilities: set[str] = set()  # whose counters a break or reconnect counts in
        self.connects = 0
        self.closed = False
        self._publisher: AckedPublisher | None = None
        self._waiters: list[asyncio.Future[AckedPublisher]] = []
        self._wake = asyncio.Event()
        self._task = asyncio.get_running_loop().create_task(self._run())

    def count(self, counter: Counter) -> None:
        for capability in self.capabilities:
            self.stats.count(capability, self.protocol, counter)

    async def ready(self) -> AckedPublisher:
        """The connected client, subscribed to the reply topic; waits for a connect attempt."""
        if self._publisher is not None:
            return self._publisher
        if self.closed:
            raise TransportError(f"the client for the MQTT broker {self.broker} was closed")
        waiter: asyncio.Future[AckedPublisher] = asyncio.get_running_loop().create_future()
        self._waiters.append(waiter)
        self._wake.set()  # cut a backoff short: someone needs the broker now
        try:
            return await waiter
        finally:
            with contextlib.suppress(ValueError):
                self._waiters.remove(waiter)

    async def publish(
        self,
        publisher: AckedPublisher,
        topic: str,
        payload: bytes,
        props: Properties,
        reply: asyncio.Future[aiomqtt.Message],
    ) -> TransportError | None:
        """Publish with QoS 1 and wait for the broker's PUBACK, or for the reply (or the
        connection's end, which fails `reply`) if that comes first. Returns the error a PUBACK
        that says the request went nowhere stands for, so that the caller fails at once."""
        ack = publisher.publish(topic, payload, props)
        try:
            either: set[asyncio.Future[Any]] = {ack, reply}
            await asyncio.wait(either, return_when=asyncio.FIRST_COMPLETED)
        finally:
            ack.cancel()  # a no-op once the PUBACK came
        if reply.done():
            return None
        return puback_error(ack.result(), topic, self.broker)

    async def _run(self) -> None:
        delay = BACKOFF_FIRST_S
        while not self.closed:
            client = wire.mqtt_client(
                self.host, self.port, identifier=f"reach-{secrets.token_hex(8)}"
            )
            publisher = AckedPublisher(client)
            subscribed = False
            error: BaseException | None = None
            try:
                async with wire.mqtt_connected(client):
                    await wire.mqtt_subscribe(client, self.reply_topic)
                    subscribed = True
                    self.connects += 1
                    if self.connects > 1:
                        self.count("reconnected")
                    delay = BACKOFF_FIRST_S
                    self._publisher = publisher
                    for waiter in self._waiters:
                        if not waiter.done():
                            waiter.set_result(publisher)
                    async for message in client.messages:
                        self._deliver(message)
            except aiomqtt.MqttError as exc:
                error = exc
            except Exception as exc:  # never let the link die: requests would wait in vain
                log.exception("MQTT link to %s failed unexpectedly", self.broker)
                error = exc
            finally:
                self._publisher = None
            if self.closed:
                break
            self.count("failed")
            if subscribed:
                why = error.__cause__ if error is not None and error.__cause__ else error
                log.warning("lost the MQTT broker %s (%r); reconnecting", self.broker, why)
                self._fail_pending(
                    TransportError(
                        f"the connection to the MQTT broker {self.broker} broke while waiting "
                        f"for the reply ({error!r})"
                    )
                )
            else:
                log.info("cannot connect to the MQTT broker %s: %r", self.broker, error)
                for waiter in self._waiters:
                    if not waiter.done():
                        waiter.set_exception(reach_error(error or ConnectionError(), self.broker))
            self._wake.clear()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(delay):
                    await self._wake.wait()
            delay = min(delay * 2, BACKOFF_MAX_S)

    def _deliver(self, message: aiomqtt.Message) -> None:
        correlation = getattr(message.properties, "CorrelationData", None)
        waiter = self.pending.get(correlation) if isinstance(correlation, bytes) else None
        if waiter is None or waiter.done():
            # Mostly a late reply to a request that already ended; made up or not, it's no one's.
            log.info(
                "MQTT reply on %s with correlation data %r matches no waiting request; dropped",
                message.topic,
                correlation[:80] if isinstance(correlation, bytes) else correlation,
            )
            return
        waiter.set_result(message)

    def _fail_pending(self, error: ReachError) -> None:
        for waiter in self.pending.values():
            if not waiter.done():
                waiter.set_exception(error)

    async def aclose(self) -> None:
        self.closed = True
        self._task.cancel()
        await asyncio.gather(self._task, return_exceptions=True)
        closed = TransportError(f"the client for the MQTT broker {self.broker} was closed")
        self._fail_pending(closed)
        for waiter in self._waiters:
            if not waiter.done():
                waiter.set_exception(closed)


async def _close_link(link: BrokerLink) -> None:
    await link.aclose()


class MqttConnector(PooledConnector):
    protocol = "mqtt"

    def __init__(
        self,
        transport: TransportSettings | None = None,
        *,
        stats: ConnectionStats | None = None,
        security: SecuritySettings | None = None,
    ) -> None:
        super().__init__(transport, stats=stats, security=security)
        self.reply_topic = f"{REPLY_PREFIX}{secrets.token_hex(12)}"
        self._calls = itertools.count(1)

        def make_link(broker: str) -> BrokerLink:
            host, _, port = broker.rpartition(":")
            return BrokerLink(
                host, int(port), self.reply_topic, stats=self.stats, protocol=self.protocol
            )

        # Keyed by broker and held for no one instance: an instance leaving closes nothing
        # (`held()` is empty); idle reclaim closes the client once no one uses it.
        self._pools: Pools[BrokerLink] = self._new_pools(make_link, _close_link)

    @classmethod
    def check_address(cls, address: str) -> str:
        host, port, topic = split_address(address)
        return f"mqtt://{host}:{port}/{topic}"

    async def invoke(self, endpoint: Endpoint, message: Message, timeout_s: float) -> Reply:
        limit = endpoint.max_message_bytes or self.transport.max_message_bytes
        try:
            host, port, topic = split_address(endpoint.address)
        except InvalidRequest as exc:
            raise TransportError(exc.message, retryable=False) from exc
        broker = broker_of(host, port)
        correlation = f"{message.header.request_id}/{next(self._calls)}".encode()
        with map_mqtt_exceptions(broker):
            body = dumps(message.payload)
            props = request_properties(message, self.reply_topic, correlation, timeout_s)
            entry = self._pools.acquire(broker, endpoint.capability)
            link = entry.value
            link.capabilities.add(endpoint.capability)
            reply: asyncio.Future[aiomqtt.Message] = asyncio.get_running_loop().create_future()
            try:
                async with asyncio.timeout(max(timeout_s, 0.001)):
                    publisher = await link.ready()
                    # Waiting from here on: a break of this connection fails it at once.
                    link.pending[correlation] = reply
                    refused = await link.publish(publisher, topic, body, props, reply)
                    if refused is not None:  # e.g. no agent subscribed: no use waiting
                        self.stats.count(endpoint.capability, self.protocol, "failed")
                        raise refused
                    answer = await reply
            except TimeoutError:
                raise DeadlineExceeded(
                    f"agent {endpoint.instance_id} did not answer through the MQTT broker "
                    f"{broker} in time"
                ) from None
            finally:
                link.pending.pop(correlation, None)
                if not reply.done():
                    reply.cancel()
                self._pools.release(entry)
        return answer_of(endpoint, answer, limit)

    @classmethod
    def address_host_port(cls, address: str) -> tuple[str, int] | None:
        """The broker's host and port: Reach connects to the broker, never to the agent."""
        host, port, _ = split_address(address)
        return host, port
