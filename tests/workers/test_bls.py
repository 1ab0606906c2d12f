"""The call context a handler's calls inherit (workers/bls.py), pure: no broker."""

from __future__ import annotations

import math
import time

import numpy as np
import pytest

from zeroserve.broker import protocol as p
from zeroserve.workers import bls


def _batch(callers: list[p.Caller] | None, timeout_ms: float = 0.0,
           traced: tuple[int, ...] = ()) -> p.Batch:
    t = p.from_numpy("input", np.zeros((1, 4), np.float32))
    n = len(callers) if callers else 2
    trace = p.BatchTrace("boot", 0, [(i, {"traceparent": f"00-{i:032x}-{i:016x}-01"}, 0)
                                     for i in traced]) if traced else None
    return p.Batch(3, "h", 1, [p.BatchItem(str(i), [t]) for i in range(n)], timeout_ms,
                   trace, callers)


def test_the_batch_context_is_the_earliest_deadline_and_highest_priority() -> None:
    callers = [p.Caller(2, 500.0, "k-first"), p.Caller(1, 100.0, "k-second"),
               p.Caller(0, 0.0, "")]
    ctx = bls.context_of(_batch(callers, 100.0, traced=[1]), 10.0, lambda b: None)
    assert ctx.batch.deadline_s == pytest.approx(10.1)
    assert ctx.batch.priority == 1                  # 1 is the highest level; 0 is none
    assert ctx.batch.api_key == "k-first"           # the request taken first speaks
    assert ctx.batch.trace == {"traceparent": f"00-{1:032x}-{1:016x}-01"}
    assert ctx.origin(0).deadline_s == pytest.approx(10.5) and ctx.origin(0).trace is None
    assert ctx.origin(2).deadline_s == math.inf and ctx.origin(2).priority == 0
    with pytest.raises(IndexError):
        ctx.origin(3)


def test_a_batch_without_callers_still_inherits_its_deadline() -> None:
    ctx = bls.context_of(_batch(None, 40.0), 5.0, lambda b: None)
    assert ctx.batch.deadline_s == pytest.approx(5.04) and ctx.batch.api_key == ""


def test_waiting_is_told_once_per_batch() -> None:
    told: list[int] = []
    ctx = bls.context_of(_batch(None), 0.0, told.append)
    ctx.waiting()
    ctx.waiting()
    assert told == [3]


def test_a_call_past_the_callers_deadline_fails_unsent() -> None:
    client = bls.ModelsClient("ipc:///nonexistent/frontend")
    told: list[int] = []
    ctx = bls.context_of(_batch([p.Caller(1, 1.0, "k")] * 2, 1.0), time.monotonic() - 1.0,
                         told.append)
    with bls.calling(ctx):
        with pytest.raises(bls.ModelCallError) as info:
            client.infer("m", {"input": np.zeros((1, 4), np.float32)})
        assert client.remaining_ms() < 0
    assert info.value.code is p.ErrorCode.DEADLINE and info.value.model == "m"
    assert "'m'" in str(info.value)
    assert told == [] and client.census() == {}    # nothing sent, no socket made
    assert bls.ModelsClient.caller().deadline_s == math.inf   # outside predict()
