"""The import rules, read from the source's own imports (every module on disk, nothing
listed by hand): broker never imports workers or gateway; gateway never imports
workers, models' loaders or torch; models never import broker; only workers (and the
model loaders they call) import torch. The rooms match the processes: workers and the
gateway import the shared wire library and the broker's client, never the broker's
process (``broker/server``); no process imports the load generator (``broker/bench``),
which the CLI registers."""

from __future__ import annotations

import ast
import functools
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import ROOT
from zeroserve.broker import protocol as p
from zeroserve.broker.server.pool import WorkerPool

PACKAGES = ("broker", "gateway", "workers", "models")
FORBIDDEN = {
    "broker": ("zeroserve.workers", "zeroserve.gateway", "torch"),
    "gateway": ("zeroserve.workers", "zeroserve.models.loader", "zeroserve.models.handlers",
                "torch", "zeroserve.broker.server", "zeroserve.broker.bench"),
    "models": ("zeroserve.broker",),
    "workers": ("zeroserve.broker.server", "zeroserve.broker.bench"),
}


@functools.lru_cache(maxsize=None)   # every check walks every module: parse each once
def parsed(path: Path) -> ast.Module:
    return ast.parse(path.read_text(), str(path))


def imports(path: Path) -> list[tuple[int, str]]:
    """Every module a file imports, at any depth (function-local imports count too)."""
    tree = parsed(path)
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


def imports_of_room(room: str, root: Path = ROOT) -> list[tuple[str, int, str]]:
    """(file, line, module) of every import in ``room`` (a folder under the root, or a
    package's top-level modules when it ends in ``/*.py``)."""
    paths = sorted((root / room[:-len("/*.py")]).glob("*.py")) if room.endswith("/*.py") \
        else sorted((root / room).rglob("*.py"))
    return [(str(path.relative_to(root)), line, name)
            for path in paths for line, name in imports(path)]


def named(name: str, module: str) -> bool:
    return name == module or name.startswith(module + ".")


def test_no_process_imports_the_load_generator() -> None:
    """The bench is the CLI's subcommand (bin/zeroserve registers it with
    options.parser): the options every process parses do not stand on it."""
    wrong = [f"{path}:{line} imports {name}" for package in PACKAGES
             for path, line, name in imports_of_room(package)
             if named(name, "zeroserve.broker.bench") and not path.startswith("broker/bench/")]
    assert not wrong, "\n".join(wrong)


# the shared library's modules that are a CLI's, and so may use the broker's own files
CLI_OF_THE_BROKER = {"broker/tenants_cli.py"}   # zeroserve tenants: the tenants file


def test_the_shared_library_does_not_stand_on_the_broker_process() -> None:
    """broker/*.py is what every process imports (the wire protocol, the client, the
    options): none of it imports the broker process's package, bar the CLI's verbs."""
    wrong = [f"{path}:{line} imports {name}"
             for path, line, name in imports_of_room("broker/*.py")
             if named(name, "zeroserve.broker.server") and path not in CLI_OF_THE_BROKER]
    assert not wrong, "\n".join(wrong)


def test_the_room_rules_see_a_stray_import(tmp_path: Path) -> None:
    (tmp_path / "broker").mkdir()
    (tmp_path / "broker" / "options.py").write_text(
        "def f():\n    from zeroserve.broker.bench import main\n")
    (tmp_path / "broker" / "protocol.py").write_text("import zeroserve.broker.server.pool\n")
    assert [(p, n) for p, _, n in imports_of_room("broker/*.py", tmp_path)] == [
        ("broker/options.py", "zeroserve.broker.bench"),
        ("broker/protocol.py", "zeroserve.broker.server.pool")]


def test_torch_stays_in_workers_and_model_loaders() -> None:
    allowed = {"workers", "models/loader.py", "models/handlers.py", "models/examples.py",
               "models/aoti.py", "models/causal_lm.py", "models/kv_slab.py"}
    wrong = []
    for package in PACKAGES:
        for path in modules(package):
            rel = str(path.relative_to(ROOT))
            if rel.split("/")[0] in allowed or rel in allowed:
                continue
            wrong += [f"{rel}:{line}" for line, name in imports(path)
                      if name == "torch" or name.startswith("torch.")]
    assert not wrong, "\n".join(wrong)


# OpenTelemetry is an extra: a plain install (the README's first command) has none of it
BLOCK_OTEL = """
import importlib.abc, sys
class NoSDK(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] == "opentelemetry":
            raise ImportError(f"{name}: the optional SDK, not installed")
sys.meta_path.insert(0, NoSDK())
"""


