"""The reliability suite's A2A agent (the a2a-sdk's own server), registered by URL: its ledger
records every message it executes as the SDK agents' do (tests/reliability/agent.py).

    python -m tests.reliability.a2a_agent --port PORT --instance NAME --ledger FILE

Skills (the operation is the message's `metadata.reach.operation`): `read` answers with a
Message after `delay_ms` (registered idempotent); `write` answers with a Task at once, works for
`delay_ms` and completes with an artifact, so Reach follows it (`GetTask`, or the task's stream:
the card says it streams). The ledger line (request id, attempt and key from `metadata.reach`)
is one O_APPEND write before the work. Its tasks live in memory: a SIGKILL forgets them, as a
real agent's crash would (Reach then reports the outcome unknown).
`A2ALedgerAgent` starts one and SIGKILLs and restarts it on its port.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx

if TYPE_CHECKING:  # the agent process imports none of the tests' helpers
    from tests.helpers import Proc

SKILLS = {"read": "Read (no effect), answered with a message.", "write": "Write, as a task."}


def build(instance: str, url: str, ledger: Path) -> Any:
    from a2a.helpers import new_data_part
    from a2a.server.agent_execution import AgentExecutor, RequestContext
    from a2a.server.events import EventQueue
    from a2a.server.request_handlers import DefaultRequestHandler
    from a2a.server.routes import create_agent_card_routes, create_jsonrpc_routes
    from a2a.server.tasks import InMemoryTaskStore, TaskUpdater
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

    fd = os.open(ledger, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)

    def data_of(message: Message) -> dict[str, Any]:
        for part in message.parts:
            if part.HasField("data"):
                value = json_format.MessageToDict(part.data)
                return value if isinstance(value, dict) else {}
        return {}

    class Ledgered(AgentExecutor):
        async def execute(self, context: RequestContext, event_queue: EventQueue) -> None:
            message = context.message
            assert message is not None
            meta = message.metadata if message.HasField("metadata") else None
            reach = (json_format.MessageToDict(meta) if meta else {}).get("reach") or {}
            op = str(reach.get("operation", ""))
            line = {
                "request_id": reach.get("request_id"),
                "idempotency_key": reach.get("idempotency_key"),
                "attempt": reach.get("attempt"),
                "instance": instance,
                "op": op,
                "t": time.time(),
            }
            os.write(fd, (json.dumps(line) + "\n").encode())
            payload = data_of(message)
            delay = float(payload.get("delay_ms", 20)) / 1000
            result = [new_data_part({"instance_id": instance, "n": payload.get("n")})]
            context_id, task_id = context.context_id or "", context.task_id or ""
            if op == "read":
                await asyncio.sleep(delay)
                reply = Message(
                    message_id=f"re-{message.message_id}",
                    role="ROLE_AGENT",
                    parts=result,
                    context_id=context_id,
                )
                await event_queue.enqueue_event(reply)
                return
            submitted = TaskStatus(state=TaskState.TASK_STATE_SUBMITTED)
            task = Task(id=task_id, context_id=context_id, status=submitted, history=[message])
            await event_queue.enqueue_event(task)
            updater = TaskUpdater(event_queue, task_id, context_id)
            await updater.start_work()
            await asyncio.sleep(delay)
            await updater.add_artifact(result, name="result")
            await updater.complete()

        async def cancel(self, context: RequestContext, event_queue: EventQueue) -> None:
            updater = TaskUpdater(event_queue, context.task_id or "", context.context_id or "")
            await updater.cancel()

    card = AgentCard(
        name=instance,
        description="Reach's reliability ledger agent",
        version="1.0.0",
        supported_interfaces=[
            AgentInterface(url=url, protocol_binding="JSONRPC", protocol_version="1.0")
        ],
        capabilities=AgentCapabilities(streaming=True, push_notifications=False),
        default_input_modes=["application/json"],
        default_output_modes=["application/json"],
        skills=[
            AgentSkill(id=skill, name=skill, description=text, tags=["reliability"])
            for skill, text in SKILLS.items()
        ],
    )
    handler = DefaultRequestHandler(Ledgered(), InMemoryTaskStore(), card)
    return Starlette(routes=[*create_jsonrpc_routes(handler, "/"), *create_agent_card_routes(card)])


def main() -> None:
    p = argparse.ArgumentParser(description="reliability ledger A2A agent")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--instance", required=True)
    p.add_argument("--ledger", type=Path, required=True)
    args = p.parse_args()
    import uvicorn

    url = f"http://127.0.0.1:{args.port}/"
    app = build(args.instance, url, args.ledger)
    print(f"a2a ledger agent {args.instance} at {url}", flush=True)
    uvicorn.run(app, host="127.0.0.1", port=args.port, log_level="warning")


class A2ALedgerAgent:
    """One ledger A2A agent process on a port of its own, kept across restarts."""

    def __init__(self, tmp: Path, ledgers: Path, instance: str = "rel-a2a-00") -> None:
        from tests.helpers import free_port

        self.tmp = tmp
        self.instance = instance
        self.ledger = ledgers / f"{instance}.jsonl"
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc: Proc | None = None

    def start(self) -> A2ALedgerAgent:
        from tests.helpers import spawn

        args = [sys.executable, "-m", "tests.reliability.a2a_agent", "--port", str(self.port)]
        args += ["--instance", self.instance, "--ledger", str(self.ledger)]
        self.proc = spawn(args, {}, self.tmp / f"{self.instance}.log")
        return self

    async def ready(self, timeout_s: float = 60.0) -> A2ALedgerAgent:
        deadline = time.monotonic() + timeout_s
        card = f"{self.url}/.well-known/agent-card.json"
        async with httpx.AsyncClient(trust_env=False) as client:
            while time.monotonic() < deadline:
                assert self.proc is not None
                if self.proc.popen.poll() is not None:
                    raise RuntimeError(f"A2A agent exited:\n{self.proc.own_output()}")
                try:
                    if (await client.get(card, timeout=1)).status_code == 200:
                        return self
                except httpx.HTTPError:
                    pass
                await asyncio.sleep(0.05)
        raise TimeoutError(f"A2A agent {self.instance} not ready")

    async def restart(self) -> None:
        """SIGKILL (its tasks are forgotten), then the same port: the probes find it again."""
        assert self.proc is not None
        self.proc.kill()
        self.proc.popen.wait()
        await self.start().ready()


if __name__ == "__main__":
    main()
