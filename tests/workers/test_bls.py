"""The call context a handler's calls inherit (workers/bls.py), pure: no broker."""

from __future__ import annotations

import math
import time
from pathlib import Path

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


CALLER = '''
class Model:
    def load(self, version_dir, device, models):
        self.models = models

    def predict(self, inputs):
        return {"y": self.models.infer("m", {"x": inputs["x"]})["y"]}
'''


def test_a_handler_that_calls_models_is_refused_by_a_worker_of_an_older_broker(
        tmp_path: Path) -> None:
    """Its batches would tell the broker WAITING, which a broker older than protocol
    version 3 drops as malformed (the nested-call deadlock would return): the worker
    refuses such a handler at load, naming why; from a current broker it loads."""
    from zeroserve.workers.worker import Worker

    vdir = tmp_path / "caller" / "1"
    vdir.mkdir(parents=True)
    (vdir / "model.py").write_text(CALLER)
    config = {"name": "caller", "platform": "python", "max_batch_size": 4,
              "inputs": [{"name": "x", "datatype": "FP32", "shape": [4]}],
              "outputs": [{"name": "y", "datatype": "FP32", "shape": [4]}]}
    header = {"model": "caller", "version": 1, "path": str(vdir), "config": config}
    worker = Worker("ipc:///nonexistent", "test/0", device="cpu",
                    frontend=f"ipc://{tmp_path}/frontend")
    try:
        _, old, _ = p.unpack(p.encode(p.LoadModel(**header)))
        del old["versions"]   # what an older broker's LOAD holds
        refused = worker.loader.load_version(p.decode(p.LoadModel, old))
        assert not refused.ok
        assert "load() asks for a models client" in refused.error
        assert "protocol version 3 or later" in refused.error
        assert "speaks protocol versions 1" in refused.error
        loaded = worker.loader.load_version(p.LoadModel(**header, versions=[1, 2, 3]))
        assert loaded.ok, loaded.error
    finally:
        if worker.models_client is not None:
            worker.models_client.close()
        worker.ctx.destroy(linger=0)
