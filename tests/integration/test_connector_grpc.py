"""The gRPC connector against the SDK's gRPC server and raw gRPC servers, over real sockets."""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from functools import partial
from typing import Any

import grpc
import grpc.aio
import pytest

from agent_reach_proto.agent_pb2 import InvokeReply, InvokeRequest
from agent_reach_sdk.context import RequestContext
from agent_reach_sdk.runtime import AgentRuntime, OperationError
from agent_reach_sdk.servers.grpc import GrpcAgentServer
from agent_reach_sdk.wire import Answer, Dispatch, Inbound
from connectors import ConnectionStats
from connectors.grpc import GrpcConnector
from connectors.http import HttpConnector
from gateway_api.devserver import free_port
from reach.config import TransportSettings
from reach.errors import AgentError, DeadlineExceeded, ReachError, TransportError
from reach.invocation import Endpoint
from reach.messages import dumps
from tests.helpers import TRACEPARENT, agent_server, wait_until
from tests.helpers import message as a_message

pytestmark = pytest.mark.integration

# Deadlines past the 5 s most calls here are given, so the call's own timeout is what ends them.
message = partial(a_message, deadline_s=10.0)

AGENT_LIMIT = 64 * 1024


def endpoint(port: int, max_message_bytes: int | None = None, name: str = "g1") -> Endpoint:
    return Endpoint(
        instance_id=name,
        capability="cap",
        protocol="grpc",
        address=f"127.0.0.1:{port}",
        max_message_bytes=max_message_bytes,
    )


def counts(conn: GrpcConnector) -> dict[str, int]:
    return conn.stats.of("cap").get("grpc", {})


# -- the agent: a real AgentRuntime's operations behind the SDK's gRPC server ---------------------


class Agent:
    def __init__(self) -> None:
        self.runtime = AgentRuntime(
            "cap", protocol="grpc", instance_id="grpc-agent", max_message_bytes=AGENT_LIMIT
        )
        self.seen: list[RequestContext] = []
        op = self.runtime.operation

        @op("echo")
        async def echo(payload: dict[str, Any], ctx: RequestContext) -> dict[str, Any]:
            self.seen.append(ctx)
            return {"got": payload}

        @op("list")
        def as_list(payload: dict[str, Any]) -> list[int]:
            return [1, 2]

        @op("later")
        async def later(payload: dict[str, Any], ctx: RequestContext) -> object:
            return ctx.defer()

        @op("slow")
        async def slow(payload: dict[str, Any]) -> dict[str, Any]:
            await asyncio.sleep(float(payload.get("s", 30)))
            return {"slept": True}

        @op("fail")
        async def fail(payload: dict[str, Any]) -> dict[str, Any]:
            raise OperationError(payload["message"], type=payload["type"], status=payload["status"])

        @op("crash")
        async def crash(payload: dict[str, Any]) -> dict[str, Any]:
            raise RuntimeError("boom")

        @op("big")
        async def big(payload: dict[str, Any]) -> dict[str, Any]:
            return {"pad": "x" * int(payload["n"])}


@pytest.fixture(scope="module")
def agent() -> Agent:
    return Agent()


def grpc_server(
    dispatch: Dispatch, port: int = 0, max_body_bytes: int = AGENT_LIMIT
) -> GrpcAgentServer:
    return GrpcAgentServer(
        dispatch,
        listen=f"127.0.0.1:{port}",
        advertise="127.0.0.1:0",
        instance_id="grpc-agent",
        max_body_bytes=max_body_bytes,
    )


@contextlib.asynccontextmanager
async def serving(dispatch: Dispatch, port: int = 0, **kw: Any) -> AsyncIterator[GrpcAgentServer]:
    server = grpc_server(dispatch, port, **kw)
    await server.start()
    try:
        yield server
    finally:
        await server.close(0)


class Proxy:
    """A TCP forwarder in front of an agent: the agent side's count of connections."""

    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self.accepted = 0
        self.open = 0
        self.port = 0
        self._tasks: set[asyncio.Task[None]] = set()
        self._server: asyncio.Server | None = None

    async def __aenter__(self) -> Proxy:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._server is not None
        self._server.close()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self._server.wait_closed()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        self.accepted += 1
        self.open += 1
        upstream: asyncio.StreamWriter | None = None
        try:
            up_reader, upstream = await asyncio.open_connection("127.0.0.1", self.target_port)
            await asyncio.gather(_pipe(reader, upstream), _pipe(up_reader, writer))
        except (OSError, asyncio.CancelledError):
            pass  # refused upstream, or shut down by __aexit__
        finally:
            self.open -= 1
            self._tasks.discard(task)
            writer.close()
            if upstream is not None:
                upstream.close()


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while data := await reader.read(65536):
            writer.write(data)
            await writer.drain()
    except ConnectionError:
        pass
    finally:
        writer.close()


