"""A registration's trial load finds what the body left out (workers/discovery.py):
input datatypes FP32 then INT64, outputs by name, datatype and shape, -1 where the
two trial runs differ. Real scripted models and handlers, loaded in this process."""

from __future__ import annotations

import functools
import textwrap
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from zeroserve.broker import protocol as p
from zeroserve.models.loader import LoadError, load
from zeroserve.models.repository import parse_config, undeclared_datatypes
from zeroserve.workers import batching, discovery
from zeroserve.workers.memory import rss_bytes


class Tokens(torch.nn.Module):
    """Token ids in, two outputs back: per token (grows with the input) and pooled."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(50, 6)

    def forward(self, ids: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor,
                                                                        torch.Tensor]:
        hidden = self.embed(ids) * mask.unsqueeze(-1).to(torch.float32)
        return hidden, hidden.sum(1)


class BoolOnly(torch.nn.Module):
    def forward(self, flags: torch.Tensor) -> torch.Tensor:
        assert flags.dtype == torch.bool, "flags must be a BOOL mask"
        return flags.logical_not()


class Pooled(torch.nn.Module):
    """Sums over the batch: no batch dimension in its output."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.sum(0)


def save(tmp_path: Path, module: torch.nn.Module) -> Path:
    torch.manual_seed(0)
    vdir = tmp_path / "1"
    vdir.mkdir()
    torch.jit.save(torch.jit.script(module.eval()), str(vdir / "model.pt"))
    return vdir


def trial(body: dict[str, Any], vdir: Path) -> Any:
    """What a worker does with a registration's trial LOAD."""
    cfg = parse_config(body, "registration", discover=True)
    return load(cfg, 1, vdir, "cpu", rss_bytes,
                settle=functools.partial(discovery.complete,
                                         guessed=undeclared_datatypes(body)))


def specs(tensors: Any) -> list[tuple[str, str, list[int]]]:
    return [(t.name, t.datatype, list(t.shape)) for t in tensors]


def test_token_ids_are_found_int64_and_outputs_named_as_triton_does(tmp_path: Path) -> None:
    body = {"name": "tok", "platform": "pytorch", "max_batch_size": 16,
            "input_shape": {"ids": [1, -1], "mask": [1, -1]}}
    loaded = trial(body, save(tmp_path, Tokens()))
    assert specs(loaded.config.inputs) == [("ids", "INT64", [-1]), ("mask", "INT64", [-1])]
    assert specs(loaded.config.outputs) == [("output__0", "FP32", [-1, 6]),
                                            ("output__1", "FP32", [6])]
    # the settled config serves: a batch of two requests of the same length
    ids = np.array([[1, 2, 3]], dtype=np.int64)
    items = [p.BatchItem(str(i), [p.from_numpy("ids", ids + i),
                                  p.from_numpy("mask", np.ones_like(ids))], None)
             for i in range(2)]
    result = batching.run(loaded, p.Batch(1, "tok", 1, items, 0))
    assert result.error is None, result.error
    assert [t.meta.shape for t in result.replies[1].tensors] == [(1, 3, 6), (1, 6)]


def test_fixed_dims_stay_fixed_and_declared_datatypes_are_kept(tmp_path: Path) -> None:
    body = {"name": "tok", "platform": "pytorch", "max_batch_size": 4,
            "input_shape": {"ids": {"shape": [1, 7], "datatype": "INT32"},
                            "mask": {"shape": [1, 7], "datatype": "INT64"}}}
    loaded = trial(body, save(tmp_path, Tokens()))
    assert specs(loaded.config.inputs) == [("ids", "INT32", [7]), ("mask", "INT64", [7])]
    assert specs(loaded.config.outputs) == [("output__0", "FP32", [7, 6]),
                                            ("output__1", "FP32", [6])]


def test_a_model_refusing_fp32_and_int64_is_refused_saying_how_to_declare(
        tmp_path: Path) -> None:
    body = {"name": "flags", "platform": "pytorch", "max_batch_size": 8,
            "input_shape": {"flags": [1, 3]}}
    with pytest.raises(LoadError) as err:
        trial(body, save(tmp_path, BoolOnly()))
    message = str(err.value)
    assert message.startswith("flags/1: the model runs neither on FP32 nor on INT64 inputs")
    assert "flags must be a BOOL mask" in message
    assert '"input_shape": {"flags": {"shape": [1, 3], "datatype": "INT64"}}' in message
    # declared, it loads
    body["input_shape"] = {"flags": {"shape": [1, 3], "datatype": "BOOL"}}
    loaded = trial(body, tmp_path / "1")
    assert specs(loaded.config.outputs) == [("output__0", "BOOL", [3])]


