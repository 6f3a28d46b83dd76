"""The one interface every protocol plug-in implements (R1, R4).

Shaped like httpx's transports: one async method that takes the standard message and returns a
`Reply`, `aclose()`, and async-context-manager use. A connector raises only `reach.errors`
exceptions (mapped from its library's exceptions in one place), so the policy engine can act on
failures without knowing the protocol.

Connections are the connector's to manage (R4): opened lazily, kept alive, reconnected after a
break, closed when idle past `transport.idle_timeout_s`, and closed when their instance leaves
the registry (`held` + `forget`, driven by `ConnectorSet`'s sweep). Their lifecycle is counted
in `stats` (`connectors._pools.ConnectionStats`).

A connector gets the transport settings once, at construction, and checks an agent's service
address when the agent joins (`check_address`), so that an address it cannot call is refused
there rather than failing every request routed to it.
"""

from __future__ import annotations

import functools
from abc import ABC, abstractmethod
from collections.abc import Awaitable, Callable
from types import TracebackType
from typing import Any, ClassVar, Self, TypeVar

from connectors._pools import ConnectionStats, Pools
from connectors._tls import ReachTls
from reach.config import SecuritySettings, TransportSettings
from reach.invocation import Endpoint
from reach.messages import Message, Reply
from reach.registry.models import Discovery


