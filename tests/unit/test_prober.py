"""Registration by URL and the liveness probe's decisions, over a memory registry and a fake
connector (pure logic: what is joined, heartbeaten, left alone, when)."""

from __future__ import annotations

import asyncio
import time
from typing import ClassVar

import pytest

import connectors
from connectors.base import Connector
from gateway_api.live import Live
from gateway_api.prober import MAX_PROBES_IN_FLIGHT, MAX_PROBES_PER_OWNER, Prober, owner_of
from gateway_api.services import remote
from gateway_api.services.agents import Agents
from reach import acceptance
from reach.config import ReachSettings, UrlAgentSettings
from reach.errors import Forbidden, InvalidRequest, ReachError, TransportError, Unavailable
from reach.invocation import Endpoint
from reach.limits import Limits
from reach.messages import Message, Reply
from reach.registry import JoinRequest, Registry
from reach.registry.by_url import (
    REGISTRATIONS_KEY,
    UrlRegistration,
    changed,
    instance_id_for,
    merged_operations,
    probe_due,
)
from reach.registry.models import Discovery, OperationDeclaration
from reach.security.tokens import Principal
from reach.store import MemoryStore
from reach.telemetry.metrics import ReachMetrics
from tests.helpers import wait_until

PROTOCOL = "fakeurl"


class FakeUrlConnector(Connector):
    """Answers discovery from `ANSWERS` (address -> a Discovery or the error to raise)."""

    protocol = PROTOCOL
    registered_by_url = True
    ANSWERS: ClassVar[dict[str, Discovery | ReachError]] = {}
    asked: ClassVar[list[tuple[str, Discovery | None]]] = []
    HELD: ClassVar[dict[str, asyncio.Event]] = {}  # address -> what its answer waits for

    @classmethod
    def check_address(cls, address: str) -> str:
        if not address.startswith("fake://"):
            raise InvalidRequest(f"{address!r} is not a fake:// URL")
        return address.rstrip("/")

    async def discover(self, address: str, known: Discovery | None = None) -> Discovery:
        self.asked.append((address, known))
        if address in self.HELD:
            await self.HELD[address].wait()
        answer = self.ANSWERS.get(address, TransportError(f"nobody at {address}"))
        if isinstance(answer, ReachError):
            raise answer
        if known is not None and known.version == answer.version:
            return known  # what a conditional request (an ETag) answers
        return answer

    async def invoke(self, endpoint: Endpoint, message: Message, timeout_s: float) -> Reply:
        raise NotImplementedError


def served(version: str, *names: str, card: str = "fake agent") -> Discovery:
    return Discovery(
        operations=[OperationDeclaration(name=n, description=f"does {n}") for n in names],
        version=version,
        etag=f'"{version}"',
        details={"card_name": card},
    )


@pytest.fixture(autouse=True)
def _fake_connector(monkeypatch: pytest.MonkeyPatch) -> None:
    where = f"{PROTOCOL}={FakeUrlConnector.__module__}:FakeUrlConnector"
    monkeypatch.setenv(connectors.EXTRA_ENV_VAR, where)
    assert connectors.load(PROTOCOL) is FakeUrlConnector
    FakeUrlConnector.ANSWERS = {}
    FakeUrlConnector.asked = []
    FakeUrlConnector.HELD = {}


def gateway_parts(**registry: float) -> tuple[Agents, Registry, ReachMetrics]:
    settings = ReachSettings(
        registry={"heartbeat_interval": 0.2, "heartbeat_timeout": 2.0, **registry}
    )
    reg = Registry(MemoryStore(), settings.registry)
    metrics = ReachMetrics()
    return Agents(Live(settings), reg, metrics=metrics), reg, metrics


def body(url: str = "fake://one", **kw: object) -> UrlRegistration:
    return UrlRegistration.model_validate(
        {"protocol": PROTOCOL, "service_address": url, "capability": "planner", **kw}
    )


