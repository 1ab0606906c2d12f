"""The sticky traffic split: a routing key's version, over many keys and as weights grow."""

from __future__ import annotations

from pathlib import Path

from hypothesis import given, settings, strategies as st

from tests.conftest import examples
from zeroserve.broker.server.catalog import CatalogModel
from zeroserve.broker.server.split import pick, point
from zeroserve.models.repository import parse_config

KEYS = [f"user-{i}" for i in range(10_000)]


def model(traffic: dict[str, int], ready: set[int]) -> CatalogModel:
    cfg = parse_config({"name": "m", "platform": "pytorch_torchscript", "traffic": traffic,
                        "inputs": [{"name": "x", "datatype": "FP32", "shape": [4]}],
                        "outputs": [{"name": "y", "datatype": "FP32", "shape": [2]}]}, "t")
    return CatalogModel(cfg, Path("/nonexistent"), tuple(sorted(ready)), ready=set(ready))


def test_ten_thousand_keys_split_within_two_points_of_the_weights() -> None:
    for weights in ({"1": 90, "2": 10}, {"1": 50, "2": 50}, {"1": 70, "2": 25, "3": 5}):
        m = model(weights, {int(v) for v in weights})
        seen = [m.route(k) for k in KEYS]
        for v, w in weights.items():
            share = 100.0 * seen.count(int(v)) / len(KEYS)
            assert abs(share - w) <= 2.0, (weights, v, share)


def test_one_key_one_version_while_the_weights_hold() -> None:
    m = model({"1": 80, "2": 20}, {1, 2})
    first = {k: m.route(k) for k in KEYS[:500]}
    for _ in range(3):
        assert {k: m.route(k) for k in KEYS[:500]} == first


def test_a_key_lands_alike_in_every_process() -> None:
    # blake2b, not hash(): the same key meets the same version on every broker
    assert point("m", "alice") == point("m", "alice")
    assert 0.0 <= point("m", "alice") < 100.0
    assert point("m", "alice") != point("other", "alice")


@settings(max_examples=examples(200))
@given(st.lists(st.integers(1, 99), min_size=2, max_size=6, unique=True),
       st.lists(st.text(min_size=1, max_size=12), min_size=1, max_size=50))
def test_a_growing_canary_keeps_its_keys(shares: list[int], keys: list[str]) -> None:
    """As the canary's weight grows (the stable's shrinks), every key already on the
    canary stays there."""
    steps = sorted(shares) + [100]
    on_canary: set[str] = set()
    for share in steps:
        weights = {2: share, 1: 100 - share} if share < 100 else {2: 100}
        now = {k for k in keys if pick(weights, point("m", k)) == 2}
        assert on_canary <= now
        on_canary = now
    assert on_canary == set(keys)


@settings(max_examples=examples(200))
@given(st.dictionaries(st.integers(1, 9), st.integers(1, 100), min_size=1, max_size=5),
       st.floats(0.0, 100.0, exclude_max=True))
def test_pick_names_a_weighted_version(weights: dict[int, int], at: float) -> None:
    assert pick(weights, at) in weights


def test_versions_not_ready_or_rolled_back_get_nothing() -> None:
    m = model({"1": 50, "2": 50}, {1})
    assert {m.route(k) for k in KEYS[:200]} == {1}
    m = model({"1": 50, "2": 50}, {1, 2})
    m.failed[2] = ("rolled back", "")
    assert {m.route(k) for k in KEYS[:200]} == {1}
    assert m.default_version == 1


def test_a_rollouts_weights_replace_the_configs() -> None:
    m = model({}, {1, 2})
    assert not m.routed and m.default_version == 2
    m.weights = {2: 10, 1: 90}
    assert m.routed and m.default_version == 1
    share = sum(m.route(k) == 2 for k in KEYS) / len(KEYS)
    assert abs(share - 0.10) <= 0.02