# -- outcomes ---------------------------------------------------------------------------------


async def test_a_call_carries_the_requests_metadata_and_returns_its_result(agent: Agent) -> None:
    async with serving(agent.runtime.dispatch) as server, GrpcConnector() as conn:
        assert server.service_address == f"127.0.0.1:{server.port}"
        msg = message("echo", {"text": "日本語 🙂"})
        reply = await conn.invoke(endpoint(server.port), msg, 5)
        assert (reply.status, reply.result) == ("ok", {"got": {"text": "日本語 🙂"}})
        ctx = agent.seen[-1]
        assert ctx.request_id == msg.header.request_id
        assert (ctx.caller, ctx.attempt, ctx.idempotency_key) == ("tester", 2, "key-1")
        assert ctx.deadline_ms == msg.header.deadline_ms
        assert ctx.headers["traceparent"] == TRACEPARENT
        assert (await conn.invoke(endpoint(server.port), message("list"), 5)).result == {
            "value": [1, 2]
        }
        bare = message("echo", deadline_ms=None, idempotency_key=None, traceparent=None)
        await conn.invoke(endpoint(server.port), bare, 5)
        assert agent.seen[-1].deadline_ms is None
        assert "traceparent" not in agent.seen[-1].headers
        assert agent.seen[-1].idempotency_key is None


async def test_a_deferred_operation_is_accepted(agent: Agent) -> None:
    async with serving(agent.runtime.dispatch) as server, GrpcConnector() as conn:
        reply = await conn.invoke(endpoint(server.port), message("later"), 5)
    assert (reply.status, reply.result) == ("accepted", None)


@pytest.mark.parametrize(
    ("status", "code", "retryable"),
    [
        (422, grpc.StatusCode.INVALID_ARGUMENT, False),
        (400, grpc.StatusCode.INVALID_ARGUMENT, False),
        (401, grpc.StatusCode.UNAUTHENTICATED, False),
        (403, grpc.StatusCode.PERMISSION_DENIED, False),
        (409, grpc.StatusCode.ALREADY_EXISTS, False),
        (429, grpc.StatusCode.RESOURCE_EXHAUSTED, True),
        (500, grpc.StatusCode.INTERNAL, True),
        (503, grpc.StatusCode.UNAVAILABLE, True),
    ],
)
async def test_an_operation_error_is_an_agent_error_with_its_words_inside(
    agent: Agent, status: int, code: grpc.StatusCode, retryable: bool
) -> None:
    payload = {"message": "q must be a number", "type": "bad_input", "status": status}
    async with serving(agent.runtime.dispatch) as server, GrpcConnector() as conn:
        with pytest.raises(AgentError) as err:
            await conn.invoke(endpoint(server.port), message("fail", payload), 5)
        # What a generic gRPC client sees: the code, and the HTTP-style status beside it.
        request = InvokeRequest(operation="fail", payload=dumps(payload)).SerializeToString()
        async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
            invoke: grpc.aio.UnaryUnaryMultiCallable[bytes, bytes] = channel.unary_unary(
                "/reach.agent.v1.Agent/Invoke"
            )
            rid = "req-raw-" + uuid.uuid4().hex
            with pytest.raises(grpc.aio.AioRpcError) as raw:
                await invoke(request, metadata=(("x-reach-request-id", rid),))
    assert raw.value.code() == code
    assert raw.value.details() == "q must be a number"
    trailing = dict(raw.value.trailing_metadata() or ())
    assert trailing["x-reach-status"] == str(status)
    assert trailing["x-reach-error-type"] == "bad_input"
    assert err.value.retryable is retryable
    assert err.value.message == f"agent g1 answered {status}: q must be a number"
    assert err.value.fault is not None
    assert err.value.fault.type == "bad_input"
    assert err.value.fault.message == "q must be a number"
    assert err.value.fault.status == status  # the same as over HTTP, WebSocket and MQTT


