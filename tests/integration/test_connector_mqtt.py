"""The MQTT connector and the SDK's MQTT server through real brokers.

Ordinary tests share the machine's Mosquitto on 127.0.0.1:1883, each on topics of its own; the
tests that stop a broker start their own Mosquitto on a free port and leave 1883 alone.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import json
import shutil
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine
from pathlib import Path
from typing import Any

import aiomqtt
import pytest
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.subscribeoptions import SubscribeOptions

from agent_reach_sdk import AgentRuntime, OperationError, RequestContext
from agent_reach_sdk.servers import mqtt as mqtt_server
from agent_reach_sdk.servers.mqtt import MqttAgentServer
from agent_reach_sdk.wire import Answer, Inbound
from connectors.mqtt import BrokerLink, MqttConnector, new_properties
from reach.config import TransportSettings
from reach.errors import AgentError, DeadlineExceeded, TransportError
from reach.invocation import Endpoint
from reach.messages import Reply, dumps
from tests.helpers import TRACEPARENT, free_port, message, wait_until

pytestmark = pytest.mark.integration

MACHINE_BROKER = "127.0.0.1:1883"


def new_id() -> str:
    return f"t-{uuid.uuid4().hex[:12]}"


async def port_open(port: int) -> bool:
    try:
        _, writer = await asyncio.open_connection("127.0.0.1", port)
    except OSError:
        return False
    writer.close()
    await writer.wait_closed()
    return True


@pytest.fixture(scope="module")
async def broker() -> str:
    if not await port_open(1883):
        pytest.fail("Mosquitto is not answering on 127.0.0.1:1883 (see the env skill)")
    return MACHINE_BROKER


def endpoint(address: str, instance_id: str, max_message_bytes: int | None = None) -> Endpoint:
    return Endpoint(
        instance_id=instance_id,
        capability="cap",
        protocol="mqtt",
        address=MqttConnector.check_address(address),
        max_message_bytes=max_message_bytes,
    )


def only_link(conn: MqttConnector) -> BrokerLink:
    links = [entry.value for key in conn._pools.held_keys() if (entry := conn._pools.get(key))]
    assert len(links) == 1
    return links[0]


# -- an SDK agent ---------------------------------------------------------------------------------


class SdkAgent:
    """An `AgentRuntime`'s operations behind a `MqttAgentServer` (no gateway: never joined)."""

    def __init__(
        self, broker: str, *, max_body_bytes: int = 1 << 20, listen: str | None = None
    ) -> None:
        """`listen` is where the server connects (the broker, or a `Gate` in front of it);
        `broker` is the broker it advertises, the one Reach publishes to."""
        self.instance_id = new_id()
        self.runtime = AgentRuntime("cap", protocol="mqtt", instance_id=self.instance_id)
        self.seen: list[Inbound] = []
        self.started = asyncio.Event()
        self.server = MqttAgentServer(
            self.dispatch,
            listen=listen or broker,
            advertise=broker,
            instance_id=self.instance_id,
            max_body_bytes=max_body_bytes,
        )
        rt = self.runtime

        @rt.operation("echo")
        async def echo(payload: dict[str, Any], ctx: RequestContext) -> dict[str, Any]:
            return {
                "got": payload,
                "request_id": ctx.request_id,
                "caller": ctx.caller,
                "attempt": ctx.attempt,
                "deadline_ms": ctx.deadline_ms,
                "idempotency_key": ctx.idempotency_key,
                "traceparent": ctx.headers.get("traceparent"),
            }

        @rt.operation("later")
        def later(payload: dict[str, Any], ctx: RequestContext) -> object:
            return ctx.defer()

        @rt.operation("slow")
        async def slow(payload: dict[str, Any]) -> dict[str, Any]:
            self.started.set()
            await asyncio.sleep(float(payload["s"]))
            return {"slept": payload["s"]}

        @rt.operation("busy")
        def busy(payload: dict[str, Any]) -> dict[str, Any]:
            raise OperationError("come back later", type="overloaded", status=503)

    async def dispatch(self, request: Inbound) -> Answer:
        self.seen.append(request)
        return await self.runtime.dispatch(request)

    @property
    def endpoint(self) -> Endpoint:
        return endpoint(self.server.service_address, self.instance_id)

    async def __aenter__(self) -> SdkAgent:
        await self.server.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.server.close(grace_s=1.0)


