"""A2A agents built on the a2a-sdk's own server, for the connector's tests and the bench.

Run one in its own process: `python -m tests.a2a_agents --port P [--name N]`. It serves its card
at `/.well-known/agent-card.json`, the JSON-RPC binding at `/`, and `GET /count`: how many
messages it has received, per skill (what a test reads to prove a message was sent once).

Skills (the skill is the message's `reach.operation` metadata, as Reach's connector sends it):

    echo    answers at once with a Message: one data part, {"echo": <the payload>}
    slow    a Task that works for `payload.seconds` (default 3) and completes with an artifact
    ask     a Task that asks for input; a follow-up naming the task completes it
    fail    a Task that fails, in the agent's own words
    cancel  a Task the agent cancels itself

Its card says it streams (`--stream off`: it does not); `--stream break` cuts every task
stream (`SubscribeToTask`) half a second in, mid-task. `GET /count` also counts `GetTask`s
(`get_task`), subscriptions (`subscribed`), streams cut (`stream_broken`), and says when each
task completed (`done_at`, epoch seconds).

`A2AAgentProcess` starts one for a test (a free port, its log in the test's directory).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import ssl
import sys
import time
from collections import Counter
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import uvicorn
from a2a.helpers import new_data_part, new_text_message, new_text_part
from a2a.server.agent_execution import AgentExecutor, RequestContext
from a2a.server.events import EventQueue
from a2a.server.request_handlers import DefaultRequestHandler
from a2a.server.routes import create_agent_card_routes, create_jsonrpc_routes
from a2a.server.tasks import (
    BasePushNotificationSender,
    InMemoryPushNotificationConfigStore,
    InMemoryTaskStore,
    TaskUpdater,
)
from a2a.types import (
    AgentCapabilities,
    AgentCard,
    AgentInterface,
    AgentSkill,
    Message,
    Task,
    TaskState,
    TaskStatus,
)
from google.protobuf import json_format
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

SKILLS = {
    "echo": "Answers at once with what it was sent.",
    "slow": "Works for payload.seconds, then completes.",
    "ask": "Asks for a name, then greets it.",
    "fail": "Fails, saying why.",
    "cancel": "Cancels its own task.",
}


def card(
    name: str, url: str, *, push: bool = False, streaming: bool = True, description: str = ""
) -> AgentCard:
    return AgentCard(
        name=name,
        description=description or "Reach's test agent",
        version="1.0.0",
        supported_interfaces=[
            AgentInterface(url=url, protocol_binding="JSONRPC", protocol_version="1.0")
        ],
        capabilities=AgentCapabilities(streaming=streaming, push_notifications=push),
        default_input_modes=["application/json", "text/plain"],
        default_output_modes=["application/json", "text/plain"],
        skills=[
            AgentSkill(id=skill, name=skill, description=text, tags=["test"])
            for skill, text in SKILLS.items()
        ],
    )


def _payload(message: Message | None) -> dict[str, Any]:
    if message is None:
        return {}
    for part in message.parts:
        if part.HasField("data"):
            value = json_format.MessageToDict(part.data)
            if isinstance(value, dict):
                return value
    return {}


def _skill(message: Message | None) -> str:
    if message is None:
        return ""
    meta = json_format.MessageToDict(message.metadata) if message.HasField("metadata") else {}
    reach = meta.get("reach")
    return str(reach.get("operation", "")) if isinstance(reach, dict) else ""


class TestExecutor(AgentExecutor):
    def __init__(self) -> None:
        self.counts: Counter[str] = Counter()
        self.message_ids: list[str] = []
        self.contexts: dict[str, str] = {}  # message id -> the context it was answered in
        self.done_at: dict[str, float] = {}  # task id -> when it completed (epoch seconds)
        self.push_urls: dict[str, str] = {}  # task id -> the push config's URL it came with

    async def execute(self, context: RequestContext, event_queue: EventQueue) -> None:
        message = context.message
        skill = _skill(message)
        self.counts[skill or "?"] += 1
        self.counts["total"] += 1
        if message is not None:
            self.message_ids.append(message.message_id)
        payload = _payload(message)
        task_id = context.task_id or ""
        context_id = context.context_id or ""
        if message is not None:
            self.contexts[message.message_id] = context_id
        push = (
            context.configuration.task_push_notification_config if context.configuration else None
        )
        if push is not None and push.url:
            self.push_urls[task_id] = push.url
        current = context.current_task
        if current is not None and current.status.state == TaskState.TASK_STATE_INPUT_REQUIRED:
            updater = TaskUpdater(event_queue, task_id, context_id)
            await updater.start_work()
            await updater.add_artifact([new_data_part({"hello": payload.get("name", "?")})])
            await updater.complete()
            return
        if skill == "echo":
            reply = Message(
                message_id=f"echo-{message.message_id if message else ''}",
                role="ROLE_AGENT",
                parts=[new_data_part({"echo": payload})],
                context_id=context_id,
            )
            await event_queue.enqueue_event(reply)
            return
        await event_queue.enqueue_event(
            Task(
                id=task_id,
                context_id=context_id,
                status=TaskStatus(state=TaskState.TASK_STATE_SUBMITTED),
                history=[message] if message is not None else [],
            )
        )
        updater = TaskUpdater(event_queue, task_id, context_id)
        await updater.start_work()
        if skill == "slow":
            seconds = float(payload.get("seconds", 3))
            await asyncio.sleep(seconds)
            await updater.add_artifact(
                [new_data_part({"done": True, "seconds": seconds})], name="result"
            )
            await updater.add_artifact([new_text_part("all done")], name="note")
            self.done_at[task_id] = time.time()
            await updater.complete()
        elif skill == "ask":
            await updater.requires_input(
                new_text_message("What is your name?", context_id=context_id, task_id=task_id)
            )
        elif skill == "cancel":
            await updater.cancel(new_text_message("I changed my mind", task_id=task_id))
        else:  # fail, and any skill it does not have
            await updater.failed(
                new_text_message(f"I cannot do {skill or 'that'}", task_id=task_id)
            )

    async def cancel(self, context: RequestContext, event_queue: EventQueue) -> None:
        self.counts["canceled"] += 1
        updater = TaskUpdater(event_queue, context.task_id or "", context.context_id or "")
        await updater.cancel()


class CountingSender(BasePushNotificationSender):
    """The SDK's push sender, counting the notifications it sends (`lost`: none is sent)."""

    def __init__(
        self, store: InMemoryPushNotificationConfigStore, counts: Counter[str], *, lost: bool
    ) -> None:
        super().__init__(httpx.AsyncClient(trust_env=False, timeout=5), store)
        self.counts = counts
        self.lost = lost

    async def send_notification(self, task_id: str, event: Any) -> None:
        self.counts["push_lost" if self.lost else "pushed"] += 1
        if not self.lost:
            await super().send_notification(task_id, event)


