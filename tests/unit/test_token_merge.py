"""Copies of the token records merge one way (issue 25): kept if any copy holds a record, revoked
from the earliest time any copy says; a cache never forgets or un-revokes what it saw."""

from __future__ import annotations

from pathlib import Path

import pytest

from reach.errors import Unauthorized
from reach.security.tokens import (
    HASH_KEY,
    FileTokenStore,
    SharedTokenStore,
    TokenCache,
    TokenRecord,
    issue,
    merge,
)
from reach.store import MemoryStore


def test_a_revocation_is_never_undone_by_an_older_copy() -> None:
    _, alive = issue("a", now=100.0)
    _, gone = issue("b", now=100.0)
    revoked = gone.model_copy(update={"revoked_at": 200.0})
    later = gone.model_copy(update={"revoked_at": 300.0})
    merged = merge([alive, revoked], [gone], [later])
    assert merged.keys() == {alive.id, gone.id}
    assert merged[gone.id].revoked_at == 200.0
    assert merged[alive.id] == alive
    assert merge([gone], [revoked])[gone.id].revoked_at == 200.0


async def test_a_cache_keeps_what_its_file_lost_or_restored_older(tmp_path: Path) -> None:
    store = FileTokenStore(tmp_path / "tokens.json")
    token, record = issue("former")
    store.write(record)
    cache = TokenCache(store, resync_s=3600)
    await cache.start()
    try:
        await store.revoke(record.id)
        await cache.reload()
        with pytest.raises(Unauthorized, match="revoked"):
            cache.book.verify(token)
        store.path.write_text('{"tokens": [' + record.model_dump_json() + "]}")  # the old copy
        await cache.reload()
        with pytest.raises(Unauthorized, match="revoked"):
            cache.book.verify(token)
        store.path.unlink()
        await cache.reload()
        assert record.id in cache.book.records
    finally:
        await cache.aclose()


async def test_a_revocation_made_while_a_gateway_writes_back_is_not_undone(
    tmp_path: Path,
) -> None:
    """Redis restarted empty: a gateway writes back the records it knows, and an operator
    revokes one of them meanwhile (the CLI on this host, writing the mirror, then Redis). The
    gateway's older copy must not stay over the revocation, in Redis or in the mirror."""
    redis = MemoryStore()
    path = tmp_path / "tokens.reach.mirror.json"
    gateway = SharedTokenStore(redis, FileTokenStore(path))
    records = [issue(f"p{i}")[1] for i in range(3)]
    token, victim = issue("p-victim")  # written back last
    for record in [*records, victim]:
        await gateway.save(record)
    cache = TokenCache(gateway, resync_s=3600)
    await cache.reload()  # not started: no change notice reloads it behind the test's back
    try:
        for record in [*records, victim]:  # a Redis restarted empty
            await redis.hash_delete(HASH_KEY, record.id)
        cli = SharedTokenStore(redis, FileTokenStore(path))
        revoked: list[TokenRecord] = []
        hash_set = redis.hash_set

        async def racing(key: str, field: str, value: str) -> None:
            if not revoked:  # while the first record is written back, the operator revokes
                revoked.append(victim)
                revoked[0] = await cli.revoke(victim.id)
            await hash_set(key, field, value)

        redis.hash_set = racing  # type: ignore[method-assign]
        await cache.reload()
        assert revoked[0].revoked_at is not None
        shared = {r.id: r for r in await gateway.load_shared()}
        mirrored = {r.id: r for r in FileTokenStore(path).read()}
        assert shared[victim.id].revoked_at == revoked[0].revoked_at
        assert mirrored[victim.id].revoked_at == revoked[0].revoked_at
        with pytest.raises(Unauthorized, match="revoked"):
            cache.book.verify(token)
    finally:
        await cache.aclose()


async def test_revoking_again_repairs_a_revocation_only_the_mirror_kept(tmp_path: Path) -> None:
    redis = MemoryStore()
    cli = SharedTokenStore(redis, FileTokenStore(tmp_path / "tokens.reach.mirror.json"))
    _, record = issue("a")
    await cli.save(record)
    revoked = await cli.revoke(record.id)
    await redis.hash_set(HASH_KEY, record.id, record.model_dump_json())  # overwritten there
    assert (await cli.revoke(record.id)).revoked_at == revoked.revoked_at
    assert (await cli.load_shared())[0].revoked_at == revoked.revoked_at


def test_a_file_store_never_un_revokes(tmp_path: Path) -> None:
    store = FileTokenStore(tmp_path / "tokens.json")
    _, record = issue("a")
    revoked = record.model_copy(update={"revoked_at": 200.0})
    store.write(revoked)
    store.write(record)  # an older copy, from a process that had not seen the revocation
    assert store.read()[0].revoked_at == 200.0
