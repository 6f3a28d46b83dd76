"""A capability snapshot derived from the last one (a few instances changed) equals one built
from every instance; the view derives it when few changed (pure logic, no store)."""

from __future__ import annotations

import asyncio
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from reach.config import RegistrySettings
from reach.registry import HealthReport, JoinRequest, Registry
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
    st.lists(one_entry, max_size=30),
    st.lists(st.tuples(st.integers(0, 40), st.one_of(st.none(), one_entry)), max_size=8),
)
def test_a_derived_snapshot_equals_one_built_whole(
    start: list[RouteEntry], edits: list[tuple[int, RouteEntry | None]]
) -> None:
    members = {e.instance_id: e for e in start}
    before = CapabilitySnapshot("cap", members.values())
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
    assert derived.version != before.version
    assert derived.cache == {}
    assert picture(before) == picture(
        CapabilitySnapshot("cap", {e.instance_id: e for e in start}.values())
    )


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
