"""The test layers: which tests start real servers or processes (``e2e``), read from the
tests' own code, so the fast layer (``pytest -m "not e2e"``) needs no list kept by hand.

A test is e2e when its function, a fixture it uses (at any depth), or a function or class
of the tests it calls (followed through ``from tests... import``) starts a process or a
server: ``subprocess.Popen``/``run``/``check_output``, or ``Server(...)`` (``zeroserve
serve``, which the ``serve`` and ``api_server`` fixtures start).
"""

from __future__ import annotations

import ast
from functools import lru_cache
from pathlib import Path

TESTS = Path(__file__).resolve().parent
STARTS = {"Popen", "Server"}                       # called by name
SUBPROCESS = {"run", "Popen", "check_output", "check_call", "call"}   # subprocess.<x>


@lru_cache(maxsize=None)   # one walk per function: every test that reaches it asks
def _called(node: ast.AST) -> set[str]:
    """Names a piece of code calls, uses as fixtures (arguments of a function), or asks
    for by ``usefixtures``; ``subprocess.run`` and the like as ``subprocess.run``."""
    out: set[str] = set()
    for sub in ast.walk(node):
        if isinstance(sub, ast.Call):
            f = sub.func
            if isinstance(f, ast.Name):
                out.add(f.id)
            elif isinstance(f, ast.Attribute):
                if isinstance(f.value, ast.Name) and f.value.id == "subprocess":
                    out.add(f"subprocess.{f.attr}")
                else:
                    out.add(f.attr)
        elif isinstance(sub, ast.Name):
            out.add(sub.id)   # a helper passed on (target=helper) or a class used
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
        out |= {a.arg for a in node.args.args + node.args.kwonlyargs}
    return out


@lru_cache(maxsize=None)
def _module(path: Path) -> tuple[dict[str, ast.AST], dict[str, tuple[Path, str]], set[str]]:
    """A test module's top-level functions and classes, the names it imports from other
    test modules (name -> (file, name there)), and those it imports from elsewhere."""
    tree = ast.parse(path.read_text(), str(path))
    defs: dict[str, ast.AST] = {}
    imported: dict[str, tuple[Path, str]] = {}
    foreign: set[str] = set()
    for node in tree.body:
        if isinstance(node, ast.Import):
            foreign |= {(a.asname or a.name).split(".")[0] for a in node.names}
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            defs[node.name] = node
        elif isinstance(node, ast.ImportFrom) and node.module and \
                node.module.split(".")[0] == "tests":
            target = TESTS.parent.joinpath(*node.module.split("."))
            file = target.with_suffix(".py") if target.with_suffix(".py").is_file() \
                else target / "__init__.py"
            for alias in node.names:
                imported[alias.asname or alias.name] = (file, alias.name)
        elif isinstance(node, ast.ImportFrom):
            foreign |= {a.asname or a.name for a in node.names}
    return defs, imported, foreign


@lru_cache(maxsize=None)   # asked again for every test that reaches it
def _conftests(path: Path) -> list[Path]:
    folders = [path.parent, *path.parent.parents]
    return [f / "conftest.py" for f in folders
            if f.is_relative_to(TESTS) and (f / "conftest.py").is_file()]


@lru_cache(maxsize=None)   # asked again for every test that reaches it
def _resolve(name: str, path: Path) -> tuple[Path, ast.AST] | None:
    """Where ``name``, seen in ``path``, is defined among the tests: the module itself,
    what it imports from tests, or (fixtures) a conftest.py above it."""
    if name in _module(path)[2]:
        return None   # imported from the project or a library: not a fixture of ours
    for file in [path, *_conftests(path)]:
        defs, imported, _ = _module(file)
        if name in defs:
            return file, defs[name]
        if name in imported and imported[name][0].is_file():
            other, there = imported[name]
            found = _module(other)[0].get(there)
            if found is not None:
                return other, found
    return None


def starts_processes(path: Path, *names: str) -> bool:
    """Whether the test named ``names`` (its function; a class holding it) of ``path``,
    or what it reaches, starts a process."""
    seen: set[tuple[Path, str]] = set()
    todo = [(path, name) for name in names]
    while todo:
        file, current = todo.pop()
        if (file, current) in seen:
            continue
        seen.add((file, current))
        found = _resolve(current, file)
        if found is None:
            continue
        where, node = found
        calls = _called(node)
        if calls & STARTS or any(f"subprocess.{s}" in calls for s in SUBPROCESS):
            return True
        todo += [(where, c) for c in calls]
    return False
