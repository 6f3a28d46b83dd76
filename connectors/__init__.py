"""Protocol plug-ins behind one `Connector` interface, found through the entry-point group
`agent_reach.connectors` (built-ins are registered the same way as third-party ones).

A connector class that is not installed as a distribution (a test's, a script's) is named in
`$AGENT_REACH_CONNECTORS` (`name=module:Class[,name=module:Class...]`), read by every process
that loads connectors (gateways and workers) each time it looks one up. Those come first: a
name there hides an installed connector of the same name.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import logging
import os
from collections.abc import Awaitable, Callable
from importlib.metadata import entry_points

# What other packages use of the connectors' helpers is named here, public; the modules
# behind them stay private. `guard` is the address guard's module itself, for the tests that
# replace its resolver (`monkeypatch.setattr(guard, "resolve", ...)`).
from connectors import _guard as guard
from connectors._answers import reply_for_status
from connectors._guard import (
    AddressRefused,
    GuardedBackend,
    GuardedTransport,
    guarded_client,
    refusal_in,
)
from connectors._pools import ConnectionStats
from connectors._tls import public_context
from connectors.base import Connector
from reach.config import SecuritySettings, TransportSettings

ENTRY_POINT_GROUP = "agent_reach.connectors"
EXTRA_ENV_VAR = "AGENT_REACH_CONNECTORS"

__all__ = [
    "ENTRY_POINT_GROUP",
    "EXTRA_ENV_VAR",
    "AddressRefused",
    "ConnectionStats",
    "Connector",
    "ConnectorSet",
    "GuardedBackend",
    "GuardedTransport",
    "available",
    "guard",
    "guarded_client",
    "load",
    "public_context",
    "refusal_in",
    "reply_for_status",
]

log = logging.getLogger("connectors")

# capability -> the instance ids it has now (None: the registry could not say).
LiveInstances = Callable[[str], Awaitable[set[str] | None]]


def _extra() -> dict[str, str]:
    """`$AGENT_REACH_CONNECTORS` as protocol -> 'module:Class'."""
    named: dict[str, str] = {}
    for item in os.environ.get(EXTRA_ENV_VAR, "").split(","):
        name, sep, value = item.partition("=")
        if sep and name.strip() and value.strip():
            named[name.strip()] = value.strip()
    return named


def _checked(cls: object, where: str) -> type[Connector]:
    if not (isinstance(cls, type) and issubclass(cls, Connector)):
        raise TypeError(f"entry point {where} is not a Connector subclass")
    return cls


def available() -> dict[str, str]:
    """Protocol name -> 'module:Class' of every installed connector (and extra one)."""
    installed = {ep.name: ep.value for ep in entry_points(group=ENTRY_POINT_GROUP)}
    return installed | _extra()


def load(protocol: str) -> type[Connector]:
    extra = _extra().get(protocol)
    if extra is not None:
        module, _, attr = extra.partition(":")
        return _checked(getattr(importlib.import_module(module), attr), extra)
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        if ep.name == protocol:
            return _checked(ep.load(), ep.value)
    known = ", ".join(sorted(available())) or "none installed"
    raise LookupError(f"no connector for protocol {protocol!r}; known: {known}")


class ConnectorSet:
    """One live connector per protocol, built on first use with these settings, closed together.

    With `live_instances`, a sweep every `sweep_s` closes the connections of instances that
    left the registry (or were evicted), whichever process they left through.
    """

    def __init__(
        self,
        transport: TransportSettings | None = None,
        *,
        live_instances: LiveInstances | None = None,
        sweep_s: float = 1.0,
        security: SecuritySettings | None = None,
        gateway_url: str | None = None,
    ) -> None:
        self.transport = transport
        self.security = security
        self.gateway_url = gateway_url  # where agents reach Reach back (`Connector.reached_at`)
        self.stats = ConnectionStats()
        self._live: dict[str, Connector] = {}
        self._live_instances = live_instances
        self._sweep_s = sweep_s
        self._sweeper: asyncio.Task[None] | None = None

    def get(self, protocol: str) -> Connector:
        connector = self._live.get(protocol)
        if connector is None:
            connector = load(protocol)(self.transport, stats=self.stats, security=self.security)
            if self.gateway_url is not None:
                connector.reached_at(self.gateway_url)
            self._live[protocol] = connector
        if self._sweeper is None and self._live_instances is not None:
            with contextlib.suppress(RuntimeError):  # no running loop: the next call starts it
                self._sweeper = asyncio.get_running_loop().create_task(self._sweep_forever())
        return connector

    def stats_of(self, capability: str) -> dict[str, dict[str, int]]:
        return self.stats.of(capability)

    async def sweep(self) -> int:
        """Close the connections of instances no longer registered; how many were closed."""
        if self._live_instances is None:
            return 0
        by_capability: dict[str, list[tuple[Connector, str]]] = {}
        for connector in list(self._live.values()):
            for instance_id, capability in connector.held().items():
                by_capability.setdefault(capability, []).append((connector, instance_id))
        closed = 0
        for capability, held in by_capability.items():
            live = await self._live_instances(capability)
            if live is None:
                continue  # the registry did not answer: keep everything until it does
            for connector, instance_id in held:
                if instance_id not in live:
                    log.info("closing connections to %s: it left the registry", instance_id)
                    await connector.forget(instance_id)
                    closed += 1
        return closed

    async def _sweep_forever(self) -> None:
        while True:
            await asyncio.sleep(self._sweep_s)
            try:
                await self.sweep()
            except Exception as exc:  # the registry's trouble; the next sweep tries again
                log.debug("connection sweep failed: %r", exc)

    async def aclose(self) -> None:
        if self._sweeper is not None:
            self._sweeper.cancel()
            await asyncio.gather(self._sweeper, return_exceptions=True)
            self._sweeper = None
        live, self._live = self._live, {}
        for connector in live.values():
            await connector.aclose()
