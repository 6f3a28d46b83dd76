"""The settings in force in a gateway, and what is derived from them.

A reload (`ConfigWatcher`, the admin API) replaces the settings whole; whatever is worked out
from them here is worked out again from the next request on. Every part of the door and the
services beside it reads the same `Live`, so one reload changes them all at once.
"""

from __future__ import annotations

from reach.config import ReachSettings, RoutingSettings
from reach.invocation import CallbackPlan
from reach.limits import Limits
from reach.security.netguard import AddressGuard


class Live:
    """What the door and the services read of the configuration, per request."""

    def __init__(self, settings: ReachSettings) -> None:
        self.settings = settings
        self.limits = Limits(max_message_bytes=settings.transport.max_message_bytes)
        self._derive()

    def reconfigure(self, settings: ReachSettings) -> None:
        """A reloaded configuration (validated): plans, limits and rules use it from the next
        request on. Connections, workers and the registry keep theirs until a restart (the
        reload says which sections that concerns)."""
        # `security` (allowed networks, mTLS, encryption) is the connectors' and workers' too:
        # it changes with a restart, everywhere at once, never for the door alone.
        self.settings = settings.model_copy(update={"security": self.settings.security})
        self._derive()

    def _derive(self) -> None:
        self.callback_plan = CallbackPlan(**self.settings.callback.model_dump())
        self._routing: dict[str, RoutingSettings] = {}
        self._guard: AddressGuard | None = None

    def routing_for(self, capability: str) -> RoutingSettings:
        found = self._routing.get(capability)
        if found is None:
            found = self._routing[capability] = self.settings.routing_for(capability)
        return found

    def address_guard(self) -> AddressGuard:
        """The request-forgery guard for the allowed networks in force."""
        if self._guard is None:
            self._guard = AddressGuard(self.settings.security.allow_networks)
        return self._guard