@pytest.mark.tool
def test_every_process_starts_without_the_optional_sdk() -> None:
    entries = ["zeroserve.workers.main", "zeroserve.gateway.serve",
               "zeroserve.broker.server.main", "zeroserve.workers.serve"]
    code = BLOCK_OTEL + "".join(f"import {m}\n" for m in entries)
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120)
    assert run.returncode == 0, "a module level import reaches opentelemetry:\n" + \
        run.stderr[-3000:]


def test_the_rule_checker_sees_function_local_imports(tmp_path: Path) -> None:
    sample = tmp_path / "m.py"
    sample.write_text("def f():\n    from zeroserve.workers.main import run\n")
    assert imports(sample) == [(2, "zeroserve.workers.main")]


# -- import cycles, typing-only imports included ------------------------------------------
# The back edges of the cycles that exist today, each a typing-only import (``if
# TYPE_CHECKING:``) or a function-local one, with the owner who may break it. The graph
# is checked without them: any other cycle, or one of these closed by a new edge, fails.
KNOWN_BACK_EDGES = {
    ("broker/server/fairqueue.py", "broker/server/scheduler.py"),   # lead: Entry, typing
    ("gateway/errors.py", "gateway/http.py"),            # gateway: error_response, local
    ("models/repository.py", "models/triton_config.py"),  # protobuf only for config.pbtxt
}


def module_file(name: str, root: Path = ROOT) -> str | None:
    """The file of a ``zeroserve.*`` module, relative to ``root`` (None: not ours)."""
    if not name.startswith("zeroserve."):
        return None
    rel = Path(*name.split(".")[1:])
    for candidate in (rel.with_suffix(".py"), rel / "__init__.py"):
        if (root / candidate).is_file():
            return str(candidate)
    return None


def import_graph(root: Path = ROOT) -> dict[str, set[str]]:
    """File -> the project files it imports, typing-only and function-local imports too
    (``from zeroserve.x import y``: ``x/y.py`` when ``y`` is a module, else ``x``)."""
    graph: dict[str, set[str]] = {}
    for package in PACKAGES:
        for path in sorted((root / package).rglob("*.py")):
            edges = set()
            tree = parsed(path)
            for node in ast.walk(tree):
                if isinstance(node, ast.Import):
                    targets = [module_file(a.name, root) for a in node.names]
                elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                    # from a package, a submodule where the name is one, else the package
                    targets = [module_file(f"{node.module}.{a.name}", root)
                               or module_file(node.module, root) for a in node.names]
                else:
                    continue
                edges |= {t for t in targets if t is not None}
            here = str(path.relative_to(root))
            graph[here] = edges - {here}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[set[str]]:
    """The strongly connected groups of more than one file (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[set[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in graph.get(node, ()):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            group = set()
            while True:
                member = stack.pop()
                on_stack.discard(member)
                group.add(member)
                if member == node:
                    break
            if len(group) > 1:
                out.append(group)

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return out


def test_no_import_cycle_even_through_typing_only_imports() -> None:
    graph = {a: {b for b in edges if (a, b) not in KNOWN_BACK_EDGES}
             for a, edges in import_graph().items()}
    found = [sorted(c) for c in cycles(graph)]
    assert not found, "import cycles:\n" + "\n".join(" <-> ".join(c) for c in found)


def test_the_cycle_finder_sees_a_typing_only_edge(tmp_path: Path) -> None:
    (tmp_path / "broker").mkdir()
    (tmp_path / "broker" / "a.py").write_text("from zeroserve.broker.b import B\n")
    (tmp_path / "broker" / "b.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
        "    from zeroserve.broker.a import A\n")
    for package in PACKAGES[1:]:
        (tmp_path / package).mkdir()
    assert cycles(import_graph(tmp_path)) == [{"broker/a.py", "broker/b.py"}]


# -- nobody writes another object's private attributes -----------------------------------
# Private is private to its module: the one writer of a piece of state (the worker pool
# of WorkerState, say) keeps that state's class beside it and writes its ``_fields``;
# everyone else reads public, read-only views and asks the owner's verbs.
GENERATED = "# Generated by the protocol buffer compiler."   # protoc's code is not ours
MUTATORS = {"add", "append", "clear", "discard", "extend", "insert", "pop", "popitem",
            "remove", "setdefault", "update", "difference_update", "intersection_update",
            "symmetric_difference_update", "sort", "reverse"}


def declared_private(tree: ast.AST) -> set[str]:
    """The private names a module's own classes declare: ``self._x = ...`` in their
    methods, or an entry of their ``__slots__``."""
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store) \
                and isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"):
            out.add(node.attr)
        elif isinstance(node, ast.Assign) and any(
                isinstance(t, ast.Name) and t.id == "__slots__" for t in node.targets):
            out |= {e.value for e in ast.walk(node.value)
                    if isinstance(e, ast.Constant) and isinstance(e.value, str)}
    return {name for name in out if name.startswith("_") and not name.startswith("__")}


def _written(node: ast.AST) -> list[ast.expr]:
    """What a statement or call changes: assignment and ``del`` targets, and the object
    a mutating method is called on (``x._items.append(...)``)."""
    if isinstance(node, (ast.Assign, ast.Delete)):
        targets = node.targets
    elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
        targets = [node.target]
    elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) \
            and node.func.attr in MUTATORS:
        targets = [node.func.value]
    else:
        return []
    return [e for t in targets for e in (t.elts if isinstance(t, ast.Tuple) else [t])]


def private_writes(path: Path, root: Path = ROOT) -> list[str]:
    """Writes (plain, augmented, annotated, del, a mutating call) to ``x._name`` where
    ``x`` is not ``self`` or ``cls`` and ``_name`` is not declared by a class of this
    module: another module's private state."""
    if GENERATED in path.read_text()[:500]:
        return []
    tree = parsed(path)
    ours = declared_private(tree)
    out = []
    for node in ast.walk(tree):
        for target in _written(node):
            while isinstance(target, ast.Subscript):
                target = target.value
            if not isinstance(target, ast.Attribute) or not target.attr.startswith("_") \
                    or target.attr.startswith("__") or target.attr in ours:
                continue
            owner = target.value
            if isinstance(owner, ast.Name) and owner.id in ("self", "cls"):
                continue
            out.append(f"{path.relative_to(root)}:{node.lineno} "
                       f"{ast.unparse(target)}")
    return out


