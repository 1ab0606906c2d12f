"""AOTInductor packages: compiled once for the session (by `zeroserve compile` itself, plus
two packages as `aoti_compile_and_package` makes them on its own: a batch from 2 and a
fixed batch), then loaded, padded, refused and served by a real worker."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import pytest
import torch

from tests.conftest import ZEROSERVE, Server, linear_config, short_tmpdir, wait_for, \
    write_model
from zeroserve.broker import protocol as p
from zeroserve.broker.client import Client
from zeroserve.models import archives
from zeroserve.models.aoti import PadBatch
from zeroserve.models.footprint import predict
from zeroserve.models.loader import LoadError, LoadedModel, load
from zeroserve.models.repository import parse_config
from zeroserve.workers import batching
from zeroserve.workers.compile import compile_package
from zeroserve.workers.memory import rss_bytes

# compiling takes 10-90 s a package on this shared host; the first test pays for three
pytestmark = pytest.mark.timeout(600)

N_IN, N_OUT, MAX_BATCH = 4, 3, 8


def tiny() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(N_IN, 16), torch.nn.ReLU(),
                               torch.nn.Linear(16, N_OUT)).eval()


def config(name: str = "aoti", mbs: int = MAX_BATCH, **extra: Any) -> dict[str, Any]:
    return {**linear_config(name, N_IN, N_OUT, mbs), "platform": "pytorch_export", **extra}


@dataclass
class Packages:
    root: Path
    program: Path        # torch.export.save
    compiled: Path       # zeroserve compile: batch 1..8, records its torch
    compile_stdout: str
    from_two: Path       # aoti_compile_and_package, batch 2..8 (torch's 0/1 specialization)
    fixed: Path          # aoti_compile_and_package, batch 4 only
    module: torch.nn.Module


def _compile_plain(program: Any, path: Path) -> Path:
    torch._inductor.aoti_compile_and_package(program, package_path=str(path))
    return path


@pytest.fixture(scope="session")
def packages() -> Iterator[Packages]:
    root = short_tmpdir("zsaoti")
    module = tiny()
    batch = torch.export.Dim("batch", min=2, max=MAX_BATCH)
    program = torch.export.export(module, (torch.randn(2, N_IN),),
                                  dynamic_shapes=({0: batch},))
    (root / "src").mkdir()
    torch.export.save(program, str(root / "src" / "model.pt2"))
    (root / "src" / "config.json").write_text(json.dumps(config()))
    out = subprocess.run([*ZEROSERVE, "compile", str(root / "src" / "model.pt2"),
                          "--config", str(root / "src" / "config.json"),
                          "--output", str(root / "compiled" / "model.pt2")],
                         capture_output=True, text=True, timeout=500)
    assert out.returncode == 0, out.stderr
    fixed = torch.export.export(module, (torch.randn(4, N_IN),))
    yield Packages(root, root / "src" / "model.pt2", root / "compiled" / "model.pt2",
                   out.stdout, _compile_plain(program, root / "from_two.pt2"),
                   _compile_plain(fixed, root / "fixed.pt2"), module)
    shutil.rmtree(root, ignore_errors=True)


def version_dir(tmp: Path, package: Path, version: int = 1) -> Path:
    vdir = tmp / str(version)
    vdir.mkdir(parents=True)
    shutil.copy(package, vdir / "model.pt2")
    return vdir


def rewritten(package: Path, dest: Path, **meta: str) -> Path:
    """A copy of the package whose metadata says otherwise (another device, another
    torch): what a package compiled elsewhere carries."""
    with zipfile.ZipFile(package) as src, zipfile.ZipFile(dest, "w") as out:
        for info in src.infolist():
            data = src.read(info)
            if info.filename.endswith("_metadata.json"):
                data = json.dumps({**json.loads(data), **meta}).encode()
            out.writestr(info, data)
    return dest


def run_rows(loaded: LoadedModel, module: torch.nn.Module, *rows: int) -> list[np.ndarray]:
    """One batch of requests with these row counts, through the worker's batch path."""
    rng = np.random.default_rng(sum(rows))
    items = [p.BatchItem(str(i), [p.from_numpy("input", rng.standard_normal(
        (n, N_IN)).astype(np.float32))], None) for i, n in enumerate(rows)]
    result = batching.run(loaded, p.Batch(1, loaded.name, 1, items, 0))
    assert result.error is None, result.error
    outs = [p.to_numpy(r.tensors[0]) for r in result.replies]
    for item, out in zip(items, outs):
        with torch.inference_mode():
            expected = module(torch.from_numpy(p.to_numpy(item.tensors[0])))
        np.testing.assert_allclose(out, expected.numpy(), atol=1e-5)
    return outs


