"""An A2A agent that greets, built on the a2a-sdk alone, for Reach to call.

    python examples/a2a_agent.py --port 8930
    reach agents add a2a http://127.0.0.1:8930 --capability greeter
    reach invoke greeter greet --payload '{"name": "Ada"}'

Reach reads its card at /.well-known/agent-card.json (the skill `greet` becomes the operation),
sends the payload as a data part and the operation in the message's metadata (`reach`), and
takes the data part of the reply as the result (see docs/protocols/a2a.md).
"""

from __future__ import annotations

import argparse
from typing import Any

from a2a.helpers import new_data_part
from a2a.server.agent_execution import AgentExecutor, RequestContext
from a2a.server.events import EventQueue
from a2a.server.request_handlers import DefaultRequestHandler
from a2a.server.routes import create_agent_card_routes, create_jsonrpc_routes
from a2a.server.tasks import InMemoryTaskStore
from a2a.types import AgentCapabilities, AgentCard, AgentInterface, AgentSkill, Message
from google.protobuf import json_format
from starlette.applications import Starlette


def payload_of(message: Message | None) -> dict[str, Any]:
    """The first data part of a message (where Reach puts the payload)."""
    for part in message.parts if message is not None else []:
        if part.HasField("data"):
            value = json_format.MessageToDict(part.data)
            return value if isinstance(value, dict) else {}
    return {}


class Greeter(AgentExecutor):
    async def execute(self, context: RequestContext, event_queue: EventQueue) -> None:
        name = str(payload_of(context.message).get("name", "stranger"))
        reply = Message(
            message_id=f"greeting-{context.message.message_id if context.message else ''}",
            role="ROLE_AGENT",
            parts=[new_data_part({"greeting": f"Hello, {name}!"})],
            context_id=context.context_id or "",
        )
        await event_queue.enqueue_event(reply)

    async def cancel(self, context: RequestContext, event_queue: EventQueue) -> None:
        return None  # it answers at once: there is nothing to cancel


def build(url: str) -> Starlette:
    card = AgentCard(
        name="greeter",
        description="Greets whoever it is told.",
        version="1.0.0",
        supported_interfaces=[
            AgentInterface(url=url, protocol_binding="JSONRPC", protocol_version="1.0")
        ],
        capabilities=AgentCapabilities(streaming=False),
        default_input_modes=["application/json"],
        default_output_modes=["application/json"],
        skills=[AgentSkill(id="greet", name="greet", description="Say hello.", tags=["demo"])],
    )
    handler = DefaultRequestHandler(Greeter(), InMemoryTaskStore(), card)
    return Starlette(routes=[*create_jsonrpc_routes(handler, "/"), *create_agent_card_routes(card)])


if __name__ == "__main__":
    import uvicorn

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--port",
        type=int,
        default=8930,
        help="the port it listens on, on 127.0.0.1 (default: %(default)s)",
    )
    args = parser.parse_args()
    url = f"http://127.0.0.1:{args.port}/"
    print(f"greeter A2A agent at {url}", flush=True)
    uvicorn.run(build(url), host="127.0.0.1", port=args.port, log_level="warning")