def test_no_object_writes_another_objects_private_attributes() -> None:
    wrong = [w for package in PACKAGES for path in modules(package)
             for w in private_writes(path)]
    assert not wrong, "\n".join(wrong)


def test_the_private_write_checker_sees_one(tmp_path: Path) -> None:
    (tmp_path / "pkg").mkdir()
    sample = tmp_path / "pkg" / "m.py"
    sample.write_text("def f(other, self):\n    other._state = 1\n    self._mine = 2\n"
                      "    self.peer._x[0] = 3\n    other._items.append(4)\n"
                      "    other._mine = 5\n")
    assert private_writes(sample, tmp_path) == ["pkg/m.py:2 other._state",
                                                "pkg/m.py:4 self.peer._x",
                                                "pkg/m.py:5 other._items"]


def test_worker_state_is_written_only_by_its_pool() -> None:
    """Every public attribute of a WorkerState is read-only (an assignment raises), and
    its private fields are the pool module's: a write from anywhere else is a private
    write (the test above)."""
    pool = WorkerPool(lambda identity, frames: True, lambda: 0.0)
    worker = pool.register(b"w", p.WorkerReady("w/0", 1), 0.0)
    public = [n for n in dir(worker) if not n.startswith("_")
              and not callable(getattr(worker, n))]
    assert {"loaded", "loading", "load_errors", "draining", "last_seen_s", "memory"} \
        <= set(public)
    writable = []
    for name in public:
        try:
            setattr(worker, name, getattr(worker, name))
        except AttributeError:
            continue
        writable.append(name)
    assert not writable, f"WorkerState attributes anyone may assign: {writable}"
    state = parsed(ROOT / "broker/server/pool.py")
    assert {f"_{n}" for n in public if n not in ("free", "on_cpu")} \
        <= declared_private(state)


# -- tests wait for conditions, not durations ---------------------------------------------
SLEEP = re.compile(r"\b(time|asyncio)\.sleep\(")
SLEEP_OK = "# noqa: sleep-ok"   # a deliberate one, with the reason beside it


def untagged_sleeps(root: Path) -> list[str]:
    return [f"{path.relative_to(root)}:{n}: {line.strip()}"
            for path in sorted(root.rglob("*.py"))
            for n, line in enumerate(path.read_text().splitlines(), 1)
            if SLEEP.search(line) and SLEEP_OK not in line]


