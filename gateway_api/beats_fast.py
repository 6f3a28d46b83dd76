"""`PUT /reach/agents/{instance_id}/heartbeat` served straight from ASGI, as `POST
/reach/invoke` is (`gateway_api.fast`): past the framework's routing, dependency injection and
response model, with the route's checks in the route's order (body limit, the agent token,
the body, the registry) and its answers and error envelopes. The FastAPI route stays for the
OpenAPI document and answers what this path does not take: an instance_id that is not valid
(its 422 is the framework's).

A report is kept as checked by its instance, session and body (an agent sends the same ones
every interval, `reach.registry.kept`): a repeat skips the JSON and model checks, and is still
checked against the token and the registry and recorded on its own.
"""

from __future__ import annotations

import logging

from pydantic import TypeAdapter, ValidationError
from starlette.datastructures import State
from starlette.requests import ClientDisconnect
from starlette.responses import JSONResponse
from starlette.types import Receive, Scope, Send

from agent_reach_proto import wire
from gateway_api.errors import BodyLimit, CatchBugs, error_response
from reach import acceptance
from reach.errors import ReachError
from reach.limits import Limits
from reach.messages import InstanceId
from reach.registry import BeatEntry, kept

log = logging.getLogger("reach.gateway")

PREFIX, SUFFIX = "/reach/agents/", "/heartbeat"
_INSTANCE_ID: TypeAdapter[str] = TypeAdapter(InstanceId)
_AUTHORIZATION = b"authorization"
_SESSION = wire.HTTP_SESSION.lower().encode()

MAX_KNOWN_REPORTS = 20_000
"""Reports kept as checked (emptied when full)."""


def heartbeat_of(scope: Scope) -> str | None:
    """The instance_id of a heartbeat this path answers (None: the framework's route does)."""
    if scope["type"] != "http" or scope["method"] != "PUT":
        return None
    path: str = scope["path"]
    if not (path.startswith(PREFIX) and path.endswith(SUFFIX)):
        return None
    instance_id = path[len(PREFIX) : -len(SUFFIX)]
    if not instance_id or "/" in instance_id:
        return None
    try:
        _INSTANCE_ID.validate_python(instance_id)
    except ValidationError:
        return None
    return instance_id


class HeartbeatFastPath:
    """The single heartbeat as an ASGI app of its own (`ReachApp` sends it here)."""

    def __init__(self, state: State, limit: int) -> None:
        self.state = state
        self.app = CatchBugs(BodyLimit(self._beat, limit))
        self._known: dict[tuple[str, str | None, bytes], BeatEntry] = {}
        self._known_limits: Limits | None = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await self.app(scope, receive, send)

    async def _beat(self, scope: Scope, receive: Receive, send: Send) -> None:
        instance_id = scope["path"][len(PREFIX) : -len(SUFFIX)]
        gateway = self.state.gateway
        authorization = session = None
        for key, value in scope["headers"]:
            if key == _AUTHORIZATION and authorization is None:
                authorization = value.decode("latin-1")
            elif key == _SESSION and session is None:
                session = value.decode("latin-1")
        response: JSONResponse
        try:
            agent = gateway.guard.auth.agent(authorization) if gateway.guard else None
            raw = await _body(receive)
            entry = self._entry(instance_id, session, raw, gateway.limits)
            beat = (await gateway.agents.heartbeats((entry,), agent))[0]
            if isinstance(beat, ReachError):
                raise beat
            response = JSONResponse(
                {
                    "instance_id": instance_id,
                    "status": beat.status,
                    "heartbeat_interval": beat.heartbeat_interval,
                }
            )
        except ClientDisconnect:
            return  # gone before its whole body came: nothing to answer
        except ReachError as exc:
            log.info("PUT %s -> %s: %s", scope["path"], exc.type, exc.message)
            response = error_response(None, exc)
        await response(scope, receive, send)

    def _entry(
        self, instance_id: str, session: str | None, raw: bytes, limits: Limits
    ) -> BeatEntry:
        if self._known_limits is not limits:  # reconfigured: check again
            self._known.clear()
            self._known_limits = limits
        key = (instance_id, session, raw)
        entry = self._known.get(key)
        if entry is None:
            entry = kept(BeatEntry(instance_id, acceptance.health_report(raw, limits), session))
            if len(self._known) >= MAX_KNOWN_REPORTS:
                self._known.clear()
            self._known[key] = entry
        return entry


async def _body(receive: Receive) -> bytes:
    chunks = []
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise ClientDisconnect
        chunks.append(message.get("body", b""))
        if not message.get("more_body", False):
            return b"".join(chunks)