def test_zeroserve_compile_writes_a_package_that_takes_a_batch_from_one(
        packages: Packages) -> None:
    assert "batch 1..8" in packages.compile_stdout, packages.compile_stdout
    names = archives.members(packages.compiled)
    assert archives.is_aoti_package(names) and not archives.is_exported_program(names)
    assert archives.aoti_metadata(packages.compiled)["torch_version"] == torch.__version__
    assert [f.name for f in packages.compiled.parent.iterdir()] == ["model.pt2"]  # no temp


def test_zeroserve_compile_refuses_what_is_not_an_exported_program(
        packages: Packages, tmp_path: Path) -> None:
    out = subprocess.run([*ZEROSERVE, "compile", str(packages.compiled),
                          "--config", str(packages.root / "src" / "config.json"),
                          "--output", str(tmp_path / "model.pt2")],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 1
    assert f"{packages.compiled}: not an exported program (torch.export.save)" in out.stderr
    assert not list(tmp_path.iterdir())


def test_a_compiled_package_answers_batches_of_1_3_and_max(packages: Packages,
                                                            tmp_path: Path) -> None:
    cfg = parse_config(config(), "t")
    loaded = load(cfg, 1, version_dir(tmp_path, packages.compiled), "cpu", rss_bytes)
    assert loaded.format == "AOTInductor package" and not isinstance(loaded.fn, PadBatch)
    # requests of 1, 3 and 4 rows: one batch of the max
    outs = run_rows(loaded, packages.module, 1, 3, MAX_BATCH - 4)
    assert [o.shape for o in outs] == [(1, N_OUT), (3, N_OUT), (4, N_OUT)]
    run_rows(loaded, packages.module, MAX_BATCH)
    loaded.release()


def test_a_package_from_two_pads_a_batch_of_one(packages: Packages, tmp_path: Path) -> None:
    assert archives.aoti_batch_range(packages.from_two, 1) == archives.BatchRange(2, 8)
    loaded = load(parse_config(config(), "t"), 1, version_dir(tmp_path, packages.from_two),
                  "cpu", rss_bytes)
    assert isinstance(loaded.fn, PadBatch) and loaded.fn.low == 2
    assert [o.shape for o in run_rows(loaded, packages.module, 1)] == [(1, N_OUT)]
    run_rows(loaded, packages.module, 2, 1)
    run_rows(loaded, packages.module, MAX_BATCH)


def test_the_footprint_counts_the_packages_weights(packages: Packages, tmp_path: Path) -> None:
    vdir = version_dir(tmp_path, packages.compiled)
    weights = predict(parse_config(config(), "t"), vdir).weights_bytes
    params = [t.numel() * t.element_size() for t in packages.module.parameters()]
    matrices = sum(n for t, n in zip(packages.module.parameters(), params) if t.dim() == 2)
    # the weight matrices at least (inductor may fold the small biases into its kernels),
    # each constant at most rounded up to inductor's 64-byte alignment
    assert weights is not None and matrices <= weights <= sum(-(-n // 64) * 64 for n in params)


def test_an_exported_program_beside_still_loads_as_one(packages: Packages,
                                                       tmp_path: Path) -> None:
    loaded = load(parse_config(config(), "t"), 1, version_dir(tmp_path, packages.program),
                  "cpu", rss_bytes)
    assert loaded.format == "exported program"
    run_rows(loaded, packages.module, 1, 3)


def refusal(packages: Packages, tmp_path: Path, case: str) -> tuple[Path, dict[str, Any], str]:
    """(model file, config, device) of one bad case."""
    cfg, device = config(), "cpu"
    tmp_path.mkdir(parents=True, exist_ok=True)
    target = tmp_path / "bad.pt2"
    if case == "cuda package on a cpu worker":
        rewritten(packages.compiled, target, AOTI_DEVICE_KEY="cuda")
    elif case == "cpu package on a cuda worker":
        shutil.copy(packages.compiled, target)
        device = "cuda:1"   # refused before torch touches a device: no GPU needed
    elif case == "another torch":
        rewritten(packages.compiled, target, torch_version="2.1.0")
    elif case == "neither format":
        write_model(tmp_path, "ts", 1, "nn.Linear(4, 3)")   # TorchScript named model.pt2
        shutil.copy(tmp_path / "ts" / "1" / "model.pt", target)
    elif case == "corrupt archive":
        data = packages.compiled.read_bytes()
        target.write_bytes(data[:len(data) // 2])
    elif case == "fixed batch":
        shutil.copy(packages.fixed, target)
    else:   # "max batch too small"
        shutil.copy(packages.from_two, target)
        cfg = config(mbs=16)
    return target, cfg, device


REFUSALS = {
    "cuda package on a cpu worker": r"an AOTInductor package compiled for cuda, but this "
                                    r"worker runs on cpu: compile it for cpu",
    "cpu package on a cuda worker": r"compiled for cpu, but this worker runs on cuda:1",
    "another torch": r"compiled by torch 2\.1\.0, but this worker runs torch 2\.",
    "neither format": r"neither an AOTInductor package \(.*\) nor an exported program "
                      r"\(torch\.export\.save\)",
    "corrupt archive": r"not a readable zip archive \(corrupt or truncated\?\)",
    "fixed batch": r"takes a fixed batch of 4, but max_batch_size 8 needs a dynamic batch "
                   r"dimension",
    "max batch too small": r"takes batches of at most 8, but max_batch_size is 16",
}


@pytest.mark.parametrize("case", sorted(REFUSALS))
def test_a_package_that_cannot_serve_is_refused_with_the_reason(
        packages: Packages, tmp_path: Path, case: str) -> None:
    bad, cfg, device = refusal(packages, tmp_path, case)
    vdir = version_dir(tmp_path / "m", bad)
    with pytest.raises(LoadError) as err:
        load(parse_config(cfg, "t"), 1, vdir, device, rss_bytes)
    assert str(err.value).startswith(str(vdir / "model.pt2") + ": "), err.value
    assert re.search(REFUSALS[case], str(err.value)), err.value


def test_a_worker_serves_a_package_beside_refused_ones(packages: Packages, serve) -> None:
    repo = short_tmpdir("zsrepo")
    try:
        version_dir(repo / "aoti", packages.compiled)
        (repo / "aoti" / "config.json").write_text(json.dumps(config()))
        write_model(repo, "linear", 1, "nn.Linear(4, 3)", linear_config("linear"))
        bad = {"cudapkg": "cuda package on a cpu worker", "neither": "neither format",
               "corrupt": "corrupt archive", "fixed": "fixed batch"}
        for name, case in bad.items():
            path, cfg, _ = refusal(packages, repo / f".{name}", case)
            version_dir(repo / name, path)
            (repo / name / "config.json").write_text(json.dumps({**cfg, "name": name,
                                                                 "optional": True}))
        srv: Server = serve(repo)
        errors = wait_for(lambda: (e := load_errors(srv)).keys() >= {f"{n}/1" for n in bad}
                          and e, 60, "every bad package refused")
        for name, case in bad.items():
            assert re.search(REFUSALS[case], errors[f"{name}/1"]), errors
            assert f"{name}/1/model.pt2: " in errors[f"{name}/1"]
        x = np.random.default_rng(0).standard_normal((3, N_IN)).astype(np.float32)
        with Client(srv.frontend, timeout_s=10) as c:
            for rows in (1, 3):
                got = c.infer("aoti", {"input": x[:rows]}).outputs["output"]
                with torch.inference_mode():
                    want = packages.module(torch.from_numpy(x[:rows])).numpy()
                np.testing.assert_allclose(got, want, atol=1e-5)
            assert c.infer("linear", {"input": x}).outputs["output"].shape == (3, 3)
    finally:
        shutil.rmtree(repo, ignore_errors=True)


def load_errors(srv: Server) -> dict[str, str]:
    """Each version's load error, as the worker reported it to the broker."""
    with Client(srv.control, timeout_s=5) as c:
        (worker,) = c.control("status")["workers"]
    return worker["load_errors"]  # type: ignore[no-any-return]


# skipped before its fixture compiles the CPU packages (tens of seconds for nothing)
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_cuda_package_runs_on_the_workers_gpu(packages: Packages, tmp_path: Path) -> None:
    index = torch.cuda.device_count() - 1
    cfg = parse_config(config(), "t")
    vdir = tmp_path / "1"
    compile_package(packages.program, cfg, vdir / "model.pt2", f"cuda:{index}")
    assert archives.aoti_metadata(vdir / "model.pt2")["AOTI_DEVICE_KEY"] == "cuda"
    loaded = load(cfg, 1, vdir, f"cuda:{index}", rss_bytes)
    x = torch.randn(3, N_IN)
    with torch.inference_mode():
        got = loaded.fn(x.to(f"cuda:{index}"))
        assert got.device == torch.device(f"cuda:{index}")
        np.testing.assert_allclose(got.cpu().numpy(), packages.module(x).numpy(), atol=1e-4)
    with pytest.raises(LoadError, match="compiled for cuda, but this worker runs on cpu"):
        load(cfg, 1, vdir, "cpu", rss_bytes)
