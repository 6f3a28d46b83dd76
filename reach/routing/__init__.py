"""Router: picks one routable instance of a capability (R5, R12).

Round robin is the default. Its counter lives in the shared store, so several gateways and
workers (Redis backend) spread requests together instead of each starting at instance 0.
Strategies are small classes behind one interface; more arrive with the routing step.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import ClassVar

from reach.registry import InstanceRecord
from reach.store import Store


class Router(ABC):
    name: ClassVar[str]

    @abstractmethod
    async def pick(
        self,
        capability: str,
        candidates: Sequence[InstanceRecord],
        routing_key: str | None = None,
    ) -> InstanceRecord:
        """Choose one of `candidates` (non-empty, sorted by instance id)."""


class RoundRobin(Router):
    name = "round_robin"

    def __init__(self, store: Store) -> None:
        self._store = store

    async def pick(
        self,
        capability: str,
        candidates: Sequence[InstanceRecord],
        routing_key: str | None = None,
    ) -> InstanceRecord:
        n = await self._store.incr(f"rr:{capability}")
        return candidates[(n - 1) % len(candidates)]


ROUTERS: dict[str, type[RoundRobin]] = {RoundRobin.name: RoundRobin}


def create_router(name: str, store: Store) -> Router:
    try:
        return ROUTERS[name](store)
    except KeyError:
        known = ", ".join(sorted(ROUTERS))
        raise ValueError(f"unknown routing strategy {name!r}; known: {known}") from None


__all__ = ["ROUTERS", "RoundRobin", "Router", "create_router"]