def later(seconds: float) -> float:
    return time.time() + seconds


# -- pure decisions -----------------------------------------------------------------------


def test_instance_id_is_stable_per_url_and_protocol() -> None:
    a = instance_id_for("a2a", "https://agents.example.com/travel")
    assert a == instance_id_for("a2a", "https://agents.example.com/travel")
    assert a.startswith("a2a-agents.example.com-")
    assert a != instance_id_for("a2a", "https://agents.example.com/other")
    assert a != instance_id_for("mcp", "https://agents.example.com/travel")
    JoinRequest(
        capability="c",
        instance_id=instance_id_for("mcp", "http://[::1]:80/x"),
        service_address="127.0.0.1:1",
    )


def test_overrides_apply_per_name_and_add_nothing() -> None:
    found = served("v1", "book", "search").operations
    merged = merged_operations(
        found, ["search", OperationDeclaration(name="book", idempotent=True), {"name": "gone"}]
    )  # type: ignore[list-item]
    assert [op.name for op in merged] == ["book", "search"]
    assert merged[0].idempotent is True
    assert merged[0].description == "does book"
    assert merged[1] == found[1]


def test_due_changed() -> None:
    assert probe_due(None, 0, 1)
    assert changed_record_version("v1", served("v2", "a")) is True
    assert changed_record_version("v1", served("v1", "a")) is False


def changed_record_version(version: str, discovery: Discovery) -> bool:
    agents, _, _ = gateway_parts()
    del agents
    from reach.registry import InstanceRecord

    record = InstanceRecord(
        instance_id="i",
        capability="c",
        protocol=PROTOCOL,
        address="fake://x",
        operations=["a"],
        max_message_bytes=1,
        async_callback=False,
        heartbeat_interval=1,
        joined_at=0,
        last_seen=0,
        discovery_version=version,
    )
    return changed(record, discovery)


def test_the_body_is_a_registration_only_for_a_protocol_registered_by_url() -> None:
    limits = Limits(max_message_bytes=1 << 20)
    raw = b'{"protocol": "fakeurl", "service_address": "fake://x", "capability": "c"}'
    parsed = acceptance.join_or_registration(raw, limits, lambda p: p == PROTOCOL)
    assert isinstance(parsed, UrlRegistration)
    assert parsed.instance_id is None
    with pytest.raises(InvalidRequest, match="instance_id") as refused:
        acceptance.join_or_registration(raw, limits, lambda p: False)
    # A Join without its id says why one is needed: `reach agents add grpc URL` said no more
    # than "instance_id: Field required".
    assert "a fakeurl instance joins by itself, naming its instance_id" in str(refused.value)
    assert "registered by URL" in str(refused.value)
    with pytest.raises(InvalidRequest, match="heartbeat_interval"):
        acceptance.join_or_registration(
            raw[:-1] + b', "heartbeat_interval": 1}', limits, lambda p: True
        )


# -- registration ---------------------------------------------------------------------------


async def test_registration_discovers_and_joins_with_overrides() -> None:
    agents, registry, _ = gateway_parts()
    FakeUrlConnector.ANSWERS["fake://one"] = served("v1", "book", "search")
    ack = await agents.remote.register(
        body(operations=[{"name": "book", "idempotent": True}]), None
    )
    assert ack.instance_id == instance_id_for(PROTOCOL, "fake://one")
    assert [(o.name, o.idempotent) for o in ack.operations] == [("book", True), ("search", None)]
    assert ack.details == {"card_name": "fake agent"}
    record = await registry.get(ack.instance_id)
    assert record is not None
    assert record.registered_by_url
    assert record.details == {"card_name": "fake agent"}
    assert record.operations == ["book", "search"]
    assert record.declared["book"].idempotent is True
    assert record.declared["search"].description == "does search"
    assert (record.discovery_version, record.discovery_etag) == ("v1", '"v1"')
    assert ack.instance_id in await agents.remote.registrations()
    # A joined instance's record is stored as before: none of the by-URL fields.
    await agents.join(
        JoinRequest(capability="planner", instance_id="plain-1", service_address="127.0.0.1:1")
    )
    stored = (await registry.store.get_records(["plain-1"]))[0]
    assert stored is not None
    assert "registered_by_url" not in stored.fields["join"]


