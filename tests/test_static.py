"""The static checks, run as the suite runs: mypy, strict on broker, gateway and models
(mypy.ini), and ruff (ruff.toml), both pinned in the test extra. By hand, from the
checkout: ``.venv/bin/python -m pytest tests/test_static.py`` (it prints what failed).
ruff is part of the fast layer; mypy, a subprocess of a minute on a cold cache, is e2e.

mypy needs the packages under their installed names (``zeroserve.broker`` is the
top-level ``broker/``): it reads them through a folder holding a ``zeroserve`` link
to the checkout. Its cache stays in the checkout (.mypy_cache), so a second run takes
seconds."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from tests.conftest import ROOT


def _names_root() -> Path:
    """A folder whose ``zeroserve`` is this checkout (one per checkout, kept)."""
    tag = hashlib.sha256(str(ROOT).encode()).hexdigest()[:12]
    folder = Path(tempfile.gettempdir()) / f"zeroserve-mypy-{tag}"
    folder.mkdir(exist_ok=True)
    link = folder / "zeroserve"
    if not link.is_symlink() or link.resolve() != ROOT:
        link.unlink(missing_ok=True)
        link.symlink_to(ROOT, target_is_directory=True)
    return folder


def _run(*argv: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", *argv], cwd=ROOT, capture_output=True,
                          text=True, timeout=540, env={**os.environ, **(env or {})})


@pytest.mark.timeout(600)   # a cold cache reads torch's and numpy's stubs: about a minute
def test_mypy_strict_on_broker_gateway_and_models() -> None:
    out = _run("mypy", "--config-file", str(ROOT / "mypy.ini"),
               "--cache-dir", str(ROOT / ".mypy_cache"),
               "-p", "zeroserve.broker", "-p", "zeroserve.gateway", "-p", "zeroserve.models",
               env={"MYPYPATH": str(_names_root())})
    assert out.returncode == 0, (out.stdout + out.stderr).replace(str(_names_root()) + "/", "")


@pytest.mark.tool   # under a second: in the fast layer, unlike mypy's minute on a cold cache
def test_ruff_finds_nothing() -> None:
    out = _run("ruff", "check", "--output-format", "concise", ".")
    assert out.returncode == 0, out.stdout + out.stderr
