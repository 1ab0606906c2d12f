"""Ensembles as configs (models/ensemble.py and the repository's reading of them): each
refusal Triton makes at load, named by step and tensor, in config.json and
config.pbtxt; the graph's order and its critical path. Pure: no process."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings, strategies as st

from tests.conftest import examples

from zeroserve.models import ensemble as ens
from zeroserve.models.repository import ConfigError, load_config, parse_config, scan


def tensor(name: str, shape: list[int] | None = None, dt: str = "FP32") -> dict[str, Any]:
    return {"name": name, "datatype": dt, "shape": shape or [4]}


def model(name: str, ins: list[dict[str, Any]], outs: list[dict[str, Any]], mbs: int = 8,
          platform: str = "python", **extra: Any) -> dict[str, Any]:
    return {"name": name, "platform": platform, "max_batch_size": mbs, "inputs": ins,
            "outputs": outs, **extra}


def step(name: str, ins: dict[str, str], outs: dict[str, str], version: int = -1
         ) -> dict[str, Any]:
    return {"model_name": name, "model_version": version, "input_map": ins, "output_map": outs}


def pipeline(steps: list[dict[str, Any]], ins: list[dict[str, Any]] | None = None,
             outs: list[dict[str, Any]] | None = None, mbs: int = 8) -> dict[str, Any]:
    return model("pipe", ins or [tensor("RAW")], outs or [tensor("OUT", [3])], mbs,
                 platform="ensemble", ensemble_scheduling={"step": steps})


GEN = model("gen", [tensor("x")], [tensor("y")], model_transaction_policy={"decoupled": True})
GOOD = [step("pre", {"x": "RAW"}, {"y": "mid"}), step("net", {"input": "mid"}, {"output": "OUT"})]


def repo(tmp_path: Path, ensemble: dict[str, Any], **more: dict[str, Any]) -> Path:
    models = {"pre": model("pre", [tensor("x")], [tensor("y")]),
              "net": model("net", [tensor("input")], [tensor("output", [3])],
                           platform="pytorch_torchscript"),
              "pipe": ensemble, **more}
    for name, cfg in models.items():
        (tmp_path / name / "1").mkdir(parents=True)
        (tmp_path / name / "config.json").write_text(json.dumps(cfg))
        if cfg["platform"] != "ensemble":
            file = "model.py" if cfg["platform"] == "python" else "model.pt"
            (tmp_path / name / "1" / file).write_text("")
    return tmp_path


def test_a_valid_ensemble_is_served_with_its_steps(tmp_path: Path) -> None:
    found, errors = scan(repo(tmp_path, pipeline(GOOD)))
    assert errors == {}
    cfg = found["pipe"].config
    assert found["pipe"].versions == (1,)
    assert [s.model_name for s in cfg.ensemble] == ["pre", "net"]
    assert cfg.to_json()["ensemble_scheduling"]["step"][0] == GOOD[0]
    assert parse_config(cfg.to_json(), "again") == cfg   # config verb's form reads back


def test_an_ensemble_folder_without_a_version_folder_serves_version_one(tmp_path) -> None:
    root = repo(tmp_path, pipeline(GOOD))
    (root / "pipe" / "1").rmdir()
    assert scan(root)[0]["pipe"].versions == (1,)


@pytest.mark.parametrize("steps, ins, outs, words", [
    ([step("pre", {"x": "RAW"}, {"y": "mid"}), step("net", {"input": "other"},
                                                    {"output": "OUT"})],
     None, None, "step[1] (model 'net'): input tensor 'other' is neither"),
    ([step("pre", {"x": "RAW"}, {"y": "OUT"}), step("net", {"input": "RAW"}, {"output": "OUT"})],
     None, None, "step[1] (model 'net'): output tensor 'OUT' is already produced by "
     "step[0] (model 'pre')"),
    ([step("pre", {"x": "RAW"}, {"y": "RAW"})], None, None,
     "output tensor 'RAW' is already produced by the ensemble's input"),
    ([step("pre", {"x": "RAW"}, {"y": "mid"})], None, None,
     "ensemble output 'OUT' is not produced by any step"),
    ([step("pre", {"x": "b"}, {"y": "a"}), step("pre", {"x": "a"}, {"y": "b"}),
      step("net", {"input": "RAW"}, {"output": "OUT"})], None, None,
     "step[0] (model 'pre'): input tensor 'b' is part of a cycle"),
    ([], None, None, "at least one step"),
    ([step("pre", {"x": "RAW"}, {"y": "mid"}, version=0)], None, None, "model_version"),
    ([{**GOOD[0], "input_map": {}}], None, None, "input_map must map"),
])
def test_a_graph_that_cannot_run_is_refused_naming_step_and_tensor(steps, ins, outs,
                                                                    words) -> None:
    with pytest.raises(ConfigError) as err:
        parse_config(pipeline(steps, ins, outs), "pipe/config.json")
    assert "field 'ensemble_scheduling'" in str(err.value)
    assert words in str(err.value)


@pytest.mark.parametrize("steps, outs, extra, words", [
    ([step("nope", {"x": "RAW"}, {"y": "OUT"})], None, {},
     "step[0] (model 'nope'): model 'nope' is not in the repository"),
    ([step("pre", {"zz": "RAW"}, {"y": "mid"}), GOOD[1]], None, {},
     "step[0] (model 'pre'): input_map names 'zz', which is not an input"),
    ([step("two", {"a": "RAW"}, {"y": "mid"}), GOOD[1]], None,
     {"two": model("two", [tensor("a"), tensor("b")], [tensor("y")])},
     "step[0] (model 'two'): input 'b' of the model is not mapped"),
    ([step("pre", {"x": "RAW"}, {"nope": "mid"}), GOOD[1]], None, {},
     "output_map names 'nope', which is not an output"),
    ([step("pre", {"x": "RAW"}, {"y": "mid"}), step("int", {"input": "mid"},
                                                    {"output": "OUT"})], None,
     {"int": model("int", [tensor("input", dt="INT64")], [tensor("output", [3])])},
     "step[1] (model 'int'): input 'input' takes INT64 [-1, 4] but tensor 'mid' is "
     "FP32 [-1, 4]"),
    ([step("pre", {"x": "RAW"}, {"y": "mid"}), step("wide", {"input": "mid"},
                                                    {"output": "OUT"})], None,
     {"wide": model("wide", [tensor("input", [5])], [tensor("output", [3])])},
     "input 'input' takes FP32 [-1, 5] but tensor 'mid' is FP32 [-1, 4]"),
    (GOOD, [tensor("OUT", [7])], {}, "ensemble output 'OUT' is declared FP32 [-1, 7] but "
     "its step produces FP32 [-1, 3]"),
    ([step("small", {"x": "RAW"}, {"y": "OUT"})], [tensor("OUT")],
     {"small": model("small", [tensor("x")], [tensor("y")], mbs=2)},
     "max_batch_size 2 is below the ensemble's 8"),
    ([step("gen", {"x": "RAW"}, {"y": "mid"}), step("pre", {"x": "mid"}, {"y": "OUT"})],
     [tensor("OUT")], {"gen": GEN},
     "step[0] (model 'gen'): a decoupled model can only be the last step, but step[1] "
     "(model 'pre') reads its tensor 'mid'"),
    ([step("gen", {"x": "RAW"}, {"y": "OUT"}), step("pre", {"x": "RAW"}, {"y": "OUT2"})],
     [tensor("OUT"), tensor("OUT2")], {"gen": GEN},
     "must produce every ensemble output; 'OUT2' comes from another step"),
])
def test_steps_checked_against_their_models(tmp_path, steps, outs, extra, words) -> None:
    found, errors = scan(repo(tmp_path, pipeline(steps, outs=outs), **extra))
    assert "pipe" not in found
    assert words in errors["pipe"], errors["pipe"]
    assert {"pre", "net"} <= set(found)     # the rest of the repository is served


def test_a_decoupled_model_may_be_the_last_step(tmp_path: Path) -> None:
    steps = [GOOD[0], step("gen", {"x": "mid"}, {"y": "OUT"})]
    found, errors = scan(repo(tmp_path, pipeline(steps, outs=[tensor("OUT")]), gen=GEN))
    assert errors == {} and "pipe" in found


def test_a_step_on_a_model_that_is_not_served_says_why(tmp_path: Path) -> None:
    root = repo(tmp_path, pipeline(GOOD))
    (root / "pre" / "config.json").write_text("{")
    errors = scan(root)[1]
    assert "model 'pre' is not in the repository: " in errors["pipe"]
    assert "not valid JSON" in errors["pipe"]


def test_ensemble_fields_only_with_the_ensemble_platform() -> None:
    with pytest.raises(ConfigError, match="needs platform"):
        parse_config({**model("m", [tensor("x")], [tensor("y")]),
                      "ensemble_scheduling": {"step": GOOD}}, "m")
    with pytest.raises(ConfigError, match="is required with platform"):
        parse_config(model("m", [tensor("x")], [tensor("y")], platform="ensemble"), "m")


PBTXT = '''
name: "pipe"
platform: "ensemble"
max_batch_size: 8
input [ { name: "RAW" data_type: TYPE_FP32 dims: [ 4 ] } ]
output [ { name: "OUT" data_type: TYPE_FP32 dims: [ 3 ] } ]
ensemble_scheduling {
  step [
    { model_name: "pre" model_version: -1 input_map { key: "x" value: "RAW" }
      output_map { key: "y" value: "mid" } },
    { model_name: "net" model_version: -1 input_map { key: "input" value: "mid" }
      output_map { key: "output" value: "OUT" } }
  ]
}
'''


def test_triton_config_pbtxt_ensemble(tmp_path: Path) -> None:
    root = repo(tmp_path, pipeline(GOOD))
    (root / "pipe" / "config.json").unlink()
    (root / "pipe" / "config.pbtxt").write_text(PBTXT)
    cfg = load_config(root / "pipe")
    assert cfg.platform == "ensemble"
    assert cfg.ensemble == parse_config(pipeline(GOOD), "x").ensemble
    found, errors = scan(root)
    assert errors == {} and "pipe" in found


def test_order_and_critical_path_run_independent_steps_side_by_side() -> None:
    steps = [ens.Step("a", -1, (("x", "IN"),), (("y", "A"),)),
             ens.Step("b", -1, (("x", "IN"),), (("y", "B"),)),
             ens.Step("c", -1, (("x", "A"), ("z", "B")), (("y", "OUT"),))]
    assert ens.order(steps, ["IN"]) == [0, 1, 2]
    assert ens.depends(steps, ["IN"]) == [set(), set(), {0, 1}]
    cost = {0: 0.010, 1: 0.030, 2: 0.005}
    assert ens.critical_path_s(steps, ["IN"], cost.__getitem__) == pytest.approx(0.035)


@st.composite
def dags(draw: st.DrawFn) -> tuple[list[ens.Step], list[float]]:
    """A random graph: step k reads the input or earlier steps' tensors, written in a
    shuffled order, each with a cost."""
    n = draw(st.integers(1, 8))
    steps = []
    for k in range(n):
        reads = draw(st.sets(st.sampled_from(["IN"] + [f"T{j}" for j in range(k)]),
                             min_size=1, max_size=3))
        steps.append(ens.Step(f"m{k}", -1, tuple((f"i{t}", t) for t in sorted(reads)),
                              ((f"o{k}", f"T{k}"),)))
    order = draw(st.permutations(range(n)))
    costs = draw(st.lists(st.floats(0, 1), min_size=n, max_size=n))
    return [steps[i] for i in order], [costs[i] for i in order]


@settings(max_examples=examples(300))
@given(dags())
def test_order_runs_every_step_after_what_it_reads_and_the_path_is_the_longest(
        dag: tuple[list[ens.Step], list[float]]) -> None:
    steps, costs = dag
    ran: set[str] = {"IN"}
    for i in ens.order(steps, ["IN"]):
        assert set(steps[i].reads()) <= ran
        ran |= set(steps[i].writes())
    by_tensor = {t: i for i, s in enumerate(steps) for t in s.writes()}

    def longest(i: int) -> float:   # brute force, from the step back to the input
        return costs[i] + max((longest(by_tensor[t]) for t in steps[i].reads()
                               if t != "IN"), default=0.0)
    assert ens.critical_path_s(steps, ["IN"], costs.__getitem__) == pytest.approx(
        max(longest(i) for i in range(len(steps))))