# -- a raw agent: replies exactly as a misbehaving agent sends them -------------------------------

Respond = Callable[[aiomqtt.Client, aiomqtt.Message], Coroutine[Any, Any, None]]


def operation_of(request: aiomqtt.Message) -> str:
    pairs = getattr(request.properties, "UserProperty", None) or []
    return next(str(v) for k, v in pairs if k == "operation")


async def reply(
    client: aiomqtt.Client,
    request: aiomqtt.Message,
    payload: bytes,
    status: str | None = "200",
    correlation: bytes | None = None,
) -> None:
    props = new_properties(PacketTypes.PUBLISH)
    props.CorrelationData = correlation or request.properties.CorrelationData  # type: ignore[union-attr]
    if status is not None:
        props.UserProperty = ("status", status)
    topic = request.properties.ResponseTopic  # type: ignore[union-attr]
    await client.publish(topic, payload, qos=1, properties=props)


class RawAgent:
    """A bare aiomqtt subscriber on a topic of its own; `respond` (if any) answers by hand."""

    def __init__(self, broker: str, respond: Respond | None = None) -> None:
        self.broker = broker
        self.topic = f"raw/{new_id()}/requests"
        self.respond = respond
        self.received: list[aiomqtt.Message] = []
        self._stack = contextlib.AsyncExitStack()
        self._tasks: set[asyncio.Task[None]] = set()

    def endpoint(self, max_message_bytes: int | None = None) -> Endpoint:
        return endpoint(f"mqtt://{self.broker}/{self.topic}", "raw", max_message_bytes)

    async def __aenter__(self) -> RawAgent:
        host, port = self.broker.split(":")
        self.client = aiomqtt.Client(host, int(port), protocol=aiomqtt.ProtocolVersion.V5)
        await self._stack.enter_async_context(self.client)
        await self.client.subscribe(self.topic, options=SubscribeOptions(qos=1))
        reader = asyncio.create_task(self._read())
        self._stack.push_async_callback(self._stop, reader)
        return self

    async def _stop(self, reader: asyncio.Task[None]) -> None:
        for task in [reader, *self._tasks]:
            task.cancel()
        await asyncio.gather(reader, *self._tasks, return_exceptions=True)

    async def _read(self) -> None:
        with contextlib.suppress(aiomqtt.MqttError):
            async for request in self.client.messages:
                self.received.append(request)
                if self.respond is not None:
                    task = asyncio.create_task(self.respond(self.client, request))
                    self._tasks.add(task)
                    task.add_done_callback(self._tasks.discard)

    async def __aexit__(self, *exc: object) -> None:
        await self._stack.aclose()


# -- a broker of the test's own, to stop and start ------------------------------------------------


def mosquitto_binary() -> str:
    found = shutil.which("mosquitto") or shutil.which("mosquitto", path="/usr/sbin:/usr/bin")
    if found is None:
        pytest.fail("mosquitto is not installed (apt-get install mosquitto)")
    return found


class OwnBroker:
    """A Mosquitto of this test's own on a free loopback port, with its own config file."""

    def __init__(self, tmp: Path) -> None:
        self.port = free_port()
        self.address = f"127.0.0.1:{self.port}"
        self.conf = tmp / "mosquitto.conf"
        self.conf.write_text(
            f"listener {self.port} 127.0.0.1\nallow_anonymous true\nset_tcp_nodelay true\n"
        )
        self.log = tmp / "mosquitto.log"
        self.proc: asyncio.subprocess.Process | None = None

    async def start(self) -> None:
        with self.log.open("ab") as out:
            self.proc = await asyncio.create_subprocess_exec(
                mosquitto_binary(), "-c", str(self.conf), stdout=out, stderr=out
            )
        deadline = time.monotonic() + 10
        while not await port_open(self.port):
            if self.proc.returncode is not None or time.monotonic() > deadline:
                raise RuntimeError(f"mosquitto did not start: {self.log.read_text()}")
            await asyncio.sleep(0.05)

    async def stop(self) -> None:
        if self.proc is not None and self.proc.returncode is None:
            self.proc.terminate()
            try:
                async with asyncio.timeout(10):
                    await self.proc.wait()
            except TimeoutError:
                self.proc.kill()
                await self.proc.wait()
        self.proc = None


