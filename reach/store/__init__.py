"""The one small store the registry and the policy counters sit on.

Two backends behind one interface: `memory` (one process) and `redis` (several gateways and
workers on several hosts; key TTLs make eviction happen even when no gateway is alive).

`create_store` is the one place the configuration picks a backend. State that must be shared
as widely as the store (policy counters, in-flight counts) asks the store, not the settings:
`Store.shared_redis()` lends the Redis a store lives in, or None for a process-local store.
"""

from __future__ import annotations

from reach.config import RegistrySettings
from reach.store.base import GroupScan, Record, Store
from reach.store.memory import MemoryStore

__all__ = ["GroupScan", "MemoryStore", "Record", "Store", "create_store"]


def create_store(settings: RegistrySettings) -> Store:
    """The store `registry.type` names (its `backend`); Redis as `registry.redis_url` says it
    is run: one server, a Sentinel-watched master or a Cluster (`reach.store.redis_connect`)."""
    if settings.type == "redis":
        from reach.store.redis import RedisStore

        return RedisStore.from_url(
            settings.redis_url,
            prefix=settings.key_prefix,
            timeout_s=settings.redis_timeout_s,
            max_connections=settings.redis_max_connections,
        )
    return MemoryStore()