class CountingHandler(DefaultRequestHandler):
    """The SDK's handler, counting GetTask and SubscribeToTask (`cut`: each stream breaks
    half a second in, its connection dropped mid-task)."""

    def __init__(self, *args: Any, counts: Counter[str], cut: bool, **kw: Any) -> None:
        super().__init__(*args, **kw)
        self.counts = counts
        self.cut = cut

    async def on_get_task(self, params: Any, context: Any) -> Task | None:
        self.counts["get_task"] += 1
        return await super().on_get_task(params, context)

    async def on_subscribe_to_task(self, params: Any, context: Any) -> AsyncIterator[Any]:
        self.counts["subscribed"] += 1
        async for event in super().on_subscribe_to_task(params, context):
            yield event
            if self.cut:
                await asyncio.sleep(0.5)
                self.counts["stream_broken"] += 1
                raise ConnectionResetError("the test agent cuts its stream")


def app(name: str, url: str, push: str = "", stream: str = "") -> Starlette:
    """`push`: "" (the card says no push), "on" (sent), "lost" (the card says push, and
    every notification is lost on the way); `stream`: "" (the card says it streams), "off"
    (it says not), "break" (it streams, and cuts every task stream mid-task)."""
    executor = TestExecutor()
    own = card(name, url, push=bool(push), streaming=stream != "off")
    store = InMemoryPushNotificationConfigStore()
    sender = CountingSender(store, executor.counts, lost=push == "lost") if push else None
    handler = CountingHandler(
        executor,
        InMemoryTaskStore(),
        own,
        push_config_store=store,
        push_sender=sender,
        counts=executor.counts,
        cut=stream == "break",
    )
    routes = [*create_jsonrpc_routes(handler, "/"), *create_agent_card_routes(own)]

    async def count(request: Request) -> Response:
        return JSONResponse(
            {
                "counts": dict(executor.counts),
                "message_ids": executor.message_ids,
                "contexts": executor.contexts,
                "push_urls": executor.push_urls,
                "done_at": executor.done_at,
            }
        )

    routes.append(Route("/count", count, methods=["GET"]))
    return Starlette(routes=routes)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--name", default="test-agent")
    parser.add_argument("--push", choices=("", "on", "lost"), default="")
    parser.add_argument("--stream", choices=("", "off", "break"), default="")
    # TLS: its certificate and key, and the CA a client's certificate must come from (required).
    parser.add_argument("--tls", nargs=3, metavar=("CERT", "KEY", "CLIENT_CA"))
    args = parser.parse_args()
    scheme = "https" if args.tls else "http"
    url = f"{scheme}://127.0.0.1:{args.port}/"
    tls: dict[str, Any] = {}
    if args.tls:
        cert, key, ca = args.tls
        tls = {
            "ssl_certfile": cert,
            "ssl_keyfile": key,
            "ssl_ca_certs": ca,
            "ssl_cert_reqs": ssl.CERT_REQUIRED,
        }
    print(f"a2a agent {args.name} serving at {url}", flush=True)
    uvicorn.run(
        app(args.name, url, args.push, args.stream),
        host="127.0.0.1",
        port=args.port,
        log_level="warning",
        **tls,
    )


