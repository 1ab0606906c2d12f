"""The README's and the docs pages' commands stay true.

CI runs the README's test command; the docs repeat its two set-up commands exactly;
every ``zeroserve`` command in them parses with the real argument parser; every flag
they name is an option of a ``zeroserve`` command, and every option of the components
is named on some page; every benchmark command names a script that takes its flags;
every link from the README into ``docs/`` resolves, and every anchor a page links to
is the same on the docs site (Python-Markdown's slugs) as on GitHub.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import io
import re
import shlex
import unicodedata
from pathlib import Path

import pytest
from markdown.extensions.toc import slugify

from zeroserve.broker import config, options
from zeroserve.broker.bench import main as bench

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
DOCS = ROOT / "docs"
PAGES = sorted(DOCS.glob("*.md"))
EVERY = [README, *PAGES]

# Flags of other tools that the pages show with their own commands (pip, useradd, ...):
# a flag outside a `zeroserve` command must be one of zeroserve's or listed here.
FOREIGN_FLAGS = {
    "--index-url": "pip", "--build-arg": "docker", "--system": "useradd",
    "--home-dir": "useradd", "--shell": "useradd", "--groups": "useradd",
    "--strict": "mkdocs", "--gil": "py-spy",
    "--grpc-infer-response-compression-level": "tritonserver",
}


def rel(path: Path) -> str:
    return str(path.relative_to(ROOT))


def readme_commands() -> list[str]:
    return re.findall(r"```sh\n(python3 -m venv[^\n]+)\n```", README.read_text())


def code_blocks(text: str, lang: str) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", text, re.S)


def shell_lines(text: str) -> list[str]:
    """Each command of the page's ``sh`` blocks: continuations joined, comments dropped."""
    out = []
    for block in code_blocks(text, "sh"):
        for line in block.replace("\\\n", " ").splitlines():
            line = re.sub(r"(^|\s)#.*$", "", line).strip()
            if line:
                out.append(line)
    return out


def prose(text: str) -> str:
    return re.sub(r"```.*?```", "", text, flags=re.S)


def inline_code(text: str) -> list[str]:
    return re.findall(r"`([^`\n]+)`", prose(text))


def zeroserve_argv(command: str) -> list[list[str]]:
    """The argument lists after each ``zeroserve`` (a path to it, or ``sudo`` before it)
    in one shell line, split at ``&&``, ``;``, ``|`` and ``&``, up to a redirection."""
    out = []
    for part in re.split(r"&&|;|\|\||\||&", command):
        try:
            words = shlex.split(part)
        except ValueError:
            continue
        while words and (words[0] == "sudo" or "=" in words[0]):
            words = words[1:]
        # a redirection (`> key`, `2>&1`) is the shell's, not an argument
        cut = next((i for i, w in enumerate(words) if re.match(r"\d*[<>]", w)), len(words))
        words = words[:cut]
        if words and Path(words[0]).name == "zeroserve":
            out.append(words[1:])
    return out


def parse_error(argv: list[str]) -> str | None:
    """argparse's complaint about ``zeroserve ARGV``, or None when it parses."""
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            options.parser([bench.register]).parse_args(argv)
    except SystemExit as exc:
        return None if exc.code == 0 else err.getvalue().strip().splitlines()[-1]
    return None


def subcommands() -> dict[str, argparse.ArgumentParser]:
    return options.subparsers(options.parser([bench.register]))


def every_flag() -> set[str]:
    """Every flag of a ``zeroserve`` command or of a script in tests/bench or tests/gpu."""
    flags = {flag for sub in subcommands().values() for action in sub._actions
             for flag in action.option_strings if flag.startswith("--")}
    for script in [*(ROOT / "tests" / "bench").glob("*.py"),
                   *(ROOT / "tests" / "gpu").glob("*.py")]:
        flags |= set(re.findall(r'add_argument\(\s*"(--[a-z][a-z0-9-]*)"', script.read_text()))
    return flags


# -- the two set-up commands -------------------------------------------------------


def test_readme_starts_with_serve_and_test_commands():
    serve, test = readme_commands()[:2]
    assert serve.endswith("zeroserve serve")
    assert "pytest" in test


def test_ci_runs_the_readme_test_command():
    test = readme_commands()[1]
    assert test in (ROOT / ".ci" / "run").read_text().splitlines()


