"""Callback delivery against hostile receivers (issue 25, the review of its heartbeats): a
receiver that never answers or trickles its answer, one that answers 2xx slowly around the
heartbeat timeout, one that redirects, one that streams an endless body, and many hung at once
beside a healthy one. Each receiver is a raw socket server, so it can misbehave below HTTP."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
from standardwebhooks.webhooks import Webhook

from activities.receivers import PER_RECEIVER
from reach.security.webhooks import caller_secret
from tests.a2a_agents import A2AAgentProcess
from tests.conftest import new_stack
from tests.helpers import Agent, GatewayProcess, Worker, invoke, wait_until

pytestmark = pytest.mark.integration


@dataclass
class Post:
    """One connection to a raw receiver: when it opened, its request head, when it closed."""

    opened: float
    headers: dict[str, str] = field(default_factory=dict)
    body: bytes = b""
    read: bool = False  # its head and body are in (a connection is listed once opened)
    closed: float | None = None


Behaviour = Callable[["Post", asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


class RawReceiver:
    """A TCP server that reads each request and then does what `behave` says."""

    def __init__(self, behave: Behaviour, host: str = "127.0.0.1") -> None:
        self.behave = behave
        self.host = host
        self.posts: list[Post] = []
        self._server: asyncio.Server | None = None
        self._tasks: set[asyncio.Task[None]] = set()

    async def start(self) -> RawReceiver:
        self._server = await asyncio.start_server(self._connection, self.host, 0)
        return self

    @property
    def url(self) -> str:
        assert self._server is not None
        return f"http://{self.host}:{self._server.sockets[0].getsockname()[1]}/callback"

    async def _connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        post = Post(time.monotonic())
        self.posts.append(post)
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        try:
            head = await reader.readuntil(b"\r\n\r\n")
            for line in head.decode("latin-1").split("\r\n")[1:]:
                name, sep, value = line.partition(":")
                if sep:
                    post.headers[name.strip().lower()] = value.strip()
            post.body = await reader.readexactly(int(post.headers.get("content-length", "0")))
            post.read = True
            await self.behave(post, reader, writer)
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            post.closed = post.closed or time.monotonic()
            writer.close()
            self._tasks.discard(task)

    def open_now(self) -> int:
        return sum(1 for p in self.posts if p.closed is None)

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
        for task in list(self._tasks):
            task.cancel()
        with contextlib.suppress(Exception):
            await asyncio.gather(*self._tasks, return_exceptions=True)


async def until_peer_closes(post: Post, reader: asyncio.StreamReader) -> None:
    """Hold the connection until the sender gives up on it (reads EOF)."""
    while await reader.read(65536):
        pass
    post.closed = time.monotonic()


async def never_answer(post: Post, reader: asyncio.StreamReader, _: asyncio.StreamWriter) -> None:
    await until_peer_closes(post, reader)


async def trickle(post: Post, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """A status line, then one header byte every 0.3 s, forever: never a read timeout."""
    writer.write(b"HTTP/1.1 200 OK\r\nX-Slow: ")
    watch = asyncio.ensure_future(until_peer_closes(post, reader))
    try:
        while not watch.done():
            writer.write(b"a")
            await writer.drain()
            await asyncio.sleep(0.3)
    finally:
        watch.cancel()
        post.closed = post.closed or time.monotonic()


def answer_after(delays: dict[str, float]) -> Behaviour:
    """200 after the delay set for the POST's request id (so many can run at once)."""

    async def behave(post: Post, _: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await asyncio.sleep(delays.get(post.headers.get("x-reach-request-id", ""), 0.0))
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nConnection: close\r\n\r\nok")
        await writer.drain()

    return behave


async def endless_body(post: Post, _: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """200 with a 10 GiB body, streamed until the sender hangs up."""
    writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 10737418240\r\n\r\n")
    chunk = b"x" * 65536
    with contextlib.suppress(ConnectionError):
        while True:
            writer.write(chunk)
            await writer.drain()


def redirect_to(location: str) -> Behaviour:
    async def behave(post: Post, _: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(
            b"HTTP/1.1 307 Temporary Redirect\r\nLocation: "
            + location.encode()
            + b"\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"
        )
        await writer.drain()

    return behave


async def stack_with_agent(
    temporal_server: str, tmp_path: Path, capability: str, **extra: str
) -> GatewayProcess:
    stack = new_stack(temporal_server, tmp_path, extra=extra)
    gateway = await GatewayProcess(stack).ready()
    await Agent(gateway, f"{capability}-01", capability).ready()
    return gateway


async def delivery(http: httpx.AsyncClient, gateway: GatewayProcess, request_id: str) -> Any:
    r = await http.get(f"{gateway.url}/reach/requests/{request_id}")
    assert r.status_code == 200, r.text
    return r.json().get("delivery")


async def test_a_trickling_receiver_does_not_hold_a_post_past_its_attempt_timeout(
    temporal_server: str, tmp_path: Path, http: httpx.AsyncClient, capability: str
) -> None:
    """One header byte every 0.3 s is never a read timeout: only the attempt timeout (3 s)
    ends the POST, which the worker hears of through its heartbeat (within 4 s more)."""
    gateway = await stack_with_agent(
        temporal_server, tmp_path, capability, REACH_CALLBACK__ATTEMPT_TIMEOUT_S="3"
    )
    receiver = await RawReceiver(trickle).start()
    try:
        r = await invoke(http, gateway, capability, callback=receiver.url)
        assert r.status_code == 202, r.text
        await wait_until(lambda: bool(receiver.posts), 30, every_s=0.05)
        await wait_until(lambda: receiver.posts[0].closed is not None, 20, every_s=0.05)
        first = receiver.posts[0]
        assert first.closed is not None
        held_s = first.closed - first.opened
        print(f"trickled POST held {held_s:.2f} s (attempt timeout 3 s)")
        await wait_until(lambda: len(receiver.posts) >= 2 and receiver.posts[1].read, 20)
        assert receiver.posts[1].headers["x-reach-delivery-attempt"] == "2"
        state = await delivery(http, gateway, r.json()["request_id"])
        assert state["status"] == "pending", state
    finally:
        await receiver.close()


async def test_a_slow_2xx_around_the_heartbeat_timeout_is_delivered_once(
    temporal_server: str, tmp_path: Path, http: httpx.AsyncClient, capability: str
) -> None:
    """Receivers answering 200 from 3.5 s to 13 s after the POST (heartbeat timeout 5 s,
    attempt timeout 20 s): each is one POST, attempt 1, delivered; a heartbeat that came late
    would send it again (signed: the same webhook-id on both)."""
    gateway = await stack_with_agent(
        temporal_server,
        tmp_path,
        capability,
        REACH_CALLBACK__ATTEMPT_TIMEOUT_S="20",
        REACH_SECURITY__WEBHOOK_KEY="hostile-review-master-key",
    )
    delays: dict[str, float] = {}
    receiver = await RawReceiver(answer_after(delays)).start()
    wanted = [3.5, 4.0, 4.5, 4.9, 5.1, 5.5, 6.0, 8.5, 9.0, 13.0]
    try:
        ids = []
        for i, delay in enumerate(wanted):
            request_id = f"req-slow-{i}-{capability}"
            delays[request_id] = delay
            r = await invoke(
                http, gateway, capability, request_id=request_id, callback=receiver.url
            )
            assert r.status_code == 202, r.text
            ids.append(request_id)

        async def all_delivered() -> bool:
            states = [await delivery(http, gateway, i) for i in ids]
            return all(s and s["status"] == "delivered" for s in states)

        await wait_until(all_delivered, 60, every_s=0.5)
        by_id: dict[str, list[Post]] = {}
        for post in receiver.posts:
            by_id.setdefault(post.headers["x-reach-request-id"], []).append(post)
        twice = {i: [p.headers["x-reach-delivery-attempt"] for p in ps] for i, ps in by_id.items()}
        for posts in by_id.values():  # a repeat is the same message to dedupe on
            assert len({p.headers["webhook-id"] for p in posts}) == 1
            assert len({p.body for p in posts}) == 1
        assert all(len(by_id[i]) == 1 for i in ids), twice
    finally:
        await receiver.close()


async def test_a_redirect_is_refused_and_never_followed(
    temporal_server: str, tmp_path: Path, http: httpx.AsyncClient, capability: str
) -> None:
    gateway = await stack_with_agent(temporal_server, tmp_path, capability)
    target = await RawReceiver(answer_after({})).start()
    receiver = await RawReceiver(redirect_to(target.url)).start()
    try:
        r = await invoke(http, gateway, capability, callback=receiver.url)
        assert r.status_code == 202, r.text
        request_id = r.json()["request_id"]

        async def ended() -> bool:
            state = await delivery(http, gateway, request_id)
            return bool(state) and state["status"] != "pending"

        await wait_until(ended, 30, every_s=0.2)
        state = await delivery(http, gateway, request_id)
        assert state["status"] == "given_up", state
        assert "307" in state["last_error"], state
        assert len(receiver.posts) == 1
        assert target.posts == []
    finally:
        await receiver.close()
        await target.close()


async def test_an_endless_response_body_is_never_read(
    temporal_server: str, tmp_path: Path, http: httpx.AsyncClient, capability: str
) -> None:
    gateway = await stack_with_agent(temporal_server, tmp_path, capability)
    receiver = await RawReceiver(endless_body).start()
    try:
        r = await invoke(http, gateway, capability, callback=receiver.url)
        assert r.status_code == 202, r.text
        request_id = r.json()["request_id"]

        async def delivered() -> bool:
            state = await delivery(http, gateway, request_id)
            return bool(state) and state["status"] == "delivered"

        await wait_until(delivered, 30, every_s=0.2)
        await wait_until(lambda: receiver.open_now() == 0, 10, every_s=0.05)
        assert len(receiver.posts) == 1
    finally:
        await receiver.close()


HUNG = 120


async def test_receivers_that_never_answer_do_not_hold_up_another_callers_callback(
    temporal_server: str, tmp_path: Path, http: httpx.AsyncClient, capability: str
) -> None:
    """120 callbacks to a receiver host that accepts and never answers (each POST held for its
    30 s attempt timeout), then one to a healthy receiver on another host: it must not wait
    behind them. Activity slots (100) and the callback client's connections (100) are shared;
    before the per-receiver bound the hung POSTs held all of them and the healthy callback
    came 24.5 s later, now at most PER_RECEIVER are the hung host's."""
    gateway = await stack_with_agent(
        temporal_server, tmp_path, capability, REACH_CALLBACK__ATTEMPT_TIMEOUT_S="30"
    )
    hung = await RawReceiver(never_answer, "127.0.0.1").start()
    healthy = await RawReceiver(answer_after({}), "127.0.0.2").start()
    most_open = 0

    def sample() -> int:
        nonlocal most_open
        most_open = max(most_open, hung.open_now())
        return most_open

    try:
        ids = []
        for _ in range(HUNG):
            r = await invoke(http, gateway, capability, callback=hung.url)
            assert r.status_code == 202, r.text
            ids.append(r.json()["request_id"])

        async def last_one_tried() -> bool:
            sample()
            state = await delivery(http, gateway, ids[-1])
            return bool(state) and (state.get("attempts") or 0) >= 1

        # Before the bound the last one waited for a slot the hung POSTs held (30 s).
        await wait_until(last_one_tried, 20, every_s=0.2)
        sent = time.monotonic()
        r = await invoke(http, gateway, capability, callback=healthy.url)
        assert r.status_code == 202, r.text
        await wait_until(lambda: bool(sample() >= 0 and healthy.posts), 40, every_s=0.05)
        waited_s = healthy.posts[0].opened - sent
        print(f"healthy callback after {waited_s:.2f} s; hung POSTs open at most {most_open}")
        assert waited_s < 5.0, f"{waited_s:.1f} s"
        assert most_open <= PER_RECEIVER, most_open
    finally:
        await hung.close()
        await healthy.close()


async def test_a_burst_to_one_slow_receiver_is_delivered_once_each_past_the_bound(
    temporal_server: str, tmp_path: Path, http: httpx.AsyncClient, capability: str
) -> None:
    """60 callbacks to one receiver answering each after 1 s: more than PER_RECEIVER at once,
    so some attempts are not sent and tried again; every callback still comes, once."""
    gateway = await stack_with_agent(temporal_server, tmp_path, capability)
    ids = [f"req-burst-{i}-{capability}" for i in range(60)]
    receiver = await RawReceiver(answer_after(dict.fromkeys(ids, 1.0))).start()
    try:
        for request_id in ids:
            r = await invoke(
                http, gateway, capability, request_id=request_id, callback=receiver.url
            )
            assert r.status_code == 202, r.text
        arrived = lambda: {p.headers["x-reach-request-id"] for p in receiver.posts}  # noqa: E731
        await wait_until(lambda: arrived() >= set(ids), 60, every_s=0.1)
        await wait_until(lambda: receiver.open_now() == 0, 10, every_s=0.05)
        assert len(receiver.posts) == len(ids), len(receiver.posts)
    finally:
        await receiver.close()


def hold_first(held: asyncio.Event) -> Behaviour:
    """Hold the first POST open until `held` is set (its worker dies holding it); 200 to the
    rest. The receiver has the first one's bytes: as if it processed it, its 200 lost."""

    async def behave(post: Post, _: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if not held.is_set():
            held.set()
            await asyncio.Event().wait()  # until the sender's socket dies (or the test ends)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")
        await writer.drain()

    return behave


async def test_a_post_whose_worker_was_sigkilled_comes_again_as_the_same_signed_message(
    temporal_server: str, tmp_path: Path, http: httpx.AsyncClient, capability: str
) -> None:
    """The receiver dedupes a redelivery after a SIGKILL mid-POST on its webhook-id: the same
    id, the same body, the next attempt, a signature of its own that verifies."""
    master = "hostile-review-master-key"
    extra = {"REACH_SECURITY__WEBHOOK_KEY": master, "REACH_CALLBACK__ATTEMPT_TIMEOUT_S": "60"}
    stack = new_stack(temporal_server, tmp_path, extra=extra)
    doomed = await GatewayProcess(stack, "doomed").ready()
    await Agent(doomed, f"{capability}-01", capability).ready()
    held = asyncio.Event()
    receiver = await RawReceiver(hold_first(held)).start()
    try:
        r = await invoke(http, doomed, capability, caller="orchestrator", callback=receiver.url)
        assert r.status_code == 202, r.text
        await wait_until(held.is_set, 30, every_s=0.05)
        await Worker(stack).ready()
        doomed.proc.kill()
        await wait_until(lambda: sum(p.read for p in receiver.posts) >= 2, 45, every_s=0.05)
        first, second = [p for p in receiver.posts if p.read][:2]
        assert first.headers["webhook-id"] == second.headers["webhook-id"]
        assert first.body == second.body
        assert second.headers["x-reach-delivery-attempt"] == "2"
        verifier = Webhook(caller_secret(master, "orchestrator"))
        for post in (first, second):
            verifier.verify(
                post.body,
                {
                    k: post.headers[k]
                    for k in ("webhook-id", "webhook-timestamp", "webhook-signature")
                },
            )
    finally:
        await receiver.close()


HOSTS = 8


async def test_hung_receivers_on_many_hosts_do_not_stall_a_followed_task(
    temporal_server: str, tmp_path: Path, http: httpx.AsyncClient, capability: str
) -> None:
    """16 hung callbacks on each of 8 receiver hosts (128, past the 100 activity slots a worker
    has even with the per-receiver bound), then a sync call to an A2A agent whose task Reach
    follows (a regular activity on the same worker): it must not wait for the hung POSTs'
    30 s attempt timeout."""
    gateway = await stack_with_agent(
        temporal_server, tmp_path, capability, REACH_CALLBACK__ATTEMPT_TIMEOUT_S="30"
    )
    agent = await A2AAgentProcess(tmp_path, "hostile").ready()
    task_cap = f"{capability}-a2a"
    r = await http.post(
        f"{gateway.url}/reach/agents",
        json={
            "capability": task_cap,
            "instance_id": f"{task_cap}-01",
            "protocol": "a2a",
            "service_address": agent.url,
        },
    )
    assert r.status_code == 200, r.text
    hung = [await RawReceiver(never_answer, f"127.0.0.{i + 1}").start() for i in range(HOSTS)]
    try:
        for i, receiver in enumerate(hung):  # a caller each: within a caller's share
            for _ in range(PER_RECEIVER):
                r = await invoke(http, gateway, capability, caller=f"c{i}", callback=receiver.url)
                assert r.status_code == 202, r.text
        open_now = lambda: sum(h.open_now() for h in hung)  # noqa: E731
        await wait_until(lambda: open_now() >= 64, 30, every_s=0.1)
        started = time.monotonic()
        r = await http.post(
            f"{gateway.url}/reach/invoke",
            json={"target": task_cap, "operation": "slow", "payload": {"seconds": 0.5}},
            params={},
            timeout=40,
        )
        took_s = time.monotonic() - started
        print(f"followed task took {took_s:.2f} s with {open_now()} hung POSTs open")
        assert r.status_code == 200, r.text
        assert r.json()["status"] == "success", r.json()
        assert took_s < 8.0, f"{took_s:.1f} s"
    finally:
        for receiver in hung:
            await receiver.close()
        agent.proc.stop()