async def test_a_grpc_style_join_of_a_url_protocol_is_a_registration() -> None:
    agents, registry, _ = gateway_parts()
    FakeUrlConnector.ANSWERS["fake://one"] = served("v1", "book")
    join = JoinRequest(
        capability="planner", instance_id="mine-1", protocol=PROTOCOL, service_address="fake://one"
    )
    await agents.join(join)
    record = await registry.get("mine-1")
    assert record is not None
    assert record.registered_by_url
    assert record.operations == ["book"]


@pytest.mark.parametrize(
    ("answer", "error"),
    [
        (TransportError("connection refused"), TransportError),
        (Unavailable("no answer"), Unavailable),
        (InvalidRequest("card: skills[0].id is missing"), InvalidRequest),
    ],
)
async def test_a_failed_registration_keeps_nothing(
    answer: ReachError, error: type[ReachError]
) -> None:
    agents, registry, _ = gateway_parts()
    FakeUrlConnector.ANSWERS["fake://one"] = answer
    with pytest.raises(error):
        await agents.remote.register(body(), None)
    assert await agents.remote.registrations() == {}
    assert await registry.capabilities() == []


async def test_refusals_name_the_problem() -> None:
    agents, _, _ = gateway_parts()
    with pytest.raises(InvalidRequest, match="not a fake:// URL"):
        await agents.remote.register(body("http://x"), None)
    with pytest.raises(InvalidRequest, match="join themselves"):
        await agents.remote.register(body(protocol="http", service_address="127.0.0.1:1"), None)
    big = served("v1", "a")
    big.details = {"blob": "x" * 9000}
    FakeUrlConnector.ANSWERS["fake://big"] = big
    with pytest.raises(InvalidRequest, match=r"details are .* bytes"):
        await agents.remote.register(body("fake://big"), None)


async def test_who_may_register_and_remove() -> None:
    agents, _, _ = gateway_parts()
    FakeUrlConnector.ANSWERS["fake://one"] = served("v1", "a")
    alice = Principal("alice", "agent", "t1", frozenset({"planner"}))
    bob = Principal("bob", "agent", "t2", frozenset({"planner"}))
    other = Principal("carol", "agent", "t3", frozenset({"search"}))
    with pytest.raises(Forbidden):
        await agents.remote.register(body(), other)
    ack = await agents.remote.register(body(), alice)
    with pytest.raises(Forbidden):
        await agents.remote.register(body(), bob)
    with pytest.raises(Forbidden):
        await agents.leave(ack.instance_id, bob)
    assert await agents.leave(ack.instance_id, alice)
    assert await agents.remote.registrations() == {}


# -- the probe --------------------------------------------------------------------------------


async def test_a_probe_heartbeats_skips_the_fresh_and_asks_conditionally() -> None:
    agents, registry, metrics = gateway_parts()
    FakeUrlConnector.ANSWERS["fake://one"] = served("v1", "a")
    ack = await agents.remote.register(body(), None)
    prober = Prober(agents.remote, agents.live.settings)
    assert await prober.round() == {ack.instance_id: "skipped"}  # just joined: fresh
    prober.clock = lambda: later(0.15)
    assert await prober.round() == {ack.instance_id: "ok"}
    record = await registry.get(ack.instance_id)
    assert record is not None
    assert record.checks == {"probe": "ok"}
    known = FakeUrlConnector.asked[-1][1]
    assert known is not None
    assert (known.version, known.etag) == ("v1", '"v1"')
    assert b'reach_probes_total{capability="planner",outcome="ok",protocol="fakeurl"} 1.0' in (
        metrics.exposition()
    )


