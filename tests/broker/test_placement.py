"""Placement without sockets (outboxes are lists, the clock a number), on real model
files: a version is predicted from its archive before any LOAD is sent, refused with
the device and the bytes when it does not fit after the headroom, evicts idle models
when that makes room, and is planned with what was measured once a worker warmed it."""

from __future__ import annotations

import tempfile
import zipfile
from pathlib import Path

import pytest

from tests.broker.rig import BrokerRig
from tests.conftest import linear_config, write_model
from zeroserve.broker import protocol as p
from zeroserve.broker.server.types import ModelVersion
from zeroserve.models.archives import graph_bytes
from zeroserve.models.footprint import ACTIVATION_FACTOR
from zeroserve.models.formats import EXPORT_GRAPH_FACTOR, TORCHSCRIPT_GRAPH_FACTOR

MB = 1_000_000
WEIGHTS = (1000 * 1000 + 1000) * 4      # nn.Linear(1000, 1000): 4.0 MB
GUESS = ACTIVATION_FACTOR * 1000 * 4 * 8  # its first activations guess at batch 8: 1.0 MB


def _overhead() -> int:
    """Its overhead's first guess: TorchScript's factor times its archive's code bytes."""
    with tempfile.TemporaryDirectory() as folder:
        write_model(Path(folder), "m", 1, "nn.Linear(1000, 1000)")
        return TORCHSCRIPT_GRAPH_FACTOR * (graph_bytes(Path(folder) / "m" / "1" / "model.pt")
                                           or 0)


OVERHEAD = _overhead()
NEED = WEIGHTS + OVERHEAD + GUESS        # predicted before any warm-up, on a CPU
GPU_NEED = WEIGHTS + GUESS               # on a GPU (the overhead guess is host memory)


class Rig(BrokerRig):
    def model(self, name: str, versions: tuple[int, ...] = (1,), mbs: int = 8) -> None:
        self.add_model(name, linear_config(name, 1000, 1000, mbs=mbs), versions,
                       factory="nn.Linear(1000, 1000)")


def test_a_version_that_does_not_fit_on_a_gpu_is_refused_before_it_loads(tmp_path: Path) -> None:
    rig = Rig(tmp_path)
    rig.model("m")
    w = rig.worker("host/1", "cuda:0", gpu_free_bytes=4 * MB, headroom_bytes=1 * MB,
                   models={})
    assert rig.loads("host/1") == [], "nothing is sent to load what does not fit"
    why = rig.placement.refusal(w, "m", 1)
    assert why == ("cuda:0 on worker host/1 has 3.0 MB free after 1.0 MB headroom; m/1 "
                   "needs 5.0 MB (predicted: 4.0 MB weights + 1.0 MB activations at batch 8 "
                   "(first guesses from the files and inputs))")
    rig.now += 0.01
    assert rig.b.lifecycle.next_due() == rig.now   # the refusal is answered on the next tick
    rig.b.tick(rig.now)
    assert w.load_errors == {ModelVersion("m", 1): why} and not w.loading and not w.loaded
    assert rig.b.catalog.failures["m"]["error"] == why
    assert 'zeroserve_memory_refusals_total{device="cuda:0",model="m"} 1.0' \
        in rig.b.metrics.render()
    plan = rig.plan.describe()["host/1"]
    assert plan["available_bytes"] == 3 * MB and plan["headroom_bytes"] == 1 * MB


def test_what_fits_loads_and_its_measurement_replaces_the_prediction(tmp_path: Path) -> None:
    rig = Rig(tmp_path)
    rig.model("m")
    a = rig.worker("a/0", "cuda:0", gpu_free_bytes=100 * MB, headroom_bytes=1 * MB,
                   models={})
    assert rig.loads("a/0") == ["m/1"]
    entry = rig.plan.describe()["a/0"]["models"]["m/1"]
    assert entry["predicted_bytes"] == GPU_NEED and entry["state"] == "loading"
    # loading, not yet in a heartbeat: what it is predicted to take is not free any more
    assert rig.placement.available(a) == 100 * MB - GPU_NEED - 1 * MB
    rig.loaded("a/0", "m", 1, resident_bytes=WEIGHTS + 100_000, batch=8,
               activation_bytes_per_sample=4000, activation_fixed_bytes=1000,
               overhead_bytes=100_000, footprint_bytes=WEIGHTS + 100_000 + 33_000)
    entry = rig.plan.describe()["a/0"]["models"]["m/1"]
    assert entry["measured_bytes"] == WEIGHTS + 133_000
    assert entry["error_pct"] == round(100 * (GPU_NEED - WEIGHTS - 133_000)
                                       / (WEIGHTS + 133_000), 1)
    text = rig.b.metrics.render()
    assert 'zeroserve_model_memory_measured_bytes{model="m",version="1",worker="a/0"}' in text
    # a replica on another worker is planned with what a/0 measured for the same files
    b = rig.worker("b/0", "cuda:0", gpu_free_bytes=4_100_000, headroom_bytes=0, models={})
    assert rig.loads("b/0") == []
    assert "needs 4.1 MB (measured on worker a/0)" in (rig.placement.refusal(b, "m", 1) or "")


