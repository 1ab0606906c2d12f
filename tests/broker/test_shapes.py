"""Shape keys (models/shapes.py) and the scheduler's single-shape batches, with a fake
clock: requests of another shape wait for the next batch, are never starved past the
aging bound nor failed for another's shape; padded models share batches across lengths
and are priced at their longest row."""

from __future__ import annotations

import math
from typing import Any

import pytest
from hypothesis import given, strategies as st

from zeroserve.broker.server.scheduler import QUEUED, Entry, Policy, Scheduler
from zeroserve.models.repository import ConfigError, parse_config
from zeroserve.models.shapes import ShapeError, rule


def bert_config(padding: dict[str, Any] | None = None, mbs: int = 16) -> dict[str, Any]:
    cfg: dict[str, Any] = {
        "name": "bert", "platform": "pytorch_torchscript", "max_batch_size": mbs,
        "inputs": [{"name": "input_ids", "datatype": "INT64", "shape": [-1]},
                   {"name": "attention_mask", "datatype": "INT64", "shape": [-1]}],
        "outputs": [{"name": "last_hidden_state", "datatype": "FP32", "shape": [-1, 8]},
                    {"name": "pooler_output", "datatype": "FP32", "shape": [8]}]}
    if padding is not None:
        cfg["dynamic_batching"] = {"padding": padding}
    return cfg


PAD = {"inputs": [{"name": "input_ids", "dim": 0, "value": 0},
                  {"name": "attention_mask", "dim": 0}],
       "outputs": [{"name": "last_hidden_state", "dim": 0}]}


def shapes(length: int, rows: int = 1) -> dict[str, list[int]]:
    return {"input_ids": [rows, length], "attention_mask": [rows, length]}


# -- the rule ----------------------------------------------------------------------------

def test_a_model_of_fixed_shapes_has_one_key_at_no_cost() -> None:
    cfg = parse_config({**bert_config(), "inputs": [
        {"name": "x", "datatype": "FP32", "shape": [4]}]}, "t")
    r = rule(cfg)
    assert r.fixed and r.classify({"x": [3, 4]}) == (None, 1.0)


def test_free_dims_key_by_length_and_scale_with_it() -> None:
    r = rule(parse_config(bert_config(), "t"))
    k5, s5 = r.classify(shapes(5))
    k12, s12 = r.classify(shapes(12, rows=3))
    assert k5 != k12 and k5 == r.classify(shapes(5, rows=4))[0]
    assert (s5, s12) == (5.0, 12.0)   # rows x elements, against one row of length 1


def test_padding_takes_the_length_out_of_the_key() -> None:
    r = rule(parse_config(bert_config(PAD), "t"))
    assert r.classify(shapes(5))[0] == r.classify(shapes(31))[0]
    assert r.classify(shapes(31))[1] == 31.0


def test_buckets_key_by_bucket_and_price_at_it() -> None:
    r = rule(parse_config(bert_config({**PAD, "buckets": [16, 32, 64]}), "t"))
    (k5, s5), (k16, _), (k17, s17) = (r.classify(shapes(n)) for n in (5, 16, 17))
    assert k5 == k16 != k17 and (s5, s17) == (16.0, 32.0)
    # past the largest bucket a request keys (and pads) to its own length
    assert r.classify(shapes(100))[0] != r.classify(shapes(101))[0]
    assert r.padded_length(100) == 100 and r.warmup_length() == 16


def test_padded_inputs_must_agree_in_length() -> None:
    r = rule(parse_config(bert_config(PAD), "t"))
    with pytest.raises(ShapeError, match="must agree in length: 3 against 4"):
        r.classify({"input_ids": [1, 3], "attention_mask": [1, 4]})


@pytest.mark.parametrize("padding, message", [
    ({"inputs": [{"name": "token_ids", "dim": 0}]}, "input 'token_ids' is not declared"),
    ({"inputs": [{"name": "input_ids", "dim": 1}]}, "has 1 dimension"),
    ({"inputs": [{"name": "input_ids", "dim": 0}],
      "outputs": [{"name": "pooler_output", "dim": 0}]}, "fixed at 8"),
    ({"inputs": [{"name": "input_ids", "dim": 0}],
      "outputs": [{"name": "logits", "dim": 0}]}, "output 'logits' is not declared"),
    ({"inputs": [{"name": "input_ids", "dim": 0}], "buckets": [32, 16]}, "must ascend"),
    ({"inputs": [{"name": "input_ids", "dim": 0, "value": "pad"}]}, "must be a number"),
    ({"inputs": []}, "non-empty list"),
    ({"inputs": [{"name": "input_ids", "dim": 0}], "bucket": [8]}, "must be"),
])
def test_a_padding_that_names_what_does_not_exist_is_refused(
        padding: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=message) as err:
        parse_config(bert_config(padding), "models/bert/config.json")
    assert "models/bert/config.json" in str(err.value)
    assert "dynamic_batching.padding" in str(err.value)


def test_padding_needs_a_batching_model() -> None:
    with pytest.raises(ConfigError, match="needs max_batch_size > 0"):
        parse_config(bert_config(PAD, mbs=0), "t")


def test_padding_round_trips_through_the_served_config() -> None:
    cfg = parse_config(bert_config({**PAD, "buckets": [16, 32]}), "t")
    again = parse_config(cfg.to_json(), "t")
    assert again.dynamic_batching.padding == cfg.dynamic_batching.padding
    assert "padding" not in parse_config(bert_config(), "t").to_json()["dynamic_batching"]