@pytest.fixture
async def own_broker(tmp_path: Path) -> AsyncIterator[OwnBroker]:
    own = OwnBroker(tmp_path)
    await own.start()
    try:
        yield own
    finally:
        await own.stop()


class Gate:
    """A TCP relay in front of a broker, for an agent to connect through. Shut, it refuses new
    connections, as a broker that is down would: the agent comes back only when the test lets
    it. Connections already relayed live on until either end closes."""

    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self.shut = False
        self._handlers: set[asyncio.Task[Any]] = set()
        self._writers: set[asyncio.StreamWriter] = set()

    async def __aenter__(self) -> Gate:
        self._server = await asyncio.start_server(self._relay, "127.0.0.1", 0)
        self.address = f"127.0.0.1:{self._server.sockets[0].getsockname()[1]}"
        return self

    async def __aexit__(self, *exc: object) -> None:
        self._server.close()
        await self._server.wait_closed()
        for writer in self._writers:
            writer.close()
        await asyncio.gather(*self._handlers, return_exceptions=True)

    async def _relay(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._handlers.add(task)
        self._writers.add(writer)
        try:
            if self.shut:
                return
            try:
                up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.target_port)
            except OSError:
                return
            self._writers.add(up_writer)
            await asyncio.gather(self._pipe(reader, up_writer), self._pipe(up_reader, writer))
        finally:
            writer.close()
            self._handlers.discard(task)

    @staticmethod
    async def _pipe(source: asyncio.StreamReader, sink: asyncio.StreamWriter) -> None:
        with contextlib.suppress(OSError):
            while data := await source.read(65536):
                sink.write(data)
                await sink.drain()
        sink.close()


async def retried(
    call: Callable[[int], Awaitable[Reply]], *, within_s: float = 10.0, backoff_s: float = 0.1
) -> tuple[Reply, list[tuple[TransportError, float]]]:
    """What the workflow's retry policy does with a retryable error: try again after a backoff.
    Returns the reply and each failed attempt's error and duration."""
    failures: list[tuple[TransportError, float]] = []
    deadline = time.monotonic() + within_s
    attempt = 1
    while True:
        start = time.monotonic()
        try:
            return await call(attempt), failures
        except TransportError as exc:
            failures.append((exc, time.monotonic() - start))
            if not exc.retryable or time.monotonic() > deadline:
                raise
        attempt += 1
        await asyncio.sleep(backoff_s)


# -- outcomes -------------------------------------------------------------------------------------


async def test_a_request_reaches_the_agent_with_its_metadata(broker: str) -> None:
    async with SdkAgent(broker) as agent, MqttConnector() as conn:
        sent = message("echo", {"text": "日本語 é 🙂", "n": [1.5, None, True]})
        reply_ = await conn.invoke(agent.endpoint, sent, 5)
    assert reply_.status == "ok"
    assert reply_.result is not None
    h = sent.header
    assert reply_.result == {
        "got": sent.payload,
        "request_id": h.request_id,
        "caller": "tester",
        "attempt": 2,
        "deadline_ms": h.deadline_ms,
        "idempotency_key": "key-1",
        "traceparent": TRACEPARENT,
    }
    inbound = agent.seen[-1]
    assert inbound.operation == "echo"
    assert inbound.body == dumps(sent.payload)  # the payload as Reach measured it
    assert inbound.headers["x-reach-request-id"] == h.request_id


async def test_a_deferred_answer_is_accepted(broker: str) -> None:
    async with SdkAgent(broker) as agent, MqttConnector() as conn:
        reply_ = await conn.invoke(agent.endpoint, message("later"), 5)
    assert reply_.status == "accepted"
    assert reply_.result is None


