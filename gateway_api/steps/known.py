"""Step 5, known or a repeat: a capability nobody registered is a 404, unless the RequestID
is one Reach already holds (a repeat attaches to it whatever the registry says now)."""

from __future__ import annotations

from typing import Protocol

from reach.errors import UnknownCapability
from reach.messages import InvokeRequest
from reach.registry import Registry
from reach.registry.view import RegistryView
from reach.telemetry.metrics import UNKNOWN as UNKNOWN_LABEL


class Requests(Protocol):
    """What the steps ask of the engine about a RequestID (limits ask it too)."""

    async def exists(self, request_id: str) -> bool: ...


class Capabilities:
    """Which capabilities exist: the local registry view when there is one, else the store."""

    def __init__(self, registry: Registry, view: RegistryView | None = None) -> None:
        self.registry = registry
        self.view = view

    async def known(self, capability: str) -> bool:
        if self.view is not None:
            return await self.view.known(capability)
        return await self.registry.known(capability)

    async def check(self, request: InvokeRequest, requests: Requests) -> None:
        assert request.request_id is not None  # accepted requests always have one
        if not await self.known(request.target) and not await requests.exists(request.request_id):
            raise UnknownCapability(f"no agent has registered capability {request.target!r}")

    async def labels(self, request: InvokeRequest) -> tuple[str, str]:
        """Metric labels for a request that did not succeed: a capability nobody registered
        is the caller's to name (and to multiply), so it counts as `_unknown`."""
        if await self.known(request.target):
            return request.target, request.operation
        return UNKNOWN_LABEL, UNKNOWN_LABEL
