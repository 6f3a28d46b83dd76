"""A capability snapshot derived from the last one (a few instances changed) equals one built
from every instance; the view derives it when few changed (pure logic, no store)."""

from __future__ import annotations

import asyncio
from typing import Any
from unittest import mock

from hypothesis import given, settings
from hypothesis import strategies as st

from reach.config import RegistrySettings
from reach.registry import HealthReport, JoinRequest, Registry, rows
from reach.registry.view import CapabilitySnapshot, RegistryView, RouteEntry
from reach.store import MemoryStore

STATUSES = ("ok", "degraded", "unhealthy")


def entry(i: int, status: str = "ok", size: int = 1 << 20, limit: int | None = None) -> RouteEntry:
    return RouteEntry(
        instance_id=f"i{i:03d}",
        capability="cap",
        protocol="http",
        address=f"10.0.0.{i}:1",
        max_message_bytes=size,
        status=status,  # type: ignore[arg-type]
        weight=1 + i % 3,
        max_inflight=limit,
        joined_at=0.0,
        declared={},
    )


def picture(snap: CapabilitySnapshot) -> tuple[Any, ...]:
    return (
        snap.capability,
        snap.entries,
        snap.by_id,
        snap.routable,
        snap.ok,
        snap.degraded,
        snap.members,
        snap.ids,
        snap.smallest,
        snap.limited,
    )


one_entry = st.builds(
    entry,
    st.integers(0, 40),
    st.sampled_from(STATUSES),
    st.sampled_from([1 << 10, 1 << 20]),
    st.sampled_from([None, 4]),
)


@settings(max_examples=300, deadline=None)
@given(
    st.sampled_from([2, 4, 8, rows.CHUNK]),
    st.lists(one_entry, max_size=30),
    st.lists(
        st.lists(st.tuples(st.integers(0, 40), st.one_of(st.none(), one_entry)), max_size=8),
        max_size=4,
    ),
)
def test_derived_snapshots_equal_ones_built_whole(
    chunk: int, start: list[RouteEntry], rounds: list[list[tuple[int, RouteEntry | None]]]
) -> None:
    # Small chunks: edits split and merge them, and land at their edges.
    with mock.patch.object(rows, "CHUNK", chunk):
        members = {e.instance_id: e for e in start}
        first = before = CapabilitySnapshot("cap", members.values())
        for edits in rounds:  # each derived from the last derived one
            changed: dict[str, RouteEntry | None] = {}
            for i, new in edits:
                instance_id = new.instance_id if new is not None else f"i{i:03d}"
                if new is None:
                    members.pop(instance_id, None)
                else:
                    members[instance_id] = new
                changed[instance_id] = members.get(instance_id)
            derived = before.changed(changed)
            assert picture(derived) == picture(CapabilitySnapshot("cap", members.values()))
            assert derived.ids == {instance_id for instance_id, _ in derived.members}
            assert derived.version != before.version
            assert derived.cache == {}
            for i in range(42):
                instance_id = f"i{i:03d}"
                assert derived.by_id.get(instance_id) == members.get(instance_id)
                assert (instance_id in derived.by_id) == (instance_id in members)
            before = derived
        assert picture(first) == picture(
            CapabilitySnapshot("cap", {e.instance_id: e for e in start}.values())
        )