async def test_a_changed_version_rejoins_keeping_the_join_time() -> None:
    agents, registry, _ = gateway_parts()
    FakeUrlConnector.ANSWERS["fake://one"] = served("v1", "a")
    ack = await agents.remote.register(body(operations=[{"name": "b", "timeout_ms": 50}]), None)
    before = await registry.get(ack.instance_id)
    assert before is not None
    assert "b" not in before.operations
    FakeUrlConnector.ANSWERS["fake://one"] = served("v2", "a", "b", card="renamed")
    prober = Prober(agents.remote, agents.live.settings, clock=lambda: later(1))
    assert await prober.round() == {ack.instance_id: "changed"}
    after = await registry.get(ack.instance_id)
    assert after is not None
    assert after.operations == ["a", "b"]
    assert after.declared["b"].timeout_ms == 50
    assert after.details == {"card_name": "renamed"}
    assert after.discovery_version == "v2"
    assert after.joined_at == before.joined_at


async def test_failures_write_nothing_and_it_comes_back() -> None:
    agents, registry, metrics = gateway_parts()
    FakeUrlConnector.ANSWERS["fake://one"] = served("v1", "a")
    ack = await agents.remote.register(body(), None)
    seen = await registry.get(ack.instance_id)
    assert seen is not None
    FakeUrlConnector.ANSWERS["fake://one"] = TransportError("connection refused")
    prober = Prober(agents.remote, agents.live.settings, clock=lambda: later(1))
    for _ in range(3):
        assert await prober.round() == {ack.instance_id: "transport_error"}
    assert prober.failing == {ack.instance_id: "connection refused"}
    still = await registry.get(ack.instance_id)
    assert still is not None
    assert still.last_seen == seen.last_seen
    await registry.leave(ack.instance_id)  # what its record's expiry does
    FakeUrlConnector.ANSWERS["fake://one"] = served("v1", "a")
    assert await prober.round() == {ack.instance_id: "joined"}
    assert prober.failing == {}
    back = await registry.get(ack.instance_id)
    assert back is not None
    assert back.routable
    assert back.registered_by_url
    text = metrics.exposition()
    assert b'outcome="transport_error",protocol="fakeurl"} 3.0' in text
    assert b'outcome="joined",protocol="fakeurl"} 1.0' in text


async def test_a_removed_or_taken_instance_is_left_alone() -> None:
    agents, registry, _ = gateway_parts()
    FakeUrlConnector.ANSWERS["fake://one"] = served("v1", "a")
    FakeUrlConnector.ANSWERS["fake://two"] = served("v1", "a")
    one = await agents.remote.register(body(), None)
    two = await agents.remote.register(body("fake://two"), None)
    assert await agents.leave(one.instance_id)
    await agents.join(
        JoinRequest(
            capability="planner", instance_id=two.instance_id, service_address="127.0.0.1:1"
        )
    )
    prober = Prober(agents.remote, agents.live.settings, clock=lambda: later(1))
    assert await prober.round() == {two.instance_id: "taken"}
    assert await registry.get(one.instance_id) is None
    taken = await registry.get(two.instance_id)
    assert taken is not None
    assert not taken.registered_by_url


