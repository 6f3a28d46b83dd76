"""The agent's MQTT 5 server: requests from a broker topic, replies to each request's Response
Topic (the wire contract is in `docs/protocols/mqtt.md`, its names and the connect helpers in
`agent_reach_proto.wire`).

Here `listen` and `advertise` name the BROKER (`host:port` or `mqtt://host:port`), not a socket
of the agent's own: the agent connects out to `listen`, and joins Reach with
`mqtt://<advertise>/reach/agents/<instance_id>/<8 hex, random per process>/requests`, the
topic it subscribes to with QoS 1.
Each request runs in a task of its own, so a slow operation never holds up the others; the
runtime's `dispatch` does the rest (deduplication, deadlines, `ctx.defer()`).

The connection heals itself: after a break (a broker restart) the server reconnects with backoff
(0.1 s doubling to 2 s) and subscribes again. Its sessions are clean (nothing survives at the
broker), so a request published while it is away reaches no one: the broker tells Reach so
(PUBACK "No matching subscribers"), and the request fails at once as a retryable
`transport_error` that the workflow retries after its backoff, by when the server is back.
`connections` counts the subscriptions made, for whoever needs to know it is back.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
from typing import Any

import aiomqtt
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties

from agent_reach_proto import wire
from agent_reach_sdk.servers import AgentServer, split_hostport
from agent_reach_sdk.wire import INTERNAL_ERROR, Answer, Dispatch, Inbound, error_answer

log = logging.getLogger("agent_reach_sdk.server")

DEFAULT_PORT = wire.MQTT_DEFAULT_PORT
OPERATION = wire.MQTT_OPERATION
STATUS = wire.MQTT_STATUS
# The most a request may be as the broker sends it is wire.MQTT_MAX_PACKET_BYTES (announced by
# `wire.mqtt_client`); the runtime's negotiated limit is checked per request (413), that only
# keeps an absurd packet out of memory.
BACKOFF_FIRST_S = 0.1
BACKOFF_MAX_S = 2.0
# Requests running at once; past it, a retryable 503 at once, so a flood of requests cannot
# pile up operations without bound (as on the WebSocket server).
MAX_HANDLERS = 1024
UNSUBSCRIBE_TIMEOUT_S = 2.0


def request_topic(instance_id: str, process: str = "") -> str:
    """`reach/agents/<instance_id>/<process>/requests`: the process segment (random per server)
    keeps two processes started with one instance_id off each other's requests — on a topic
    both subscribed to, each request would run twice. Reach calls whichever joined last."""
    middle = f"{instance_id}/{process}" if process else instance_id
    return f"reach/agents/{middle}/requests"


def _properties(packet_type: int) -> Properties:
    return Properties(packet_type)  # type: ignore[no-untyped-call]  # paho leaves it untyped


def _hostport(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


class MqttAgentServer(AgentServer):
    protocol = "mqtt"
    default_address = f"127.0.0.1:{DEFAULT_PORT}"  # the broker

    def __init__(self, dispatch: Dispatch, **kwargs: Any) -> None:
        super().__init__(dispatch, **kwargs)
        self.topic = request_topic(self.instance_id, secrets.token_hex(4))
        self.connections = 0  # subscriptions made: 1 after start, +1 after each reconnect
        self._host, self._port = split_hostport(self.listen, DEFAULT_PORT)
        self._client: aiomqtt.Client | None = None
        self._task: asyncio.Task[None] | None = None
        self._first: asyncio.Future[None] | None = None
        self._handlers: set[asyncio.Task[None]] = set()
        self._closing = False

    @property
    def broker(self) -> str:
        return _hostport(self._host, self._port)

    async def start(self) -> None:
        """Connect and subscribe; a broker that cannot be reached fails the start."""
        self._first = asyncio.get_running_loop().create_future()
        self._task = asyncio.create_task(self._run())
        try:
            await self._first
        except BaseException:
            self._closing = True
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None
            raise

    @property
    def service_address(self) -> str:
        host, port = split_hostport(self.advertise, DEFAULT_PORT)
        return f"mqtt://{_hostport(host, port)}/{self.topic}"

    async def close(self, grace_s: float = 5.0) -> None:
        if self._task is None:
            return
        self._closing = True
        client = self._client
        if client is not None:  # no new requests from here on
            try:
                await client.unsubscribe(self.topic, timeout=UNSUBSCRIBE_TIMEOUT_S)
            except aiomqtt.MqttError as exc:
                log.debug("unsubscribing from %s failed: %r", self.topic, exc)
        if self._handlers:
            _, running = await asyncio.wait(set(self._handlers), timeout=grace_s)
            for task in running:
                task.cancel()
            await asyncio.gather(*running, return_exceptions=True)
        self._task.cancel()
        await asyncio.gather(self._task, return_exceptions=True)
        self._task = None

    # -- the connection -----------------------------------------------------------------------

    async def _run(self) -> None:
        delay = BACKOFF_FIRST_S
        while not self._closing:
            client = wire.mqtt_client(
                self._host, self._port, identifier=f"reach-agent-{secrets.token_hex(8)}"
            )
            try:
                async with wire.mqtt_connected(client):
                    await wire.mqtt_subscribe(client, self.topic)
                    self._client = client
                    self.connections += 1
                    delay = BACKOFF_FIRST_S
                    if self._first is not None and not self._first.done():
                        self._first.set_result(None)
                    async for message in client.messages:
                        task = asyncio.create_task(self._handle(message))
                        self._handlers.add(task)
                        task.add_done_callback(self._handlers.discard)
            except Exception as exc:  # MqttError, or a bug: either way, serve on if we can
                if self._first is not None and not self._first.done():
                    self._first.set_exception(
                        ConnectionError(f"cannot use the MQTT broker at {self.broker}: {exc}")
                    )
                    return
                if not isinstance(exc, aiomqtt.MqttError):
                    log.exception("the MQTT server for %s failed; reconnecting", self.topic)
                elif not self._closing:
                    why = exc.__cause__ or exc
                    log.warning("lost the MQTT broker %s (%r); reconnecting", self.broker, why)
            finally:
                self._client = None
            await asyncio.sleep(delay)
            delay = min(delay * 2, BACKOFF_MAX_S)

    # -- one request --------------------------------------------------------------------------

    async def _handle(self, message: aiomqtt.Message) -> None:
        props = message.properties
        reply_to = getattr(props, "ResponseTopic", None)
        if not reply_to:
            log.warning("a request on %s has no Response Topic; dropped", message.topic)
            return
        correlation = getattr(props, "CorrelationData", None)
        headers: dict[str, str] = {}
        for name, value in getattr(props, "UserProperty", None) or []:
            headers.setdefault(str(name).lower(), str(value))
        answer = await self._answer(headers, bytes(message.payload))
        try:
            payload = answer.content()  # a body that is not JSON fails here
        except (TypeError, ValueError):
            log.exception("an operation answered with a body that is not JSON")
            answer = INTERNAL_ERROR
            payload = answer.content()
        reply = _properties(PacketTypes.PUBLISH)
        if correlation is not None:
            reply.CorrelationData = correlation
        reply.ContentType = "application/json"
        reply.UserProperty = (STATUS, str(answer.status))
        client = self._client
        if client is None:
            log.warning("no connection to the broker: the answer to a request is lost")
            return
        try:
            await client.publish(str(reply_to), payload, qos=1, properties=reply)
        except (aiomqtt.MqttError, ValueError) as exc:  # ValueError: a topic MQTT can't publish to
            log.warning("could not send an answer to %r: %r", reply_to, exc)

    async def _answer(self, headers: dict[str, str], body: bytes) -> Answer:
        if self._closing:
            return error_answer(503, "unavailable", "the agent is shutting down", retryable=True)
        if len(self._handlers) > MAX_HANDLERS:  # this request's own task is counted too
            return error_answer(503, "overloaded", f"{MAX_HANDLERS} requests already run here")
        if len(body) > self.max_body_bytes:
            return error_answer(
                413, "payload_too_large", f"the body passes the limit of {self.max_body_bytes}"
            )
        operation = headers.get(OPERATION)
        if not operation:
            return error_answer(400, "invalid_request", "the request has no operation property")
        try:
            return await self.dispatch(Inbound(operation, headers, body))
        except Exception:
            log.exception("operation handler crashed")
            return INTERNAL_ERROR
