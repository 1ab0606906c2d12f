"""Rollouts in the broker without sockets (BrokerRig): requests routed by key, a plan
refused whole, a canary's failures after its rollback run again on the stable version,
promotion retiring the old one, and every request answered once."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tests.broker.rig import BrokerRig
from tests.conftest import linear_config
from zeroserve.broker import protocol as p
from zeroserve.broker.server.control import ControlError

CONFIG = linear_config("m", version_policy={"latest": 2})


@pytest.fixture
def rig(tmp_path: Path) -> BrokerRig:
    rig = BrokerRig(tmp_path / "repo")
    rig.add_model("m", CONFIG, versions=(1, 2), factory="nn.Linear(4, 3)")
    rig.worker("w1", credits=64)
    rig.loaded("w1", "m", 1)
    rig.loaded("w1", "m", 2)
    return rig


def send(rig: BrokerRig, n: int, key: str) -> None:
    """Request ``r<n>``, whose input holds ``n`` so its batch item says whose it is."""
    req = p.InferRequest(f"r{n}", "m",
                         [p.from_numpy("input", np.full((1, 4), n, np.float32))],
                         routing_key=key)
    rig.b.on_frontend(b"gw", [bytes(f) for f in p.encode_request(req)])


def rids(batch: p.Batch) -> list[str]:
    return [f"r{int(p.to_numpy(i.tensors[0]).flat[0])}" for i in batch.items]


def batches(rig: BrokerRig, seen: set[int]) -> list[p.Batch]:
    """The batches sent since the last call."""
    out = [b for _, _, b in rig.sent(p.Kind.BATCH) if b.batch_id not in seen]
    seen.update(b.batch_id for b in out)
    return out


def ok(rig: BrokerRig, batch: p.Batch, compute_ms: float = 1.0) -> None:
    rig.from_worker("w1", p.BatchResult(batch.batch_id, [
        p.InferReply(i.request_id, batch.model, batch.version, i.tensors)
        for i in batch.items], compute_ms))


def fail(rig: BrokerRig, batch: p.Batch) -> None:
    rig.from_worker("w1", p.BatchResult(batch.batch_id, [], 1.0,
                                        error="ValueError: the canary fails"))


def answers(rig: BrokerRig) -> dict[str, p.InferReply | p.ErrorReply]:
    out: dict[str, p.InferReply | p.ErrorReply] = {}
    for _, frames in rig.to_clients:
        kind, header, bufs = p.unpack(frames)
        if kind in (p.Kind.REPLY, p.Kind.REPLIES):
            parts = p.decode_replies(header, bufs) if kind is p.Kind.REPLIES \
                else [p.decode_reply(header, bufs)]
            for rep in parts:
                assert rep.request_id not in out, "a second answer"
                out[rep.request_id] = rep
        elif kind is p.Kind.ERROR:
            err = p.decode_error(header)
            assert err.request_id not in out, "a second answer"
            out[err.request_id] = err
    return out


def start(rig: BrokerRig, **plan: Any) -> dict[str, Any]:
    return rig.b.releases.rollout_verb({"model": "m", "version": 2, **plan})


def test_requests_follow_their_key_and_the_split(rig: BrokerRig) -> None:
    start(rig, steps=[30, 100], dwell_s=60.0)
    for i in range(400):
        send(rig, i, f"user-{i % 100}")
    rig.tick()
    seen: set[int] = set()
    by_key: dict[str, set[int]] = {}
    keys = {f"r{i}": f"user-{i % 100}" for i in range(400)}
    for b in batches(rig, seen):
        for rid in rids(b):
            by_key.setdefault(keys[rid], set()).add(b.version)
    assert all(len(v) == 1 for v in by_key.values()), "a key saw two versions"
    canary = sum(v == {2} for v in by_key.values())
    assert 15 <= canary <= 45, canary   # 30 of 100 keys, give or take the hash


@pytest.mark.parametrize("plan, message", [
    ({"steps": [50, 25, 100]}, "ascend"),
    ({"steps": [25, 50]}, "end at 100"),
    ({"version": 7}, "version 7"),
    ({"stable": 2}, "stable must be another"),
    ({"stable": 9}, "stable must be another"),
])
def test_a_bad_plan_is_refused_and_changes_nothing(rig: BrokerRig, plan: dict[str, Any],
                                                   message: str) -> None:
    with pytest.raises(ControlError, match=message) as err:
        start(rig, **plan)
    assert err.value.code == "bad_input"
    assert rig.b.catalog.models["m"].weights is None and not rig.b.releases.rollouts


def test_failures_after_the_rollback_run_again_on_the_stable_version(rig: BrokerRig
                                                                     ) -> None:
    """Canary batches fail one by one: those failed before the verdict fail their
    requests; the one that brings the verdict, and every one after, run again on
    version 1 and are answered by it."""
    start(rig, steps=[50, 100], dwell_s=60.0, min_requests=12, min_errors=2,  # 2 batches
          retry=False)
    for i in range(200):
        send(rig, i, f"user-{i}")
    rig.tick()
    seen: set[int] = set()
    sent = batches(rig, seen)
    canary = [b for b in sent if b.version == 2]
    expected_failed: set[str] = set()
    rescued = 0
    for b in canary:
        fail(rig, b)
        if "m" in rig.b.releases.ended:
            rescued += 1
        else:
            expected_failed |= set(rids(b))
    assert expected_failed and rescued >= 2, (len(expected_failed), rescued)
    assert rig.b.releases.ended["m"]["outcome"] == "rolled back"
    assert rig.b.catalog.models["m"].failed.keys() == {2}
    for b in sent:
        if b.version == 1:
            ok(rig, b)
    for _ in range(10):
        rig.tick()
        for b in batches(rig, seen):
            assert b.version == 1, "a request went to the rolled-back version"
            ok(rig, b)
    got = answers(rig)
    assert len(got) == 200, "a request was not answered, or answered twice"
    assert {rid for rid, a in got.items() if isinstance(a, p.ErrorReply)} == expected_failed
    assert all(a.version == 1 for a in got.values() if isinstance(a, p.InferReply))
    assert all(n == 0 for n in rig.b.census().values())


def test_a_retrying_plan_answers_every_canary_failure_from_the_stable_version(
        rig: BrokerRig) -> None:
    start(rig, steps=[50, 100], dwell_s=60.0, min_requests=100)   # no verdict here
    for i in range(100):
        send(rig, i, f"user-{i}")
    rig.tick()
    seen: set[int] = set()
    for _ in range(5):
        for b in batches(rig, seen):
            if b.version == 2:
                fail(rig, b)
            else:
                ok(rig, b)
        rig.tick()
    got = answers(rig)
    assert len(got) == 100 and all(isinstance(a, p.InferReply) and a.version == 1
                                   for a in got.values())
    counts = rig.b.releases.rollouts["m"].counts[2]
    assert counts.errors == counts.requests > 0   # counted against the canary all the same


def test_promotion_retires_the_old_version(rig: BrokerRig) -> None:
    start(rig, steps=[50, 100], dwell_s=1.0, min_requests=2)
    seen: set[int] = set()
    for step in range(3):
        for i in range(40):
            send(rig, step * 40 + i, f"user-{i}")
        rig.tick(1.5)
        for b in batches(rig, seen):
            ok(rig, b)
        rig.tick()
    assert rig.b.releases.ended["m"]["outcome"] == "promoted"
    model = rig.b.catalog.models["m"]
    assert model.versions == (2,) and model.ready == {2} and model.weights is None
    assert len(answers(rig)) == 120


def test_a_rollout_waiting_for_traffic_lets_the_loop_sleep(rig: BrokerRig) -> None:
    """No request came in its step's dwell: the loop's next wake-up is ahead, not the
    dwell's end behind (a poll timeout of 0, the loop spinning until traffic came)."""
    start(rig, steps=[50, 100], dwell_s=1.0, min_requests=2)
    assert rig.b.releases.next_due() is None
    rig.tick(1.5)
    assert rig.b.next_due(rig.now) > rig.now
    seen: set[int] = set()
    for i in range(40):
        send(rig, i, f"user-{i}")
    rig.tick()
    for b in batches(rig, seen):
        ok(rig, b)
    rig.tick()                           # the answers' turn decides the step
    assert rig.b.releases.describe("m")["rollout"]["step"] == 1


