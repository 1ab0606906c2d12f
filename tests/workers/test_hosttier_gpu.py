"""Memory returned after a move back from the host-memory tier: a version parked in host
memory (an unload), taken back (a load), then unloaded for good leaves the device as it
found it, and the worker sees no leak to recycle for. The worker's own code
(``Loader.load_version``, ``Loader.unload_version``) in this process, no broker; on the
CPU, and on a GPU where there is one."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Iterator

import pytest
import torch

from tests.conftest import linear_config, short_tmpdir, write_model
from zeroserve.broker import protocol as p
from zeroserve.workers.worker import Worker

WIDTH = 2048   # 16 MB of weights: a few allocator blocks, no rounding luck


@pytest.fixture
def repo() -> Iterator[Path]:
    root = short_tmpdir("zstier")
    write_model(root, "wide", 1, f"nn.Linear({WIDTH}, {WIDTH})",
                linear_config("wide", n_in=WIDTH, n_out=WIDTH))
    yield root
    shutil.rmtree(root, ignore_errors=True)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda:0", marks=pytest.mark.gpu)])
def test_memory_is_returned_after_a_move_back_from_the_host_tier(repo: Path, device: str
                                                                 ) -> None:
    if device.startswith("cuda") and not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    worker = Worker("ipc:///nonexistent", "tier/0", device=device)
    msg = p.LoadModel("wide", 1, str(repo / "wide" / "1"),
                      linear_config("wide", n_in=WIDTH, n_out=WIDTH))
    base = torch.cuda.memory_allocated(device) if device != "cpu" else 0
    first = worker.loader.load_version(msg)
    assert first.ok, first.error
    msg = p.LoadModel("wide", 1, msg.path, msg.config, sha256=first.sha256)
    worker.loader.unload_version("wide", 1)       # parked in host memory
    parked = torch.cuda.memory_allocated(device) if device != "cpu" else 0
    back = worker.loader.load_version(msg)        # moved back from it
    assert back.ok and worker.loader.host_cache.hits == 1, (back, worker.loader.host_cache.hits)
    x = torch.ones(2, WIDTH, device=device)
    with torch.inference_mode():
        assert worker.models[("wide", 1)].fn(x).shape == (2, WIDTH)
    del x
    worker.loader.unload_version("wide", 1)
    assert worker.loader.recycle_reason == "", worker.loader.recycle_reason
    if device != "cpu":
        # parked, the weights left the device; taken back and parked again, they left it
        # again: nothing of them stays allocated there
        now = torch.cuda.memory_allocated(device)
        assert parked - base < 1 << 20 and now - base < 1 << 20, (base, parked, now)
