"""Bearer tokens for callers, agents and admins (R18): issued one by one, revocable one by one.

A token reads `reach_<id>_<secret>`: the id names its record (and shows in lists and audit), the
secret is 32 random bytes. Only the SHA-256 of the whole token is stored; a presented token is
hashed and compared in constant time. The secret is shown once, when issued.

Where records live (`TokenStore`):
- `FileTokenStore`: a JSON file (mode 0600), with the memory registry (`reach up`, one host);
  the CLI writes it and every gateway on the host sees the change within `FILE_POLL_S`.
- `SharedTokenStore`: a hash in the registry's store (Redis), with a change notice published
  on every write, so a revocation reaches every gateway at once (and a full re-read every
  `auth.resync_s` covers a notice lost while a subscription reconnected). Every write is also
  kept in a mirror file beside the host's tokens file (`mirror_path`), which reads merge in.

Gateways verify from a local copy (`TokenCache`): no store round trip per request.

Records are revoked, never deleted, and a revocation is never undone, so copies merge one
way (`merge`): a record any copy holds is kept, and revoked from the earliest time any copy
says. A Redis restarted empty, or restored from a snapshot taken before a revocation, cannot
revive a token a gateway or the mirror saw revoked: the gateway keeps it revoked and writes
what the store lacks back into it (`TokenCache.reload`).
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import hashlib
import hmac
import json
import logging
import os
import re
import secrets
import time
from abc import ABC, abstractmethod
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, Field, ValidationError

from reach.errors import Forbidden, ReachError, Unauthorized
from reach.store import Store

log = logging.getLogger("reach.auth")

Kind = Literal["caller", "agent", "admin"]
TOKEN_PATTERN = re.compile(r"^reach_([a-z0-9]{12})_([A-Za-z0-9_-]{43})$")
PRINCIPAL_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._:@-]{0,127}$"
FILE_POLL_S = 0.2
HASH_KEY = "auth:tokens"
CHANNEL = "auth:tokens"
ANY = "*"


class TokenRecord(BaseModel):
    """What is stored of a token: never the token itself."""

    id: str
    principal: str = Field(pattern=PRINCIPAL_PATTERN)
    kind: Kind = "caller"
    capabilities: list[str] = Field(
        default_factory=list, description="agent tokens: the capabilities it may serve (* any)"
    )
    sha256: str
    created_at: float
    expires_at: float | None = None
    revoked_at: float | None = None
    note: str | None = None

    def state(self, now: float) -> Literal["active", "expired", "revoked"]:
        if self.revoked_at is not None:
            return "revoked"
        if self.expires_at is not None and now >= self.expires_at:
            return "expired"
        return "active"


@dataclass(frozen=True)
class Principal:
    """Who a request comes from: named by its token, never by a header it chose."""

    name: str
    kind: Kind
    token_id: str | None = None  # None: auth is off and the caller named itself
    capabilities: frozenset[str] = frozenset()

    def may_serve(self, capability: str) -> bool:
        return ANY in self.capabilities or capability in self.capabilities


def merge(*copies: Iterable[TokenRecord]) -> dict[str, TokenRecord]:
    """Copies of the records as one: every id any copy holds, each revoked at the earliest
    time any copy says (a revocation is never undone by a copy that predates it)."""
    out: dict[str, TokenRecord] = {}
    for records in copies:
        for record in records:
            seen = out.get(record.id)
            if seen is None:
                out[record.id] = record
                continue
            times = [t for t in (seen.revoked_at, record.revoked_at) if t is not None]
            if times and seen.revoked_at != min(times):
                out[record.id] = seen.model_copy(update={"revoked_at": min(times)})
    return out


def digest(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def issue(
    principal: str,
    kind: Kind = "caller",
    capabilities: Iterable[str] = (),
    *,
    ttl_s: float | None = None,
    note: str | None = None,
    now: float | None = None,
) -> tuple[str, TokenRecord]:
    """A new token and its record; the token itself is returned here and nowhere else."""
    now = time.time() if now is None else now
    caps = sorted(set(capabilities))
    if kind == "agent" and not caps:
        raise ValueError("an agent token needs the capabilities it may serve (--capability)")
    if kind != "agent" and caps:
        raise ValueError("only agent tokens are scoped to capabilities")
    token_id = secrets.token_hex(6)
    token = f"reach_{token_id}_{secrets.token_urlsafe(32)}"
    record = TokenRecord(
        id=token_id,
        principal=principal,
        kind=kind,
        capabilities=caps,
        sha256=digest(token),
        created_at=now,
        expires_at=now + ttl_s if ttl_s is not None else None,
        note=note,
    )
    return token, record


def bearer(authorization: str | None) -> str:
    """The token of an `Authorization: Bearer …` header, or Unauthorized naming what is wrong."""
    if not authorization:
        raise Unauthorized("missing credentials: send Authorization: Bearer <token>")
    scheme, _, value = authorization.strip().partition(" ")
    if scheme.lower() != "bearer" or not value.strip():
        raise Unauthorized("the Authorization header must read 'Bearer <token>'")
    return value.strip()


class TokenBook:
    """An immutable snapshot of the token records, indexed by id."""

    def __init__(self, records: Iterable[TokenRecord] = ()) -> None:
        self.records: dict[str, TokenRecord] = {r.id: r for r in records}

    def __len__(self) -> int:
        return len(self.records)

    def verify(self, token: str, now: float | None = None) -> Principal:
        """The principal of a valid token, or Unauthorized (401) saying which check failed."""
        found = TOKEN_PATTERN.match(token)
        record = self.records.get(found.group(1)) if found else None
        # Hash and compare even when the id is unknown: the time taken does not tell.
        expected = record.sha256 if record is not None else "0" * 64
        if not hmac.compare_digest(digest(token), expected) or record is None:
            raise Unauthorized("invalid token")
        state = record.state(time.time() if now is None else now)
        if state != "active":
            raise Unauthorized(f"token {record.id} is {state}")
        return Principal(
            name=record.principal,
            kind=record.kind,
            token_id=record.id,
            capabilities=frozenset(record.capabilities),
        )


# -- stores ---------------------------------------------------------------------------------


class TokenStore(ABC):
    @abstractmethod
    async def load(self) -> list[TokenRecord]: ...

    @abstractmethod
    async def save(self, record: TokenRecord) -> None:
        """Create or replace the record with this id, and tell every watcher."""

    @abstractmethod
    async def watch(self, on_change: Callable[[], None]) -> Callable[[], Awaitable[None]]:
        """Call `on_change` whenever the records may have changed; returns a stopper."""

    async def get(self, token_id: str) -> TokenRecord | None:
        return next((r for r in await self.load() if r.id == token_id), None)

    async def revoke(self, token_id: str, now: float | None = None) -> TokenRecord:
        record = await self.get(token_id)
        if record is None:
            raise LookupError(f"no token with id {token_id!r}")
        if record.revoked_at is None:
            record = record.model_copy(update={"revoked_at": time.time() if now is None else now})
            await self.save(record)
        return record


def _parse(raw: str, where: str) -> TokenRecord | None:
    try:
        return TokenRecord.model_validate_json(raw)
    except ValidationError as exc:
        log.error("unreadable token record in %s ignored: %s", where, exc.errors()[0]["msg"])
        return None


class FileTokenStore(TokenStore):
    """Token records in a JSON file (0600), written whole and atomically under a lock."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)

    def read(self) -> list[TokenRecord]:
        try:
            raw = json.loads(self.path.read_text(encoding="utf-8"))
        except FileNotFoundError:
            return []
        except (OSError, ValueError) as exc:
            raise ReachError(f"cannot read token file {self.path}: {exc}") from exc
        items = raw.get("tokens", []) if isinstance(raw, dict) else []
        parsed = (_parse(json.dumps(item), str(self.path)) for item in items)
        return [r for r in parsed if r is not None]

    def write(self, record: TokenRecord) -> None:
        self.write_many([record])

    def write_many(self, written: Iterable[TokenRecord]) -> None:
        """Merge `written` into the file one way (`merge`): a record the file holds revoked
        stays revoked, whoever writes an older copy of it (a gateway writing back what it
        read before an operator revoked it)."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        lock = self.path.with_name(self.path.name + ".lock")
        with open(lock, "a") as held:
            fcntl.flock(held, fcntl.LOCK_EX)
            records = merge(self.read(), written)
            body = {"tokens": [r.model_dump(mode="json") for r in records.values()]}
            tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}.tmp")
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(fd, "w", encoding="utf-8") as out:
                json.dump(body, out, indent=1)
                out.flush()
                os.fsync(out.fileno())
            os.replace(tmp, self.path)

    async def load(self) -> list[TokenRecord]:
        return await asyncio.to_thread(self.read)

    async def save(self, record: TokenRecord) -> None:
        await asyncio.to_thread(self.write, record)

    async def save_many(self, records: list[TokenRecord]) -> None:
        await asyncio.to_thread(self.write_many, records)

    def stamp(self) -> tuple[int, int, int] | None:
        """The file's (mtime, size, inode), None when absent: a write (a new file put in
        place) changes it."""
        try:
            st = self.path.stat()
        except FileNotFoundError:
            return None
        return (st.st_mtime_ns, st.st_size, st.st_ino)

    async def watch(self, on_change: Callable[[], None]) -> Callable[[], Awaitable[None]]:
        async def poll() -> None:
            seen = self.stamp()
            while True:
                await asyncio.sleep(FILE_POLL_S)
                now = self.stamp()
                if now != seen:
                    seen = now
                    on_change()

        task = asyncio.get_running_loop().create_task(poll())

        async def stop() -> None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

        return stop


def mirror_path(tokens_file: str | Path, key_prefix: str) -> Path:
    """Where a host keeps its mirror of a shared store's records: beside the tokens file, named
    by the deployment's key prefix (so neither the memory registry's file nor another
    deployment's records are mixed in)."""
    path = Path(tokens_file)
    return path.with_name(f"{path.stem}.{key_prefix}.mirror.json")