def test_an_output_without_the_batch_dimension_is_refused(tmp_path: Path) -> None:
    body = {"name": "pool", "platform": "pytorch", "max_batch_size": 8,
            "input_shape": {"x": [1, 4]}}
    with pytest.raises(LoadError, match=r"output 'output__0' has shape \[4\] for a batch "
                                        r"of 2: with max_batch_size > 0 every output keeps"):
        trial(body, save(tmp_path, Pooled()))
    body["max_batch_size"] = 0
    body["input_shape"] = {"x": [-1, 4]}
    loaded = trial(body, tmp_path / "1")
    assert specs(loaded.config.outputs) == [("output__0", "FP32", [4])]


HANDLER = textwrap.dedent('''
    import numpy as np

    class Model:
        def load(self, version_dir, device):
            pass

        def predict(self, inputs):
            x = inputs["x"].numpy()
            return {"score": x.sum(axis=1, keepdims=True).astype(np.float32),
                    "ids": np.argsort(x, axis=1).astype(np.int64),
                    "label": np.array([b"row"] * len(x), dtype=object)}
''')


def test_a_handler_names_its_outputs_and_numpy_gives_their_datatypes(tmp_path: Path) -> None:
    vdir = tmp_path / "1"
    vdir.mkdir()
    (vdir / "model.py").write_text(HANDLER)
    body = {"name": "np", "platform": "python", "max_batch_size": 8,
            "input_shape": {"x": [1, 5]}}
    loaded = trial(body, vdir)
    assert specs(loaded.config.inputs) == [("x", "FP32", [5])]
    assert specs(loaded.config.outputs) == [("score", "FP32", [1]), ("ids", "INT64", [5]),
                                            ("label", "BYTES", [])]
    loaded.release()


def test_declared_outputs_are_kept_and_only_the_datatypes_are_settled(tmp_path: Path) -> None:
    outputs = [{"name": "hidden", "datatype": "FP32", "shape": [-1, 6]},
               {"name": "pooled", "datatype": "FP32", "shape": [6]}]
    body = {"name": "tok", "platform": "pytorch", "max_batch_size": 4,
            "input_shape": {"ids": [1, -1], "mask": [1, -1]}, "outputs": outputs}
    loaded = trial(body, save(tmp_path, Tokens()))
    assert [t.datatype for t in loaded.config.inputs] == ["INT64", "INT64"]
    assert [t.to_json() for t in loaded.config.outputs] == outputs


@pytest.mark.parametrize("shape", [[1, 17], [1, 4, 4]])
def test_a_shape_error_names_the_shapes_and_never_suggests_a_datatype(
        tmp_path: Path, shape: list[int]) -> None:
    body = {"name": "lin", "platform": "pytorch", "max_batch_size": 8,
            "input_shape": {"x": shape}}
    with pytest.raises(LoadError) as err:
        trial(body, save(tmp_path, torch.nn.Linear(16, 4)))
    message = str(err.value)
    assert message.startswith(f"lin/1: the model refused inputs of the declared shapes "
                              f"(x: {shape}, the batch dimension first)"), message
    assert "INT64" not in message and "datatype" not in message, message
    # with outputs given (no datatype to find), the same advice
    body["outputs"] = [{"name": "output__0", "datatype": "FP32", "shape": [4]}]
    body["input_shape"] = {"x": {"shape": shape, "datatype": "FP32"}}
    with pytest.raises(LoadError, match=r"refused inputs of the declared shapes"):
        trial(body, tmp_path / "1")


def test_token_ids_of_the_wrong_shape_get_shape_advice_not_a_datatype(
        tmp_path: Path) -> None:
    """FP32 ids are refused for their datatype, INT64 ones for their shape: the shape."""
    body = {"name": "tok", "platform": "pytorch", "max_batch_size": 4,
            "input_shape": {"ids": [1, 3], "mask": [1, 5]}}
    with pytest.raises(LoadError) as err:
        trial(body, save(tmp_path, Tokens()))
    assert "declared shapes (ids: [1, 3], mask: [1, 5]" in str(err.value), str(err.value)
    assert "Declare each input's datatype" not in str(err.value)


def test_a_padded_registration_without_outputs_loads_and_publishes(tmp_path: Path) -> None:
    body = {"name": "tok", "platform": "pytorch", "max_batch_size": 4,
            "input_shape": {"ids": [1, -1], "mask": [1, -1]},
            "dynamic_batching": {"padding": {
                "inputs": [{"name": "ids", "dim": 0}, {"name": "mask", "dim": 0}],
                "outputs": [{"name": "output__0", "dim": 0}]}}}
    loaded = trial(body, save(tmp_path, Tokens()))
    assert specs(loaded.config.outputs) == [("output__0", "FP32", [-1, 6]),
                                            ("output__1", "FP32", [6])]
    # what the broker writes into the published config.json parses as a repository's
    published = parse_config(loaded.config.to_json(), "tok/config.json")
    assert published.dynamic_batching.padding == loaded.config.dynamic_batching.padding
    loaded.release()