def test_the_learned_terms_predict_the_next_version(tmp_path: Path) -> None:
    rig = Rig(tmp_path)
    rig.model("m", versions=(1,), mbs=8)
    rig.worker("a/0", "cpu", budget=100 * MB, context_bytes=5 * MB)
    rig.loaded("a/0", "m", 1, resident_bytes=WEIGHTS + 200_000, batch=8,
               activation_bytes_per_sample=10_000, activation_fixed_bytes=0,
               overhead_bytes=200_000, footprint_bytes=WEIGHTS + 280_000)
    rig.model("m", versions=(1, 2), mbs=8)
    b = rig.worker("b/0", "cpu", budget=9 * MB, context_bytes=5 * MB)
    why = rig.placement.refusal(b, "m", 2) or ""
    assert why.startswith("cpu on worker b/0 (memory budget 9.0 MB, 5.0 MB context) has ")
    assert ("m/2 needs 4.3 MB (predicted: 4.0 MB weights + 0.2 MB overhead + 0.1 MB "
            "activations at batch 8)") in why


def test_the_headroom_is_kept_on_a_budget(tmp_path: Path) -> None:
    rig = Rig(tmp_path)
    rig.model("m")
    roomy = rig.worker("roomy/0", "cpu", budget=10 * MB, context_bytes=1 * MB,
                       headroom_bytes=0)
    tight = rig.worker("tight/0", "cpu", budget=10 * MB, context_bytes=1 * MB,
                       headroom_bytes=6 * MB)
    assert rig.loads("roomy/0") == ["m/1"] and rig.loads("tight/0") == []
    assert rig.placement.refusal(roomy, "m", 1) is None   # there already
    why = rig.placement.refusal(tight, "m", 1) or ""
    assert "has 3.0 MB free after 6.0 MB headroom; m/1 needs 5.1 MB" in why
    assert "more than worker tight/0's memory budget of 10.0 MB leaves after" in why


def test_a_budget_caps_a_gpu_below_its_free_memory(tmp_path: Path) -> None:
    rig = Rig(tmp_path)
    rig.model("old")
    # 80 GB free: the budget of 11 MB (1 MB context, the 512 MiB headroom kept of the
    # device's free memory, not of the budget) is what binds
    w = rig.worker("g/0", "cuda:0", budget=11 * MB, context_bytes=1 * MB,
                   gpu_free_bytes=80_000 * MB, headroom_bytes=512 << 20, models={})
    assert rig.loads("g/0") == ["old/1"]
    assert rig.placement.available(w) == 11 * MB - 1 * MB - GPU_NEED
    rig.loaded("g/0", "old", 1, resident_bytes=WEIGHTS, footprint_bytes=WEIGHTS)
    rig.model("new")
    rig.b.loads.sync_worker(w)
    assert rig.loads("g/0")[-1] == "new/1"     # 1 + 4 + 5 of 11 MB: both fit
    rig.loaded("g/0", "new", 1, resident_bytes=WEIGHTS, footprint_bytes=WEIGHTS)
    rig.model("third")
    rig.b.loads.sync_worker(w)
    assert rig.loads("g/0")[-1] == "third/1"   # an idle one made room, on a roomy GPU
    assert len(w.loaded & {("old", 1), ("new", 1)}) == 1 and ("third", 1) in w.loading
    rig.model("huge", mbs=8)
    rig.plan.measured[(w.identity, "huge", 1)] = {"footprint_bytes": 10_500_000}
    why = rig.placement.refusal(w, "huge", 1) or ""
    assert why.startswith("cuda:0 on worker g/0 (memory budget 11.0 MB, 1.0 MB context) has ")
    assert why.endswith("more than worker g/0's memory budget of 11.0 MB leaves after its "
                        "context"), why
    # too big even with every idle model gone
    assert (rig.placement.too_big(w, "huge", 1) or "").endswith("budget of 11.0 MB leaves "
                                                                "after its context")
    # the device's free memory still binds when it is the lesser
    tight = rig.worker("g/1", "cuda:1", budget=10 * MB, context_bytes=2 * MB,
                       gpu_free_bytes=5 * MB, headroom_bytes=2 * MB, models={})
    assert rig.placement.available(tight) == 3 * MB
    assert "has 3.0 MB free after 2.0 MB headroom" in (rig.placement.refusal(tight, "old", 1)
                                                        or "")


