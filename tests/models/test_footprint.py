"""The footprint predicted from a version's files: the tensor storages a TorchScript or
torch.export archive holds, summed from the zip's directory without torch, equal the
loaded module's parameter and buffer bytes; the activation line fitted to warm-up peaks."""

from __future__ import annotations

import json
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from tests.conftest import linear_config, write_model
from zeroserve.models.footprint import ACTIVATION_FACTOR, GUESS_LENGTH, RUNTIME_GUESS_BYTES, \
    ActivationTerm, \
    Learned, archive_tensor_bytes, facts, files_of, first_guess, fit_activation, predict, \
    runtime_charge, size_text
from zeroserve.models import archives
from zeroserve.models.formats import TORCHSCRIPT_GRAPH_FACTOR
from zeroserve.models.repository import parse_config

FACTORIES = {
    "linear": "nn.Linear(4, 3)",
    "mlp": "nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10))",
    "bn": "nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.ReLU())",  # buffers too
    "half": "nn.Linear(32, 16).half()",
    "nobias": "nn.Sequential(nn.Linear(16, 16, bias=False), nn.Embedding(100, 16))",
}


def module_bytes(path: Path) -> int:
    import torch

    m = torch.jit.load(str(path))
    return sum(t.numel() * t.element_size() for t in [*m.parameters(), *m.buffers()])


@pytest.mark.parametrize("name", sorted(FACTORIES))
def test_archive_tensor_bytes_are_the_loaded_parameters_and_buffers(tmp_path: Path,
                                                                    name: str) -> None:
    vdir = write_model(tmp_path, name, 1, FACTORIES[name])
    assert archive_tensor_bytes(vdir / "model.pt") == module_bytes(vdir / "model.pt") > 0


@pytest.mark.slow   # torch.export takes seconds
def test_a_torch_export_archive_is_read_too(tmp_path: Path) -> None:
    import torch

    m = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.BatchNorm1d(16)).eval()
    torch.export.save(torch.export.export(m, (torch.zeros(2, 8),)), str(tmp_path / "m.pt2"))
    expect = sum(t.numel() * t.element_size() for t in [*m.parameters(), *m.buffers()])
    assert archive_tensor_bytes(tmp_path / "m.pt2") == expect


def test_what_is_not_an_archive_is_not_predicted(tmp_path: Path) -> None:
    (tmp_path / "model.py").write_text("class Model: pass\n")
    assert archive_tensor_bytes(tmp_path / "model.py") is None
    assert archive_tensor_bytes(tmp_path / "missing.pt") is None
    cfg = parse_config({**linear_config("h"), "platform": "python"}, "test")
    pred = predict(cfg, tmp_path)
    assert pred.weights_bytes is None and pred.total_bytes == 0
    assert "unknown weights" in pred.describe()


def test_the_broker_predicts_without_importing_torch(tmp_path: Path) -> None:
    vdir = write_model(tmp_path, "m", 1, FACTORIES["mlp"], linear_config("m", 64, 10))
    code = ("import json, sys; from pathlib import Path\n"
            "from zeroserve.models.footprint import predict\n"
            "from zeroserve.models.repository import load_config\n"
            "cfg = load_config(Path(sys.argv[1]) / 'm')\n"
            "pred = predict(cfg, Path(sys.argv[1]) / 'm' / '1')\n"
            "print(json.dumps([pred.weights_bytes, 'torch' in sys.modules]))")
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    weights, torch_loaded = json.loads(out.stdout)
    assert weights == module_bytes(vdir / "model.pt") and not torch_loaded


def test_prediction_adds_the_learned_terms_at_the_largest_batch(tmp_path: Path) -> None:
    write_model(tmp_path, "m", 1, FACTORIES["mlp"], linear_config("m", 64, 10, mbs=32))
    cfg = parse_config(linear_config("m", 64, 10, mbs=32), "test")
    weights = module_bytes(tmp_path / "m" / "1" / "model.pt")
    cold = predict(cfg, tmp_path / "m" / "1")
    # before any warm-up: the first guess, 32 x one sample's input bytes per sample
    graph = archives.graph_bytes(tmp_path / "m" / "1" / "model.pt")
    assert graph and cold.overhead_bytes == TORCHSCRIPT_GRAPH_FACTOR * graph
    assert cold.total_bytes == weights + cold.overhead_bytes + ACTIVATION_FACTOR * 64 * 4 * 32
    assert "(first guesses from the files and inputs)" in cold.describe()
    learned = Learned(ActivationTerm(1000, 500), overhead_bytes=20_000)
    warm = predict(cfg, tmp_path / "m" / "1", learned)
    assert warm.total_bytes == weights + 20_000 + 500 + 1000 * 32
    assert "activations at batch 32" in warm.describe()