# -- the scheduler -----------------------------------------------------------------------

def entry(key: int, length: int, t: float = 0.0, prio: int = 1,
          deadline: float = math.inf, rows: int = 1, padding: Any = None) -> Entry:
    r = rule(parse_config(bert_config(padding), "t"))
    shape, scale = r.classify(shapes(length, rows))
    return Entry(key=key, model="m", priority=prio, arrival_s=t, deadline_s=deadline,
                 samples=rows, shape=shape, scale=scale)


def test_a_batch_takes_one_shape_and_the_others_wait_their_turn() -> None:
    s = Scheduler()
    s.set_policy("m", Policy(max_batch_size=8))
    for i, n in enumerate((5, 12, 5, 31, 12, 5)):
        s.add(entry(i, n))
    batches = []
    while (d := s.take("m", 0.0)) is not None:
        batches.append([e.key for e in d.entries])
    assert batches == [[0, 2, 5], [1, 4], [3]]


def test_a_padded_batch_is_priced_at_its_longest_row() -> None:
    s = Scheduler()
    s.set_policy("m", Policy(max_batch_size=8))
    s.add(entry(0, 4, deadline=1.0, padding=PAD))
    s.add(entry(1, 100, deadline=1.0, padding=PAD))
    priced: list[float] = []

    def predict(units: float) -> float:
        priced.append(units)
        return units * 0.001

    d = s.take("m", 0.0, predict)
    assert d is not None and [e.key for e in d.entries] == [0, 1]
    assert priced[-1] == 200.0   # two rows at 100, not 104


ops = st.lists(st.one_of(
    st.tuples(st.just("add"), st.integers(1, 2), st.floats(0.001, 0.08),
              st.sampled_from([5, 12, 31, 64]), st.integers(1, 3)),
    st.tuples(st.just("advance"), st.floats(0.0, 0.02)),
    st.tuples(st.just("take"), st.integers(1, 3)),
), max_size=100)


@given(ops, st.integers(1, 8), st.sampled_from([None, PAD, {**PAD, "buckets": [16, 32]}]),
       st.floats(0.0, 0.0005))
def test_any_mix_forms_single_shape_batches_in_order(
        ops: list[tuple[Any, ...]], mbs: int, padding: Any, per_unit: float) -> None:
    """Each batch holds one shape key (padded models: one padded key); its first entry is
    what the dispatch order puts first, the oldest aged request when one has aged (so no
    shape is starved); a same-shape entry is never passed over for a later one; none runs
    after its deadline; every request is answered exactly once."""
    aging = 0.01
    s = Scheduler()
    s.set_policy("m", Policy(max_batch_size=mbs, aging_s=aging))
    now, n = 0.0, 0
    live: dict[int, Entry] = {}
    answered: dict[int, str] = {}

    def predict(units: float) -> float:
        return per_unit * units

    def answer(key: Any, how: str) -> None:
        assert key not in answered, f"request {key} answered twice"
        answered[key] = how
        live.pop(key, None)

    for op in ops:
        if op[0] == "add":
            _, prio, timeout, length, rows = op
            e = entry(n, length, now, prio, now + timeout, min(rows, mbs), padding)
            live[n] = e
            n += 1
            for shed in s.add(e):
                answer(shed.key, "shed")
        elif op[0] == "advance":
            now += op[1]
        else:
            for _ in range(op[1]):
                queued = sorted((e for e in live.values() if e.state == QUEUED),
                                key=lambda e: e.seq)
                d = s.take("m", now, predict)
                if d is None:
                    break
                for e in d.doomed:
                    assert now + predict(e.units) > e.deadline_s, "doomed a request that fit"
                    answer(e.key, "doomed")
                if not d.entries:
                    continue
                assert len({e.shape for e in d.entries}) == 1, "a batch mixed shapes"
                head = d.entries[0]
                fits = [e for e in queued if e.deadline_s > now and e not in d.doomed]
                aged = [e for e in fits if e.arrival_s + aging <= now]
                if aged:
                    assert head is aged[0], "an aged request was passed over"
                else:
                    assert head.priority == min(e.priority for e in fits)
                taken = {id(e) for e in d.entries}
                for e in d.entries:
                    assert now < e.deadline_s, "ran after its deadline"
                last = max(e.seq for e in d.entries)
                skipped = [e for e in fits if e.shape == head.shape and id(e) not in taken
                           and e.priority == head.priority and e.seq < last
                           and e.deadline_s <= head.deadline_s and not aged]
                assert not skipped or sum(x.samples for x in d.entries) + min(
                    x.samples for x in skipped) > mbs or any(
                    now + predict((sum(x.samples for x in d.entries) + x.samples) * max(
                        x.scale, *(y.scale for y in d.entries))) > min(
                        x.deadline_s, *(y.deadline_s for y in d.entries)) for x in skipped), \
                    "a same-shape request was passed over for a later one"
                for e in d.entries:
                    answer(e.key, "ran")
        for e in s.expire(now):
            assert e.deadline_s <= now
            answer(e.key, "expired")
    now += 1.0
    for e in s.expire(now):
        answer(e.key, "expired")
    for e in s.drop_model("m"):
        answer(e.key, "dropped")
    assert set(answered) == set(range(n)), "some request was never answered"
    assert all(v == 0 for v in s.census().values())


def test_a_retried_entry_keeps_its_shape_and_scale() -> None:
    e = entry(1, 31, padding={**PAD, "buckets": [16, 32]})
    again = e.again()
    assert (again.shape, again.scale, again.units) == (e.shape, e.scale, 32.0)