def test_a_status_change_copies_the_chunk_it_falls_in_not_the_capability() -> None:
    # What a young pass of the cyclic collector walks: a derived snapshot's new containers.
    n = 10_000
    whole = CapabilitySnapshot("cap", [entry(i) for i in range(n)])
    degraded = whole.changed({"i5000": entry(5000, "degraded")})
    shared = 0
    for tier in ("_entries", "_routable", "_ok"):
        before, after = getattr(whole, tier), getattr(degraded, tier)
        assert len(after.chunks) <= 4 * n // rows.CHUNK + 1
        old = {id(c) for c in before.chunks}
        new = [c for c in after.chunks if id(c) not in old]
        assert sum(map(len, new)) <= 2 * rows.CHUNK
        shared += len(after.chunks) - len(new)
    assert shared >= 3 * (n // rows.CHUNK - 1)
    assert degraded._routable is degraded._entries
    assert len(degraded.ok) == n - 1
    assert [e.instance_id for e in degraded.degraded] == ["i5000"]
    assert degraded.by_id["i5000"].status == "degraded"
    assert whole.by_id["i5000"].status == "ok"
    # The sets routing takes away from its candidates (`Router.route`).
    assert {"i5000", "nobody"} & degraded.by_id.keys() == {"i5000"}
    assert len(degraded.by_id) == n
    assert list(degraded.by_id)[:2] == ["i000", "i001"]


def test_tiers_that_hold_every_instance_are_the_entries_tuple_itself() -> None:
    # One tuple, not three, for the cyclic collector to walk while a new snapshot is young.
    whole = CapabilitySnapshot("cap", [entry(i) for i in range(10)])
    assert whole.routable is whole.entries
    assert whole.ok is whole.entries
    degraded = whole.changed({"i003": entry(3, "degraded")})
    assert degraded.routable is degraded.entries
    assert degraded.ok is not degraded.entries
    assert len(degraded.ok) == 9
    healed = degraded.changed({"i003": entry(3), "i011": entry(11)})
    assert healed.routable is healed.entries
    assert healed.ok is healed.entries
    assert len(healed.entries) == 11
    gone = healed.changed({"i000": None, "i004": entry(4, "unhealthy")})
    assert gone.routable is not gone.entries
    assert gone.ok is gone.routable
    assert len(gone.entries) == 10
    assert len(gone.routable) == 9


def test_the_view_derives_a_status_change_and_routes_what_the_store_holds() -> None:
    async def run() -> None:
        registry = Registry(MemoryStore(), RegistrySettings(heartbeat_timeout=60))
        for i in range(200):
            await registry.join(
                JoinRequest(
                    capability="cap", instance_id=f"i{i:03d}", service_address=f"10.0.0.{i}:1"
                )
            )
        view = RegistryView(registry, resync_s=3600, sweep_s=None)
        await view.start()
        try:
            first = await view.snapshot("cap")
            assert first is not None
            assert len(first.ok) == 200
            await registry.heartbeat("i007", HealthReport(status="degraded"))
            await registry.heartbeat("i150", HealthReport(status="unhealthy"))
            await registry.leave("i042")
            snap = await view.snapshot("cap")
            assert snap is not None
            assert snap is not first
            assert [e.instance_id for e in snap.degraded] == ["i007"]
            assert "i150" not in {e.instance_id for e in snap.routable}
            assert "i042" not in snap.by_id
            assert len(snap.entries) == 199
            whole = CapabilitySnapshot("cap", snap.entries)
            assert picture(snap) == picture(whole)
        finally:
            await view.aclose()

    asyncio.run(run())


def test_a_resync_lets_the_loop_go_and_parses_only_what_changed(monkeypatch: Any) -> None:
    """A resync works in short slices (here: one record each) with the loop let go between
    them, so a heartbeat and a leave land in the middle of it; it ends at what the store
    holds, and parses again only the records whose join part or status changed."""
    import reach.registry.view as view_module

    async def run() -> None:
        registry = Registry(MemoryStore(), RegistrySettings(heartbeat_timeout=60))
        for i in range(300):
            await registry.join(
                JoinRequest(
                    capability="cap", instance_id=f"i{i:03d}", service_address=f"10.0.0.{i}:1"
                )
            )
        view = RegistryView(registry, resync_s=3600, sweep_s=None)
        await view.start()
        parsed: list[str] = []
        parse = registry.parse

        def counting(stored: Any) -> Any:
            record = parse(stored)
            parsed.append(record.instance_id if record else "?")
            return record

        monkeypatch.setattr(registry, "parse", counting)
        monkeypatch.setattr(view_module, "RESYNC_SLICE_S", 0.0)
        try:
            for i in range(300):  # only last_seen changes: nothing to parse
                await registry.heartbeat(f"i{i:03d}", HealthReport())
            steps = 0

            async def beside() -> None:
                nonlocal steps
                while not resynced.done():
                    steps += 1
                    if steps == 50:
                        await registry.heartbeat("i250", HealthReport(status="degraded"))
                        await registry.leave("i260")
                    await asyncio.sleep(0)

            resynced = asyncio.ensure_future(view.resync())
            await asyncio.gather(resynced, beside())
            assert steps > 100  # the loop went round between records
            snap = await view.snapshot("cap")
            assert snap is not None
            assert [e.instance_id for e in snap.degraded] == ["i250"]
            assert "i260" not in snap.by_id
            assert len(snap.entries) == 299
            assert set(parsed) <= {"i250"}  # the status change, re-read by event or resync
            await view.resync()  # (a record re-read on its event has no fingerprint yet)
            parsed.clear()
            await view.resync()
            assert parsed == []
        finally:
            await view.aclose()

    asyncio.run(run())


def test_the_memory_stores_expire_lets_the_loop_go_and_keeps_what_is_refreshed() -> None:
    from reach.store.memory import SCAN_PAGE

    async def run() -> None:
        clock = [0.0]
        store = MemoryStore(clock=lambda: clock[0])
        n = 10 * SCAN_PAGE
        for i in range(n):
            ttl = 5.0 if i % 2 else 20.0  # odd ones expire at 10
            await store.put_record(f"r{i}", "g", {"join": "{}"}, ttl_s=ttl, group_ttl_s=60)
        clock[0] = 10.0
        steps = 0

        async def beside() -> None:
            nonlocal steps
            while not expired.done():
                steps += 1
                await asyncio.sleep(0)

        expired = asyncio.ensure_future(store.expire())
        await asyncio.gather(expired, beside())
        assert steps > 1
        left = await store.get_records([f"r{i}" for i in range(n)])
        assert [r is not None for r in left] == [i % 2 == 0 for i in range(n)]

    asyncio.run(run())


def test_a_kept_entrys_health_part_is_what_json_makes_of_it() -> None:
    """A heartbeat writes its health part from a head made once (`kept`) or per beat: the
    same text either way, json.dumps of status, checks, inflight and last_seen."""
    import json

    from reach.registry import BeatEntry, kept

    async def run() -> None:
        store = MemoryStore()
        registry = Registry(store, RegistrySettings(heartbeat_timeout=60))
        await registry.join(JoinRequest(capability="cap", instance_id="i", service_address="a:1"))
        for report in (
            HealthReport(),
            HealthReport(status="degraded", checks={"disk": [1, {"é": None}]}, inflight=7),
        ):
            entry = BeatEntry("i", report)
            assert kept(entry) == entry  # the head is no part of what an entry says
            for made in (entry, kept(entry)):
                await registry.heartbeats([made])
                stored = (await store.get_records(["i"]))[0]
                assert stored is not None
                text = stored.fields["health"]
                values = json.loads(text)
                assert text == json.dumps(values)
                assert list(values) == ["status", "checks", "inflight", "last_seen"]
                assert values["status"] == report.status
                assert values["checks"] == report.checks
                assert values["inflight"] == report.inflight

    asyncio.run(run())