def test_the_activation_line_through_the_warm_up_peaks() -> None:
    assert fit_activation({}) is None
    assert fit_activation({1: 1500, 8: 8500}) == ActivationTerm(1000, 500)
    assert fit_activation({1: 1500, 4: 9999, 8: 8500}) == ActivationTerm(1000, 500)
    assert fit_activation({8: 8001}) == ActivationTerm(1001, 0)   # rounds up
    # the small batch's peak inflated by something else: the large batch alone counts
    assert fit_activation({1: 9000, 8: 8000}) == ActivationTerm(1000, 0)
    assert ActivationTerm(1000, 500).at(0) == 1500
    doc = ActivationTerm(7, 3).to_json()
    assert ActivationTerm.from_json(doc) == ActivationTerm(7, 3)
    assert ActivationTerm.from_json({}) is None
    assert Learned.from_plan({**doc, "overhead_bytes": -5}) == Learned(ActivationTerm(7, 3), 0)


def test_sizes_for_people() -> None:
    assert size_text(1_234_567) == "1.2 MB" and size_text(2_000_000_000) == "2.0 GB"


def test_the_first_activations_guess_reads_the_inputs_and_the_largest_batch() -> None:
    tokens = parse_config({**linear_config("t", mbs=16), "inputs": [
        {"name": "ids", "datatype": "INT64", "shape": [-1]},
        {"name": "mask", "datatype": "INT64", "shape": [-1]}]}, "t")
    assert first_guess(tokens).at(16) == ACTIVATION_FACTOR * 2 * 8 * GUESS_LENGTH * 16
    image = parse_config({**linear_config("i", mbs=0), "inputs": [
        {"name": "x", "datatype": "FP32", "shape": [3, 64, 64]}]}, "i")
    assert first_guess(image).at(1) == ACTIVATION_FACTOR * 3 * 64 * 64 * 4


def test_every_format_reads_its_weights_and_is_named(tmp_path: Path) -> None:
    """An exported program's weights are read as a TorchScript archive's; the format is
    named, so a measurement of one format is never applied to another's prediction."""
    import torch

    module = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(),
                                 torch.nn.Linear(128, 10)).eval()
    params = sum(p.numel() * p.element_size() for p in module.parameters())
    (tmp_path / "ts" / "1").mkdir(parents=True)
    torch.jit.save(torch.jit.script(module), str(tmp_path / "ts" / "1" / "model.pt"))
    (tmp_path / "ex" / "1").mkdir(parents=True)
    program = torch.export.export(module, (torch.zeros(2, 64),), dynamic_shapes=(
        {0: torch.export.Dim("b", min=1, max=32)},))
    torch.export.save(program, str(tmp_path / "ex" / "1" / "model.pt2"))
    ts = parse_config(linear_config("ts", 64, 10), "t")
    ex = parse_config({**linear_config("ex", 64, 10), "platform": "pytorch_export"}, "t")
    assert files_of(ts, tmp_path / "ts" / "1") == (params, "TorchScript")
    assert files_of(ex, tmp_path / "ex" / "1") == (params, "exported program")


def test_a_package_maps_its_so_beside_its_constants_and_needs_the_export_runtime(
        tmp_path: Path) -> None:
    """An AOTInductor package's ``.so`` holds its constants again and is mapped beside
    the copies a load makes: its size is the overhead's first guess, in host memory."""
    (tmp_path / "1").mkdir()
    with zipfile.ZipFile(tmp_path / "1" / "model.pt2", "w") as package:
        package.writestr("model/data/aotinductor/model/m_wrapper.cpp",
                         "constants_info_[0].data_size = 4000;\n")
        package.writestr("model/data/aotinductor/model/m_wrapper.so", b"x" * 5000)
    cfg = parse_config({**linear_config("m", 10, 10, mbs=1), "platform": "pytorch_export"},
                       "m")
    got = facts(cfg, tmp_path / "1")
    assert (got.weights_bytes, got.overhead_bytes, got.runtime) == (4000, 5000, "torch.export")
    guess = first_guess(cfg).at(1)
    assert predict(cfg, tmp_path / "1").total_bytes == 4000 + 5000 + guess
    assert predict(cfg, tmp_path / "1", host=False).total_bytes == 4000 + guess
    learned = predict(cfg, tmp_path / "1", Learned(None, 7000))
    assert learned.overhead_bytes == 7000, "a measured overhead replaces the guess"
    charged = predict(cfg, tmp_path / "1", runtime_bytes=100)
    assert charged.total_bytes == 4000 + 5000 + guess + 100
    assert "for the torch.export runtime" in charged.describe()


def test_a_runtime_is_charged_until_the_worker_has_it() -> None:
    assert runtime_charge("", {}, {}, True) == 0, "a format with no runtime of its own"
    assert runtime_charge("torch.export", {}, {}, True) == RUNTIME_GUESS_BYTES["torch.export"]
    assert runtime_charge("torch.export", {}, {}, False) == 0, "host memory: not a GPU's"
    assert runtime_charge("torch.export", {}, {"torch.export": 97}, True) == 97
    assert runtime_charge("torch.export", {"torch.export": 97}, {"torch.export": 97},
                          True) == 0
