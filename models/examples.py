"""Build the bundled example repository (``mlp`` and ``cnn``), exactly as the shared
benchmark's ``make_models.py`` does, so a served answer can be checked against the
same model run in-process.

Run as its own process (``python -m zeroserve.models.examples OUT``) so the
supervisor that asks for it never imports torch.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

import torch
import torch.nn as nn

CONFIGS = {
    "mlp": {"name": "mlp", "platform": "pytorch_torchscript", "max_batch_size": 64,
            "inputs": [{"name": "input", "datatype": "FP32", "shape": [256]}],
            "outputs": [{"name": "output", "datatype": "FP32", "shape": [10]}]},
    "cnn": {"name": "cnn", "platform": "pytorch_torchscript", "max_batch_size": 16,
            "inputs": [{"name": "input", "datatype": "FP32", "shape": [3, 64, 64]}],
            "outputs": [{"name": "output", "datatype": "FP32", "shape": [10]}]},
}


def make_mlp() -> nn.Module:
    return nn.Sequential(
        nn.Linear(256, 1024), nn.ReLU(),
        nn.Linear(1024, 1024), nn.ReLU(),
        nn.Linear(1024, 10),
    )


class Block(nn.Module):
    """conv3x3(stride 2)-BN-ReLU-conv3x3-BN + 1x1 stride-2 projection shortcut, ReLU."""

    def __init__(self, cin: int, cout: int) -> None:
        super().__init__()
        self.c1 = nn.Conv2d(cin, cout, 3, stride=2, padding=1, bias=False)
        self.b1 = nn.BatchNorm2d(cout)
        self.c2 = nn.Conv2d(cout, cout, 3, stride=1, padding=1, bias=False)
        self.b2 = nn.BatchNorm2d(cout)
        self.proj = nn.Conv2d(cin, cout, 1, stride=2, bias=False)
        self.bp = nn.BatchNorm2d(cout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.relu(self.b1(self.c1(x)))
        y = self.b2(self.c2(y))
        return torch.relu(y + self.bp(self.proj(x)))


class SmallResNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Sequential(
            nn.Conv2d(3, 32, 3, stride=1, padding=1, bias=False),
            nn.BatchNorm2d(32), nn.ReLU())
        self.blocks = nn.Sequential(
            Block(32, 32), Block(32, 64), Block(64, 128), Block(128, 256))
        self.fc = nn.Linear(256, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.blocks(self.stem(x))
        x = torch.mean(x, dim=(2, 3))
        out: torch.Tensor = self.fc(x)
        return out


BUILDERS = {"mlp": make_mlp, "cnn": SmallResNet}


def build_module(name: str) -> nn.Module:
    torch.manual_seed(0)
    return BUILDERS[name]().eval()


def is_built(repo: Path) -> bool:
    return all((repo / n / "1" / "model.pt").is_file() and (repo / n / "config.json").is_file()
               for n in CONFIGS)


def build(repo: Path) -> None:
    """Write the example repository, published by one rename so a crash leaves nothing."""
    repo.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".examples-", dir=repo.parent))
    try:
        for name, cfg in CONFIGS.items():
            (tmp / name / "1").mkdir(parents=True)
            torch.jit.save(torch.jit.script(build_module(name)), str(tmp / name / "1" / "model.pt"))
            (tmp / name / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
        if repo.exists():
            shutil.rmtree(repo)
        os.rename(tmp, repo)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def main() -> int:
    if len(sys.argv) != 2:
        print("usage: python -m zeroserve.models.examples OUT_DIR", file=sys.stderr)
        return 2
    repo = Path(sys.argv[1])
    if not is_built(repo):
        build(repo)
    print(repo)
    return 0


if __name__ == "__main__":
    sys.exit(main())