async def test_configured_agents_are_kept_until_they_answer() -> None:
    agents, registry, _ = gateway_parts()
    FakeUrlConnector.ANSWERS["fake://up"] = served("v1", "a")
    configured = [
        UrlAgentSettings(protocol=PROTOCOL, url="fake://up", capability="planner"),
        UrlAgentSettings(
            protocol=PROTOCOL,
            url="fake://later",
            capability="planner",
            instance_id="later-1",
            operations=[{"name": "a", "idempotent": True}],  # type: ignore[list-item]
        ),
    ]
    assert await agents.remote.register_configured(configured) == 1
    kept = await registry.store.hash_all(REGISTRATIONS_KEY)
    assert set(kept) == {instance_id_for(PROTOCOL, "fake://up"), "later-1"}
    assert await registry.get("later-1") is None
    FakeUrlConnector.ANSWERS["fake://later"] = served("v1", "a")
    prober = Prober(agents.remote, agents.live.settings, clock=lambda: later(1))
    assert (await prober.round())["later-1"] == "joined"
    record = await registry.get("later-1")
    assert record is not None
    assert record.declared["a"].idempotent is True


async def test_two_gateways_probe_an_instance_once_per_interval_between_them() -> None:
    agents, registry, _ = gateway_parts()
    FakeUrlConnector.ANSWERS["fake://one"] = served("v1", "a")
    ack = await agents.remote.register(body(), None)
    other = Agents(agents.live, registry)  # a second gateway over the same store
    first = Prober(agents.remote, agents.live.settings, clock=lambda: later(0.2))
    assert await first.round() == {ack.instance_id: "ok"}
    probed = await registry.get(ack.instance_id)
    assert probed is not None
    # The second gateway's round comes a quarter interval after that probe's heartbeat, on
    # its own clock (real time could be past the half interval on a busy box).
    seen = probed.last_seen
    second = Prober(other.remote, agents.live.settings, clock=lambda: seen + 0.05)
    assert await second.round() == {ack.instance_id: "skipped"}
    later_one = Prober(other.remote, agents.live.settings, clock=lambda: seen + 0.11)
    assert await later_one.round() == {ack.instance_id: "ok"}  # past half an interval: due
    assert len(FakeUrlConnector.asked) == 3  # the registration's discovery, two probes


def test_records_with_and_without_the_by_url_fields_read_everywhere() -> None:
    from reach.registry import InstanceRecord

    older = {
        "instance_id": "i",
        "capability": "c",
        "protocol": "http",
        "address": "127.0.0.1:1",
        "max_message_bytes": 1,
        "async_callback": False,
        "heartbeat_interval": 1,
        "joined_at": 0,
        "last_seen": 0,
    }
    record = InstanceRecord.model_validate(older)
    assert not record.registered_by_url
    assert record.details == {}
    newer = InstanceRecord.model_validate({**older, "registered_by_url": True, "later": 1})
    assert newer.registered_by_url
    assert "details" not in record.model_dump(mode="json")  # a joined record stays as it was


async def test_a_probe_that_hangs_does_not_hold_the_others() -> None:
    agents, _, _ = gateway_parts()
    FakeUrlConnector.ANSWERS["fake://slow"] = served("v1", "a")
    FakeUrlConnector.ANSWERS["fake://quick"] = served("v1", "a")
    slow = await agents.remote.register(body("fake://slow"), None)
    quick = await agents.remote.register(body("fake://quick"), None)
    FakeUrlConnector.HELD["fake://slow"] = held = asyncio.Event()
    prober = Prober(agents.remote, agents.live.settings, clock=lambda: later(1))
    first = asyncio.create_task(prober.round())
    await asyncio.sleep(0)  # the first round's probes are under way
    while slow.instance_id not in prober.inflight:  # noqa: ASYNC110
        await asyncio.sleep(0.01)
    assert await prober.round() == {slow.instance_id: "in_flight", quick.instance_id: "ok"}
    held.set()
    assert (await first)[slow.instance_id] == "ok"
    await prober.aclose()


