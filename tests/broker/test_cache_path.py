"""The response cache in the broker's request path, without sockets (BrokerRig): a hit
answered at admission without a batch, after the tenant's gate; a miss's answer kept;
errors, other versions and models without the cache never served from it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from tests.broker.rig import BrokerRig
from tests.conftest import linear_config
from zeroserve.broker import protocol as p
from zeroserve.broker.server.tenants import new_key

CACHED = linear_config("m", response_cache={"enable": True})


def rig_with(tmp_path: Path, config: dict[str, Any] = CACHED, **broker: Any) -> BrokerRig:
    rig = BrokerRig(tmp_path / "repo", **broker)
    rig.add_model("m", config, factory="nn.Linear(4, 3)")
    rig.worker("w1")
    rig.loaded("w1", "m", 1)
    return rig


def send(rig: BrokerRig, rid: str, value: float = 1.0, api_key: str = "",
         version: int | None = None) -> None:
    req = p.InferRequest(rid, "m", [p.from_numpy("input", np.full((1, 4), value, np.float32))],
                         version=version, api_key=api_key)
    rig.b.on_frontend(b"gw", [bytes(f) for f in p.encode_request(req)])
    rig.tick()   # the loop's turn: what is queued is dispatched


def replies(rig: BrokerRig) -> dict[str, p.InferReply | p.ErrorReply]:
    out: dict[str, p.InferReply | p.ErrorReply] = {}
    for _, frames in rig.to_clients:
        kind, header, bufs = p.unpack(frames)
        if kind is p.Kind.REPLY:
            rep = p.decode_reply(header, bufs)
            assert rep.request_id not in out, "a second answer"
            out[rep.request_id] = rep
        elif kind is p.Kind.ERROR:
            err = p.decode_error(header)
            assert err.request_id not in out, "a second answer"
            out[err.request_id] = err
    return out


def batches(rig: BrokerRig) -> int:
    return len(rig.sent(p.Kind.BATCH))


def stats(rig: BrokerRig) -> dict[str, Any]:
    (doc,) = rig.b.stats.render("m", [1], 1, {})
    return dict(doc["inference_stats"])


def test_an_identical_request_is_answered_at_admission_without_a_batch(tmp_path) -> None:
    rig = rig_with(tmp_path)
    send(rig, "1")
    rig.run_batches("w1")
    assert batches(rig) == 1
    send(rig, "2")
    assert batches(rig) == 1   # no batch: answered by the broker
    got = replies(rig)
    first, second = got["1"], got["2"]
    assert isinstance(first, p.InferReply) and isinstance(second, p.InferReply)
    assert [bytes(t.data) for t in first.tensors] == [bytes(t.data) for t in second.tensors]
    assert second.stats["cache_hit"] == 1 and second.version == 1
    st = stats(rig)
    assert st["cache_hit"]["count"] == 1 and st["cache_miss"]["count"] == 1
    assert st["success"]["count"] == 2
    assert not any(rig.b.census().values()), rig.b.census()


def test_a_different_input_or_version_misses(tmp_path) -> None:
    rig = rig_with(tmp_path)
    send(rig, "1", 1.0)
    rig.run_batches("w1")
    send(rig, "2", 2.0)            # another input
    send(rig, "3", 1.0, version=1)   # pinned to the version that answered: the same key
    rig.run_batches("w1")
    assert batches(rig) == 2
    assert stats(rig)["cache_hit"]["count"] == 1 and stats(rig)["cache_miss"]["count"] == 2


def test_errors_are_not_kept(tmp_path) -> None:
    rig = rig_with(tmp_path)
    send(rig, "1")
    (_, _, batch), = rig.sent(p.Kind.BATCH)
    rig.from_worker("w1", p.BatchResult(batch.batch_id, [], 1.0, error="boom"))
    send(rig, "2")
    assert batches(rig) == 2 and len(rig.b.cache) == 0
    assert isinstance(replies(rig)["1"], p.ErrorReply)


def test_a_model_without_the_cache_never_uses_it(tmp_path) -> None:
    rig = rig_with(tmp_path, linear_config("m"))
    for rid in ("1", "2", "3"):
        send(rig, rid)
        rig.run_batches("w1")
    assert batches(rig) == 3 and len(rig.b.cache) == 0
    assert stats(rig)["cache_miss"]["count"] == 0


def test_a_bound_of_zero_turns_it_off(tmp_path) -> None:
    rig = rig_with(tmp_path, response_cache_bytes=0)
    for rid in ("1", "2"):
        send(rig, rid)
        rig.run_batches("w1")
    assert batches(rig) == 2 and stats(rig)["cache_miss"]["count"] == 0


def test_a_tenants_hit_counts_against_its_quota(tmp_path) -> None:
    """The gate comes first: a hit spends the tenant's rate like a computed answer, and
    gives its in-flight place back with the answer."""
    key, hashed = new_key()
    tenants = tmp_path / "tenants.toml"
    tenants.write_text(f'[tenants.a]\nkeys = ["{hashed}"]\nrate = 1.0\nburst = 2\n'
                       'max_inflight = 1\n')
    rig = rig_with(tmp_path, tenants_path=tenants)
    send(rig, "1", api_key=key)
    rig.run_batches("w1")           # a miss, computed: one token
    send(rig, "2", api_key=key)      # a hit: the second token
    send(rig, "3", api_key=key)      # would be a hit, but the bucket is empty
    got = replies(rig)
    assert isinstance(got["2"], p.InferReply) and got["2"].stats["cache_hit"] == 1
    refused = got["3"]
    assert isinstance(refused, p.ErrorReply) and refused.code is p.ErrorCode.QUOTA
    assert rig.b.tenancy.open_count() == 0


def test_a_new_version_misses_and_the_old_ones_answers_go(tmp_path) -> None:
    rig = rig_with(tmp_path)
    send(rig, "1")
    rig.run_batches("w1")
    assert len(rig.b.cache) == 1
    # version 2 committed in place of 1 (what a swap's commit does), then what the
    # lifecycle does after every commit
    rig.add_model("m", CACHED, versions=(2,), factory="nn.Linear(4, 3)")
    rig.b.answers.retain("m")
    assert len(rig.b.cache) == 0
    rig.loaded("w1", "m", 2)
    send(rig, "2")
    rig.run_batches("w1")
    assert batches(rig) == 2
    rep = replies(rig)["2"]
    assert isinstance(rep, p.InferReply) and rep.version == 2 and "cache_hit" not in rep.stats


def test_removing_the_model_drops_its_answers(tmp_path) -> None:
    rig = rig_with(tmp_path)
    send(rig, "1")
    rig.run_batches("w1")
    assert len(rig.b.cache) == 1
    rig.b.lifecycle.remove_model("m", "its folder was removed")
    assert len(rig.b.cache) == 0 and rig.b.cache.nbytes == 0
