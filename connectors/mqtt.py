"""MQTT 5 connector: requests and replies through a broker, paired by MQTT 5 properties.

The wire contract (what an agent written without the SDK implements: the address, the request
PUBLISH and its properties, what the broker's PUBACK means, the reply, what each status means,
malformed replies, timing and breaks), its connections and what a broker needs (ACLs,
TCP_NODELAY, MQTT 5) are docs/protocols/mqtt.md; its names, and the connect helpers both ends
use, are `agent_reach_proto.wire`'s. Here the connection to each broker (`BrokerLink`: connect,
subscribe, read, reconnect with backoff; kept and reclaimed in `connectors._pools.Pools`) and the
call on it (`MqttConnector.invoke`: publish, wait for the PUBACK and the reply). One request's
translation (address, properties, PUBACK and reply reading, errors) is `connectors._mqtt_call`'s;
QoS 1 publishing that keeps the PUBACK's reason code is `connectors._mqtt_publisher`'s. The
Correlation Data is `<request id>/<n>`, n unique per call in the process, so a late reply to an
earlier attempt cannot answer a later one.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import secrets
from typing import Any

import aiomqtt
from paho.mqtt.reasoncodes import ReasonCode

from agent_reach_proto import wire
from agent_reach_proto.wire import paho_client
from connectors._mqtt_call import (
    answer_of,
    broker_of,
    map_mqtt_exceptions,
    new_properties,
    puback_error,
    reach_error,
    reply_status,
    request_properties,
    split_address,
    user_properties,
)
from connectors._mqtt_publisher import AckedPublisher
from connectors._pools import ConnectionStats, Counter, Pools
from connectors.base import PooledConnector
from reach.config import SecuritySettings, TransportSettings
from reach.errors import DeadlineExceeded, InvalidRequest, ReachError, TransportError
from reach.invocation import Endpoint
from reach.messages import Message, Reply, dumps

# This module's names and those that moved to the role modules (importable from here as before).
# The older names of the contract's constants below stay importable, unlisted: their home is wire.
__all__ = [
    "BACKOFF_FIRST_S",
    "BACKOFF_MAX_S",
    "AckedPublisher",
    "BrokerLink",
    "MqttConnector",
    "answer_of",
    "broker_of",
    "map_mqtt_exceptions",
    "new_properties",
    "paho_client",
    "puback_error",
    "reach_error",
    "reply_status",
    "request_properties",
    "split_address",
    "user_properties",
]

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

# Reconnecting after a break or a failed connect (at once when a request is waiting).
BACKOFF_FIRST_S = 0.1
BACKOFF_MAX_S = 5.0


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

    async def acked(
        self,
        ack: asyncio.Future[ReasonCode],
        topic: str,
        reply: asyncio.Future[aiomqtt.Message],
    ) -> TransportError | None:
        """Wait for the broker's PUBACK to a request published with QoS 1 (`ack`), or for the
        reply (or the connection's end, which fails `reply`) if that comes first. Returns the
        error a PUBACK that says the request went nowhere stands for, so that the caller fails
        at once."""
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
                # Every request waiting was published on this connection: the broker may have
                # passed it on, and its agent run it.
                self._fail_pending(
                    TransportError(
                        f"the connection to the MQTT broker {self.broker} broke while waiting "
                        f"for the reply ({error!r}); the request was published, so its agent "
                        "may have run it",
                        outcome_unknown=True,
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
        self._fail_pending(
            TransportError(
                f"the client for the MQTT broker {self.broker} was closed while waiting for the "
                "reply; the request was published, so its agent may have run it",
                outcome_unknown=True,
            )
        )
        closed = TransportError(f"the client for the MQTT broker {self.broker} was closed")
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
            published = False  # from here on the agent may have it: a break is an unknown outcome
            try:
                async with asyncio.timeout(max(timeout_s, 0.001)):
                    publisher = await link.ready()
                    # Waiting from here on: a break of this connection fails it at once.
                    link.pending[correlation] = reply
                    ack = publisher.publish(topic, body, props)  # raises: nothing went out
                    published = True
                    refused = await link.acked(ack, topic, reply)
                    if refused is not None:  # e.g. no agent subscribed: no use waiting
                        self.stats.count(endpoint.capability, self.protocol, "failed")
                        raise refused
                    answer = await reply
            except TimeoutError:
                if not published:  # never connected in time: not sent, and not started
                    raise TransportError(
                        f"the MQTT broker {broker} was not reached before the deadline; the "
                        f"request was not sent to agent {endpoint.instance_id}"
                    ) from None
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