class A2AAgentProcess:
    """One test agent in a process of its own, on a free loopback port."""

    def __init__(
        self,
        log_dir: Path,
        name: str = "test-agent",
        push: str = "",
        tls: tuple[str, str, str] | None = None,
        stream: str = "",
        client: ssl.SSLContext | None = None,
    ) -> None:
        """`tls`: serve HTTPS (certificate, key, the CA clients' certificates must come from);
        `client`: the TLS context its own readiness and count checks connect with."""
        from tests.helpers import free_port, spawn

        self.name = name
        self.port = free_port()
        self.url = f"{'https' if tls else 'http'}://127.0.0.1:{self.port}"
        self.client: ssl.SSLContext | bool = client if client is not None else True
        self.proc = spawn(
            [
                sys.executable,
                "-m",
                "tests.a2a_agents",
                "--port",
                str(self.port),
                "--name",
                name,
                "--push",
                push,
                "--stream",
                stream,
                *(["--tls", *tls] if tls else []),
            ],
            {},
            log_dir / f"a2a-{name}-{self.port}.log",
        )

    async def ready(self, timeout_s: float = 30.0) -> A2AAgentProcess:
        deadline = time.monotonic() + timeout_s
        async with httpx.AsyncClient(trust_env=False, verify=self.client) as client:
            while time.monotonic() < deadline:
                if self.proc.popen.poll() is not None:
                    raise RuntimeError(f"a2a agent exited:\n{self.proc.output()}")
                with contextlib.suppress(httpx.HTTPError):
                    if (await client.get(f"{self.url}/count", timeout=1)).status_code == 200:
                        return self
                await asyncio.sleep(0.05)
        raise TimeoutError(f"a2a agent not ready:\n{self.proc.output()}")

    async def counts(self) -> dict[str, Any]:
        async with httpx.AsyncClient(trust_env=False, verify=self.client) as client:
            r = await client.get(f"{self.url}/count", timeout=5)
            r.raise_for_status()
            body: dict[str, Any] = r.json()
            return body


if __name__ == "__main__":
    main()
