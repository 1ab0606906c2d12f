"""An exported program whose outputs are a class torch only rebuilds where its module is
imported (transformers' ModelOutput is the common one): the worker, which has not imported
it, refuses the load naming the class and what to do, not torch's bare 'error when
deserializing'."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path

import torch

from tests.conftest import ROOT
from zeroserve.models import archives


@dataclass
class Doubled:
    y: torch.Tensor


torch.export.register_dataclass(Doubled, serialized_type_name=f"{__name__}.Doubled")


class Model(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> Doubled:
        return Doubled(x * 2)


def test_a_program_whose_outputs_need_an_import_is_refused_saying_so(tmp_path: Path) -> None:
    program = torch.export.export(Model(), (torch.ones(2, 4),))
    (tmp_path / "1").mkdir()
    torch.export.save(program, str(tmp_path / "1" / "model.pt2"))
    assert archives.output_types(tmp_path / "1" / "model.pt2") == [f"{__name__}.Doubled"]
    cfg = {"name": "d", "platform": "pytorch_export", "max_batch_size": 0,
           "inputs": [{"name": "x", "datatype": "FP32", "shape": [2, 4]}],
           "outputs": [{"name": "y", "datatype": "FP32", "shape": [2, 4]}]}
    code = textwrap.dedent(f"""
        from pathlib import Path
        from zeroserve.models.loader import LoadError, load
        from zeroserve.models.repository import parse_config
        try:
            load(parse_config({cfg!r}, "t"), 1, Path({str(tmp_path / "1")!r}), "cpu",
                 lambda: 0)
        except LoadError as exc:
            print(exc)
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         cwd=ROOT, timeout=120)
    assert f"the program's outputs are {__name__}.Doubled" in out.stdout, out.stderr[-2000:]
    assert "tuple of tensors" in out.stdout