class SharedTokenStore(TokenStore):
    """Token records in the shared store (a Redis hash); every write is announced, and kept
    in `mirror` too (the host's tokens file) when one is given."""

    def __init__(self, store: Store, mirror: FileTokenStore | None = None) -> None:
        self.store = store
        self.mirror = mirror
        self._mirror_failed = False

    async def load_shared(self) -> list[TokenRecord]:
        """What the shared store holds (without the mirror)."""
        raw = await self.store.hash_all(HASH_KEY)
        parsed = (_parse(v, "the shared store") for v in raw.values())
        return [r for r in parsed if r is not None]

    async def load(self) -> list[TokenRecord]:
        shared = await self.load_shared()
        return list(merge(shared, await self.load_mirror()).values())

    async def load_mirror(self) -> list[TokenRecord]:
        if self.mirror is None:
            return []
        try:
            return await self.mirror.load()
        except ReachError as exc:
            self._mirror_trouble(exc)
            return []

    async def save(self, record: TokenRecord) -> None:
        await self.keep(record)
        await self.store.hash_set(HASH_KEY, record.id, record.model_dump_json())
        await self.store.publish(CHANNEL, record.id)

    async def revoke(self, token_id: str, now: float | None = None) -> TokenRecord:
        """Revoke it, and write the revocation into the shared store also when only the
        mirror held it (an older copy was written over it there): revoking again repairs."""
        record = await super().revoke(token_id, now)
        shared = {r.id: r for r in await self.load_shared()}
        if shared.get(token_id) != record:
            await self.save(record)
        return record

    async def keep(self, record: TokenRecord) -> None:
        """Write `record` into the mirror (a mirror that fails is logged, never fatal)."""
        await self.keep_many([record])

    async def keep_many(self, records: list[TokenRecord]) -> None:
        if self.mirror is None or not records:
            return
        try:
            await self.mirror.save_many(records)
        except (OSError, ReachError) as exc:
            self._mirror_trouble(exc)

    def _mirror_trouble(self, exc: Exception) -> None:
        if not self._mirror_failed:
            self._mirror_failed = True
            log.warning(
                "the token mirror %s is not usable (%s): revocations then live only in the "
                "shared store and the gateways' copies",
                self.mirror.path if self.mirror else "-",
                exc,
            )

    async def watch(self, on_change: Callable[[], None]) -> Callable[[], Awaitable[None]]:
        subscription = await self.store.subscribe(CHANNEL, lambda _message: on_change())
        return subscription.aclose