def test_rollback_and_promote_by_hand(rig: BrokerRig) -> None:
    start(rig, steps=[50, 100], dwell_s=60.0)
    assert rig.b.releases.rollback_verb({"model": "m"}) == {
        "model": "m", "rolled_back": 2, "serving": 1}
    assert rig.b.catalog.models["m"].default_version == 1
    assert rig.b.catalog.status("m")["rolled_back"] == {"2": "rolled back by hand"}
    index = {e["version"]: e for e in rig.b.repository.index({})}
    assert index["2"]["reason"] == "rolled back: rolled back by hand"
    assert index["2"]["state"] == "READY" and index["1"]["reason"] == ""
    with pytest.raises(ControlError, match="no rollout in progress"):
        rig.b.releases.promote_verb({"model": "m"})
    assert rig.b.releases.promote_verb({"model": "m", "version": 2})["retired"] == 1
    model = rig.b.catalog.models["m"]
    assert model.default_version == 2 and not model.failed and model.versions == (2,)
    with pytest.raises(LookupError):
        rig.b.releases.rollback_verb({"model": "nope"})


def test_a_removed_model_leaves_nothing_behind(rig: BrokerRig) -> None:
    start(rig, steps=[50, 100], dwell_s=60.0)
    rig.b.releases.rollback_verb({"model": "m"})
    assert rig.b.releases.ended and rig.b.releases.watched and rig.b.releases.rollbacks
    rig.b.lifecycle.remove_model("m", "test")
    rig.tick()
    rel = rig.b.releases
    assert not (rel.ended or rel.rollouts or rel.watched or rel.rollbacks)