async def test_an_agents_errors_keep_their_meaning(broker: str) -> None:
    async with SdkAgent(broker) as agent, MqttConnector() as conn:
        with pytest.raises(AgentError) as busy:
            await conn.invoke(agent.endpoint, message("busy"), 5)
        with pytest.raises(AgentError) as missing:
            await conn.invoke(agent.endpoint, message("nope"), 5)
        # The agent's own deadline ran out (its 504), well before the connector's timeout.
        short = message("slow", {"s": 5}, deadline_ms=int(time.time() * 1000) + 300)
        with pytest.raises(DeadlineExceeded, match="answered 504"):
            await conn.invoke(agent.endpoint, short, 5)
    assert busy.value.retryable
    assert busy.value.fault is not None
    assert (busy.value.fault.type, busy.value.fault.status) == ("overloaded", 503)
    assert not missing.value.retryable
    assert "operation not served" in missing.value.message


async def test_an_agent_that_never_answers_is_a_timeout_at_the_deadline(broker: str) -> None:
    async with RawAgent(broker) as silent, MqttConnector() as conn:
        start = time.monotonic()
        with pytest.raises(DeadlineExceeded):
            await conn.invoke(silent.endpoint(), message("op"), 0.5)
        elapsed = time.monotonic() - start
        assert 0.45 <= elapsed < 5  # at its deadline: never a hang
        assert len(silent.received) == 1  # it was delivered; nobody answered
        assert only_link(conn).pending == {}


async def test_a_request_no_agent_is_subscribed_to_fails_at_once(broker: str) -> None:
    """The broker's PUBACK says "No matching subscribers": a retryable transport_error at once,
    where before the fix it was a `timeout` at the deadline (5 s here). Mixed with requests that
    do reach an agent, on one connection: each PUBACK is matched to its own request."""
    nobody = endpoint(f"mqtt://{broker}/nobody/{new_id()}/requests", "nobody")
    topic = nobody.address.split("/", 3)[3]
    async with SdkAgent(broker) as agent, MqttConnector() as conn:
        start = time.monotonic()
        with pytest.raises(TransportError) as err:
            await conn.invoke(nobody, message("echo"), 30)
        assert time.monotonic() - start < 5  # at once, far from the 30 s deadline
        assert err.value.retryable
        assert f"no agent subscribed to {topic}" in err.value.message
        assert conn.stats.of("cap")["mqtt"]["failed"] == 1
        link = only_link(conn)
        assert link.pending == {}
        assert (await link.ready()).waiting() == 0

        start = time.monotonic()
        mixed = [conn.invoke(ep, message("echo"), 30) for ep in [nobody, agent.endpoint] * 10]
        outcomes = await asyncio.gather(*mixed, return_exceptions=True)
        assert time.monotonic() - start < 5
        assert all(isinstance(o, TransportError) and o.retryable for o in outcomes[::2])
        assert all(isinstance(o, Reply) and o.status == "ok" for o in outcomes[1::2])
        assert len(agent.seen) == 10
        # The connection carries on: refusals are no breaks.
        assert link.connects == 1
        assert link.pending == {}
        assert (await link.ready()).waiting() == 0
        assert conn.stats.of("cap")["mqtt"]["failed"] == 11


async def test_a_redelivered_request_is_executed_once(broker: str) -> None:
    async with SdkAgent(broker) as agent, MqttConnector() as conn:
        sent = message("echo")
        first = await conn.invoke(agent.endpoint, sent, 5)
        again = sent.model_copy(update={"header": sent.header.model_copy(update={"attempt": 3})})
        second = await conn.invoke(agent.endpoint, again, 5)
    assert first == second
    assert len(agent.seen) == 2
    assert agent.runtime.executed == 1


async def test_a_payload_over_the_agents_limit_is_refused_with_413(broker: str) -> None:
    async with SdkAgent(broker, max_body_bytes=1024) as agent, MqttConnector() as conn:
        with pytest.raises(AgentError) as err:
            await conn.invoke(agent.endpoint, message("echo", {"p": "x" * 2000}), 5)
        assert (await conn.invoke(agent.endpoint, message("echo"), 5)).status == "ok"
    assert not err.value.retryable
    assert "refused the payload as too large" in err.value.message
    assert agent.runtime.executed == 1


