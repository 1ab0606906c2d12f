"""The registry of model formats (models/formats.py), walked: every entry is whole, every
place that names platforms reads it, and the names each platform went by before the
registry still mean what they meant."""

from __future__ import annotations

import importlib
import subprocess
import sys
from pathlib import Path

import pytest

from zeroserve.gateway.grpc.messages import model_config
from zeroserve.models import formats
from zeroserve.models.loader import Opened, Source
from zeroserve.models.repository import ConfigError, parse_config
from tests.conftest import linear_config


@pytest.mark.parametrize("fmt", formats.FORMATS, ids=lambda f: f.name)
def test_every_entry_is_whole(fmt: formats.Format) -> None:
    module, _, attr = fmt.loader.partition(":")
    opener = getattr(importlib.import_module(module), attr)
    assert callable(opener) and opener.__annotations__.get("src") in (Source, "Source")
    assert opener.__annotations__.get("return") in (Opened, "Opened")
    assert formats.canonical(fmt.platform) == fmt.platform
    assert all(formats.canonical(a) == fmt.platform for a in fmt.aliases)
    assert formats.model_file(fmt.platform) == fmt.file
    cfg = parse_config({**linear_config("m"), "platform": fmt.platform}, "t")
    assert cfg.platform == fmt.platform and cfg.model_file == fmt.file
    doc = model_config(cfg.to_json())
    assert (doc.platform, doc.backend) == (fmt.triton_platform, fmt.triton_backend)


def test_formats_that_share_a_file_are_told_apart_by_detection() -> None:
    by_file: dict[tuple[str, str], list[formats.Format]] = {}
    for fmt in formats.FORMATS:
        by_file.setdefault((fmt.platform, fmt.file), []).append(fmt)
    shared = [group for group in by_file.values() if len(group) > 1]
    assert shared, "model.pt2 holds two formats"
    for group in shared:
        assert all(f.detect is not None for f in group), [f.name for f in group]


def test_the_names_a_platform_went_by_keep_their_meaning() -> None:
    expect = {"pytorch_torchscript": "pytorch_torchscript",
              "pytorch_libtorch": "pytorch_torchscript",   # Triton's
              "pytorch": "pytorch_torchscript",            # the seed's
              "pytorch_export": "pytorch_export", "python": "python",
              "transformers": "transformers"}
    assert {n: formats.canonical(n) for n in expect} == expect
    assert set(formats.platforms()) == set(expect)
    assert {p: formats.model_file(p) for p in ("pytorch_torchscript", "pytorch_export",
                                               "python")} == \
        {"pytorch_torchscript": "model.pt", "pytorch_export": "model.pt2", "python": "model.py"}
    assert formats.triton_names("pytorch_torchscript") == ("pytorch_libtorch", "pytorch")
    assert formats.triton_names("python") == ("", "python")
    assert formats.triton_names("onnx") == ("onnx", "")
    with pytest.raises(ConfigError, match=r"platform': must be one of .*got 'onnx'"):
        parse_config({**linear_config("m"), "platform": "onnx"}, "t")


def test_a_pt2_that_is_no_zip_is_named_with_the_reason(tmp_path: Path) -> None:
    (tmp_path / "model.pt2").write_bytes(b"not a zip")
    with pytest.raises(formats.FormatError, match=r"model\.pt2: not a readable zip archive"):
        formats.identify("pytorch_export", tmp_path / "model.pt2")
    assert formats.weights_bytes("pytorch_export", tmp_path / "model.pt2") is None
    # one format for the platform: its loader judges the file
    assert formats.identify("pytorch_torchscript", tmp_path / "model.pt").name == "TorchScript"


def test_the_registry_stays_torch_free() -> None:
    code = ("import sys; import zeroserve.models.formats, zeroserve.models.footprint; "
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60)
    assert out.stdout.strip() == "False", out.stderr
