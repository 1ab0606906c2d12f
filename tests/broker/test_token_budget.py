"""Batches by a token budget (broker/server/scheduler.py), on a fake clock: the budget
holds, lengths group, and order (aging, deadlines, priority) still comes first."""

import math
from dataclasses import dataclass

from hypothesis import given, settings, strategies as st

from tests.conftest import examples
from zeroserve.broker.server.scheduler import FULL, Entry, Policy, Scheduler
from zeroserve.broker.server.tokenfill import fill


def make(budget=64, mbs=32, packed=False, aging=1.0):
    s = Scheduler()
    s.set_policy("m", Policy(max_batch_size=mbs, max_batch_tokens=budget, packed=packed,
                             aging_s=aging))
    return s


def text(key, length, t=0.0, prio=1, deadline=math.inf, rows=1):
    # a padded model's scale is its row's length: units are tokens
    return Entry(key=key, model="m", priority=prio, arrival_s=t, deadline_s=deadline,
                 samples=rows, scale=float(length), length=length, shape=(("len",),))


def keys(d):
    return [e.key for e in d.entries]


def test_a_padded_batch_stays_under_its_budget_and_says_what_it_padded():
    s = make(budget=64)
    for i, n in enumerate([16, 16, 16, 16, 16]):
        s.add(text(i, n))
    d = s.take("m", 0.0)
    assert keys(d) == [0, 1, 2, 3] and d.reason == FULL   # 4 x 16 = 64
    assert (d.tokens, d.padded_tokens, d.padding_ratio) == (64, 64, 0.0)


def test_rows_of_a_similar_length_join_the_head_before_the_rest():
    s = make(budget=96)
    for i, n in enumerate([30, 8, 31, 9, 29, 10]):
        s.add(text(i, n))
    d = s.take("m", 0.0)
    assert keys(d) == [0, 2, 4]          # 3 x 31 = 93: the 8-10 token rows wait
    assert d.tokens == 90 and d.padded_tokens == 93
    assert keys(s.take("m", 0.0)) == [1, 3, 5]


def test_a_row_longer_than_the_budget_runs_alone():
    s = make(budget=64)
    s.add(text("long", 200))
    s.add(text("short", 8))
    assert keys(s.take("m", 0.0)) == ["long"]
    assert keys(s.take("m", 0.0)) == ["short"]


def test_packed_counts_the_sum_of_lengths():
    s = make(budget=64, packed=True)
    for i, n in enumerate([40, 8, 8, 8, 30]):
        s.add(text(i, n))
    d = s.take("m", 0.0)
    # padded, 40 with any other row would cost 80; packed, 40 + 8 + 8 + 8 = 64
    assert keys(d) == [0, 1, 2, 3]


def test_a_higher_priority_goes_before_a_closer_length():
    s = make(budget=64)
    s.add(text("head", 16, prio=1))
    s.add(text("low-same", 16, prio=2))
    s.add(text("high-other", 30, prio=1))
    d = s.take("m", 0.0)
    assert keys(d) == ["head", "high-other"]   # 2 x 30 = 60; the low one would be 90


def test_an_aged_row_goes_before_a_closer_length():
    s = make(budget=64, aging=0.5)
    s.add(text("head", 16, t=0.0, prio=1))
    s.add(text("fresh", 16, t=0.9, prio=1))
    s.add(text("old", 30, t=0.1, prio=2))     # waited past aging at t=1.0
    d = s.take("m", 1.0)
    assert keys(d) == ["head", "old"]


def test_the_deadline_of_a_row_bounds_what_joins_it():
    s = make(budget=1024)
    s.add(text("tight", 10, deadline=0.35))
    for i in range(10):
        s.add(text(i, 100))
    d = s.take("m", 0.0, predict=lambda units: 0.05 + 0.0005 * units)
    # 50 ms a batch and 0.5 ms a token: six rows at 100 tokens end at 350 ms, a seventh
    # would miss the head's deadline
    assert keys(d) == ["tight", 0, 1, 2, 3, 4]


def test_a_row_of_another_length_joins_only_where_padding_pays():
    s = make(budget=1024)
    for key, n in (("a", 50), ("b", 50), ("c", 60), ("d", 10)):
        s.add(text(key, n))
    # cost proportional to tokens, nothing a batch: padding never pays, equal lengths do
    d = s.take("m", 0.0, predict=lambda units: 0.001 * units)
    assert keys(d) == ["a", "b"] and d.padding_ratio == 0.0
    # a large cost a batch: padding 60 to 50 pays, padding 10 to 60 does not
    s = make(budget=1024)
    for key, n in (("a", 50), ("b", 50), ("c", 60), ("d", 10)):
        s.add(text(key, n))
    d = s.take("m", 0.0, predict=lambda units: 0.03 + 0.001 * units)
    assert keys(d) == ["a", "b", "c"]


@settings(max_examples=examples(300))
@given(st.lists(st.tuples(st.integers(1, 300), st.integers(1, 2), st.integers(1, 3)),
                min_size=1, max_size=60),
       st.integers(16, 2048), st.integers(1, 32), st.booleans())
def test_properties(texts, budget, mbs, packed):
    """Every entry taken exactly once; a batch of more than one row within the budget
    and the row cap; the head of the order is always in the batch it starts."""
    s = make(budget=budget, mbs=mbs, packed=packed, aging=10.0)
    for i, (length, prio, rows) in enumerate(texts):
        s.add(text(i, length, prio=prio, rows=min(rows, mbs)))
    taken: list[int] = []
    while True:
        d = s.take("m", 0.0)
        if d is None:
            break
        assert d.entries
        best = min((e.priority, e.seq) for e in d.entries)
        assert (d.entries[0].priority, d.entries[0].seq) == best
        rows = sum(e.samples for e in d.entries)
        longest = max(e.length for e in d.entries)
        tokens = sum(e.samples * e.length for e in d.entries)
        if len(d.entries) > 1:
            assert rows <= mbs
            assert (tokens if packed else rows * longest) <= budget
        assert d.tokens == tokens and d.padded_tokens == rows * longest
        taken += keys(d)
    assert sorted(taken) == list(range(len(texts)))
    assert s.census()["scheduler.by_key"] == 0


def test_the_fill_is_pure_on_plain_rows():
    """tokenfill.fill reads only a row's fields: frozen rows, no queue, no scheduler."""
    @dataclass(frozen=True)
    class Row:
        length: int
        seq: int
        deadline_s: float = math.inf
        samples: int = 1
        priority: int = 1
        arrival_s: float = 0.0

        @property
        def scale(self) -> float:
            return float(self.length)

        @property
        def units(self) -> float:
            return self.samples * self.scale

    pol = Policy(max_batch_size=8, max_batch_tokens=64)
    rest = [Row(n, i + 1) for i, n in enumerate([40, 16, 15, 17, 16])] + [Row(16, 9, 0.5)]
    got = fill(Row(16, 0), rest, pol, now=0.0, start=1.0, cap=8, predict=lambda u: 0.0)
    # nearest lengths first, 4 x 16 = the budget; the row due before the start never joins
    assert [(r.length, r.seq) for r in got] == [(16, 0), (16, 2), (16, 5), (15, 3)]
    assert fill(Row(16, 0), rest, pol, 0.0, 1.0, 2, lambda u: 0.0) == [Row(16, 0), Row(16, 2)]