async def test_a_request_without_a_response_topic_is_dropped(broker: str) -> None:
    async with SdkAgent(broker) as agent, MqttConnector() as conn:
        host, port = broker.split(":")
        async with aiomqtt.Client(host, int(port), protocol=aiomqtt.ProtocolVersion.V5) as raw:
            props = new_properties(PacketTypes.PUBLISH)
            props.UserProperty = [("operation", "echo"), ("x-reach-request-id", "no-reply-to")]
            await raw.publish(agent.server.topic, b"{}", qos=1, properties=props)
        # The server carries on: the next request is answered as usual.
        after = message("echo")
        assert (await conn.invoke(agent.endpoint, after, 5)).status == "ok"
    assert [r.headers["x-reach-request-id"] for r in agent.seen] == [after.header.request_id]


async def test_close_stops_new_requests_and_finishes_those_in_flight(broker: str) -> None:
    async with MqttConnector() as conn:
        agent = SdkAgent(broker)
        await agent.server.start()
        ep = agent.endpoint
        running = asyncio.create_task(conn.invoke(ep, message("slow", {"s": 0.5}), 5))
        await asyncio.wait_for(agent.started.wait(), 5)
        closing = asyncio.create_task(agent.server.close(grace_s=5))
        await asyncio.sleep(0.1)
        start = time.monotonic()
        with pytest.raises(TransportError, match="no agent subscribed"):  # unsubscribed
            await conn.invoke(ep, message("echo"), 30)
        assert time.monotonic() - start < 5  # the broker said so: no wait for the deadline
        assert (await running).result == {"slept": 0.5}
        await closing
    assert agent.runtime.executed == 1


# -- malformed and oversized replies --------------------------------------------------------------


async def garbage(client: aiomqtt.Client, request: aiomqtt.Message) -> None:
    op = operation_of(request)
    if op == "not_json":
        await reply(client, request, b"\xff{oops")
    elif op == "no_status":
        await reply(client, request, b'{"ok":true}', status=None)
    elif op == "bad_status":
        await reply(client, request, b'{"ok":true}', status="two hundred")
    elif op == "unknown":  # an answer for no request this process is waiting for
        await reply(client, request, b'{"ok":true}', correlation=b"made-up/1")
    elif op == "big":
        size = int(json.loads(request.payload)["size"])
        await reply(client, request, dumps({"pad": "x" * (size - len('{"pad":""}'))}))
    else:
        await reply(client, request, b'{"ok":true}')


async def test_garbage_replies_fail_their_own_request_only(broker: str) -> None:
    async with RawAgent(broker, garbage) as raw, MqttConnector() as conn:
        ep = raw.endpoint()
        calls = {
            op: asyncio.create_task(conn.invoke(ep, message(op), 1.0))
            for op in ("not_json", "no_status", "bad_status", "unknown", "fine")
        }
        await asyncio.wait(calls.values())
        for op in ("not_json", "no_status", "bad_status"):
            err = calls[op].exception()
            assert isinstance(err, AgentError), op
            assert not err.retryable, op
        assert "without a valid status" in str(calls["bad_status"].exception())
        assert isinstance(calls["unknown"].exception(), DeadlineExceeded)  # ignored, logged
        assert calls["fine"].result().result == {"ok": True}
        # The client and its connection carry on.
        assert (await conn.invoke(ep, message("fine"), 2)).result == {"ok": True}
        assert only_link(conn).connects == 1
        assert conn.stats.of("cap")["mqtt"]["failed"] == 0


async def test_a_reply_over_the_limit_is_a_final_agent_error(broker: str) -> None:
    limit = 4096
    async with RawAgent(broker, garbage) as raw, MqttConnector() as conn:
        exact = await conn.invoke(raw.endpoint(limit), message("big", {"size": limit}), 5)
        assert exact.status == "ok"
        with pytest.raises(AgentError) as err:
            await conn.invoke(raw.endpoint(limit), message("big", {"size": 5000}), 5)
        # The configured limit applies when none was negotiated.
        small = MqttConnector(TransportSettings(max_message_bytes=limit))
        async with small:
            with pytest.raises(AgentError, match="4097 bytes"):
                await small.invoke(raw.endpoint(), message("big", {"size": limit + 1}), 5)
        assert (await conn.invoke(raw.endpoint(limit), message("fine"), 5)).status == "ok"
    assert not err.value.retryable
    assert "5000 bytes" in err.value.message


