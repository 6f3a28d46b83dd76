"""Copies of the token records merge one way (issue 25): kept if any copy holds a record, revoked
from the earliest time any copy says; a cache never forgets or un-revokes what it saw."""

from __future__ import annotations

from pathlib import Path

import pytest

from reach.errors import Unauthorized
from reach.security.tokens import FileTokenStore, TokenCache, issue, merge


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