class Connector(ABC):
    protocol: ClassVar[str]

    def __init__(
        self,
        transport: TransportSettings | None = None,
        *,
        stats: ConnectionStats | None = None,
        security: SecuritySettings | None = None,
    ) -> None:
        self.transport = transport if transport is not None else TransportSettings()
        self.stats = stats if stats is not None else ConnectionStats()
        # mTLS to agents and the allowed networks (reach.security); defaults: off, global only.
        self.security = security if security is not None else SecuritySettings()
        self._watchers: list[Callable[[str], None]] = []  # `watch`

    @classmethod
    def check_address(cls, address: str) -> str:
        """The address normalized, or `reach.errors.InvalidRequest` naming what is wrong.

        The default accepts any address as it is; a protocol with an address syntax checks it.
        """
        return address

    @functools.cached_property
    def tls(self) -> ReachTls:
        """Reach's side of mTLS (`security.tls`): its client context and the name each agent
        instance must prove (`connectors._tls`)."""
        return ReachTls(self.security)

    async def verify_identity(self, address: str, instance_id: str) -> None:
        """At Join, with mTLS on: prove that the agent at `address` holds a certificate from
        Reach's CA for `instance_id`, by the handshake a call would make. Raises
        `reach.errors.Forbidden` (wrong CA, wrong identity, no TLS) or `InvalidRequest` (an id
        mTLS cannot name, a plaintext address, or nobody there to ask).

        `address` is the one `check_address` returned. The default does nothing: a protocol
        that does not reach agents directly (MQTT: the broker does) has nothing to check."""
        return None

    # True: this protocol's agents run a request delivered twice once (the agent contract's
    # R8: the SDK answers a repeated RequestID from its answer cache), so a call whose outcome
    # is unknown may be sent again to the same instance. False (A2A agents, MCP servers): a
    # second delivery may run it twice, so the activity claims each attempt's send in the
    # shared store first and never sends one again that a lost process may have sent.
    deduplicates: ClassVar[bool] = True

    # True: this protocol's agents report a call's progress (MCP's notifications/progress):
    # the connector hands each to `reach.progress.report`, and the activity keeps a bounded
    # record of them for the request's timeline. False: no record is set up for its calls.
    reports_progress: ClassVar[bool] = False

    # True: this protocol's instances do not Join or heartbeat (A2A agents, MCP servers); they
    # are registered by URL (`POST /reach/agents`, `reach.yaml`, `reach agents add`), described
    # by `discover`, and kept alive by a probe that calls `discover` every heartbeat_interval.
    registered_by_url: ClassVar[bool] = False

    async def discover(self, address: str, known: Discovery | None = None) -> Discovery:
        """What the instance at `address` (checked by `check_address`) serves now. `known` is
        the last discovery: a protocol that can ask conditionally (an ETag) returns `known`
        itself when nothing changed. Raises `reach.errors.InvalidRequest` for an answer that
        is malformed (naming what), `Unavailable`/`TransportError` when nobody answers.

        Called at registration and by the liveness probe; only for `registered_by_url`
        protocols."""
        raise NotImplementedError(f"{self.protocol} instances join; they are not discovered")

    def watch(self, changed: Callable[[str], None]) -> None:
        """Call `changed(address)` whenever an instance at `address` says that what it serves
        changed (an MCP server's `notifications/tools/list_changed` on a call's stream), so
        the prober of this process discovers it again at once rather than at its next round.
        Only `registered_by_url` protocols ever call it."""
        self._watchers.append(changed)

    @property
    def watched(self) -> bool:
        """Whether anything `watch`es this connector (a gateway's prober does)."""
        return bool(self._watchers)

    def changed(self, address: str) -> None:
        """Tell the watchers (`watch`) that the instance at `address` changed what it serves."""
        for watcher in self._watchers:
            watcher(address)

    def reached_at(self, gateway_url: str) -> None:
        """Where agents reach this deployment back (its gateway's public URL), for a connector
        that hands agents a URL of Reach's (A2A push notifications); the others ignore it."""
        del gateway_url

    def continues(self, message: Message) -> list[str]:
        """The agent's own task or context ids `message` continues (an A2A follow-up's): Reach
        sends it only for the caller they were handed to (`activities._conversations`). The
        default: none."""
        return []

    def conversations(self, reply: Reply) -> list[str]:
        """The task or context ids `reply` hands to its caller to continue later. The default:
        none."""
        return []

    @abstractmethod
    async def invoke(self, endpoint: Endpoint, message: Message, timeout_s: float) -> Reply:
        """Deliver `message` to `endpoint` and return its answer within `timeout_s`."""

    async def follow(self, endpoint: Endpoint, handle: dict[str, Any], timeout_s: float) -> Reply:
        """Where the work `handle` names stands now (`handle`: the `Reply.follow` an invoke
        returned, kept in the request's history): its final Reply, an accepted Reply with a
        handle (still going), or the Reach error it ended in. Only a connector whose invoke
        returns follow handles implements it (A2A: `GetTask`)."""
        raise NotImplementedError(f"{self.protocol} returns no follow handles")

    async def cancel(self, endpoint: Endpoint, handle: dict[str, Any], timeout_s: float) -> None:
        """Ask the agent to stop the work `handle` names (the request's deadline passed)."""
        raise NotImplementedError(f"{self.protocol} returns no follow handles")

    def held(self) -> dict[str, str]:
        """instance_id -> capability of every instance this connector holds a connection to."""
        return {}

    async def forget(self, instance_id: str) -> None:
        """Close what is held for an instance that left the registry (in-flight calls end
        first)."""
        return None

    async def aclose(self) -> None:
        return None

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()

    @classmethod
    def address_host_port(cls, address: str) -> tuple[str, int] | None:
        """The host and port a (checked) service address connects to, for the address guard
        (`reach.security.netguard`) to vet when the agent joins: every address the host
        resolves to must be allowed. None: the address names no TCP host to vet (the default,
        for a protocol whose address syntax this base class cannot know)."""
        return None


T = TypeVar("T")


class PooledConnector(Connector):
    """A connector holding one connection (or pool of them) per instance in `Pools`: `held`
    and `forget` come with it."""

    _pools: Pools[Any]

    def _new_pools(
        self, make: Callable[[str], T], close: Callable[[T], Awaitable[None]]
    ) -> Pools[T]:
        return Pools(
            self.protocol,
            make,
            close,
            idle_timeout_s=self.transport.idle_timeout_s,
            max_pools=self.transport.max_pools,
            stats=self.stats,
        )

    def held(self) -> dict[str, str]:
        return self._pools.instances()

    async def forget(self, instance_id: str) -> None:
        self._pools.discard_instance(instance_id)

    async def aclose(self) -> None:
        await self._pools.aclose()