async def test_one_owner_s_hanging_instances_hold_a_share_of_the_slots() -> None:
    agents, _, _ = gateway_parts()
    held = asyncio.Event()
    flood = [f"fake://flood-{i:03d}" for i in range(3 * MAX_PROBES_IN_FLIGHT)]
    for url in [*flood, "fake://zz-other"]:
        FakeUrlConnector.ANSWERS[url] = served("v1", "a")
    for url in flood:  # sorted before the other, so the first to wait for a slot
        await agents.remote.register(body(url, capability="flood"), None)
    other = await agents.remote.register(body("fake://zz-other", capability="other"), None)
    for url in flood:
        FakeUrlConnector.HELD[url] = held
    FakeUrlConnector.asked = []
    prober = Prober(agents.remote, agents.live.settings, clock=lambda: later(1))
    first = asyncio.create_task(prober.round())
    # The other capability's instance is probed while the flood's hang...
    async with asyncio.timeout(5):
        while "fake://zz-other" not in [address for address, _ in FakeUrlConnector.asked]:  # noqa: ASYNC110
            await asyncio.sleep(0.01)
    # ...which hold no more than their share of the slots.
    assert len(FakeUrlConnector.asked) == MAX_PROBES_PER_OWNER + 1
    registered = await agents.remote.registrations()
    assert owner_of(registered[other.instance_id]) == "capability:other"
    principal = registered[other.instance_id].model_copy(update={"principal": "kr"})
    assert owner_of(principal) == "principal:kr"  # an agent token's, whatever the capability
    held.set()
    outcomes = await first
    assert set(outcomes.values()) == {"ok"}
    await prober.aclose()


async def test_one_principal_registers_a_bounded_number_of_instances(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(remote, "MAX_REGISTRATIONS_PER_PRINCIPAL", 2)
    agents, _, _ = gateway_parts()
    alice = Principal("alice", "agent", "t1", frozenset({"planner"}))
    bob = Principal("bob", "agent", "t2", frozenset({"planner"}))
    for url in ("fake://a1", "fake://a2", "fake://a3", "fake://b1"):
        FakeUrlConnector.ANSWERS[url] = served("v1", "a")
    first = await agents.remote.register(body("fake://a1"), alice)
    await agents.remote.register(body("fake://a2"), alice)
    with pytest.raises(Unavailable, match="principal 'alice' has registered 2 instances"):
        await agents.remote.register(body("fake://a3"), alice)
    await agents.remote.register(body("fake://a1"), alice)  # its own again: not a new one
    await agents.remote.register(body("fake://b1"), bob)  # another principal's are its own
    await agents.remote.register(body("fake://a3"), None)  # an admin's are not counted
    assert await agents.leave(first.instance_id, alice)
    await agents.remote.register(body("fake://a3", instance_id="alice-3"), alice)


async def test_an_instance_saying_it_changed_is_probed_at_once_and_at_most_every_second() -> None:
    agents, registry, _ = gateway_parts(heartbeat_interval=30.0, heartbeat_timeout=120.0)
    FakeUrlConnector.ANSWERS["fake://one"] = served("v1", "a")
    ack = await agents.remote.register(body(), None)
    prober = Prober(agents.remote, agents.live.settings)
    prober.start()  # its first round is 30 s away
    connector = agents.remote.connector(PROTOCOL)
    try:
        FakeUrlConnector.ANSWERS["fake://one"] = served("v2", "a", "b")
        asked = len(FakeUrlConnector.asked)

        async def rejoined() -> bool:
            record = await registry.get(ack.instance_id)
            return record is not None and record.operations == ["a", "b"]

        await asyncio.sleep(0)  # the loop starts: it watches the connectors first
        connector.changed("fake://one")  # before any round read the registrations
        await wait_until(rejoined, 5)
        assert len(FakeUrlConnector.asked) == asked + 1
        first = time.monotonic()
        # Said again and again: one more probe, a second after the last, not one each time.
        for _ in range(5):
            connector.changed("fake://one")
        connector.changed("fake://nobody")  # not registered: nothing
        await wait_until(lambda: len(FakeUrlConnector.asked) >= asked + 2, 10)
        assert time.monotonic() - first >= 0.5
        assert len(FakeUrlConnector.asked) == asked + 2
    finally:
        await prober.aclose()
