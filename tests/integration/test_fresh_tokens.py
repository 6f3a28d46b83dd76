"""A token used the moment it is issued is accepted (issue 25): a gateway on the tokens file
refused a brand-new token 401 "invalid token" until its next look at the file (every 0.2 s).
An unknown token now re-reads the file before it is refused, at most once per MISS_REREAD_S, so
a flood of unknown tokens reads it a bounded number of times. Real gateway, real token file."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest

from reach.config import AuthSettings
from reach.errors import Unauthorized
from reach.security.auth import MISS_REREAD_S, Auth
from reach.security.tokens import FileTokenStore, TokenBook, TokenCache, TokenRecord, issue
from tests.conftest import new_stack
from tests.helpers import GatewayProcess, wait_until

pytestmark = pytest.mark.integration


def past(moment: float) -> Callable[[], bool]:
    return lambda: time.monotonic() > moment


async def test_a_token_is_accepted_the_moment_it_is_written(
    temporal_server: str, tmp_path: Path, http: httpx.AsyncClient
) -> None:
    stack = new_stack(temporal_server, tmp_path, extra={"REACH_AUTH__MODE": "tokens"})
    store = FileTokenStore(tmp_path / "tokens.json")
    first, record = issue("first", "admin")
    store.write(record)
    async with GatewayProcess(stack) as gw:
        r = await http.get(
            f"{gw.url}/reach/capabilities", headers={"Authorization": f"Bearer {first}"}
        )
        assert r.status_code == 200, r.text
        for n in range(5):
            token, record = issue(f"caller-{n}")
            store.write(record)  # what `reach tokens issue` does; then used at once
            r = await http.get(
                f"{gw.url}/reach/capabilities", headers={"Authorization": f"Bearer {token}"}
            )
            assert r.status_code == 200, (n, r.text)
            # The next one comes after this gateway's re-read window (one re-read per window).
            await wait_until(past(time.monotonic() + 2 * MISS_REREAD_S), 5, every_s=0.02)


class CountedFile(FileTokenStore):
    def __init__(self, path: Path) -> None:
        super().__init__(path)
        self.reads = 0

    def read(self) -> list[TokenRecord]:
        self.reads += 1
        return super().read()


async def test_a_flood_of_unknown_tokens_reads_the_file_a_bounded_number_of_times(
    tmp_path: Path,
) -> None:
    store = CountedFile(tmp_path / "tokens.json")
    _, record = issue("someone", "admin")
    store.write(record)
    cache = TokenCache(store)
    await cache.start()
    try:
        auth = Auth(AuthSettings(mode="tokens"), cache)
        before = store.reads
        started = time.monotonic()
        refused = 0
        for _ in range(2000):
            bogus, _ = issue("nobody")  # well formed, never written
            try:
                auth.caller(f"Bearer {bogus}", None)
            except Unauthorized:
                refused += 1
        took = time.monotonic() - started
        assert refused == 2000
        assert store.reads - before <= 1 + took / MISS_REREAD_S, (store.reads - before, took)
        # An unchanged file is never read again, however long the flood goes on (each miss
        # costs a stat): 2,000 tokens with no store read made a gateway's loop parse a
        # 2,000-token file up to 20 times a second.
        read = store.reads
        for _ in range(3):
            await wait_until(past(time.monotonic() + MISS_REREAD_S), 5, every_s=0.01)
            with pytest.raises(Unauthorized):
                auth.caller(f"Bearer {issue('nobody')[0]}", None)
        assert store.reads == read
        # Changed (another token issued), the next miss reads it once more.
        _, another = issue("another", "admin")
        store.write(another)
        await wait_until(lambda: another.id in cache.book.records, 5)  # the poll's own read
        await wait_until(past(time.monotonic() + MISS_REREAD_S), 5, every_s=0.01)
        read = store.reads
        with pytest.raises(Unauthorized):
            auth.caller(f"Bearer {issue('nobody')[0]}", None)
        assert store.reads == read + 1
    finally:
        await cache.aclose()


async def test_a_token_read_by_someone_elses_miss_is_kept(tmp_path: Path) -> None:
    """A miss re-reads a changed file once (its stamp): a flood's unknown token that came
    first read the file with a token just issued in it, threw that away, and the new token's
    own first use found the file 'already read' and was refused until the file's poll."""
    store = FileTokenStore(tmp_path / "tokens.json")
    _, record = issue("someone", "admin")
    store.write(record)
    cache = TokenCache(store)  # not started: no poll of its own, only the misses' re-reads
    cache.book = TokenBook(await store.load())
    auth = Auth(AuthSettings(mode="tokens"), cache)
    fresh, record = issue("fresh")
    store.write(record)
    with pytest.raises(Unauthorized):  # someone else's unknown token, first after the write
        auth.caller(f"Bearer {issue('nobody')[0]}", None)
    await wait_until(past(time.monotonic() + MISS_REREAD_S), 5, every_s=0.01)
    assert auth.caller(f"Bearer {fresh}", None).name == "fresh"
