"""Every example the docs mark runs, against a real server, and prints what the page says.

A page marks a fenced block with an HTML comment on the line before it (invisible on the
site):

* ``<!-- example: file PATH -->``: the block is a file of the model repository, written
  at ``PATH`` (relative to the repository) before the server starts.
* ``<!-- example: setup -->``: a Python block run in the repository folder before the
  server starts (to make a model file, say; ``/srv/imports`` is the import root).
* ``<!-- example: run -->``: a ``sh`` or ``python`` block run once the server is ready;
  it must exit 0, and each ``# prints TEXT`` comment in it names text its output holds.
* ``<!-- example: output -->``: the output of the run block before it; the parts between
  ``...`` must appear in that output, in order.
* ``<!-- example: serve -->``: a ``sh`` block holding the page's ``zeroserve serve``
  command; its options are added to the server's (a relative path names a file beside
  the repository, where ``file ../NAME`` writes and run blocks run).

Each page with marks gets a server of its own: ``zeroserve serve`` on the bundled
examples (``mlp``, ``cnn``) plus the page's files, with an import root and the options of
its serve block. In the blocks,
``127.0.0.1:8080`` and ``localhost:8080`` become the server's HTTP address,
``127.0.0.1:8001`` its gRPC one, ``/srv/imports`` the import root, and the runtime
folder is the server's (``ZEROSERVE_RUNTIME_DIR``), so ``zeroserve`` commands and the
direct client find it. The test prints how many blocks it ran.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import pytest

from tests.conftest import ROOT, Server, short_tmpdir

pytestmark = pytest.mark.timeout(300)

PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
MARK = re.compile(r"^<!-- example: (file|setup|run|output|serve)(?: (\S+))? -->\n"
                  r"```(\w*)\n(.*?)^```$", re.M | re.S)
PRINTS = re.compile(r"#\s*prints\s+(.+?)\s*$", re.M)


@dataclass(frozen=True)
class Block:
    page: str
    line: int
    kind: str
    arg: str
    lang: str
    text: str

    def where(self) -> str:
        return f"{self.page}:{self.line}"


def blocks(page: Path) -> list[Block]:
    text = page.read_text()
    return [Block(page.name, text.count("\n", 0, m.start()) + 1, m[1], m[2] or "", m[3],
                  m[4]) for m in MARK.finditer(text)]


MARKED = {page.name: found for page in PAGES if (found := blocks(page))}
RAN: dict[str, int] = {}


@pytest.fixture(scope="module")
def examples() -> Iterator[Path]:
    """The bundled example repository, built once for every page."""
    folder = short_tmpdir("zsdocex")
    subprocess.run([sys.executable, "-m", "zeroserve.models.examples", str(folder / "repo")],
                   check=True, capture_output=True, timeout=300)
    yield folder / "repo"
    shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture(scope="module", autouse=True)
def tally(request: pytest.FixtureRequest) -> Iterator[None]:
    yield
    line = (f"docs examples: {sum(RAN.values())} blocks run "
            f"({', '.join(f'{p} {n}' for p, n in sorted(RAN.items())) or 'none'})")
    # past the capture, so the count shows in every run, -q included
    capture = request.config.pluginmanager.get_plugin("capturemanager")
    with capture.global_and_fixture_disabled():
        print(f"\n{line}")


def shim(folder: Path) -> Path:
    """A ``zeroserve`` on PATH that runs this checkout's."""
    bin_dir = folder / "bin"
    bin_dir.mkdir()
    (bin_dir / "zeroserve").write_text(
        f"#!/bin/sh\nexec {sys.executable} {ROOT / 'bin' / 'zeroserve'} \"$@\"\n")
    (bin_dir / "zeroserve").chmod(0o755)
    return bin_dir


