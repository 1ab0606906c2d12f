"""Model formats and namespace isolation, in process: torch.export programs, Python
handlers with sibling modules, and unloading that lets the old version be collected."""

from __future__ import annotations

import gc
import json
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch

from zeroserve.broker import protocol as p
from zeroserve.models import handlers
from zeroserve.models.loader import LoadError, load
from zeroserve.models.repository import parse_config
from zeroserve.workers import batching
from zeroserve.workers.memory import rss_bytes

HANDLER = '''
import torch
from . import utils


class Model:
    def load(self, version_dir, device):
        self.scale = utils.SCALE

    def predict(self, inputs):
        return {"output": inputs["input"] * self.scale + utils.offset()}
'''


def handler_config(name: str = "handler", **extra: object) -> dict[str, object]:
    return {"name": name, "platform": "python", "max_batch_size": 8,
            "inputs": [{"name": "input", "datatype": "FP32", "shape": [2]}],
            "outputs": [{"name": "output", "datatype": "FP32", "shape": [2]}], **extra}


def write_handler(root: Path, version: int, scale: float, code: str = HANDLER) -> Path:
    vdir = root / str(version)
    vdir.mkdir(parents=True)
    (vdir / "model.py").write_text(code)
    (vdir / "utils.py").write_text(f"SCALE = {scale}\n\ndef offset():\n    return {version}.0\n")
    return vdir


def batch_of(model: str, version: int, *tensors: p.Tensor) -> p.Batch:
    return p.Batch(1, model, version, [p.BatchItem("0", list(tensors), None)], 0)


def test_two_versions_with_their_own_utils_never_see_each_other(tmp_path: Path) -> None:
    cfg = parse_config(handler_config(), "test")
    a = load(cfg, 1, write_handler(tmp_path, 1, 2.0), "cpu", rss_bytes)
    b = load(cfg, 2, write_handler(tmp_path, 2, 10.0), "cpu", rss_bytes)
    assert a.package != b.package and a.package.startswith("_zeroserve_models.handler.v1_")
    x = torch.ones(3, 2)
    assert torch.equal(a.fn({"input": x})["output"], torch.full((3, 2), 3.0))
    assert torch.equal(b.fn({"input": x})["output"], torch.full((3, 2), 12.0))
    assert sys.modules[a.package + ".utils"].SCALE == 2.0
    assert sys.modules[b.package + ".utils"].SCALE == 10.0
    assert "utils" not in sys.modules  # nothing leaked into the top-level namespace
    a.release()
    b.release()


def test_unload_removes_modules_and_the_old_version_is_collected(tmp_path: Path) -> None:
    cfg = parse_config(handler_config(), "test")
    loaded = load(cfg, 1, write_handler(tmp_path, 1, 2.0), "cpu", rss_bytes)
    ref, pkg = loaded.ref(), loaded.package
    module_ref = __import__("weakref").ref(sys.modules[pkg + ".utils"])
    loaded.release()
    del loaded
    gc.collect()
    assert not [n for n in sys.modules if n.startswith(pkg)]
    assert ref() is None, "the unloaded handler is still referenced"
    assert module_ref() is None, "the unloaded version's utils module is still referenced"


def test_an_absolute_sibling_import_fails_with_a_hint(tmp_path: Path) -> None:
    cfg = parse_config(handler_config(), "test")
    vdir = write_handler(tmp_path, 1, 2.0, HANDLER.replace("from . import utils", "import utils"))
    with pytest.raises(LoadError, match=r"import it relatively \(`from \. import utils`\)"):
        load(cfg, 1, vdir, "cpu", rss_bytes)
    # even with the folder on sys.path (where the import would succeed) the leak is caught
    sys.path.insert(0, str(vdir))
    try:
        with pytest.raises(LoadError, match="relatively"):
            load(cfg, 1, vdir, "cpu", rss_bytes)
    finally:
        sys.path.remove(str(vdir))
    assert "utils" not in sys.modules
    assert not [n for n in sys.modules if n.startswith("_zeroserve_models.handler.v1_")]


def test_a_handler_that_raises_in_load_fails_the_load_cleanly(tmp_path: Path) -> None:
    cfg = parse_config(handler_config(), "test")
    vdir = write_handler(tmp_path, 1, 2.0, HANDLER.replace(
        "self.scale = utils.SCALE", "raise RuntimeError('weights missing')"))
    with pytest.raises(LoadError, match="weights missing"):
        load(cfg, 1, vdir, "cpu", rss_bytes)
    assert not [n for n in sys.modules if n.startswith("_zeroserve_models.handler.v1_")]