# -- the gateway's local copy ---------------------------------------------------------------


class TokenCache:
    """The records as this process last read them; re-read on every change notice (coalesced)
    and every `resync_s`. A failed re-read keeps the last good copy."""

    def __init__(self, store: TokenStore, *, resync_s: float = 30.0) -> None:
        self.store = store
        self.resync_s = resync_s
        self.book = TokenBook()
        self.loaded_at = 0.0
        self._stop: Callable[[], Awaitable[None]] | None = None
        self._resync: asyncio.Task[None] | None = None
        self._pending: asyncio.Task[None] | None = None
        self._again = False

    async def start(self) -> None:
        # Unreadable at start: refuse to start (an empty book would leave the door open).
        self.book = TokenBook(await self.store.load())
        self.loaded_at = time.time()
        self._take(await self._reassert(self.book.records))
        self._stop = await self.store.watch(self.changed)
        self._resync = asyncio.get_running_loop().create_task(self._resync_forever())

    def changed(self) -> None:
        if self._pending is not None and not self._pending.done():
            self._again = True  # a reload is on its way: read once more after it
            return
        self._pending = asyncio.get_running_loop().create_task(self._reload_until_quiet())

    async def _reload_until_quiet(self) -> None:
        while True:
            self._again = False
            await self.reload()
            if not self._again:
                return

    async def reload(self) -> None:
        """Re-read the store and merge it into this copy (`merge`): a record the store lost,
        or holds from before its revocation, stays as this copy knows it, and is written back
        into a shared store (re-asserted), so a Redis restarted empty or from an older
        snapshot cannot revive a revoked token nor reopen the door."""
        try:
            records = await self.store.load()
        except (ReachError, OSError) as exc:
            log.warning("could not re-read tokens (keeping the last copy): %s", exc)
            return
        known = merge(self.book.records.values(), records)
        lost = len(known) - len({r.id for r in records})
        if lost and not isinstance(self.store, SharedTokenStore):
            # A moved or truncated file: what it lost stays as this copy knows it (the door
            # does not reopen, a revoked token is not revived).
            log.error(
                "the token store no longer holds %d token(s) this gateway knows; keeping them "
                "(restore the store, or restart the gateway to start afresh)",
                lost,
            )
        self._take(known)
        self.loaded_at = time.time()
        self._take(await self._reassert(known))

    def _take(self, known: dict[str, TokenRecord]) -> None:
        if known != self.book.records:
            self.book = TokenBook(known.values())

    async def _reassert(self, known: dict[str, TokenRecord]) -> dict[str, TokenRecord]:
        """Write into the shared store (and the mirror) what they lack of `known`; returns
        `known` with what they hold now merged in. They are read again first, and what is
        written back is merged with that, so a revocation made since `known` was read is
        never overwritten by the older copy; the store's writes come before the mirror's
        (its fsync), so a revocation landing meanwhile has the narrowest window to race."""
        store = self.store
        if not isinstance(store, SharedTokenStore):
            return known
        try:
            shared = {r.id: r for r in await store.load_shared()}
            mirrored = {r.id: r for r in await store.load_mirror()}
            known = merge(known.values(), shared.values(), mirrored.values())
            behind = [r for r in known.values() if shared.get(r.id) != r]
            for record in behind:
                log.warning(
                    "token %s (%s): the shared store %s; writing this gateway's copy back",
                    record.id,
                    record.state(time.time()),
                    "had lost it" if record.id not in shared else "held an older copy",
                )
                await store.store.hash_set(HASH_KEY, record.id, record.model_dump_json())
            if behind:
                # A revocation may have landed between the read and these writes, and been
                # overwritten: its writer mirrors it before it writes the store, so it is in
                # the mirror (one on this host), read again; what became revoked is written.
                written = known
                known = merge(written.values(), await store.load_mirror())
                for record in known.values():
                    if record != written[record.id]:
                        await store.store.hash_set(HASH_KEY, record.id, record.model_dump_json())
                await store.store.publish(CHANNEL, behind[0].id)
            await store.keep_many([r for r in known.values() if mirrored.get(r.id) != r])
        except (ReachError, OSError) as exc:
            log.warning("could not write the tokens back into the shared store: %s", exc)
        return known

    async def _resync_forever(self) -> None:
        while True:
            await asyncio.sleep(self.resync_s)
            await self.reload()

    async def aclose(self) -> None:
        if self._stop is not None:
            await self._stop()
        for task in (self._resync, self._pending):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task


def check_claimed_caller(principal: Principal, claimed: str | None) -> None:
    """`X-Reach-Caller`, when a token names the caller, may only repeat that name."""
    if claimed and claimed != principal.name:
        # The claimed name is not repeated: it may be anything, a pasted secret too.
        raise Forbidden(
            f"X-Reach-Caller does not match the token's principal {principal.name!r}; drop the "
            "header or send the caller's own token"
        )