# -- the broker client's lifecycle ----------------------------------------------------------------


async def test_concurrent_requests_share_one_broker_client(broker: str) -> None:
    async with SdkAgent(broker) as agent, MqttConnector() as conn:
        start = time.monotonic()
        replies = await asyncio.gather(
            *(conn.invoke(agent.endpoint, message("slow", {"s": 0.3}), 5) for _ in range(10))
        )
        elapsed = time.monotonic() - start
        assert all(r.result == {"slept": 0.3} for r in replies)
        assert elapsed < 2.0  # in flight together, not one after another
        counts = conn.stats.of("cap")["mqtt"]
        assert (counts["opened"], counts["reused"]) == (1, 9)
        assert only_link(conn).connects == 1


async def test_an_idle_broker_client_is_reclaimed(broker: str) -> None:
    settings = TransportSettings(idle_timeout_s=0.3)
    async with SdkAgent(broker) as agent, MqttConnector(settings) as conn:
        await conn.invoke(agent.endpoint, message("echo"), 5)
        link = only_link(conn)
        await wait_until(lambda: link.closed and link._task.done(), 3)
        assert len(conn._pools) == 0
        assert (await conn.invoke(agent.endpoint, message("echo"), 5)).status == "ok"
        counts = conn.stats.of("cap")["mqtt"]
        assert (counts["opened"], counts["reclaimed"]) == (2, 1)


async def test_an_unreachable_broker_is_a_retryable_transport_error() -> None:
    dead = endpoint(f"mqtt://127.0.0.1:{free_port()}/reach/agents/x/requests", "x")
    async with MqttConnector() as conn:
        start = time.monotonic()
        with pytest.raises(TransportError) as err:
            await conn.invoke(dead, message("echo"), 5)
        assert time.monotonic() - start < 2
        assert conn.stats.of("cap")["mqtt"]["failed"] >= 1
    assert err.value.retryable


async def test_an_address_that_is_not_mqtt_is_a_final_transport_error() -> None:
    wrong = Endpoint(instance_id="x", capability="cap", protocol="mqtt", address="127.0.0.1:1883")
    async with MqttConnector() as conn:
        with pytest.raises(TransportError) as err:
            await conn.invoke(wrong, message("echo"), 5)
    assert not err.value.retryable


