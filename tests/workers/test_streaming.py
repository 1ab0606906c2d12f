"""The worker's side of decoupled models (workers/streaming.py), in-process with real
torch: each yield becomes one PARTIAL as it is made, the handler contract is checked
with a message, and the generator is closed once no request of its batch is left."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Iterator

import numpy as np
import pytest
import torch

from zeroserve.broker import protocol as p
from zeroserve.models.loader import LoadedModel
from zeroserve.models.repository import parse_config
from zeroserve.workers.streaming import run_stream
from tests.conftest import linear_config


def loaded(predict: Callable[..., Any]) -> LoadedModel:
    cfg = parse_config({**linear_config("s", mbs=8), "platform": "python",
                        "model_transaction_policy": {"decoupled": True}}, "test")
    return LoadedModel("s", 1, cfg, "0" * 64, predict, "cpu", handler=object(),
                       version_dir=Path("/nonexistent"))


def batch(*rows: int) -> p.Batch:
    items = [p.BatchItem(str(i), [p.from_numpy("input", np.full((n, 4), i, np.float32))])
             for i, n in enumerate(rows)]
    return p.Batch(1, "s", 1, items)


def out(rows: int, value: float = 1.0) -> dict[str, torch.Tensor]:
    return {"output": torch.full((rows, 3), value)}


def run(predict: Callable[..., Any], b: p.Batch,
        stopped: Callable[[], set[str]] = set) -> tuple[p.BatchResult, list[list[Any]]]:
    sent: list[list[Any]] = []
    result = run_stream(loaded(predict), b, lambda m: sent.append(
        [(x.item, x.final, [tuple(t.meta.shape) for t in x.tensors]) for x in m.parts]),
        stopped)
    return result, sent


def test_each_yield_is_sent_with_each_request_rows_and_final_flags() -> None:
    seen: list[Any] = []

    def predict(inputs: dict[str, torch.Tensor], rows: list[slice]) -> Iterator[Any]:
        seen.append([inputs["input"][r][:, 0].tolist() for r in rows])
        yield {0: (out(2), False), 1: (out(1), False)}
        yield {1: (out(1), True)}
        yield {0: (out(2), False)}
    result, sent = run(predict, batch(2, 1))
    assert seen == [[[0.0, 0.0], [1.0]]]
    assert result.error is None
    assert sent == [[("0", False, [(2, 3)]), ("1", False, [(1, 3)])], [("1", True, [(1, 3)])],
                    [("0", False, [(2, 3)])]]   # request 0's final: the broker's, at RESULT


@pytest.mark.parametrize("step, says", [
    ({5: (out(1), True)}, "names request 5; the batch has 1"),
    ([out(1)], "yielded list"),
    ({0: out(1)}, "each response is (outputs, final)"),
    ({0: (None, False)}, "an empty response must be final"),
    ({0: (out(2), True)}, "has 2 rows for a request of 1"),
    ({0: ({"other": torch.ones(1, 3)}, True)}, "no output 'output'"),
])
def test_a_yield_that_breaks_the_contract_fails_the_batch(step: Any, says: str) -> None:
    def predict(inputs: Any, rows: Any) -> Iterator[Any]:
        yield step
    result, sent = run(predict, batch(1))
    assert result.error is not None and says in result.error and sent == []


def test_a_request_named_after_its_final_response_fails_what_is_left() -> None:
    def predict(inputs: Any, rows: Any) -> Iterator[Any]:
        yield {0: (out(1), True), 1: (out(1), False)}
        yield {0: (out(1), False)}
    result, sent = run(predict, batch(1, 1))
    assert sent == [[("0", True, [(1, 3)]), ("1", False, [(1, 3)])]]
    assert result.error is not None and "request 0 was named after its final" in result.error


def test_predict_must_be_a_generator() -> None:
    result, _ = run(lambda inputs, rows: out(1), batch(1))
    assert result.error is not None and "must be a generator" in result.error


def test_a_raising_generator_keeps_what_it_sent() -> None:
    def predict(inputs: Any, rows: Any) -> Iterator[Any]:
        yield {0: (out(1), False)}
        raise RuntimeError("boom")
    result, sent = run(predict, batch(1))
    assert len(sent) == 1 and result.error == "RuntimeError: boom"


def test_the_generator_is_closed_once_every_request_is_stopped_or_ended() -> None:
    stops: set[str] = set()
    closed: list[int] = []

    def predict(inputs: Any, rows: Any) -> Iterator[Any]:
        step = 0
        try:
            while True:
                step += 1
                if step == 3:
                    stops.add("1")    # the broker stops request 1 (its client left)
                yield {0: (out(1), step == 2), 1: (out(1), False)} if step <= 2 \
                    else {1: (out(1), False)}
        finally:
            closed.append(step)
    result, sent = run(predict, batch(1, 1), lambda: set(stops))
    assert result.error is None and closed == [3]
    assert [[x[0] for x in m] for m in sent] == [["0", "1"], ["0", "1"]]
