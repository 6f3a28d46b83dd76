"""Router: picks one routable instance of a capability (R5, R12).

Round robin is the default. Its counter lives in the shared store, so several gateways and
workers (Redis backend) spread requests together instead of each starting at instance 0. The
counter expires after `ttl_s` unused (the capability retention), so forgotten capabilities
leave no counters behind.
Strategies are small classes behind one interface; more arrive with the routing step.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import ClassVar

from reach.config import RegistrySettings
from reach.registry import InstanceRecord
from reach.store import Store

DEFAULT_COUNTER_TTL_S: float = RegistrySettings.model_fields["capability_retention_s"].default


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

    def __init__(self, store: Store, ttl_s: float = DEFAULT_COUNTER_TTL_S) -> None:
        self._store = store
        self._ttl_s = ttl_s

    async def pick(
        self,
        capability: str,
        candidates: Sequence[InstanceRecord],
        routing_key: str | None = None,
    ) -> InstanceRecord:
        n = await self._store.incr(f"rr:{capability}", ttl_s=self._ttl_s)
        return candidates[(n - 1) % len(candidates)]


ROUTERS: dict[str, type[RoundRobin]] = {RoundRobin.name: RoundRobin}


def create_router(name: str, store: Store, ttl_s: float = DEFAULT_COUNTER_TTL_S) -> Router:
    try:
        return ROUTERS[name](store, ttl_s)
    except KeyError:
        known = ", ".join(sorted(ROUTERS))
        raise ValueError(f"unknown routing strategy {name!r}; known: {known}") from None


__all__ = ["ROUTERS", "RoundRobin", "Router", "create_router"]