async def test_a_broker_that_never_acknowledges_the_connect_is_not_sent_at_the_deadline() -> None:
    """Nothing was published: at the deadline it is a retryable refusal that did not start, not a
    timeout (which would read as "may have run"). And closing the connector mid-connect still
    closes the socket (aiomqtt alone would not)."""
    held: list[asyncio.StreamReader] = []
    gone = asyncio.Event()

    async def mute(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        held.append(reader)
        with contextlib.suppress(ConnectionError):
            while await reader.read(4096):  # the CONNECT, never answered; then EOF
                pass
        gone.set()
        writer.close()

    server = await asyncio.start_server(mute, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        mute_ep = endpoint(f"mqtt://127.0.0.1:{port}/reach/agents/x/requests", "x")
        conn = MqttConnector()
        start = time.monotonic()
        with pytest.raises(TransportError) as refused:
            await conn.invoke(mute_ep, message("echo"), 0.5)
        assert time.monotonic() - start < 5  # at its deadline, never a hang
        assert (refused.value.retryable, refused.value.outcome_unknown) == (True, None)
        assert "was not sent" in refused.value.message
        assert len(held) == 1
        await conn.aclose()  # the link is still waiting for CONNACK
        await asyncio.wait_for(gone.wait(), 10)
        gc.collect()  # an unclosed socket would warn here, and warnings are errors
    finally:
        server.close()
        await server.wait_closed()


async def test_a_broker_restart_between_two_invokes(own_broker: OwnBroker) -> None:
    async with SdkAgent(own_broker.address) as agent, MqttConnector() as conn:
        assert (await conn.invoke(agent.endpoint, message("echo"), 5)).status == "ok"
        await own_broker.stop()
        await own_broker.start()
        # The agent comes back by itself: reconnects and subscribes again.
        await wait_until(lambda: agent.server.connections == 2, 10)
        reply_ = await conn.invoke(agent.endpoint, message("echo", {"after": "restart"}), 5)
        assert reply_.result is not None
        assert reply_.result["got"] == {"after": "restart"}
        counts = conn.stats.of("cap")["mqtt"]
        assert counts["opened"] == 1  # the same client, reconnected
        assert counts["reconnected"] == 1
        assert counts["failed"] >= 1


async def test_requests_in_flight_fail_at_once_when_the_broker_goes(
    own_broker: OwnBroker,
) -> None:
    async with RawAgent(own_broker.address) as silent, MqttConnector() as conn:
        waiting = asyncio.create_task(conn.invoke(silent.endpoint(), message("op"), 30))
        await wait_until(lambda: len(silent.received) == 1, 5)
        start = time.monotonic()
        await own_broker.stop()
        with pytest.raises(TransportError) as err:
            await waiting
        assert time.monotonic() - start < 2  # not at the deadline, 30 s away
        assert err.value.retryable
        assert only_link(conn).pending == {}
        # While the broker is away, a request fails fast too.
        with pytest.raises(TransportError):
            await conn.invoke(silent.endpoint(), message("op"), 5)


async def test_after_a_broker_restart_requests_fail_fast_until_the_agent_is_back(
    own_broker: OwnBroker,
) -> None:
    """Invoked right away after a restart, before the agent has subscribed again: the first
    attempt fails at once (not at its 5 s deadline), and a retry after the agent is back
    succeeds. The gate holds the agent off until the test has seen the first attempt fail."""
    async with (
        Gate(own_broker.port) as gate,
        SdkAgent(own_broker.address, listen=gate.address) as agent,
        MqttConnector() as conn,
    ):
        sent = message("echo", {"after": "restart"}, attempt=1)
        assert (await conn.invoke(agent.endpoint, message("echo"), 5)).status == "ok"
        gate.shut = True
        await own_broker.stop()
        await own_broker.start()

        start = time.monotonic()
        with pytest.raises(TransportError) as err:
            await conn.invoke(agent.endpoint, sent, 30)
        assert time.monotonic() - start < 5  # at once, far from the 30 s deadline
        assert err.value.retryable
        assert f"no agent subscribed to {agent.server.topic}" in err.value.message
        assert agent.runtime.executed == 1  # the first invoke only: nothing reached the agent

        gate.shut = False  # the agent may come back now (its backoff is up to 2 s)

        async def attempt(n: int) -> Reply:
            header = sent.header.model_copy(update={"attempt": 1 + n})
            again = sent.model_copy(update={"header": header})
            return await conn.invoke(agent.endpoint, again, 30)

        reply_, failures = await retried(attempt)
        assert reply_.result is not None
        assert reply_.result["got"] == {"after": "restart"}
        assert agent.server.connections == 2
        assert agent.runtime.executed == 2
        for failure, took in failures:  # while the agent was on its way back
            assert failure.retryable
            assert "no agent subscribed" in failure.message
            assert took < 5  # refused at once, not at the 30 s deadline
        counts = conn.stats.of("cap")["mqtt"]
        assert (counts["opened"], counts["reconnected"]) == (1, 1)
        assert counts["failed"] >= 2 + len(failures)  # the break, and each refused request


async def test_past_its_handler_cap_the_agent_answers_a_retryable_503(
    broker: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(mqtt_server, "MAX_HANDLERS", 2)
    async with SdkAgent(broker) as agent, MqttConnector() as conn:
        calls = [
            conn.invoke(agent.endpoint, message("slow", {"s": 1}, request_id=f"r-{i}"), 30)
            for i in range(4)
        ]
        outcomes = await asyncio.gather(*calls, return_exceptions=True)
    done = [o for o in outcomes if isinstance(o, Reply)]
    refused = [o for o in outcomes if isinstance(o, AgentError)]
    assert len(done) == 2
    assert len(refused) == 2
    assert all(o.retryable and "already run here" in o.message for o in refused)
    assert agent.runtime.executed == 2