@pytest.mark.parametrize("char", ["中", "😀"])
async def test_a_long_non_ascii_message_is_still_the_agents_final_answer(
    agent: Agent, char: str
) -> None:
    """1000 characters of 3 or 4 bytes, percent-encoded in grpc-message, would pass gRPC's
    8 KiB/16 KiB trailer limits: the call would end RESOURCE_EXHAUSTED "received metadata size
    exceeds", a retryable failure in place of the agent's final 422."""
    payload = {"message": char * 1000, "type": "bad_input", "status": 422}
    async with serving(agent.runtime.dispatch) as server, GrpcConnector() as conn:
        for _ in range(20):
            with pytest.raises(AgentError) as err:
                await conn.invoke(endpoint(server.port), message("fail", payload), 5)
            assert not err.value.retryable
            fault = err.value.fault
            assert fault is not None
            assert (fault.type, fault.status) == ("bad_input", 422)
            assert fault.message.startswith(char * 100)
            assert fault.message.endswith("…")  # cut to the server's byte budget, and marked
            assert len(fault.message.encode()) <= 1024
            assert err.value.message == f"agent g1 answered 422: {fault.message}"


async def test_a_chatty_agents_large_trailers_are_still_its_answer() -> None:
    """A non-SDK agent may send more than gRPC's default 8 KiB of trailers (here ~30 KiB): its
    answer, not a transport-level RESOURCE_EXHAUSTED."""

    async def handle(raw: bytes, context: grpc.aio.ServicerContext[bytes, bytes]) -> bytes:
        await context.abort(
            grpc.StatusCode.INVALID_ARGUMENT,
            "中" * 2500,  # 7.5 KB of UTF-8, 22.5 KB percent-encoded
            trailing_metadata=(("x-reach-error-type", "chatty"), ("x-debug", "d" * 6000)),
        )

    async with raw_agent(handle) as port, GrpcConnector() as conn:
        for _ in range(10):
            with pytest.raises(AgentError) as err:
                await conn.invoke(endpoint(port), message("op"), 5)
            assert not err.value.retryable
            assert err.value.fault is not None
            assert err.value.fault.type == "chatty"
            assert err.value.fault.message.startswith("中" * 900)


async def test_an_unknown_operation_and_a_crash_are_told_apart(agent: Agent) -> None:
    async with serving(agent.runtime.dispatch) as server, GrpcConnector() as conn:
        with pytest.raises(AgentError) as missing:
            await conn.invoke(endpoint(server.port), message("nope"), 5)
        with pytest.raises(AgentError) as crashed:
            await conn.invoke(endpoint(server.port), message("crash"), 5)
    assert not missing.value.retryable
    assert "operation not served" in missing.value.message
    assert crashed.value.retryable
    assert crashed.value.fault is not None
    assert crashed.value.fault.message == "RuntimeError: boom"


async def test_a_slow_agent_is_a_timeout_at_the_deadline(agent: Agent) -> None:
    async with serving(agent.runtime.dispatch) as server, GrpcConnector() as conn:
        start = time.monotonic()
        with pytest.raises(DeadlineExceeded):
            await conn.invoke(endpoint(server.port), message("slow"), 0.3)
        assert time.monotonic() - start < 5  # at its deadline, not the agent's 30 s
        # The agent says it ran out of time itself (504): also Reach's timeout.
        short = message("slow", {"s": 5}, deadline_ms=int(time.time() * 1000) + 200)
        with pytest.raises(DeadlineExceeded, match="passed the request's deadline"):
            await conn.invoke(endpoint(server.port), short, 5)


async def test_a_redelivered_request_runs_once(agent: Agent) -> None:
    async with serving(agent.runtime.dispatch) as server, GrpcConnector() as conn:
        msg = message("echo", {"n": 1})
        before = agent.runtime.executed
        first = await conn.invoke(endpoint(server.port), msg, 5)
        again = await conn.invoke(endpoint(server.port), msg.model_copy(), 5)
    assert agent.runtime.executed == before + 1
    assert first == again


# -- limits -----------------------------------------------------------------------------------


async def test_a_reply_over_the_negotiated_limit_is_refused_and_the_channel_lives_on(
    agent: Agent,
) -> None:
    async with serving(agent.runtime.dispatch) as server, GrpcConnector() as conn:
        ep = endpoint(server.port, max_message_bytes=2048)
        with pytest.raises(AgentError) as err:
            await conn.invoke(ep, message("big", {"n": 8000}), 5)
        assert not err.value.retryable
        assert "max_message_bytes is 2048" in err.value.message
        # Within framing of the limit: gRPC lets it in, the re-encoded check refuses it.
        with pytest.raises(AgentError, match="the limit is 2048") as near:
            await conn.invoke(ep, message("big", {"n": 2048 - 9}), 5)
        assert not near.value.retryable
        exact = await conn.invoke(ep, message("big", {"n": 2048 - 10}), 5)
        assert exact.result is not None
        assert counts(conn)["opened"] == 1


