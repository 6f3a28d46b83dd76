"""One open WebSocket to an agent and the requests multiplexed on it, for the WebSocket connector:
each request waits for the reply frame carrying its `request_id` (several carrying the same one
go to the oldest request waiting for it), a frame Reach cannot use costs one request at most (the
one it names, if it names one), and a connection's end fails every request still waiting on it.
What each frame means for an agent is docs/protocols/websocket.md; `connectors.websocket` opens,
reopens and closes the connections.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections import deque
from typing import Protocol

from websockets.asyncio.client import ClientConnection
from websockets.exceptions import ConnectionClosed, ConnectionClosedOK
from websockets.frames import CloseCode
from websockets.protocol import State

from agent_reach_proto import wire
from connectors._websocket_call import Frame, request_id_in
from reach.errors import AgentError, TransportError

# The connector's logger: what operators filter on did not move with the code.
log = logging.getLogger("connectors.websocket")


class Owner(Protocol):
    """What a socket needs of the connection it belongs to (`connectors.websocket`'s link)."""

    address: str

    def ended(self, socket: Socket, *, clean: bool) -> None: ...


def why_closed(exc: ConnectionClosed, max_size: int) -> str:
    """Why a connection ended, in the words the requests it fails carry."""
    if exc.sent is not None and exc.sent.code == CloseCode.MESSAGE_TOO_BIG:
        return f"the agent sent a frame over {max_size} bytes (close 1009)"
    if exc.rcvd is not None:
        reason = f" {exc.rcvd.reason!r}" if exc.rcvd.reason else ""
        return f"the agent closed it (code {exc.rcvd.code}{reason})"
    if exc.sent is not None:
        return f"Reach closed it (code {exc.sent.code} {exc.sent.reason!r})"
    cause = f": {exc.__cause__!r}" if exc.__cause__ is not None else ""
    return f"it dropped without a close frame{cause}"


class Socket:
    """One open WebSocket, the task reading it, and the requests waiting for replies on it."""

    def __init__(self, link: Owner, ws: ClientConnection, capability: str, max_size: int) -> None:
        self.link = link
        self.ws = ws
        self.capability = capability
        self.max_size = max_size
        # request_id -> the requests waiting for it, oldest first.
        self.pending: dict[str, deque[asyncio.Future[Frame]]] = {}
        self.closed_by_us = False
        self.reader = asyncio.get_running_loop().create_task(self._read())

    @property
    def usable(self) -> bool:
        return self.ws.state is State.OPEN and not self.reader.done()

    def waiting(self) -> int:
        return sum(len(queue) for queue in self.pending.values())

    async def call(self, request_id: str, frame: bytes) -> Frame:
        waiter: asyncio.Future[Frame] = asyncio.get_running_loop().create_future()
        queue = self.pending.setdefault(request_id, deque())
        queue.append(waiter)  # before sending: the reply may come before send() returns
        try:
            await self.ws.send(frame, text=True)
            return await waiter
        finally:
            queue.remove(waiter)
            if not queue and self.pending.get(request_id) is queue:
                del self.pending[request_id]
            if waiter.done() and not waiter.cancelled():
                waiter.exception()  # settled as the caller gave up: nobody else will look

    async def close(self) -> None:
        self.closed_by_us = True
        await self.ws.close()
        await asyncio.gather(self.reader, return_exceptions=True)

    async def _read(self) -> None:
        why = "it ended"
        clean = False
        try:
            while True:
                data = await self.ws.recv(decode=False)
                try:
                    self._route(data)
                except Exception:  # a bug here must not leave the others hanging
                    log.exception("could not route a frame from agent at %s", self.link.address)
        except ConnectionClosed as exc:
            why = why_closed(exc, self.max_size)
            clean = isinstance(exc, ConnectionClosedOK)
        finally:
            self._fail_all(why)
            self.link.ended(self, clean=clean)

    def _oldest(self, request_id: str) -> asyncio.Future[Frame] | None:
        for waiter in self.pending.get(request_id, ()):
            if not waiter.done():
                return waiter
        return None

    def _route(self, data: bytes) -> None:
        try:
            frame = json.loads(data.decode("utf-8"))
        except (ValueError, RecursionError) as exc:  # not UTF-8, not JSON, nested too deep
            self._refuse(data, f"a frame that is not UTF-8 JSON ({type(exc).__name__})")
            return
        if not isinstance(frame, dict):
            self._refuse(data, "a frame that is not a JSON object")
            return
        kind = frame.get(wire.WS_TYPE)
        request_id = frame.get(wire.WS_REQUEST_ID)
        if kind != wire.WS_REPLY:
            if isinstance(kind, str):  # reserved for extensions
                log.debug("agent at %s sent a %r frame; ignored", self.link.address, kind[:40])
            else:
                self._refuse(data, 'a frame without "type": "reply"', request_id)
            return
        if not isinstance(request_id, str):
            self._refuse(data, "a reply frame without a string request_id")
            return
        waiter = self._oldest(request_id)
        if waiter is None:  # routine after a deadline passed; a stray otherwise
            log.debug(
                "agent at %s answered %.140s, which no request waits for; dropped",
                self.link.address,
                request_id,
            )
            return
        waiter.set_result(frame)

    def _refuse(self, data: bytes, what: str, request_id: object = None) -> None:
        """Fail the one request a malformed frame names, or log and drop the frame."""
        named = request_id if isinstance(request_id, str) else request_id_in(data)
        waiter = self._oldest(named) if named is not None else None
        if waiter is None:
            log.warning("agent at %s sent %s; dropped: %r", self.link.address, what, data[:200])
            return
        waiter.set_exception(
            AgentError(f"agent at {self.link.address} sent {what} for {named}", retryable=False)
        )

    def _fail_all(self, why: str) -> None:
        if self.closed_by_us:
            message = f"the connection to agent at {self.link.address} was closed by Reach"
        else:
            message = f"the connection to agent at {self.link.address} broke: {why}"
        for queue in self.pending.values():
            for waiter in queue:
                if not waiter.done():
                    # Sent and unanswered: the agent may have run it.
                    waiter.set_exception(
                        TransportError(message, retryable=True, outcome_unknown=True)
                    )
