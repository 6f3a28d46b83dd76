"""A snapshot's tiers as rows of entries sorted by instance id, held in chunks of about `CHUNK`.

A snapshot derived from the last one (a status change, a join, a leave) copies only the chunks
the changed instances fall in and shares every other one. Before, each derived snapshot copied
its 10,000-entry tuples and its `by_id` dict whole, and those young 10,000-entry containers were
most of what each young pass of the cyclic collector walked (~98k of ~107k references at 10,000
instances with three views): the pass's time was the longest event-loop stall. Now a derived
snapshot makes a top tuple of a few hundred chunks at most and the chunks it changed.

Routing reads a tier as one flat tuple (`Rows.flat`): made when first read (a C-speed copy of
the chunks, ~30 µs at 10,000), once per snapshot, and only for the tiers a request reads.
Lookups by id (`ById`) bisect the chunks' first ids, then the chunk: no dict is kept.
"""

from __future__ import annotations

import bisect
import itertools
import operator
from collections.abc import Callable, Iterator, Mapping
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from reach.registry.snapshot import RouteEntry

CHUNK = 64
"""Entries a chunk holds when made; an edited chunk is split past twice as many and merged
into a neighbour under a quarter as many, so a tier of n entries has at most ~4n/CHUNK."""

Chunk = tuple["RouteEntry", ...]

_by_id: Callable[[RouteEntry], str] = operator.attrgetter("instance_id")


class Rows:
    """Entries sorted by id, in chunks (immutable)."""

    __slots__ = ("_flat", "chunks", "firsts", "size")

    def __init__(self, chunks: tuple[Chunk, ...], flat: Chunk | None = None) -> None:
        self.chunks = chunks
        # A tuple of strings: the collector stops tracking it the first time it looks.
        self.firsts: tuple[str, ...] = tuple([c[0].instance_id for c in chunks])
        self.size = sum(map(len, chunks))
        self._flat = flat

    @classmethod
    def of(cls, entries: Chunk) -> Rows:
        """Rows of entries already sorted by id (kept as the flat tuple: read it for free)."""
        chunks = tuple([entries[i : i + CHUNK] for i in range(0, len(entries), CHUNK)])
        return cls(chunks, entries)

    def flat(self) -> Chunk:
        """Every entry in one tuple, made once."""
        if self._flat is None:
            if len(self.chunks) == 1:
                self._flat = self.chunks[0]
            else:
                self._flat = tuple(itertools.chain.from_iterable(self.chunks))
        return self._flat

    def __iter__(self) -> Iterator[RouteEntry]:
        if self._flat is not None:
            return iter(self._flat)
        return itertools.chain.from_iterable(self.chunks)

    def __len__(self) -> int:
        return self.size

    def find(self, instance_id: str) -> RouteEntry | None:
        c = bisect.bisect_right(self.firsts, instance_id) - 1
        if c < 0:
            return None
        chunk = self.chunks[c]
        i = bisect.bisect_left(chunk, instance_id, key=_by_id)
        if i < len(chunk) and chunk[i].instance_id == instance_id:
            return chunk[i]
        return None

    def edited(
        self, current: Mapping[str, RouteEntry | None], belongs: Callable[[RouteEntry], bool]
    ) -> Rows:
        """The rows with the changed instances put in, replaced or taken out (`belongs`: whether
        an entry is one of these rows); these same rows when none of them changed."""
        chunks = self.chunks or ((),)
        firsts = self.firsts
        copies: dict[int, list[RouteEntry]] = {}
        for instance_id, entry in current.items():
            # Placed by the first ids as they were: each chunk keeps its range of ids, so edits
            # falling in one chunk compose and the chunks stay in order.
            c = max(0, bisect.bisect_right(firsts, instance_id) - 1)
            held = copies.get(c)
            rows = held if held is not None else chunks[c]
            i = bisect.bisect_left(rows, instance_id, key=_by_id)
            present = i < len(rows) and rows[i].instance_id == instance_id
            keep = entry is not None and belongs(entry)
            if not present and not keep:
                continue
            if held is None:
                held = copies[c] = list(rows)
            if keep:
                assert entry is not None
                if present:
                    held[i] = entry
                else:
                    held.insert(i, entry)
            else:
                del held[i]
        if not copies:
            return self
        return Rows(_rechunk(chunks, copies))


def _rechunk(
    chunks: tuple[Chunk, ...], copies: Mapping[int, list[RouteEntry]]
) -> tuple[Chunk, ...]:
    out: list[Chunk] = []
    carry: list[RouteEntry] = []  # a small edited chunk, merged into the next
    last = len(chunks) - 1
    for c, chunk in enumerate(chunks):
        edited = copies.get(c)
        if edited is None and not carry:
            out.append(chunk)
            continue
        rows = carry + (edited if edited is not None else list(chunk))
        carry = []
        if len(rows) < CHUNK // 4 and c < last:
            carry = rows
            continue
        if rows and len(rows) < CHUNK // 4 and out:
            rows = list(out.pop()) + rows
        out.extend(_split(rows))
    return tuple(out)


def _split(rows: list[RouteEntry]) -> list[Chunk]:
    if len(rows) <= 2 * CHUNK:
        return [tuple(rows)] if rows else []
    pieces = -(-len(rows) // CHUNK)
    size = -(-len(rows) // pieces)
    return [tuple(rows[i : i + size]) for i in range(0, len(rows), size)]


class ById(Mapping[str, "RouteEntry"]):
    """A snapshot's entries by instance id, read from its rows (no dict of its own)."""

    __slots__ = ("_rows",)

    def __init__(self, rows: Rows) -> None:
        self._rows = rows

    def __getitem__(self, instance_id: str) -> RouteEntry:
        found = self._rows.find(instance_id)
        if found is None:
            raise KeyError(instance_id)
        return found

    def get(self, instance_id: str, default: object = None) -> RouteEntry | None:  # type: ignore[override]
        found = self._rows.find(instance_id)
        return found if found is not None else default  # type: ignore[return-value]

    def __contains__(self, instance_id: object) -> bool:
        return isinstance(instance_id, str) and self._rows.find(instance_id) is not None

    def __iter__(self) -> Iterator[str]:
        return map(_by_id, self._rows)

    def __len__(self) -> int:
        return self._rows.size


__all__ = ["CHUNK", "ById", "Rows"]
