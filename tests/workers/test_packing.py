"""Packed batches (workers/packing.py): a Python handler declaring ``token_cost:
"packed"`` gets each padded input's rows one after the other in one row, no padding,
and ``cu_seqlens``; its per-row outputs answer each request's rows and a per-token
output comes back cut to each request's length. The handler checks the layout it is
given (in warm-up too) and computes per row from the offsets alone, so a wrong offset
is a wrong answer. A real handler, loaded in this process."""

from __future__ import annotations

import textwrap
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from zeroserve.broker import protocol as p
from zeroserve.models.loader import LoadedModel, load
from zeroserve.models.repository import ConfigError, parse_config
from zeroserve.workers import batching
from zeroserve.workers.memory import rss_bytes

# a running sum of each row's token vectors that restarts at every row: right only
# where the offsets are; and each row's length
HANDLER = textwrap.dedent('''
    import torch

    class Model:
        def load(self, version_dir, device):
            torch.manual_seed(0)
            self.table = torch.randn(100, 3)

        def predict(self, inputs):
            ids, cu = inputs["ids"], inputs["cu_seqlens"]
            assert cu.dtype == torch.int64 and cu.dim() == 1 and int(cu[0]) == 0, cu
            assert ids.shape == (1, int(cu[-1])), (ids.shape, cu)
            assert inputs["scale"].shape == (len(cu) - 1, 1), inputs["scale"].shape
            lengths = (cu[1:] - cu[:-1]).tolist()
            rows = [h.cumsum(0) for h in self.table[ids[0]].split(lengths)]
            return {"tokens": torch.cat(rows).unsqueeze(0) * 1.0,
                    "length": torch.tensor(lengths).unsqueeze(1) * inputs["scale"]}
''')


# a handler that answers one token short
SHORT = textwrap.dedent('''
    import torch

    class Model:
        def load(self, version_dir, device):
            pass

        def predict(self, inputs):
            rows = len(inputs["cu_seqlens"]) - 1
            return {"tokens": torch.zeros(1, inputs["ids"].shape[1] - 1, 3),
                    "length": torch.zeros(rows, 1, dtype=torch.int64)}
''')


def packed_handler(tmp_path: Path, code: str = HANDLER) -> LoadedModel:
    vdir = tmp_path / "1"
    vdir.mkdir()
    (vdir / "model.py").write_text(code)
    cfg = parse_config({
        "name": "packed", "platform": "python", "max_batch_size": 16,
        "inputs": [{"name": "ids", "datatype": "INT64", "shape": [-1]},
                   {"name": "scale", "datatype": "INT64", "shape": [1]}],
        "outputs": [{"name": "tokens", "datatype": "FP32", "shape": [-1, 3]},
                    {"name": "length", "datatype": "INT64", "shape": [1]}],
        "dynamic_batching": {"token_cost": "packed", "padding": {
            "inputs": [{"name": "ids", "dim": 0}],
            "outputs": [{"name": "tokens", "dim": 0}]}},
        "warmup": {"batch_sizes": [1, 4]}}, "t")
    return load(cfg, 1, vdir, "cpu", rss_bytes)


def expected(ids: np.ndarray) -> np.ndarray:
    torch.manual_seed(0)
    table = torch.randn(100, 3)
    return table[torch.from_numpy(ids)].cumsum(1).numpy()


def test_rows_reach_the_handler_packed_and_come_back_per_request(tmp_path: Path) -> None:
    loaded = packed_handler(tmp_path)   # its warm-up ran packed batches: it loaded
    assert loaded.packed
    rng = np.random.default_rng(0)
    # requests of one row and of several, lengths 1 to 9
    shapes = [(1, 4), (2, 9), (1, 1), (3, 2), (1, 7)]
    reqs = [rng.integers(0, 100, shape, dtype=np.int64) for shape in shapes]
    items = [p.BatchItem(str(i), [p.from_numpy("ids", ids),
                                  p.from_numpy("scale", np.full((len(ids), 1), 2))], None)
             for i, ids in enumerate(reqs)]
    result = batching.run(loaded, p.Batch(1, "packed", 1, items, 0))
    assert result.error is None, result.error
    for ids, reply in zip(reqs, result.replies):
        out: dict[str, Any] = {t.meta.name: p.to_numpy(t) for t in reply.tensors}
        assert out["tokens"].shape == (*ids.shape, 3)
        np.testing.assert_allclose(out["tokens"], expected(ids), atol=1e-6)
        assert out["length"].tolist() == [[2 * ids.shape[1]]] * ids.shape[0]
    loaded.release()


def test_a_packed_output_of_the_wrong_length_fails_the_batch(tmp_path: Path) -> None:
    loaded = packed_handler(tmp_path, SHORT)
    ids = np.array([[1, 2, 3]], dtype=np.int64)
    result = batching.run(loaded, p.Batch(1, "packed", 1, [p.BatchItem("0", [
        p.from_numpy("ids", ids), p.from_numpy("scale", np.ones((1, 1), np.int64))], None)],
        0))
    assert result.error is not None and "output 'tokens' of a packed batch must be one " \
        "row of the batch's 3 tokens along dim 0, got shape [1, 2, 3]" in result.error
    loaded.release()


def test_only_a_handler_is_given_packed_rows(tmp_path: Path) -> None:
    """A compiled model reads no offsets: its config may not count its tokens packed,
    which would price a padded batch at its rows' own lengths."""
    raw = {"name": "m", "platform": "python", "max_batch_size": 4,
           "inputs": [{"name": "ids", "datatype": "INT64", "shape": [-1]}],
           "outputs": [{"name": "tokens", "datatype": "FP32", "shape": [-1, 3]}],
           "dynamic_batching": {"token_cost": "packed",
                                "padding": {"inputs": [{"name": "ids", "dim": 0}]}},
           "warmup": {"batch_sizes": []}}
    vdir = tmp_path / "1"
    vdir.mkdir()
    (vdir / "model.py").write_text(HANDLER)
    loaded = load(parse_config(raw, "t"), 1, vdir, "cpu", rss_bytes)
    assert loaded.packed
    loaded.release()
    with pytest.raises(ConfigError, match='"packed" needs platform "python"'):
        parse_config({**raw, "platform": "pytorch_torchscript"}, "t")
