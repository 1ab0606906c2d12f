"""A batch's predicted time capped while tenants mix (``dynamic_batching.mixed_batch_ms``,
issue 48): a batch is never preempted, so a short-text tenant arriving while a long
batch runs waits for all of it; cut to the cap, it waits for one short batch. The pure
scheduler on a fake clock, a worker simulated by the latency model's own prediction."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import assume, given, settings, strategies as st

from tests.conftest import examples, linear_config
from zeroserve.broker.server.catalog import Catalog
from zeroserve.models.repository import ConfigError, RepoModel, parse_config
from zeroserve.broker.server.scheduler import Entry, Policy, Scheduler
from zeroserve.broker.server.tokenfill import fill

SHORT, LONG = 16, 512
SHORT_ROWS, MAX_BATCH = 8, 32   # a short request's texts; the policy's max_batch_size


def predict(units: float) -> float:
    """A BERT-like batch on a CPU: a little fixed cost, then linear in tokens."""
    return 0.0005 + 2e-5 * units


def entry(key: object, tenant: str, length: int, t: float = 0.0, rows: int = 1) -> Entry:
    return Entry(key=key, model="m", priority=1, arrival_s=t, samples=rows, tenant=tenant,
                 scale=float(length), shape="bert", length=length, by_time=True)


def policy(cap_s: float, tokens: int = 0) -> Policy:
    return Policy(max_batch_size=MAX_BATCH, max_queue_size=100_000, aging_s=1e9,
                  max_batch_tokens=tokens, mixed_batch_s=cap_s)


def test_mixed_the_batch_stops_where_its_predicted_time_would_pass_the_cap() -> None:
    s = Scheduler()
    s.set_policy("m", policy(predict(4 * LONG)))
    for i in range(32):
        s.add(entry(i, "long", LONG))
    d = s.take("m", 0.0, predict, mixed=True)
    assert d is not None and len(d.entries) == 4
    d = s.take("m", 0.0, predict)          # one tenant of late: a full batch again
    assert d is not None and len(d.entries) == 28


def test_one_request_goes_even_when_it_alone_passes_the_cap() -> None:
    s = Scheduler()
    s.set_policy("m", policy(predict(LONG) / 10))
    for i in range(3):
        s.add(entry(i, "long", LONG, rows=2))
    d = s.take("m", 0.0, predict, mixed=True)
    assert d is not None and [e.key for e in d.entries] == [0]


def test_no_cap_configured_leaves_mixed_batches_whole() -> None:
    s = Scheduler()
    s.set_policy("m", policy(0.0))
    for i in range(32):
        s.add(entry(i, "long", LONG))
    d = s.take("m", 0.0, predict, mixed=True)
    assert d is not None and len(d.entries) == 32


def test_a_token_budget_batch_is_cut_the_same_way() -> None:
    s = Scheduler()
    s.set_policy("m", policy(predict(2 * LONG), tokens=8 * LONG))
    for i in range(16):
        s.add(entry(i, "long", LONG))
    d = s.take("m", 0.0, predict, mixed=True)
    assert d is not None and len(d.entries) == 2
    d = s.take("m", 0.0, predict)
    assert d is not None and len(d.entries) == 8


def test_fill_keeps_the_head_and_skips_rows_past_the_limit() -> None:
    head = entry(0, "a", LONG, rows=2)
    rest = [entry(1, "a", LONG, rows=2), entry(2, "a", LONG)]
    pol = policy(0.0, tokens=8 * LONG)
    got = fill(head, rest, pol, 0.0, 0.0, 32, predict, limit=predict(3 * LONG))
    assert [e.key for e in got] == [0, 2]
    assert fill(head, rest, pol, 0.0, 0.0, 32, predict, limit=0.0) == [head]
    assert len(fill(head, rest, pol, 0.0, 0.0, 32, predict)) == 3


def short_waits(cap_s: float, period_s: float, offset_s: float, tokens: int
                ) -> tuple[float, float, int]:
    """The long-text tenant backlogged (a batch's worth queued behind the worker at all
    times), the short-text tenant sending 8 texts every ``period_s`` from ``offset_s``;
    one worker that runs each batch its predicted time. Returns the longest a short
    text waited in the queue, the longest batch run, and the most long batches taken
    while one short text waited."""
    s = Scheduler()
    s.set_policy("m", policy(cap_s, tokens))
    now, n, queued = 0.0, 0, {"long": 0, "short": 0}
    next_short = offset_s
    waits, longest, overtaken = [0.0], 0.0, 0
    longs, seen = 0, {}   # long batches taken; at each short text's arrival
    while now < 2.0:
        while queued["long"] < 32:
            n += 1
            s.add(entry(("long", n), "long", LONG, now))
            queued["long"] += 1
        while next_short <= now:   # arrived while the batch before ran
            n += 1
            s.add(entry(("short", n), "short", SHORT, next_short, rows=SHORT_ROWS))
            seen[("short", n)] = longs
            queued["short"] += 1
            next_short += period_s
        # both tenants send within the gate's window all along: the model is mixed
        d = s.take("m", now, predict, mixed=True)
        assert d is not None and d.entries
        units = sum(e.samples for e in d.entries) * max(e.scale for e in d.entries)
        took = predict(units)
        longest = max(longest, took)
        waits += [now - e.arrival_s for e in d.entries if e.tenant == "short"]
        longs += d.entries[0].tenant == "long"
        overtaken = max([overtaken] + [longs - seen.pop(e.key) for e in d.entries
                                       if e.tenant == "short"])
        for e in d.entries:
            queued[e.tenant] -= 1
        now += took
        s.used("m", d.entries, took)
    return max(waits), longest, overtaken


@settings(max_examples=examples(100), deadline=None)
@given(rows_cap=st.integers(1, 32), period_s=st.floats(0.01, 0.2),
       offset_s=st.floats(0.0, 0.2), tokens=st.sampled_from([0, 4 * LONG, 32 * LONG]))
def test_a_short_text_waits_for_one_capped_batch_at_most(
        rows_cap: int, period_s: float, offset_s: float, tokens: int) -> None:
    """Whatever the cap, the pace and the token budget: every batch is predicted within
    the cap (or is one request), and a short text waits for the batch running when it
    came, one more long batch at most, and its own tenant's texts before it. (One
    more: start-time fair queuing is fair within a request's work, and the short
    tenant's batch, charged at once, can take its virtual time past the long one's,
    which runs one row ahead of the clock.) The short texts that come while one capped
    batch runs fit one batch: where they need more, the short tenant takes turns with
    the long one by its share, and a text may wait for a long batch a turn (found at
    ``rows_cap=8, period_s=0.01``: two)."""
    cap_s = predict(rows_cap * LONG)
    assume(cap_s / period_s * SHORT_ROWS <= MAX_BATCH)
    _, longest, overtaken = short_waits(cap_s, period_s, offset_s, tokens)
    assert longest <= cap_s + 1e-12
    assert overtaken <= 1


def test_without_the_cap_a_short_text_waits_for_a_whole_long_batch() -> None:
    """The baseline the cap is measured against (so the test above can fail): with the
    long texts batched 32 at a time, a short text waits for most of such a batch."""
    worst, longest, _ = short_waits(0.0, 0.05, 0.013, 0)
    assert longest == predict(32 * LONG)
    capped, one, _ = short_waits(predict(LONG), 0.05, 0.013, 0)
    assert one == predict(LONG)
    assert worst > 0.5 * longest and capped < worst / 8, (worst, capped)


def test_the_cap_is_read_from_the_config_in_milliseconds() -> None:
    raw = linear_config("m", mbs=8)
    raw["dynamic_batching"] = {"mixed_batch_ms": 20}
    cfg = parse_config(raw, "t")
    model, _ = Catalog(Path("/nonexistent")).commit(RepoModel(cfg, Path("/nonexistent/m"),
                                                              (1,)), {}, {1})
    assert model.policy().mixed_batch_s == pytest.approx(0.02)
    assert parse_config(linear_config("m"), "t").dynamic_batching.mixed_batch_ms == 0.0
    raw["dynamic_batching"] = {"mixed_batch_ms": -1}
    with pytest.raises(ConfigError, match="mixed_batch_ms"):
        parse_config(raw, "t")
