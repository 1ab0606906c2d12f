"""A Python handler may return numpy arrays for any datatype (workers/batching.py):
cast within numpy's same_kind rule to the declared datatype, else refused naming the
output, the datatype and what came back. A real handler, loaded in this process."""

from __future__ import annotations

import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch

from zeroserve.broker import protocol as p
from zeroserve.models.loader import load
from zeroserve.models.repository import parse_config
from zeroserve.workers import batching
from zeroserve.workers.memory import rss_bytes

# each case writes what its handler returns: ``rows`` is the batch's row count
HANDLER = textwrap.dedent('''
    import numpy as np

    class Model:
        def load(self, version_dir, device):
            pass

        def predict(self, inputs):
            rows = len(inputs["x"])
            return {{"y": {expr}}}
''')


def run(tmp_path: Path, datatype: str, expr: str) -> p.BatchResult:
    vdir = tmp_path / "1"
    vdir.mkdir()
    (vdir / "model.py").write_text(HANDLER.format(expr=expr))
    cfg = parse_config({"name": "np", "platform": "python", "max_batch_size": 4,
                        "inputs": [{"name": "x", "datatype": "FP32", "shape": [2]}],
                        "outputs": [{"name": "y", "datatype": datatype, "shape": [2]}]}, "t")
    loaded = load(cfg, 1, vdir, "cpu", rss_bytes)
    x = np.zeros((2, 2), dtype=np.float32)
    try:
        return batching.run(loaded, p.Batch(1, "np", 1, [
            p.BatchItem("0", [p.from_numpy("x", x)], None)], 0))
    finally:
        loaded.release()


@pytest.mark.parametrize("datatype, given, want", [
    ("FP32", np.float32, np.float32), ("FP32", np.float64, np.float32),
    ("FP32", np.int64, np.float32), ("INT64", np.int64, np.int64),
    ("INT32", np.int64, np.int32), ("INT64", np.uint8, np.int64),
    ("FP16", np.float32, np.float16), ("BOOL", np.bool_, np.bool_),
    ("UINT8", np.uint8, np.uint8),
])
def test_numpy_outputs_are_cast_within_their_kind(tmp_path, datatype, given, want) -> None:
    result = run(tmp_path, datatype, f"np.full((rows, 2), 3, dtype=np.{given.__name__})")
    assert result.error is None, result.error
    (out,) = result.replies[0].tensors
    assert out.meta.datatype == datatype and out.meta.shape == (2, 2)
    np.testing.assert_array_equal(p.to_numpy(out), np.full((2, 2), 3, dtype=want))


def test_bf16_takes_numpy_floats(tmp_path) -> None:
    result = run(tmp_path, "BF16", "np.full((rows, 2), 1.5, dtype=np.float32)")
    assert result.error is None, result.error
    (out,) = result.replies[0].tensors
    raw = torch.frombuffer(bytearray(out.data), dtype=torch.bfloat16)
    assert out.meta.datatype == "BF16" and raw.tolist() == [1.5] * 4


@pytest.mark.parametrize("datatype, expr, got", [
    ("INT64", "np.zeros((rows, 2), dtype=np.float32)", "ndarray of dtype float32"),
    ("UINT8", "np.zeros((rows, 2), dtype=np.int64)", "ndarray of dtype int64"),
    ("FP32", "np.array([['a', 'b']] * rows)", "ndarray of dtype <U1"),
    ("FP32", "[[0.0, 1.0]] * rows", "list"),
])
def test_a_wrong_type_names_the_output_the_datatype_and_what_came(tmp_path, datatype, expr,
                                                                   got) -> None:
    result = run(tmp_path, datatype, expr)
    assert result.error is not None
    assert result.error.startswith(f"BatchError: output 'y': expected {datatype} ")
    assert result.error.endswith(f"got {got}")