def substitute(text: str, srv: Server, imports: Path) -> str:
    for old in ("http://127.0.0.1:8080", "http://localhost:8080"):
        text = text.replace(old, srv.url)
    for old in ("127.0.0.1:8080", "localhost:8080"):
        text = text.replace(old, f"127.0.0.1:{srv.port}")
    return text.replace("127.0.0.1:8001", srv.grpc_url).replace("/srv/imports", str(imports))


def serve_options(block: Block, folder: Path) -> list[str]:
    """The options of the page's ``zeroserve serve`` line; the runner sets the model
    folder, the ports and the runtime folder itself, so the page may not."""
    words = shlex.split(block.text.replace("\\\n", " "))
    assert words[:2] == ["zeroserve", "serve"], f"{block.where()}: not a zeroserve serve line"
    own = {"--model-dir", "--http-port", "--grpc-port", "--runtime-dir"} & set(words)
    assert not own, f"{block.where()}: the runner sets {sorted(own)} itself"
    return [str(folder / w) if not w.startswith("-") and (folder / w).exists() else w
            for w in words[2:]]


def run(block: Block, code: str, env: dict[str, str], cwd: Path) -> str:
    argv = [sys.executable, "-c", code] if block.lang == "python" else \
        ["bash", "-e", "-o", "pipefail", "-c", code]
    out = subprocess.run(argv, capture_output=True, text=True, timeout=120, env=env, cwd=cwd)
    assert out.returncode == 0, (f"{block.where()}: exit {out.returncode}\n{code}\n"
                                 f"stdout: {out.stdout[-2000:]}\nstderr: {out.stderr[-2000:]}")
    return out.stdout


def check_output(block: Block, expected: str, got: str) -> None:
    at = 0
    for part in (p.strip() for p in expected.split("...")):
        found = got.find(part, at)
        assert part == "" or found >= 0, (f"{block.where()}: the page says the output holds "
                                          f"{part!r}; it printed:\n{got[-2000:]}")
        at = found + len(part) if part else at


@pytest.mark.parametrize("page", sorted(MARKED))
def test_the_marked_examples_of_the_page_run(page: str, examples: Path) -> None:
    marked = MARKED[page]
    folder = short_tmpdir("zsdoc")
    repo, imports = folder / "repo", folder / "imports"
    shutil.copytree(examples, repo)
    imports.mkdir()
    env = {**os.environ, "PATH": f"{shim(folder)}:{os.environ['PATH']}",
           "PYTHONPATH": str(ROOT)}
    for block in marked:
        if block.kind == "file":
            (repo / block.arg).parent.mkdir(parents=True, exist_ok=True)
            (repo / block.arg).write_text(block.text)
        elif block.kind == "setup":
            run(block, block.text.replace("/srv/imports", str(imports)), env, repo)
    served = [b for b in marked if b.kind == "serve"]
    assert len(served) <= 1, f"{page}: one serve block a page, found {len(served)}"
    extra = ["--import-root", str(imports), *(serve_options(served[0], folder) if served else [])]
    srv = Server(repo, extra=extra)
    try:
        srv.wait_ready()
        env["ZEROSERVE_RUNTIME_DIR"] = str(srv.runtime)
        got = ""
        for block in marked:
            code = substitute(block.text, srv, imports)
            if block.kind == "run":
                got = run(block, code, env, folder)
                for text in PRINTS.findall(block.text):
                    assert text in got, (f"{block.where()}: the page says it prints "
                                         f"{text!r}; it printed:\n{got[-2000:]}")
            elif block.kind == "output":
                check_output(block, code, got)
            RAN[page] = RAN.get(page, 0) + 1
    finally:
        srv.stop()
        shutil.rmtree(folder, ignore_errors=True)


def test_the_docs_mark_examples_to_run() -> None:
    """The runner has something to run: a page whose marks were lost fails here."""
    assert {"README.md", "pipelines.md", "rollouts.md"} <= set(MARKED), sorted(MARKED)
    assert sum(b.kind == "run" for found in MARKED.values() for b in found) >= 6
