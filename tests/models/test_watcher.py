"""The repository watcher with real inotify: debounce, temp names, new folders,
files being written, and the polling fallback."""

from __future__ import annotations

import os
import select
from pathlib import Path

import pytest

from zeroserve.models.watcher import RepoWatcher


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def drain(w: RepoWatcher) -> None:
    """Read whatever inotify has queued (events are in the queue once the syscall returns)."""
    while select.select([w.inotify], [], [], 0)[0]:
        w.read()


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    (tmp_path / "m" / "1").mkdir(parents=True)
    (tmp_path / "m" / "1" / "model.pt").write_bytes(b"x")
    return tmp_path


def test_changes_are_debounced_and_keyed_by_model(repo: Path) -> None:
    clock = Clock()
    w = RepoWatcher(repo, debounce_s=0.2, clock=clock)
    try:
        assert w.next_due() is None and w.take_due() is None
        (repo / "m" / ".tmp-2").mkdir()
        (repo / "m" / ".tmp-2" / "model.pt").write_bytes(b"y")
        drain(w)
        assert w.next_due() is None, "temp names are ignored"
        os.rename(repo / "m" / ".tmp-2", repo / "m" / "2")
        drain(w)
        assert w.next_due() == pytest.approx(100.2)
        clock.now = 100.1
        assert w.take_due() is None, "not quiet long enough"
        clock.now = 100.25
        assert w.take_due() == {"m"}
        assert w.take_due() is None
        # the renamed folder is watched: a file written in it is seen
        (repo / "m" / "2" / "extra.py").write_text("x = 1\n")
        drain(w)
        clock.now = 101.0
        assert w.take_due() == {"m"}
        assert not w.is_writing("m", 2)
    finally:
        w.close()


def test_a_file_being_written_holds_its_version_back(repo: Path) -> None:
    clock = Clock()
    w = RepoWatcher(repo, clock=clock)
    try:
        f = open(repo / "m" / "1" / "model.pt", "wb")
        f.write(b"partial")
        f.flush()
        drain(w)
        assert w.is_writing("m", 1) and not w.is_writing("m", 2)
        f.close()
        drain(w)
        assert not w.is_writing("m", 1)
        (repo / "n").mkdir()
        drain(w)
        assert w.take_due() is None
        clock.now += 1
        assert w.take_due() == {"m", "n"}
    finally:
        w.close()


def test_poll_mode_sees_changes_after_they_settle(repo: Path) -> None:
    clock = Clock()
    w = RepoWatcher(repo, mode="poll", poll_s=1.0, debounce_s=0.2, clock=clock)
    assert w.fileno() is None and w.next_due() == pytest.approx(101.0)
    (repo / "m" / "2").mkdir()
    (repo / "m" / "2" / "model.pt").write_bytes(b"y")
    clock.now = 101.0
    assert w.take_due() is None
    assert w.is_writing("m", 2), "changed since the last pass: maybe still growing"
    clock.now = 101.3
    dirty = w.take_due()
    assert dirty == {"m"}
    clock.now = 102.1
    assert w.take_due() is None
    assert not w.is_writing("m", 2), "unchanged for one interval: settled"
    clock.now = 102.4
    assert w.take_due() == {"m"}, "settling marks the model again"


def test_bad_mode_is_refused(repo: Path) -> None:
    with pytest.raises(ValueError, match="inotify"):
        RepoWatcher(repo, mode="fanotify")
