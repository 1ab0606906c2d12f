"""Python handler models (``model.py``) loaded as isolated packages.

Each (model, version, content hash) becomes its own package,
``_zeroserve_models.<model>.v<version>_<sha8>``, whose ``__path__`` is the
version folder, so ``from . import utils`` finds that version's ``utils.py`` and
no other. An absolute ``import utils`` would resolve through ``sys.path`` and
leak one version's code into another, so it fails the load with a message that
says to import relatively. Unloading removes the package's modules from
``sys.modules``; with the handler object dropped, nothing keeps the code alive.
"""

from __future__ import annotations

import asyncio
import importlib.util
import inspect
import re
import sys
import threading
import types
from pathlib import Path
from typing import Any

ROOT_PACKAGE = "_zeroserve_models"


class HandlerError(Exception):
    """A handler that cannot be loaded; the message says why."""


class NoModels:
    """Given as ``models`` where a handler may not call models: a handler that asks for
    them is refused at load with ``reason``."""

    def __init__(self, reason: str) -> None:
        self.reason = reason


def _ident(name: str) -> str:
    # model names allow '.', '-': neither may appear in a module name
    return re.sub(r"\W", "_", name)


def package_name(model: str, version: int, sha256: str) -> str:
    return f"{ROOT_PACKAGE}.{_ident(model)}.v{version}_{sha256[:8]}"


def _ensure_parent(name: str) -> None:
    """Empty namespace parents, so the dotted name imports like any package."""
    parts = name.split(".")
    for i in range(1, len(parts)):
        parent = ".".join(parts[:i])
        if parent not in sys.modules:
            mod = types.ModuleType(parent)
            mod.__path__ = []
            sys.modules[parent] = mod


def _local_modules(version_dir: Path) -> set[str]:
    names = {p.stem for p in version_dir.glob("*.py")}
    names |= {p.name for p in version_dir.iterdir() if (p / "__init__.py").is_file()}
    return names


def _absolute_siblings(before: set[str], version_dir: Path) -> list[str]:
    """Top-level modules that appeared during the load and live in the version folder."""
    found = []
    root = str(version_dir.resolve())
    for name in set(sys.modules) - before:
        if "." in name:
            continue
        path = getattr(sys.modules.get(name), "__file__", None) or ""
        if path and str(Path(path).resolve()).startswith(root):
            found.append(name)
    return sorted(found)


def calls_models(handler: Any) -> bool:
    """Whether a handler asks for a client of other models: its ``load`` takes a
    ``models`` argument (docs/bls.md)."""
    try:
        return "models" in inspect.signature(handler.load).parameters
    except (TypeError, ValueError):   # a builtin or C callable: no signature to read
        return False


_loops = threading.local()


def sync_predict(predict: Any) -> Any:
    """An ``async def predict`` as a plain call, run on its thread's own event loop
    (kept for the thread's life, so the models client's futures and the handler's
    tasks share one loop per thread)."""
    if not inspect.iscoroutinefunction(predict):
        return predict

    def run(inputs: Any) -> Any:
        loop = getattr(_loops, "loop", None)
        if loop is None:
            loop = _loops.loop = asyncio.new_event_loop()
        return loop.run_until_complete(predict(inputs))
    return run


def load_handler(model: str, version: int, sha256: str, version_dir: Path,
                 device: str, models: Any = None,
                 methods: tuple[str, ...] = ("predict",)) -> tuple[Any, str]:
    """Import ``model.py`` as a unique package, build ``Model()`` and call its load().
    A handler whose load() takes ``models`` is given ``models``: the client its
    predict() calls other models with (workers/bls.py builds it).

    ``methods``: what the class must define beside load() (an iterative model's are
    join() and step()).

    Returns (handler, package name). Raises HandlerError with the reason; on
    failure nothing of the package stays in ``sys.modules``.
    """
    pkg = package_name(model, version, sha256)
    unload_package(pkg)  # a half-loaded leftover of an earlier failed attempt
    _ensure_parent(pkg)
    spec = importlib.util.spec_from_file_location(
        pkg, version_dir / "model.py", submodule_search_locations=[str(version_dir)])
    if spec is None or spec.loader is None:
        raise HandlerError(f"{version_dir / 'model.py'} cannot be imported")
    module = importlib.util.module_from_spec(spec)
    before = set(sys.modules)
    sys.modules[pkg] = module
    try:
        try:
            spec.loader.exec_module(module)
        except ModuleNotFoundError as exc:
            if exc.name in _local_modules(version_dir):
                raise HandlerError(_relative_hint(model, version, exc.name)) from None
            raise
        leaked = _absolute_siblings(before, version_dir)
        if leaked:
            for name in leaked:
                sys.modules.pop(name, None)
            raise HandlerError(_relative_hint(model, version, leaked[0]))
        cls = getattr(module, "Model", None)
        if not isinstance(cls, type):
            raise HandlerError(f"{model}/{version}: model.py defines no class Model")
        handler = cls()
        for method in ("load", *methods):
            if not callable(getattr(handler, method, None)):
                raise HandlerError(f"{model}/{version}: class Model has no {method}() method")
        if calls_models(handler):
            if models is None or isinstance(models, NoModels):
                why = models.reason if models is not None else "this process does not offer one"
                raise HandlerError(f"{model}/{version}: load() asks for a models client, "
                                   f"and {why}")
            handler.load(version_dir, device, models=models)
        else:
            handler.load(version_dir, device)
    except BaseException:
        unload_package(pkg, version_dir)
        raise
    return handler, pkg


def _relative_hint(model: str, version: int, name: str | None) -> str:
    return (f"{model}/{version}: model.py imports its sibling module {name!r} absolutely; "
            f"import it relatively (`from . import {name}`) so versions stay isolated")


def unload_package(pkg: str, version_dir: Path | None = None) -> int:
    """Remove a handler package and its submodules from ``sys.modules``; returns how many."""
    doomed = [n for n in sys.modules if n == pkg or n.startswith(pkg + ".")]
    for name in doomed:
        del sys.modules[name]
    if version_dir is not None:
        # the import system caches a finder per search path; drop ours so nothing lingers
        sys.path_importer_cache.pop(str(version_dir), None)
    return len(doomed)
