"""The import rules, read from the source's own imports (every module on disk, nothing
listed by hand): broker never imports workers or gateway; gateway never imports
workers, models' loaders or torch; models never import broker; only workers (and the
model loaders they call) import torch."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from tests.conftest import ROOT

PACKAGES = ("broker", "gateway", "workers", "models")
FORBIDDEN = {
    "broker": ("zeroserve.workers", "zeroserve.gateway", "torch"),
    "gateway": ("zeroserve.workers", "zeroserve.models.loader", "zeroserve.models.handlers",
                "torch"),
    "models": ("zeroserve.broker",),
}


def imports(path: Path) -> list[tuple[int, str]]:
    """Every module a file imports, at any depth (function-local imports count too)."""
    tree = ast.parse(path.read_text(), str(path))
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.append((node.lineno, node.module))
    return out


def modules(package: str) -> list[Path]:
    return sorted((ROOT / package).rglob("*.py"))


def test_every_package_has_modules() -> None:
    for package in PACKAGES:
        assert modules(package), package


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_imports_point_one_way(package: str) -> None:
    wrong = [f"{path.relative_to(ROOT)}:{line} imports {name}"
             for path in modules(package) for line, name in imports(path)
             if any(name == bad or name.startswith(bad + ".") for bad in FORBIDDEN[package])]
    assert not wrong, "\n".join(wrong)


def test_torch_stays_in_workers_and_model_loaders() -> None:
    allowed = {"workers", "models/loader.py", "models/handlers.py", "models/examples.py"}
    wrong = []
    for package in PACKAGES:
        for path in modules(package):
            rel = str(path.relative_to(ROOT))
            if rel.split("/")[0] in allowed or rel in allowed:
                continue
            wrong += [f"{rel}:{line}" for line, name in imports(path)
                      if name == "torch" or name.startswith("torch.")]
    assert not wrong, "\n".join(wrong)


def test_the_rule_checker_sees_function_local_imports(tmp_path: Path) -> None:
    sample = tmp_path / "m.py"
    sample.write_text("def f():\n    from zeroserve.workers.main import run\n")
    assert imports(sample) == [(2, "zeroserve.workers.main")]
