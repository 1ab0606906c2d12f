"""Protocol version 4 in a real worker process: a batch sent right behind the LOAD of its
version is held until that load ends and then runs (its RESULT after the LOADED, with
answers, not a retry); behind a load that fails it is answered retry naming the
failure; a batch for a version neither loaded nor loading is answered retry at once, as
before. The test plays the broker with a ROUTER socket."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import pytest

from tests.conftest import linear_config
from tests.workers.test_memplan import Rig
from zeroserve.broker import protocol as p

pytestmark = pytest.mark.timeout(120)

SLOW_LOAD = '''
import time


class Model:
    def load(self, version_dir, device):
        time.sleep(0.5)  # noqa: sleep-ok (a load the batch behind it must wait for)

    def predict(self, inputs):
        return {"output": inputs["input"][:, :3] * 2.0}
'''

BROKEN = '''
class Model:
    def load(self, version_dir, device):
        raise RuntimeError("the weights are gone")

    def predict(self, inputs):
        return {"output": inputs["input"][:, :3]}
'''


def handler(repo: Path, name: str, source: str) -> tuple[str, dict[str, Any]]:
    (repo / name / "1").mkdir(parents=True)
    (repo / name / "1" / "model.py").write_text(source)
    config = {**linear_config(name), "platform": "python"}
    (repo / name / "config.json").write_text(json.dumps(config))
    return str(repo / name / "1"), config


def batch(batch_id: int, model: str) -> p.Batch:
    x = p.from_numpy("input", np.ones((1, 4), np.float32))
    return p.Batch(batch_id, model, 1, [p.BatchItem("r", [x], None)])


@pytest.fixture
def rig() -> Iterator[Rig]:
    r = Rig()
    yield r
    r.close()


def until(rig: Rig, kinds: set[p.Kind], count: int, model: str) -> list[tuple[p.Kind, Any]]:
    """The next ``count`` messages of ``kinds`` (results of ``model``'s batches),
    decoded, in the order they came."""
    out: list[tuple[p.Kind, Any]] = []
    deadline = time.monotonic() + 60
    while len(out) < count:
        left = int((deadline - time.monotonic()) * 1000)
        assert left > 0 and rig.router.poll(left), f"got {out}:\n" + \
            (rig.dir / "worker.log").read_text()[-3000:]
        _, *frames = rig.router.recv_multipart()
        kind, header, bufs = p.unpack(frames)
        if kind is p.Kind.LOADED:
            out.append((kind, p.decode(p.ModelLoaded, header)))
        elif kind is p.Kind.RESULT:
            out.append((kind, p.decode_result(header, bufs, model, 1)))
    return out


def test_a_batch_behind_its_load_waits_for_it_and_runs(rig: Rig, tmp_path: Path) -> None:
    identity, _ = rig.expect(p.Kind.READY)
    rig.send(identity, p.BrokerHeartbeat(0.2, 60.0))
    path, config = handler(tmp_path, "slow", SLOW_LOAD)
    rig.send(identity, p.LoadModel("slow", 1, path, config))
    rig.router.send_multipart([identity, *p.encode_batch(batch(1, "slow"))])
    (k1, loaded), (k2, result) = until(rig, {p.Kind.LOADED, p.Kind.RESULT}, 2, "slow")
    assert k1 is p.Kind.LOADED and loaded.ok, loaded
    assert k2 is p.Kind.RESULT and result.error is None and not result.retry, result
    [reply] = result.replies
    assert p.to_numpy(reply.tensors[0]).tolist() == [[2.0, 2.0, 2.0]]

    path, config = handler(tmp_path, "broken", BROKEN)
    rig.send(identity, p.LoadModel("broken", 1, path, config))
    rig.router.send_multipart([identity, *p.encode_batch(batch(2, "broken"))])
    (k1, loaded), (k2, result) = until(rig, {p.Kind.LOADED, p.Kind.RESULT}, 2, "broken")
    assert k1 is p.Kind.LOADED and not loaded.ok
    assert result.retry and "loading model broken/1 on worker test/0 failed" in result.error \
        and "the weights are gone" in result.error, result

    rig.router.send_multipart([identity, *p.encode_batch(batch(3, "never"))])
    [(kind, result)] = until(rig, {p.Kind.RESULT}, 1, "never")
    assert result.retry and "model never/1 is not loaded on worker test/0" in result.error