@pytest.mark.parametrize("device,budget", [("cpu", 22 * MB), ("cuda:0", 22 * MB),
                                           ("cuda:0", 0)])
def test_a_model_is_not_too_big_while_others_load_into_the_room(
        tmp_path: Path, device: str, budget: int) -> None:
    rig = Rig(tmp_path)
    for name in "abcd":
        rig.model(name)
    # four loading of 5 MB fill the 21 MB left after the context, of the budget or of
    # the GPU: a fifth waits for room, it is not refused as too big (what is loading is
    # in no model's cost yet, and evictable once loaded)
    w = rig.worker("w/0", device, budget=budget, context_bytes=1 * MB,
                   gpu_free_bytes=80_000 * MB if budget else 21 * MB, headroom_bytes=0,
                   models={})
    assert sorted(rig.loads("w/0")) == ["a/1", "b/1", "c/1", "d/1"] and not w.loaded
    rig.model("e")
    assert rig.placement.too_big(w, "e", 1) is None
    assert not rig.placement.fits(w, "e", 1)
    rig.model("f", mbs=8)
    rig.plan.measured[(w.identity, "f", 1)] = {"footprint_bytes": 21_500_000}
    assert "needs 21.5 MB (measured on this worker)" in (rig.placement.too_big(w, "f", 1)
                                                        or "")


def test_an_idle_model_is_evicted_before_the_load_when_that_makes_room(tmp_path: Path) -> None:
    rig = Rig(tmp_path)
    rig.model("old")
    w = rig.worker("a/0", "cpu", budget=11_200_000, context_bytes=1 * MB)
    rig.loaded("a/0", "old", 1, resident_bytes=WEIGHTS, footprint_bytes=WEIGHTS)
    rig.model("new")
    rig.b.loads.sync_worker(w)
    assert rig.loads("a/0") == ["old/1", "new/1"]   # room for both: nothing evicted
    rig.model("third")
    rig.b.loads.sync_worker(w)
    # 1 MB context + 4 + 5.1 + 5.1 of 11.2 MB: the least recently used idle model makes room
    assert rig.loads("a/0")[-1] == "third/1"
    assert ("old", 1) not in w.loaded and ("third", 1) in w.loading


def test_a_worker_that_held_versions_before_the_broker_knew_it_is_planned_from_its_report(
        tmp_path: Path) -> None:
    rig = Rig(tmp_path)
    rig.model("m")
    rig.model("n")
    # a broker restart: the worker registers with m/1 loaded and its plan in the report
    ready = p.WorkerReady("a/0", 1, device="cpu", models=[["m", 1]], memory_budget_bytes=12 * MB,
                          memory={"device": "cpu", "context_bytes": 1 * MB,
                                  "models": {"m/1": WEIGHTS},
                                  "plans": {"m/1": {"footprint_bytes": 5 * MB}}})
    rig.b.worker_ready(b"a/0", ready, rig.now)
    w = rig.b.pool.get(b"a/0")
    assert rig.placement.used(w) == 6 * MB + NEED   # context, m/1 as reported, n/1 loading
    assert rig.loads("a/0") == ["n/1"]


