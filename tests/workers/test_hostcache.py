"""The host-memory tier's bookkeeping, on real loaded versions of a tiny model: the
bound holds under a stream of parks, least recently parked out first, and a version is
taken back only for the same content, config and files."""

from __future__ import annotations

import os
from pathlib import Path

import torch

from tests.conftest import linear_config
from zeroserve.models.loader import LoadedModel
from zeroserve.models.repository import parse_config
from zeroserve.workers.hostcache import HostCache, files_stamp


def version(tmp: Path, name: str, memory: int) -> LoadedModel:
    vdir = tmp / name / "1"
    vdir.mkdir(parents=True, exist_ok=True)
    (vdir / "model.pt").write_bytes(b"weights of " + name.encode())
    lm = LoadedModel(name, 1, parse_config(linear_config(name), name), f"sha-{name}",
                     torch.nn.Linear(4, 3), "cpu", memory_bytes=memory, version_dir=vdir,
                     format="TorchScript")
    lm.extra.update(seq=int(name[1:]), stamp=files_stamp(vdir))
    return lm


def test_the_bound_holds_and_the_least_recently_parked_goes_first(tmp_path: Path) -> None:
    cache = HostCache(25, "cpu")
    dropped_all: list[str] = []
    for i in range(10):
        dropped = cache.park(version(tmp_path, f"m{i}", 10), {"n": i})
        dropped_all += [d.name for d in dropped]
        assert cache.bytes <= 25 and len(cache) == min(i + 1, 2)
    assert dropped_all == [f"m{i}" for i in range(8)]
    assert [d.name for d in cache.park(version(tmp_path, "m99", 26), {})] == ["m99"], \
        "larger than the bound: not parked"
    assert cache.resident_after(8) == 10 and cache.resident_after(0) == 20
    unstamped = version(tmp_path, "m50", 1)
    del unstamped.extra["stamp"]
    assert cache.park(unstamped, {}) == [unstamped], "no stamp of its files at load"


def test_taken_back_only_for_the_same_content_config_and_files(tmp_path: Path) -> None:
    cache = HostCache(100, "cpu")
    lm = version(tmp_path, "m1", 10)
    assert version_dir_of(lm) is not None
    for sha, config, change, taken in (("sha-m1", {"a": 1}, False, True),
                                       ("sha-other", {"a": 1}, False, False),
                                       ("sha-m1", {"a": 2}, False, False),
                                       ("", {"a": 1}, False, False),
                                       ("sha-m1", {"a": 1}, True, False)):
        assert cache.park(lm, {"a": 1}) == []
        if change:   # same size, a new modification time
            path = version_dir_of(lm) / "model.pt"
            path.write_bytes(path.read_bytes())
            st = path.stat()
            os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000))
        got, stale = cache.take("m1", 1, sha, config, version_dir_of(lm))
        assert (got is lm) == taken and (stale == [] if taken else stale == [lm])
        assert len(cache) == 0 and cache.bytes == 0
    assert cache.take("m1", 1, "sha-m1", {"a": 1}, version_dir_of(lm)) == (None, [])


def version_dir_of(lm: LoadedModel) -> Path:
    assert lm.version_dir is not None
    return lm.version_dir


def test_the_files_stamp_names_every_file_below_the_version_but_caches_and_dead_links(
        tmp_path: Path) -> None:
    vdir = tmp_path / "m" / "1"
    (vdir / "code" / "__pycache__").mkdir(parents=True)
    (vdir / "__pycache__").mkdir()
    (vdir / "model.pt").write_bytes(b"w" * 10)
    (vdir / "code" / "handler.py").write_text("x = 1\n")
    (vdir / "code" / "__pycache__" / "handler.cpython-311.pyc").write_bytes(b"c")
    (vdir / "__pycache__" / "model.cpython-311.pyc").write_bytes(b"c")
    (vdir / "gone").symlink_to(vdir / "nowhere")
    stamp = files_stamp(vdir)
    assert [(rel, size) for rel, size, _ in stamp] == [("code/handler.py", 6), ("model.pt", 10)]
    (vdir / "code" / "__pycache__" / "handler.cpython-311.pyc").write_bytes(b"cc")
    assert files_stamp(vdir) == stamp, "a bytecode cache is not the version's content"
    (vdir / "code" / "handler.py").write_text("x = 22\n")
    assert files_stamp(vdir) != stamp, "a rewritten file changes the stamp"
