from __future__ import annotations

import random
from collections import Counter

import pytest
from hypothesis import given
from hypothesis import strategies as st

from reach.routing.algorithms import HashRing, SmoothWeighted, key_hash


def test_smooth_weighted_spreads_5_1_1_like_nginx() -> None:
    wrr = SmoothWeighted({"a": 5, "b": 1, "c": 1})
    assert [wrr.pick() for _ in range(7)] == ["a", "a", "b", "a", "c", "a", "a"]


@given(st.dictionaries(st.sampled_from("abcdefgh"), st.integers(1, 20), min_size=1))
def test_smooth_weighted_gives_each_its_weight_per_cycle(weights: dict[str, int]) -> None:
    wrr = SmoothWeighted(weights)
    cycle = sum(weights.values())
    for _ in range(2):
        assert Counter(wrr.pick() for _ in range(cycle)) == Counter(weights)


def test_the_hash_is_stable_across_processes_and_versions() -> None:
    # Pinned: every gateway must place a key on the same instance (xxh3-64 of its UTF-8).
    assert key_hash("user-42") == 0x50FE4B21CF7B09CD


def test_removing_one_of_ten_instances_remaps_about_a_tenth_of_keys() -> None:
    ten = {f"i{n}": 1 for n in range(10)}
    nine = {k: v for k, v in ten.items() if k != "i3"}
    before, after = HashRing(ten), HashRing(nine)
    keys = [f"user-{n}" for n in range(20_000)]
    moved = sum(before.lookup(k) != after.lookup(k) for k in keys)
    owned_by_i3 = sum(before.lookup(k) == "i3" for k in keys)
    assert moved == owned_by_i3  # only i3's keys move
    assert 0.06 < moved / len(keys) < 0.14


def test_virtual_nodes_scale_with_weight() -> None:
    ring = HashRing({"small": 1, "big": 3}, vnodes=100)
    assert len(ring) == 100 + 300
    share = Counter(ring.lookup(f"k{n}") for n in range(20_000))
    assert 0.65 < share["big"] / 20_000 < 0.85


def test_bounded_load_keeps_a_hot_key_from_sinking_one_instance() -> None:
    ring = HashRing({f"i{n}": 1 for n in range(5)})
    rng = random.Random(7)
    # A skewed workload: half of all requests carry one hot key.
    keys = ["hot" if rng.random() < 0.5 else f"user-{rng.randrange(1000)}" for _ in range(2000)]
    plain: Counter[str] = Counter(ring.lookup(k) for k in keys)
    bounded: Counter[str] = Counter()
    for k in keys:
        bounded[ring.lookup_bounded(k, bounded, balance_factor=1.25)] += 1
    mean = len(keys) / 5
    assert max(plain.values()) / mean > 2.0
    assert max(bounded.values()) / mean <= 1.25 + 5 / len(keys)
    # Unloaded, bounded lookup is plain lookup: keys keep their home.
    assert all(ring.lookup_bounded(k, {}) == ring.lookup(k) for k in keys[:200])


def test_bad_ring_arguments_are_refused() -> None:
    with pytest.raises(ValueError, match="non-empty"):
        HashRing({})
    with pytest.raises(ValueError, match="positive"):
        HashRing({"a": 0})
    with pytest.raises(ValueError, match="at least 1"):
        HashRing({"a": 1}).lookup_bounded("k", {}, balance_factor=0.5)
