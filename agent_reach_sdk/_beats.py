"""Batched heartbeats for a process that hosts several instances (several `AgentRuntime`s in
one event loop, talking to the same gateways with the same token): their heartbeats go out
together, one `POST /reach/heartbeats` a round instead of one PUT per instance.

The instances of such a *group* beat in rounds: one timer per group fires every heartbeat
interval (the shortest of its members'), each member then sends its report to the group, and
the group posts them as one batch once every member has (or `LINGER_S` after the first). Each
member gets its own entry's answer as the response its single heartbeat would have had (200,
404 unknown_instance, 409 instance_replaced, ...), so the registry client acts on it exactly
as before. A group of one sends the single heartbeat it always did; so does a group whose
gateway predates the batch route (404/405 to the batch): from then on its members beat alone.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Sequence
from typing import Any, Protocol

import httpx

log = logging.getLogger("agent_reach_sdk")

LINGER_S = 0.05
"""How long a round waits for its slowest member's report (a health check that awaits)."""

MAX_BATCH = 1000
"""Entries a gateway takes in one batch (`reach.registry.MAX_HEARTBEAT_BATCH`)."""

STATUS_OF = {
    "unknown_instance": 404,
    "forbidden": 403,
    "unauthorized": 401,
    "instance_replaced": 409,
    "invalid_request": 422,
    "payload_too_large": 413,
}
"""An entry's error type as the HTTP status its single heartbeat would have been answered."""


class Sender(Protocol):
    async def send(self, doing: str, method: str, path: str, **kwargs: Any) -> httpx.Response: ...


class Member(Protocol):
    heartbeat_interval: float


Key = tuple[int, tuple[str, ...], str | None]
_groups: dict[Key, BeatGroup] = {}


def group_for(urls: Sequence[str], token: str | None) -> BeatGroup:
    """The group of this event loop's instances beating `urls` with `token`."""
    loop = asyncio.get_running_loop()
    key: Key = (id(loop), tuple(urls), token)
    group = _groups.get(key)
    if group is None or group.loop is not loop:  # a loop that ended may leave its id behind
        group = _groups[key] = BeatGroup(key)
    return group


class BeatGroup:
    def __init__(self, key: Key) -> None:
        self.key = key
        self.loop = asyncio.get_running_loop()
        self.members: list[Member] = []
        self.supported = True  # False once a gateway answered the batch route 404/405
        self._turn: asyncio.Future[None] | None = None
        self._ticker: asyncio.Task[None] | None = None
        self._pending: list[tuple[dict[str, Any], asyncio.Future[httpx.Response | None]]] = []
        self._sender: tuple[Sender, dict[str, float]] | None = None
        self._linger: asyncio.TimerHandle | None = None
        self._sends: set[asyncio.Task[None]] = set()

    @property
    def batching(self) -> bool:
        return self.supported and len(self.members) > 1

    def add(self, member: Member) -> None:
        self.members.append(member)

    def remove(self, member: Member) -> None:
        with contextlib.suppress(ValueError):
            self.members.remove(member)
        if not self.members:
            if _groups.get(self.key) is self:
                del _groups[self.key]
            if self._ticker is not None:
                self._ticker.cancel()

    async def turn(self) -> None:
        """Until this group's next round."""
        if self._turn is None or self._turn.done():
            self._turn = asyncio.get_running_loop().create_future()
        if self._ticker is None or self._ticker.done():
            self._ticker = asyncio.create_task(self._tick())
        await asyncio.shield(self._turn)

    async def _tick(self) -> None:
        while self.members:
            await asyncio.sleep(min(m.heartbeat_interval for m in self.members))
            turn, self._turn = self._turn, None
            if turn is not None and not turn.done():
                turn.set_result(None)

    async def beat(
        self, sender: Sender, entry: dict[str, Any], options: dict[str, float]
    ) -> httpx.Response | None:
        """This entry's answer in the round's batch; None: send it as a single heartbeat."""
        future: asyncio.Future[httpx.Response | None] = asyncio.get_running_loop().create_future()
        self._pending.append((entry, future))
        if self._sender is None:
            self._sender = (sender, options)
        if len(self._pending) >= min(len(self.members), MAX_BATCH):
            self._flush()
        elif self._linger is None:
            self._linger = asyncio.get_running_loop().call_later(LINGER_S, self._flush)
        return await future

    def _flush(self) -> None:
        if self._linger is not None:
            self._linger.cancel()
            self._linger = None
        batch, self._pending = self._pending, []
        sender, self._sender = self._sender, None
        if not batch or sender is None:
            return
        task = asyncio.create_task(self._send(batch, *sender))
        self._sends.add(task)
        task.add_done_callback(self._sends.discard)

    async def _send(
        self,
        batch: list[tuple[dict[str, Any], asyncio.Future[httpx.Response | None]]],
        sender: Sender,
        options: dict[str, float],
    ) -> None:
        if len(batch) == 1:
            answers: list[httpx.Response | None] = [None]
        else:
            try:
                body = [entry for entry, _ in batch]
                r = await sender.send(
                    "heartbeating", "POST", "/reach/heartbeats", json=body, **options
                )
            except Exception as exc:
                for _, future in batch:
                    if not future.done():
                        future.set_exception(exc)
                return
            answers = self._answers(r, len(batch))
        for (_, future), answer in zip(batch, answers, strict=True):
            if not future.done():
                future.set_result(answer)

    def _answers(self, r: httpx.Response, count: int) -> list[httpx.Response | None]:
        if r.status_code in (404, 405):
            # A gateway without the batch route: its members beat alone from now on.
            log.info(
                "the gateway takes no batched heartbeats (%d); heartbeating singly", r.status_code
            )
            self.supported = False
            return [None] * count
        if r.status_code != 200:  # the batch refused whole (401, 413, ...): each hears it
            return [httpx.Response(r.status_code, content=r.content, headers=r.headers)] * count
        results = r.json()["results"]
        out: list[httpx.Response | None] = []
        for result in results:
            error = result.get("error")
            if error:
                status = STATUS_OF.get(error.get("type"), 400)
                out.append(
                    httpx.Response(
                        status, json={"request_id": None, "status": "error", "error": error}
                    )
                )
            else:
                out.append(httpx.Response(200, json=result))
        return out