async def test_the_agents_result_too_large_is_not_retried(agent: Agent) -> None:
    async with serving(agent.runtime.dispatch) as server, GrpcConnector() as conn:
        ep = endpoint(server.port, max_message_bytes=4 * AGENT_LIMIT)
        with pytest.raises(AgentError) as err:
            await conn.invoke(ep, message("big", {"n": AGENT_LIMIT + 1}), 5)
    assert not err.value.retryable
    assert err.value.fault is not None
    assert err.value.fault.type == "result_too_large"


async def test_a_payload_over_the_agents_limit_is_refused_for_good(agent: Agent) -> None:
    async with (
        serving(agent.runtime.dispatch, max_body_bytes=4096) as server,
        GrpcConnector() as conn,
    ):
        server.max_body_bytes = 1024  # negotiated lower at Join, after the server started
        with pytest.raises(AgentError) as lowered:
            await conn.invoke(endpoint(server.port), message("echo", {"p": "x" * 2000}), 5)
        assert not lowered.value.retryable
        assert lowered.value.fault is not None
        assert lowered.value.fault.type == "payload_too_large"
        # Past what gRPC was started with: refused by grpc itself, just as final.
        with pytest.raises(AgentError, match="refused the payload") as huge:
            await conn.invoke(endpoint(server.port), message("echo", {"p": "x" * 9000}), 5)
        assert not huge.value.retryable
        assert (await conn.invoke(endpoint(server.port), message("echo"), 5)).status == "ok"


# -- connections ------------------------------------------------------------------------------


async def test_one_channel_is_reused_across_calls(agent: Agent) -> None:
    async with (
        serving(agent.runtime.dispatch) as server,
        Proxy(server.port) as proxy,
        GrpcConnector() as conn,
    ):
        await asyncio.gather(
            *(conn.invoke(endpoint(proxy.port), message("echo"), 5) for _ in range(5))
        )
        for _ in range(5):
            await conn.invoke(endpoint(proxy.port), message("echo"), 5)
        assert proxy.accepted == 1
        assert counts(conn)["opened"] == 1
        assert counts(conn)["reused"] == 9
        assert conn.held() == {"g1": "cap"}


async def test_an_idle_channel_is_closed_and_the_next_call_reopens_it(agent: Agent) -> None:
    settings = TransportSettings(idle_timeout_s=0.3)
    async with (
        serving(agent.runtime.dispatch) as server,
        Proxy(server.port) as proxy,
        GrpcConnector(settings) as conn,
    ):
        await conn.invoke(endpoint(proxy.port), message("echo"), 5)
        assert proxy.open == 1
        await wait_until(lambda: proxy.open == 0, 3)
        assert counts(conn)["reclaimed"] == 1
        assert conn.held() == {}
        assert (await conn.invoke(endpoint(proxy.port), message("echo"), 5)).status == "ok"
        assert proxy.accepted == 2
        assert counts(conn)["opened"] == 2


async def test_forget_closes_the_instances_channel(agent: Agent) -> None:
    async with (
        serving(agent.runtime.dispatch) as server,
        Proxy(server.port) as proxy,
        GrpcConnector() as conn,
    ):
        await conn.invoke(endpoint(proxy.port, name="leaving"), message("echo"), 5)
        await conn.invoke(endpoint(proxy.port, name="staying"), message("echo"), 5)
        assert proxy.open == 2
        await conn.forget("leaving")
        await wait_until(lambda: proxy.open == 1, 3)
        assert conn.held() == {"staying": "cap"}


async def test_nothing_listening_is_a_fast_retryable_transport_error() -> None:
    async with GrpcConnector() as conn:
        start = time.monotonic()
        with pytest.raises(TransportError) as err:
            await conn.invoke(endpoint(free_port()), message("echo"), 30)
        assert time.monotonic() - start < 5  # refused at once, far from the deadline
    assert err.value.retryable
    assert counts(conn)["failed"] == 1


