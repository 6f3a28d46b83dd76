"""Protocol plug-ins behind one `Connector` interface, found through the entry-point group
`agent_reach.connectors` (built-ins are registered the same way as third-party ones).
"""

from __future__ import annotations

from importlib.metadata import entry_points

from connectors.base import Connector
from reach.config import TransportSettings

ENTRY_POINT_GROUP = "agent_reach.connectors"

__all__ = ["ENTRY_POINT_GROUP", "Connector", "ConnectorSet", "available", "load"]


def available() -> dict[str, str]:
    """Protocol name -> 'module:Class' of every installed connector."""
    return {ep.name: ep.value for ep in entry_points(group=ENTRY_POINT_GROUP)}


def load(protocol: str) -> type[Connector]:
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        if ep.name == protocol:
            cls = ep.load()
            if not (isinstance(cls, type) and issubclass(cls, Connector)):
                raise TypeError(f"entry point {ep.value} is not a Connector subclass")
            return cls
    known = ", ".join(sorted(available())) or "none installed"
    raise LookupError(f"no connector for protocol {protocol!r}; known: {known}")


class ConnectorSet:
    """One live connector per protocol, built on first use with these settings, closed together."""

    def __init__(self, transport: TransportSettings | None = None) -> None:
        self.transport = transport
        self._live: dict[str, Connector] = {}

    def get(self, protocol: str) -> Connector:
        connector = self._live.get(protocol)
        if connector is None:
            connector = load(protocol)(self.transport)
            self._live[protocol] = connector
        return connector

    async def aclose(self) -> None:
        live, self._live = self._live, {}
        for connector in live.values():
            await connector.aclose()
