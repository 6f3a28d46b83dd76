"""The gateways an agent talks to, and the one it talks to now: failover (issue 25).

An agent given several gateway addresses sends each call (Join, heartbeat, Leave, late answer)
to the current gateway. When that fails — the connection refused or reset, a timeout, a 5xx —
the next address is tried at once, round the list once, and the first that answers becomes the
current gateway: sticky, the agent stays with it until it fails in turn. Each switch is logged
once (`gateway A unreachable (...); heartbeating via B`). Only when every gateway failed does
the call fail, and the caller's own retry applies (the next heartbeat, a late answer's backoff).

A 4xx is an answer, not a failure: the gateways share one registry and token store, so another
would say the same (a 404 to a heartbeat is the registry client's to act on: it joins again).
With one address a call is sent exactly as before failover existed.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

import httpx

log = logging.getLogger("agent_reach_sdk")


class Gateways:
    __slots__ = ("_clients", "_new_client", "_retired", "_unreachable", "current", "urls")

    def __init__(self, urls: Sequence[str], new_client: Callable[[str], httpx.AsyncClient]) -> None:
        """`urls`: the gateways' base URLs in order of preference (the first is tried first);
        `new_client(url)` opens a client for one of them, when it is first needed."""
        if not urls:
            raise ValueError("no gateway address")
        self.urls = tuple(urls)
        self.current = 0  # the index of the gateway calls go to first
        self._new_client = new_client
        self._clients: dict[int, httpx.AsyncClient] = {}
        self._retired: list[httpx.AsyncClient] = []  # of addresses replaced while open
        self._unreachable = False  # every gateway failed the last call (logged once)

    @property
    def url(self) -> str:
        return self.urls[self.current]

    @property
    def client(self) -> httpx.AsyncClient | None:
        """The current gateway's client, once opened (None before `open`)."""
        return self._clients.get(self.current)

    @client.setter
    def client(self, client: httpx.AsyncClient | None) -> None:
        if client is None:
            self._clients.pop(self.current, None)
        else:
            self._clients[self.current] = client

    def replace(self, urls: Sequence[str]) -> None:
        """Talk to `urls` from now on, the first first; clients already open close at `close`."""
        if not urls:
            raise ValueError("no gateway address")
        self._retired.extend(self._clients.values())
        self._clients.clear()
        self.urls = tuple(urls)
        self.current = 0

    def open(self) -> None:
        self._clients[self.current] = self._new_client(self.url)

    async def close(self) -> None:
        clients = [*self._retired, *self._clients.values()]
        self._retired.clear()
        self._clients.clear()
        for client in clients:
            await client.aclose()

    def _client_for(self, index: int) -> httpx.AsyncClient:
        client = self._clients.get(index)
        if client is None:
            client = self._clients[index] = self._new_client(self.urls[index])
        return client

    async def send(self, doing: str, method: str, path: str, **kwargs: Any) -> httpx.Response:
        """`method path` on the current gateway, else on each other in turn (see the module).

        `doing` names the work for the log line of a switch ("heartbeating"). Returns the first
        answer that is not a 5xx; when every gateway failed, the first 5xx (calls then go to
        the gateway that sent it first: it answers, the one it replaces may be dead), else
        raises the last `httpx.TransportError`."""
        count = len(self.urls)
        start = self.current
        failures: list[str] = []
        troubled: tuple[int, httpx.Response] | None = None
        error: httpx.TransportError | None = None
        for step in range(count):
            index = (start + step) % count
            try:
                r = await self._client_for(index).request(method, path, **kwargs)
            except httpx.TransportError as exc:
                failures.append(f"{self.urls[index]}: {exc!r}")
                error = exc
                continue
            if r.status_code < 500:
                if self._unreachable:
                    self._unreachable = False
                    log.info("gateway %s answers again; %s via it", self.urls[index], doing)
                self._move(index, start, doing, failures)
                return r
            failures.append(f"{self.urls[index]}: HTTP {r.status_code}")
            if troubled is None:
                troubled = (index, r)
        if count > 1 and not self._unreachable:
            self._unreachable = True
            log.warning("every gateway failed (%s); retrying", "; ".join(failures))
        if troubled is None:
            assert error is not None
            raise error
        self._move(troubled[0], start, doing, failures)
        return troubled[1]

    def _move(self, index: int, start: int, doing: str, failures: list[str]) -> None:
        """Calls go to gateway `index` first from now on; the switch logged once."""
        if index in (start, self.current):
            # No switch here: the first gateway tried answered, or another call (a heartbeat
            # and a late answer failing together) moved already and logged the switch.
            return
        failed, why = self.urls[start], failures[0].split(": ", 1)[-1]
        self.current = index
        log.warning("gateway %s unreachable; %s via %s (%s)", failed, doing, self.url, why)