async def test_a_restarted_agent_is_reached_again_on_the_same_channel(agent: Agent) -> None:
    port = free_port()
    stats = ConnectionStats()
    async with GrpcConnector(stats=stats) as conn:
        ep = endpoint(port)
        async with serving(agent.runtime.dispatch, port):
            await conn.invoke(ep, message("echo"), 5)
        async with serving(agent.runtime.dispatch, port):  # restarted: a new process would do
            assert (await conn.invoke(ep, message("echo"), 5)).status == "ok"
        assert (counts(conn)["opened"], counts(conn)["reconnected"]) == (1, 1)
        # Down for a call, then back: the failure is counted, and so is the way back.
        with pytest.raises(TransportError) as down:
            await conn.invoke(ep, message("echo"), 5)
        assert down.value.retryable
        async with serving(agent.runtime.dispatch, port):
            deadline = time.monotonic() + 5
            while True:  # until the channel's reconnect backoff lets it try again
                try:
                    await conn.invoke(ep, message("echo"), 5)
                    break
                except TransportError:
                    assert time.monotonic() < deadline
                    await asyncio.sleep(0.05)
        assert counts(conn)["reconnected"] == 2
        assert counts(conn)["failed"] >= 2
        assert counts(conn)["opened"] == 1


async def test_every_restart_between_calls_is_counted_however_soon_the_next_call_comes(
    agent: Agent,
) -> None:
    """The next call may leave before the channel has read the old connection's GOAWAY; gRPC
    then sends it on a new connection, and the break must still be counted (CI saw 0)."""
    port = free_port()
    async with GrpcConnector() as conn:
        ep = endpoint(port)
        for _ in range(6):
            async with serving(agent.runtime.dispatch, port):
                assert (await conn.invoke(ep, message("echo"), 5)).status == "ok"
        assert (counts(conn)["opened"], counts(conn)["reconnected"]) == (1, 5)
        assert counts(conn)["failed"] == 5


async def test_closing_the_server_refuses_new_calls_and_finishes_those_running(
    agent: Agent,
) -> None:
    server = grpc_server(agent.runtime.dispatch)
    await server.start()
    async with GrpcConnector() as conn:
        ep = endpoint(server.port)
        running = asyncio.create_task(conn.invoke(ep, message("slow", {"s": 0.5}), 5))
        await asyncio.sleep(0.2)
        closing = asyncio.create_task(server.close(grace_s=3))
        await asyncio.sleep(0.1)
        with pytest.raises(TransportError):
            await conn.invoke(ep, message("echo"), 5)
        assert (await running).result == {"slept": True}
        await closing


# -- raw agents: what a misbehaving gRPC agent sends ----------------------------------------------

RawHandler = Callable[[bytes, grpc.aio.ServicerContext[bytes, bytes]], Awaitable[bytes]]


@contextlib.asynccontextmanager
async def raw_agent(handle: RawHandler) -> AsyncIterator[int]:
    server = grpc.aio.server()
    method: grpc.RpcMethodHandler[bytes, bytes] = grpc.unary_unary_rpc_method_handler(handle)
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler("reach.agent.v1.Agent", {"Invoke": method}),)
    )
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        yield port
    finally:
        await server.stop(0)


async def test_garbage_is_a_typed_error_for_that_request_alone() -> None:
    async def handle(raw: bytes, context: grpc.aio.ServicerContext[bytes, bytes]) -> bytes:
        operation = InvokeRequest.FromString(raw).operation
        if operation == "not_protobuf":
            return b"\xff\xff\xff\xff"
        if operation == "not_json":
            return InvokeReply(result=b"\x00garbage{").SerializeToString()
        if operation == "says_retry":
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                "no",
                trailing_metadata=(("x-reach-retryable", "true"),),
            )
        return InvokeReply(result=b'{"ok":true}').SerializeToString()

    async with raw_agent(handle) as port, GrpcConnector() as conn:
        ep = endpoint(port)
        for bad in ("not_protobuf", "not_json"):
            with pytest.raises(AgentError) as err:
                await conn.invoke(ep, message(bad), 5)
            assert not err.value.retryable
        with pytest.raises(AgentError) as asked:
            await conn.invoke(ep, message("says_retry"), 5)
        assert not asked.value.retryable
        others = [conn.invoke(ep, message("fine"), 5) for _ in range(3)]
        replies = await asyncio.gather(
            *others, conn.invoke(ep, message("not_json"), 5), return_exceptions=True
        )
        assert [r.result for r in replies[:3]] == [{"ok": True}] * 3  # type: ignore[union-attr]
        assert isinstance(replies[3], AgentError)
        assert counts(conn)["opened"] == 1


