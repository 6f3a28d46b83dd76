from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from types import TracebackType


class Store(ABC):
    """String values with optional TTLs, string sets and atomic counters."""

    @abstractmethod
    async def put(self, key: str, value: str, ttl_s: float | None = None) -> None: ...

    @abstractmethod
    async def get_many(self, keys: Sequence[str]) -> list[str | None]: ...

    @abstractmethod
    async def delete(self, key: str) -> bool: ...

    @abstractmethod
    async def add_member(self, set_key: str, member: str) -> None: ...

    @abstractmethod
    async def remove_member(self, set_key: str, member: str) -> None: ...

    @abstractmethod
    async def members(self, set_key: str) -> set[str]: ...

    @abstractmethod
    async def is_member(self, set_key: str, member: str) -> bool: ...

    @abstractmethod
    async def incr(self, key: str) -> int: ...

    async def ping(self) -> bool:
        return True

    async def aclose(self) -> None:
        return None

    async def get(self, key: str) -> str | None:
        return (await self.get_many([key]))[0]

    async def __aenter__(self) -> Store:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()
