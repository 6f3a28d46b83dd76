"""Step 5, known or a repeat: a capability nobody registered is a 404, unless the RequestID
is one Reach already holds (a repeat attaches to it whatever the registry says now).

It also names a request's metric labels (`labels`): a caller chooses the capability and the
operation it names, so a name no instance declares is folded into one label value (`_unknown`
for a capability nobody registered, `_other` for an operation its instances do not declare),
and a caller cannot mint a label value an invoke."""

from __future__ import annotations

import time
from typing import Protocol

from reach.errors import ReachError, UnknownCapability
from reach.messages import InvokeRequest
from reach.registry import Registry
from reach.registry.view import RegistryView
from reach.telemetry.metrics import OTHER as OTHER_LABEL
from reach.telemetry.metrics import UNKNOWN as UNKNOWN_LABEL

# How long the operations a capability's instances declare are read from the store at most
# once (the labels of an invoke that did not succeed ask): an operation declared a moment ago
# may count as `_other` that long. Not on every registry change: heartbeats would read it often.
OPERATIONS_TTL_S = 2.0
MAX_HELD = 4096


class Requests(Protocol):
    """What the steps ask of the engine about a RequestID (limits ask it too)."""

    async def exists(self, request_id: str) -> bool: ...


class Capabilities:
    """Which capabilities exist: the local registry view when there is one, else the store."""

    def __init__(self, registry: Registry, view: RegistryView | None = None) -> None:
        self.registry = registry
        self.view = view
        self._served: dict[str, tuple[float, frozenset[str]]] = {}  # capability -> (read, ops)

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
        is the caller's to name (and to multiply), so it counts as `_unknown`; an operation
        none of its instances declares counts as `_other`. Never raises: the answer is
        decided by then (the request may be running: a 503 would read as never sent), so a
        store that cannot say counts it as `_unknown`, or by the operations last read."""
        try:
            if not await self.known(request.target):
                return UNKNOWN_LABEL, UNKNOWN_LABEL
        except ReachError:
            return UNKNOWN_LABEL, UNKNOWN_LABEL
        try:
            served = await self.operations(request.target)
        except ReachError:
            held = self._served.get(request.target)
            served = held[1] if held is not None else frozenset()
        if request.operation in served:
            return request.target, request.operation
        return request.target, OTHER_LABEL

    async def operations(self, capability: str) -> frozenset[str]:
        """The operations the capability's live instances declare (read at most every
        `OPERATIONS_TTL_S`)."""
        now = time.monotonic()
        held = self._served.get(capability)
        if held is not None and now - held[0] < OPERATIONS_TTL_S:
            return held[1]
        records = await self.registry.instances(capability)
        served = frozenset(op for record in records for op in record.operations)
        if len(self._served) >= MAX_HELD:  # capabilities that left long ago among them
            self._served.clear()
        self._served[capability] = (now, served)
        return served