@pytest.mark.parametrize("page", ["index.md", "install.md"])
def test_docs_repeat_the_readme_commands_exactly(page):
    lines = shell_lines((DOCS / page).read_text())
    for command in readme_commands()[:2]:
        assert command in lines, f"docs/{page} must show the README's command:\n{command}"


def test_readme_stays_a_front_door():
    lines = README.read_text().count("\n")
    assert lines < 300, f"README.md has {lines} lines: move the detail to a docs page"


# -- commands and options ----------------------------------------------------------


@pytest.mark.parametrize("path", EVERY, ids=rel)
def test_zeroserve_commands_in_sh_blocks_parse(path):
    wrong = []
    for line in shell_lines(path.read_text()):
        for argv in zeroserve_argv(line):
            why = parse_error(argv)
            if why:
                wrong.append(f"zeroserve {shlex.join(argv)}: {why}")
    assert not wrong, f"{rel(path)}:\n" + "\n".join(wrong)


@pytest.mark.parametrize("path", EVERY, ids=rel)
def test_inline_zeroserve_commands_name_their_own_options(path):
    """``zeroserve status [--json]`` in a table: the subcommand exists and takes each flag."""
    subs, wrong = subcommands(), []
    for code in inline_code(path.read_text()):
        m = re.match(r"zeroserve ([a-z]+)\b(.*)", code)
        if not m:
            continue
        sub, rest = m.groups()
        if sub not in subs:  # with flags, a command; without, a line it prints
            if "--" in rest:
                wrong.append(f"`{code}`: no subcommand {sub!r}")
            continue
        takes = {f for a in subs[sub]._actions for f in a.option_strings}
        wrong += [f"`{code}`: zeroserve {sub} has no {flag}"
                  for flag in re.findall(r"(?<![\w-])--[a-z][a-z0-9-]*", rest)
                  if flag not in takes]
    assert not wrong, f"{rel(path)}:\n" + "\n".join(wrong)


@pytest.mark.parametrize("path", EVERY, ids=rel)
def test_every_flag_named_is_an_option(path):
    """A flag in the prose (``--shed-lag-ms``) is one of zeroserve's (or of a benchmark
    script's); another tool's flag is written with its command, or in FOREIGN_FLAGS."""
    known, wrong = every_flag() | set(FOREIGN_FLAGS), set()
    for code in inline_code(path.read_text()):
        if re.match(r"(\S*/)?(python3?|pip|\.venv/bin/\S+|tritonserver|kubectl|docker|"
                    r"curl|mkdocs|systemctl|zeroserve)\b", code):
            continue  # a command: zeroserve's own are checked above, benchmarks below
        wrong |= {flag for flag in re.findall(r"(?<![\w-])--[a-z][a-z0-9-]*", code)
                  if flag not in known}
    assert not wrong, f"{rel(path)} names flags no zeroserve command has: {sorted(wrong)}"


def test_every_component_option_is_documented():
    text = "\n".join(p.read_text() for p in EVERY)
    missing = sorted({action.option_strings[-1]
                      for component in config.COMPONENTS
                      for action in config.options(subcommands()[component]).values()
                      if not re.search(re.escape(action.option_strings[-1]) + r"(?![\w-])",
                                       text)})
    assert not missing, ("options no page names (add them to docs/configuration.md's "
                         f"table, or to the page of their feature): {missing}")


@pytest.mark.parametrize("path", EVERY, ids=rel)
def test_benchmark_and_test_commands_name_real_files(path):
    """``python -m tests.bench.X --flag`` (or ``tests.gpu.X``) names a script that
    declares that flag; ``python -m pytest PATH`` names files that exist."""
    wrong = []
    commands = shell_lines(path.read_text()) + inline_code(path.read_text())
    for line in commands:
        for m in re.finditer(r"python3? -m (tests\.(?:bench|gpu)\.\w+)([^&;|`]*)", line):
            script = ROOT / (m.group(1).replace(".", "/") + ".py")
            if not script.is_file():
                wrong.append(f"{m.group(0)}: no {rel(script)}")
                continue
            source = script.read_text()
            wrong += [f"{m.group(0)}: {rel(script)} has no {flag}"
                      for flag in re.findall(r"(?<![\w-])--[a-z][a-z0-9-]*", m.group(2))
                      if f'"{flag}"' not in source]
        for m in re.finditer(r"python3? -m pytest ((?:tests/\S+\s*)+)", line):
            wrong += [f"{m.group(0)}: no {p}" for p in m.group(1).split()
                      if not (ROOT / p.split("::")[0]).exists()]
    assert not wrong, f"{rel(path)}:\n" + "\n".join(wrong)