@pytest.mark.parametrize("raised, transient", [
    ("MemoryError('no room')", True),
    ("torch.OutOfMemoryError('CUDA out of memory')", True),
    ("OSError(5, 'Input/output error')", True),
    ("TimeoutError('the volume did not answer')", True),
    ("RuntimeError('weights missing')", False),
    ("ValueError('a config the files do not match')", False),
])
def test_a_failed_load_says_whether_its_cause_may_pass(tmp_path: Path, raised: str,
                                                       transient: bool) -> None:
    cfg = parse_config(handler_config(), "test")
    vdir = write_handler(tmp_path, 1, 2.0, HANDLER.replace(
        "self.scale = utils.SCALE", f"raise {raised}"))
    with pytest.raises(LoadError) as info:
        load(cfg, 1, vdir, "cpu", rss_bytes)
    assert info.value.transient is transient


def test_a_corrupt_file_is_a_lasting_failure(tmp_path: Path) -> None:
    cfg = parse_config({**handler_config(), "platform": "pytorch_torchscript"}, "test")
    (tmp_path / "1").mkdir()
    (tmp_path / "1" / "model.pt").write_bytes(b"this is not a TorchScript archive")
    with pytest.raises(LoadError) as info:
        load(cfg, 1, tmp_path / "1", "cpu", rss_bytes)
    assert info.value.transient is False


def test_bytes_tensors_reach_a_handler_as_object_arrays(tmp_path: Path) -> None:
    code = textwrap.dedent('''
        import numpy as np

        class Model:
            def load(self, version_dir, device):
                pass

            def predict(self, inputs):
                text = inputs["text"]
                assert text.dtype == object
                return {"upper": np.array([t.upper() for t in text], dtype=object),
                        "length": __import__("torch").tensor([len(t) for t in text])}
    ''')
    cfg = parse_config({"name": "echo", "platform": "python", "max_batch_size": 4,
                        "inputs": [{"name": "text", "datatype": "BYTES", "shape": []}],
                        "outputs": [{"name": "upper", "datatype": "BYTES", "shape": []},
                                    {"name": "length", "datatype": "INT64", "shape": []}]}, "t")
    vdir = tmp_path / "1"
    vdir.mkdir()
    (vdir / "model.py").write_text(code)
    loaded = load(cfg, 1, vdir, "cpu", rss_bytes)
    words = np.array([b"ab", b"xyz"], dtype=object)
    items = [p.BatchItem(str(i), [p.from_numpy("text", words[i:i + 1])], None) for i in range(2)]
    result = batching.run(loaded, p.Batch(1, "echo", 1, items, 0))
    assert result.error is None, result.error
    got = [p.to_numpy(r.tensors[0]).tolist() for r in result.replies]
    assert got == [[b"AB"], [b"XYZ"]]
    assert [p.to_numpy(r.tensors[1]).tolist() for r in result.replies] == [[2], [3]]
    loaded.release()


@pytest.mark.slow   # a process's first torch.export takes seconds
def test_torch_export_program_loads_and_serves(tmp_path: Path) -> None:
    torch.manual_seed(0)
    module = torch.nn.Linear(4, 3).eval()
    batch = torch.export.Dim("batch", min=1, max=8)
    program = torch.export.export(module, (torch.randn(2, 4),), dynamic_shapes=({0: batch},))
    vdir = tmp_path / "1"
    vdir.mkdir()
    torch.export.save(program, str(vdir / "model.pt2"))
    cfg = parse_config({"name": "exp", "platform": "pytorch_export", "max_batch_size": 8,
                        "inputs": [{"name": "input", "datatype": "FP32", "shape": [4]}],
                        "outputs": [{"name": "output", "datatype": "FP32", "shape": [3]}]}, "t")
    loaded = load(cfg, 1, vdir, "cpu", rss_bytes)
    x = np.random.default_rng(0).standard_normal((3, 4)).astype(np.float32)
    result = batching.run(loaded, batch_of("exp", 1, p.from_numpy("input", x)))
    assert result.error is None, result.error
    with torch.inference_mode():
        expected = module(torch.from_numpy(x)).numpy()
    np.testing.assert_allclose(p.to_numpy(result.replies[0].tensors[0]), expected, atol=1e-6)


def test_package_names_are_identifiers() -> None:
    name = handlers.package_name("my-model.v2", 3, "ab" * 32)
    assert name == "_zeroserve_models.my_model_v2.v3_abababab"
    assert json.dumps(name)