def test_no_test_sleeps_without_saying_why() -> None:
    """A sleep in a test waits for a duration: wait for a condition with a deadline
    (``tests.conftest.wait_for``) instead, or tag a deliberate one (a one-turn yield, a
    sender's pacing) with ``# noqa: sleep-ok`` and the reason."""
    wrong = untagged_sleeps(ROOT / "tests")
    assert not wrong, "\n".join(wrong)


def test_the_sleep_finder_sees_an_untagged_one(tmp_path: Path) -> None:
    (tmp_path / "t.py").write_text("import time\ntime.sleep(0.1)\n"   # noqa: sleep-ok (a sample)
                                   "time.sleep(0.1)  # noqa: sleep-ok (pacing)\n")
    assert untagged_sleeps(tmp_path) == ["t.py:2: time.sleep(0.1)"]   # noqa: sleep-ok


# -- rooms of a size a reader takes in -----------------------------------------------------
# A class over CLASS_LINES in a process's package, or a module over MODULE_LINES, is split
# by concern. The ones over today, each with its owner and why it may stay for now:
CLASS_LINES, MODULE_LINES = 350, 600
OVERSIZED: dict[str, str] = {}


def classes_over(folder: Path, lines: int = CLASS_LINES, root: Path = ROOT) -> list[str]:
    """``path:Class (n lines)`` for every class of ``folder``'s modules longer than
    ``lines`` (nested classes count within their class)."""
    out = []
    for path in sorted(folder.rglob("*.py")):
        for node in parsed(path).body:
            if isinstance(node, ast.ClassDef):
                size = (node.end_lineno or node.lineno) - node.lineno + 1
                if size > lines:
                    out.append(f"{path.relative_to(root)}:{node.name} ({size} lines)")
    return out


def modules_over(folder: Path, lines: int = MODULE_LINES, root: Path = ROOT) -> list[str]:
    return [f"{path.relative_to(root)} ({n} lines)" for path in sorted(folder.rglob("*.py"))
            if (n := len(path.read_text().splitlines())) > lines]


def _unexcused(found: list[str]) -> list[str]:
    return [f for f in found if f.split(" (")[0] not in OVERSIZED]


def test_no_class_over_350_lines_in_the_broker_server() -> None:
    wrong = _unexcused(classes_over(ROOT / "broker" / "server"))
    assert not wrong, "split by concern:\n" + "\n".join(wrong)


def test_no_module_over_600_lines_in_broker() -> None:
    wrong = _unexcused(modules_over(ROOT / "broker"))
    assert not wrong, "split by concern:\n" + "\n".join(wrong)


def test_every_size_allowance_is_still_needed() -> None:
    over = {f.split(" (")[0] for f in classes_over(ROOT / "broker" / "server")
            + modules_over(ROOT / "broker")}
    stale = sorted(set(OVERSIZED) - over)
    assert not stale, f"no longer over: remove from OVERSIZED: {stale}"


def test_the_size_checkers_see_a_long_class_and_module(tmp_path: Path) -> None:
    (tmp_path / "m.py").write_text("class Big:\n" + "    x = 1\n" * 5 + "class Small:\n    y = 2\n")
    assert classes_over(tmp_path, 5, tmp_path) == ["m.py:Big (6 lines)"]
    assert modules_over(tmp_path, 7, tmp_path) == ["m.py (8 lines)"]
    assert modules_over(tmp_path, 8, tmp_path) == []


# -- one composition root, named ports ---------------------------------------------------
# The broker's parts are built in one place (``Broker._compose``), in dependency order,
# each handed what it asks. A lambda there is a callback into an object built later: none
# is left. The cycles that were (the lifecycle and the worker loads built from the
# placement strategies, which ask them to load; the repository extension built before the
# lifecycle it drives) are broken by tables built first (``ReplicaSets``,
# ``OnDemandSets``, ``ModelControl``) and one outbox the lifecycle drains (``Rescans``).
COMPOSITION_ROOT = ("broker/server/broker.py", "Broker", "_compose")


def _method(path: Path, cls: str, name: str) -> ast.FunctionDef:
    for node in parsed(path).body:
        if isinstance(node, ast.ClassDef) and node.name == cls:
            for item in node.body:
                if isinstance(item, ast.FunctionDef) and item.name == name:
                    return item
    raise LookupError(f"{path}: no {cls}.{name}")


def late_bindings(fn: ast.FunctionDef) -> list[tuple[str, str]]:
    """(constructor, argument) of every lambda passed to a call in ``fn`` (positional
    arguments are named by their index)."""
    out = []
    for node in ast.walk(fn):
        if not isinstance(node, ast.Call):
            continue
        callee = ast.unparse(node.func)
        args = [(str(i), a) for i, a in enumerate(node.args)] + \
            [(k.arg or "**", k.value) for k in node.keywords]
        out += [(callee, name) for name, value in args
                if any(isinstance(n, ast.Lambda) for n in ast.walk(value))]
    return out