def test_a_measurement_is_not_inherited_by_a_version_of_another_format(
        tmp_path: Path) -> None:
    """An exported program's warm-up teaches its overhead to the next exported program,
    not to an AOTInductor package of the same model, which runs compiled kernels."""
    import torch

    rig = Rig(tmp_path)
    cfg = {**linear_config("m", 1000, 1000), "platform": "pytorch_export"}
    for v in (1, 3):   # two builds: other weights, so v1's measurement is no v3's
        program = torch.export.export(torch.nn.Linear(1000, 1000).eval(),
                                      (torch.zeros(2, 1000),), dynamic_shapes=(
                                          {0: torch.export.Dim("b", min=1, max=8)},))
        (rig.repo / "m" / str(v)).mkdir(parents=True)
        torch.export.save(program, str(rig.repo / "m" / str(v) / "model.pt2"))
    # the package as the broker reads one: its wrapper source lists the constants' bytes
    (rig.repo / "m" / "2").mkdir()
    with zipfile.ZipFile(rig.repo / "m" / "2" / "model.pt2", "w") as package:
        package.writestr("model/data/aotinductor/model/m_wrapper.cpp",
                         f"constants_info_[0].data_size = {WEIGHTS};\n")
    rig.add_model("m", cfg, (1,))
    rig.worker("a/0", "cpu", budget=100 * MB, context_bytes=5 * MB)
    rig.loaded("a/0", "m", 1, resident_bytes=WEIGHTS + 30 * MB, batch=8,
               activation_bytes_per_sample=10_000, activation_fixed_bytes=0,
               overhead_bytes=30 * MB, footprint_bytes=WEIGHTS + 30 * MB + 80_000)
    rig.add_model("m", cfg, (1, 2, 3))
    b = rig.worker("b/0", "cpu", budget=200 * MB, context_bytes=5 * MB,
                   runtimes={"torch.export": 90 * MB})   # loaded: nothing charged for it
    config = rig.b.catalog.models["m"].config
    need, how = rig.plan.need(b, "m", 2, config, rig.repo / "m" / "2")
    assert need == WEIGHTS + GUESS and "first guesses from the files" in how, how
    need, how = rig.plan.need(b, "m", 3, config, rig.repo / "m" / "3")
    assert need == WEIGHTS + 30 * MB + 80_000 and "30.0 MB overhead" in how, how


def test_a_format_runtime_is_charged_to_a_worker_that_has_not_loaded_it(
        tmp_path: Path) -> None:
    """torch.export's runtime (about 100 MB of host memory, once per process) counts in
    the first exported program a worker loads: the guess before any worker measured it,
    then what a worker of the same kind measured; nothing once the worker loaded it,
    nothing for a TorchScript file, and nothing on a GPU (host memory)."""
    import torch

    from zeroserve.models.footprint import RUNTIME_GUESS_BYTES

    rig = Rig(tmp_path)
    cfg = {**linear_config("e", 1000, 1000), "platform": "pytorch_export"}
    program = torch.export.export(torch.nn.Linear(1000, 1000).eval(), (torch.zeros(2, 1000),),
                                  dynamic_shapes=({0: torch.export.Dim("b", min=1, max=8)},))
    (rig.repo / "e" / "1").mkdir(parents=True)
    torch.export.save(program, str(rig.repo / "e" / "1" / "model.pt2"))
    rig.add_model("e", cfg, (1,))
    rig.model("t")
    fresh = rig.worker("a/0", "cpu", budget=500 * MB, context_bytes=5 * MB)
    config = rig.b.catalog.models["e"].config
    # an exported program's overhead guess: its factor times its graph's bytes
    ex = WEIGHTS + GUESS + EXPORT_GRAPH_FACTOR * (graph_bytes(rig.repo / "e" / "1" / "model.pt2")
                                                  or 0)
    need, how = rig.plan.need(fresh, "e", 1, config, rig.repo / "e" / "1")
    assert need == ex + RUNTIME_GUESS_BYTES["torch.export"], how
    assert "for the torch.export runtime" in how, how
    ts = rig.b.catalog.models["t"]
    assert rig.plan.need(fresh, "t", 1, ts.config, ts.path / "1")[0] == NEED
    rig.worker("b/0", "cpu", budget=500 * MB, context_bytes=105 * MB,
               runtimes={"torch.export": 97 * MB})
    assert rig.plan.need(fresh, "e", 1, config, rig.repo / "e" / "1")[0] == ex + 97 * MB
    paid = rig.plan.need(rig.b.pool.get(b"b/0"), "e", 1, config, rig.repo / "e" / "1")
    assert paid[0] == ex and "runtime" not in paid[1]
    gpu = rig.worker("g/0", "cuda:0", gpu_free_bytes=4000 * MB, headroom_bytes=0)
    assert rig.plan.need(gpu, "e", 1, config, rig.repo / "e" / "1")[0] == WEIGHTS + GUESS