async def test_a_crashing_dispatch_is_an_internal_error_and_the_server_carries_on(
    caplog: pytest.LogCaptureFixture,
) -> None:
    calls = 0

    async def dispatch(request: Inbound) -> Answer:
        nonlocal calls
        calls += 1
        if calls == 1:
            raise RuntimeError("handler bug")
        if calls == 2:
            return Answer(200, {"bad": float("nan")})  # a body that is not JSON
        return Answer(200, {"n": calls})

    async with serving(dispatch) as server, GrpcConnector() as conn:
        for _ in range(2):
            with pytest.raises(AgentError) as err:
                await conn.invoke(endpoint(server.port), message("op"), 5)
            assert err.value.retryable
            assert "answered 500: internal error" in err.value.message
        assert (await conn.invoke(endpoint(server.port), message("op"), 5)).result == {"n": 3}
    crashed = [r for r in caplog.records if r.getMessage() == "operation handler crashed"]
    assert len(crashed) == 1
    assert crashed[0].exc_info is not None  # with its traceback


async def empty_reply(raw: bytes, context: grpc.aio.ServicerContext[bytes, bytes]) -> bytes:
    return b""


async def test_a_request_grpc_cannot_carry_is_not_retried() -> None:
    async with raw_agent(empty_reply) as port, GrpcConnector() as conn:
        bad_headers: list[dict[str, Any]] = [
            {"caller": "élan"},
            {"idempotency_key": "a\r\nx-injected: 1"},
            {"traceparent": "00-ab-cd-01\n"},
        ]
        for bad in bad_headers:
            with pytest.raises(TransportError) as err:
                await conn.invoke(endpoint(port), message("op", None, **bad), 5)
            assert not err.value.retryable
        with pytest.raises(TransportError) as err:
            await conn.invoke(endpoint(port), message("op", {"x": float("nan")}), 5)
        assert not err.value.retryable
        unparsable = endpoint(port).model_copy(update={"address": "[::1:80"})
        with pytest.raises(TransportError) as err:
            await conn.invoke(unparsable, message("op"), 5)
        assert not err.value.retryable
        assert (await conn.invoke(endpoint(port), message("op"), 5)).result == {}


# -- one answer, two protocols: the caller cannot tell which carried it ----------------------------


def _told(err: ReachError, instance_id: str) -> tuple[object, ...]:
    """All a caller learns of a failure, the instance's name taken out of the message."""
    assert err.message.startswith(f"agent {instance_id} ")
    fault = getattr(err, "fault", None)
    return (
        err.type,
        err.retryable,
        err.message.removeprefix(f"agent {instance_id} "),
        fault.model_dump() if fault is not None else None,
    )


@pytest.mark.parametrize(
    ("operation", "payload"),
    [
        *[
            ("fail", {"message": "rebuilding the index", "type": "index_unavailable", "status": s})
            for s in (400, 404, 413, 422, 429, 500, 503, 504)
        ],
        # The runtime's own final 500: a result past the negotiated size, retryable false.
        ("big", {"n": 4 * AGENT_LIMIT}),
    ],
    ids=lambda v: str(v.get("status", "result_too_large")) if isinstance(v, dict) else v,
)
async def test_the_same_answer_reads_the_same_over_http_and_grpc(
    agent: Agent, operation: str, payload: dict[str, Any]
) -> None:
    """One AgentRuntime behind the SDK's HTTP and gRPC servers: the same answer through each
    connector gives the same error type, retry flag, message and agent fault."""
    http_server = agent_server(agent.runtime.dispatch, max_body_bytes=AGENT_LIMIT)
    await http_server.start()
    try:
        async with (
            serving(agent.runtime.dispatch) as grpc_server,
            GrpcConnector() as via_grpc,
            HttpConnector() as via_http,
        ):
            told = []
            for conn, port, protocol in (
                (via_http, http_server.port, "http"),
                (via_grpc, grpc_server.port, "grpc"),
            ):
                ep = endpoint(port, max_message_bytes=8 * AGENT_LIMIT, name=f"{protocol}-1")
                ep = ep.model_copy(update={"protocol": protocol})
                with pytest.raises(ReachError) as err:
                    await conn.invoke(ep, message(operation, payload), 5)
                told.append(_told(err.value, ep.instance_id))
    finally:
        await http_server.close()
    assert told[0] == told[1]
    kind, retryable, _, fault = told[0]
    if payload.get("status") == 504:
        assert kind == "timeout"
    else:
        assert kind == "agent_error"
        assert isinstance(fault, dict)
        assert fault["status"] == payload.get("status", 500)
        expected = payload.get("status") in (429, 500, 503)
        assert retryable is expected
