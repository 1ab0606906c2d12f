"""The documentation site builds with ``mkdocs build --strict``: a link to a page or an
anchor that does not exist, an absolute link or a nav entry without its page fails
(the ``validation`` settings of mkdocs.yml make each of them a warning, and --strict
makes a warning an error)."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def build(root: Path, site: Path) -> subprocess.CompletedProcess[str]:
    # not --quiet: it silences the warnings that --strict counts, and the build passes
    return subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict",
         "--config-file", str(root / "mkdocs.yml"), "--site-dir", str(site)],
        cwd=root, capture_output=True, text=True, timeout=120)


def test_the_site_builds_strict(tmp_path: Path) -> None:
    done = build(ROOT, tmp_path / "site")
    assert done.returncode == 0, done.stdout + done.stderr
    assert (tmp_path / "site" / "index.html").is_file()
    built = {p.parent.name for p in (tmp_path / "site").rglob("index.html")}
    assert "troubleshooting" in built and "performance" in built


@pytest.fixture
def copy(tmp_path: Path) -> Path:
    """The docs and mkdocs.yml in a folder of their own, to break on purpose."""
    shutil.copytree(ROOT / "docs", tmp_path / "docs")
    shutil.copy(ROOT / "mkdocs.yml", tmp_path / "mkdocs.yml")
    return tmp_path


@pytest.mark.parametrize("link, says", [
    ("[x](scheduling.md#no-such-heading)", "does not contain an anchor '#no-such-heading'"),
    ("[x](no-such-page.md)", "'no-such-page.md', but the target is not found"),
    ("[x](/scheduling.md)", "absolute link '/scheduling.md'"),
    ("[x](../broker/protocol.py)", "'../broker/protocol.py', but the target is not found"),
])
def test_a_broken_link_fails_the_build(copy: Path, link: str, says: str) -> None:
    page = copy / "docs" / "index.md"
    page.write_text(page.read_text() + f"\n{link}\n")
    done = build(copy, copy / "site")
    assert done.returncode != 0
    assert says in done.stdout + done.stderr


def test_a_nav_entry_without_its_page_fails_the_build(copy: Path) -> None:
    (copy / "docs" / "troubleshooting.md").unlink()
    done = build(copy, copy / "site")
    assert done.returncode != 0
    assert "'troubleshooting.md' is included in the 'nav'" in done.stdout + done.stderr


def test_troubleshooting_has_every_error_code_with_its_statuses() -> None:
    """One row per ErrorCode, with the HTTP status and gRPC code the gateway answers for
    it (gateway/errors.py) and whether the client may retry it."""
    from zeroserve.broker.protocol import ErrorCode
    from zeroserve.gateway import errors

    text = (ROOT / "docs" / "troubleshooting.md").read_text()
    rows = {m[0]: m[1:] for m in re.findall(
        r"^\| `([a-z_]+)` \| (\d+) \| ([A-Z_]+) \| (yes|no) \|", text, re.M)}
    wrong = []
    for code in ErrorCode:
        status = errors.BY_CODE.get(code, errors.INTERNAL)
        want = (str(status.http), status.grpc, "yes" if code.retryable else "no")
        if rows.get(code.value) != want:
            wrong.append(f"{code.value}: the page says {rows.get(code.value)}, the code {want}")
    wrong += [f"{name}: no such ErrorCode" for name in set(rows) - {c.value for c in ErrorCode}]
    assert not wrong, "docs/troubleshooting.md's table of error codes:\n" + "\n".join(wrong)


def test_the_http_page_lists_the_extensions_the_server_reports() -> None:
    from zeroserve.gateway.app import EXTENSIONS

    text = " ".join((ROOT / "docs" / "http-api.md").read_text().split())
    listed = re.search(r"lists exactly the extensions implemented: (.*?) when it is on", text)
    assert listed, "docs/http-api.md no longer lists the extensions of GET /v2"
    named = set(re.findall(r"`([a-z_]+)`", listed.group(1)))
    assert named == {*EXTENSIONS, "system_shared_memory"}