def test_zeroserve_models_names_the_rollout_and_the_rolled_back(rig: BrokerRig) -> None:
    from zeroserve.broker.admin import human

    start(rig, steps=[5, 100], dwell_s=60.0)
    text = human("models", _models(rig))
    assert "m: rollout of version 2 at 5% (step 1 of 2) against version 1" in text
    rig.b.releases.rollback_verb({"model": "m"})
    assert "m/2: rolled back: rolled back by hand" in human("models", _models(rig))


def _models(rig: BrokerRig) -> Any:
    frames = rig.b.control.handle(p.ControlRequest("c1", "models", {}), on_frontend=False)
    kind, header, _ = p.unpack([bytes(f) for f in frames])
    return p.decode(p.ControlReply, header).result


def test_the_version_serving_stays_beside_rolled_back_ones(rig: BrokerRig) -> None:
    """The newest 2 are a rolled-back version and a new one: the scan keeps the version
    serving too (its folder is there), for the new one to be canaried against; without
    a rolled-back version among them, the policy alone decides."""
    from zeroserve.models.repository import RepoModel

    rig.b.releases.rollback_verb({"model": "m", "version": 2})
    assert (rig.repo / "m" / "1").is_dir()
    found = {"m": RepoModel(rig.b.catalog.models["m"].config, rig.repo / "m", (2, 3))}
    assert rig.b.releases.unretired((found, {}))[0]["m"].versions == (1, 2, 3)
    assert found["m"].versions == (2, 3)   # the scan given is left as it was
    healthy = {"m": RepoModel(found["m"].config, found["m"].path, (3, 4))}
    assert rig.b.releases.unretired((healthy, {}))[0]["m"].versions == (3, 4)