@pytest.mark.parametrize("path", EVERY, ids=rel)
def test_python_blocks_compile(path):
    """Snippets may await at their top level, as in an asyncio REPL or a notebook."""
    for i, block in enumerate(code_blocks(path.read_text(), "python")):
        compile(block, f"{rel(path)}, python block {i + 1}", "exec",
                flags=ast.PyCF_ALLOW_TOP_LEVEL_AWAIT, dont_inherit=True)


# -- links and anchors -------------------------------------------------------------


def heading_texts(path: Path) -> list[str]:
    """The text of each heading as rendered (code spans and links reduced to their text)."""
    out = []
    for line in prose(path.read_text()).splitlines():
        m = re.match(r"#{1,6}\s+(.*?)\s*#*\s*$", line)
        if m:
            text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", m.group(1))
            out.append(text.replace("`", "").replace("*", ""))
    return out


def unique(slugs: list[str], sep: str) -> list[str]:
    seen: dict[str, int] = {}
    out = []
    for slug in slugs:
        if slug in seen:
            seen[slug] += 1
            slug = f"{slug}{sep}{seen[slug]}"
        else:
            seen[slug] = 0
        out.append(slug)
    return out


def mkdocs_anchors(path: Path) -> list[str]:
    return unique([slugify(t, "-") for t in heading_texts(path)], "_")


def github_anchors(path: Path) -> list[str]:
    def slug(text: str) -> str:
        text = unicodedata.normalize("NFC", text).lower()
        return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")
    return unique([slug(t) for t in heading_texts(path)], "-")


def links(path: Path) -> list[str]:
    return re.findall(r"\]\(([^)\s]+)\)", prose(path.read_text()))


def test_readme_links_into_the_docs_resolve():
    wrong = []
    for target in links(README):
        if re.match(r"[a-z]+://", target):
            continue
        file, _, anchor = target.partition("#")
        dest = ROOT / file if file else README
        if not dest.is_file():
            wrong.append(f"{target}: no such file")
        elif anchor and anchor not in github_anchors(dest):
            wrong.append(f"{target}: {rel(dest)} has no heading with the anchor #{anchor}")
    assert not wrong, "README.md:\n" + "\n".join(wrong)


def test_readme_links_to_every_page():
    linked = {t.partition("#")[0] for t in links(README)}
    missing = [rel(p) for p in PAGES if rel(p) not in linked]
    assert not missing, f"README.md's table of pages leaves out {missing}"


@pytest.mark.parametrize("path", PAGES, ids=rel)
def test_anchors_a_page_links_to_are_the_same_on_github(path):
    """mkdocs build --strict checks the anchors the site makes (tests/test_docs.py); a
    heading whose GitHub anchor differs would break the same link read on GitHub."""
    wrong = []
    for target in links(path):
        file, _, anchor = target.partition("#")
        if not anchor or re.match(r"[a-z]+://", target):
            continue
        dest = path.parent / file if file else path
        if dest.is_file() and anchor in mkdocs_anchors(dest) \
                and anchor not in github_anchors(dest):
            wrong.append(f"{target}: GitHub names that heading differently; simplify it")
    assert not wrong, f"{rel(path)}:\n" + "\n".join(wrong)


def test_the_anchor_rules_agree_on_a_plain_heading_and_differ_on_punctuation(tmp_path):
    page = tmp_path / "p.md"
    page.write_text("# Load testing: `zeroserve bench`\n\n## A -- B\n\n## A -- B\n")
    assert mkdocs_anchors(page)[0] == github_anchors(page)[0] == "load-testing-zeroserve-bench"
    assert mkdocs_anchors(page)[1:] == ["a-b", "a-b_1"]
    assert github_anchors(page)[1:] == ["a----b", "a----b-1"]


def test_perf_report_writes_into_the_performance_page():
    from tests.bench import perf_report

    text = perf_report.PAGE.read_text()
    assert text.count(perf_report.BEGIN) == 1 and text.count(perf_report.END) == 1
    assert (perf_report.IMAGES / "request-path.png").is_file()


def test_a_redirection_is_no_argument_of_the_command() -> None:
    assert zeroserve_argv("zeroserve tenants add-key a --tenants f.toml > a.key 2>&1") == [
        ["tenants", "add-key", "a", "--tenants", "f.toml"]]
    assert zeroserve_argv("zeroserve models >out.txt") == [["models"]]