def test_the_composition_root_binds_no_lambda() -> None:
    path, cls, name = COMPOSITION_ROOT
    found = late_bindings(_method(ROOT / path, cls, name))
    assert not found, "a part built later, bound late: build it first, or hand the later " \
        "part a named Protocol its owner implements:\n" + "\n".join(
            f"{c}({a}=lambda ...)" for c, a in found)


def test_the_late_binding_finder_sees_a_lambda(tmp_path: Path) -> None:
    sample = tmp_path / "b.py"
    sample.write_text("class B:\n    def _compose(self):\n        self.a = A(f=lambda: self.c)\n"
                      "        self.c = C(self.a.g, lambda x: x)\n")
    assert late_bindings(_method(sample, "B", "_compose")) == [("A", "f"), ("C", "1")]


# -- nothing reaches through a part to its parts ------------------------------------------
def part_names(folder: Path, root_path: Path, cls: str, method: str) -> set[str]:
    """The names of parts: what the composition root binds (``self.x = ...`` or a local),
    and what a part builds itself (``self.x = SomeClass(...)`` of a class in ``folder``;
    the metrics' series and the socket loop's sockets are not parts)."""
    names = set()
    for node in ast.walk(_method(root_path, cls, method)):
        targets = node.targets if isinstance(node, ast.Assign) else []
        for t in targets:
            for e in (t.elts if isinstance(t, ast.Tuple) else [t]):
                if isinstance(e, ast.Name):
                    names.add(e.id)
                elif isinstance(e, ast.Attribute) and not e.attr.startswith("_"):
                    names.add(e.attr)
    ours = {n.name for path in folder.rglob("*.py") for n in ast.walk(parsed(path))
            if isinstance(n, ast.ClassDef)}
    for path in folder.rglob("*.py"):
        if path.name in ("metrics.py", "loop.py"):
            continue
        for node in ast.walk(parsed(path)):
            if isinstance(node, ast.Assign) and isinstance(node.value, ast.Call) \
                    and isinstance(node.value.func, ast.Name) and node.value.func.id in ours:
                names |= {t.attr for t in node.targets if isinstance(t, ast.Attribute)
                          and isinstance(t.value, ast.Name) and t.value.id == "self"}
    return names


def reach_throughs(path: Path, parts: set[str], root: Path = ROOT) -> list[str]:
    """``self.a.b`` where ``b`` is a part and is used, not called: reaching through one
    part to another's (``self.a.b()`` is a's verb; a metric's series are its own)."""
    tree = parsed(path)
    called = {id(n.func) for n in ast.walk(tree) if isinstance(n, ast.Call)}
    return [f"{path.relative_to(root)}:{n.lineno} {ast.unparse(n)}" for n in ast.walk(tree)
            if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Attribute)
            and isinstance(n.value.value, ast.Name) and n.value.value.id == "self"
            and n.value.attr != "metrics" and n.attr in parts and id(n) not in called]


def test_no_part_reaches_through_another_to_its_parts() -> None:
    folder = ROOT / "broker" / "server"
    path, cls, name = COMPOSITION_ROOT
    parts = part_names(folder, ROOT / path, cls, name)
    assert {"pool", "catalog", "lifecycle", "intake", "swaps"} <= parts
    wrong = [w for p in sorted(folder.rglob("*.py")) for w in reach_throughs(p, parts)]
    assert not wrong, "hand the part what it asks at construction, or ask the owner's " \
        "verb:\n" + "\n".join(wrong)


def test_the_reach_through_finder_sees_one(tmp_path: Path) -> None:
    sample = tmp_path / "m.py"
    sample.write_text("class A:\n    def f(self):\n        self.path.answers.retain(1)\n"
                      "        self.path.answers()\n        self.metrics.answers.inc()\n"
                      "        return self.pool.workers\n")
    assert reach_throughs(sample, {"answers", "pool"}, tmp_path) == [
        "m.py:3 self.path.answers"]


def test_no_class_over_350_lines_or_module_over_600_in_workers() -> None:
    """The worker's three threads were one class of 601 lines; each is a class now."""
    wrong = classes_over(ROOT / "workers") + modules_over(ROOT / "workers")
    assert not wrong, "split by concern:\n" + "\n".join(wrong)
