"""Config fields and side files the gateway's extensions and the broker rely on:
``optional`` (strict readiness), ``labels.txt`` (classification) and ``response_cache``;
the seed's ``input_shape`` and the outputs only a registration may leave out."""

from __future__ import annotations

from pathlib import Path

import pytest

from zeroserve.models.repository import ConfigError, load_labels, parse_config, \
    undeclared_datatypes
from tests.conftest import linear_config


def test_optional_defaults_to_false_and_round_trips() -> None:
    assert parse_config(linear_config("m"), "t").optional is False
    cfg = parse_config(linear_config("m", optional=True), "t")
    assert cfg.optional is True and cfg.to_json()["optional"] is True
    assert parse_config(cfg.to_json(), "t") == cfg


def test_optional_must_be_a_boolean() -> None:
    with pytest.raises(ConfigError, match="field 'optional': must be true or false"):
        parse_config(linear_config("m", optional="yes"), "t")


def test_labels_are_read_line_by_line_and_absent_is_none(tmp_path: Path) -> None:
    assert load_labels(tmp_path) is None
    (tmp_path / "labels.txt").write_text("cat\ndog\n\nbird\n")
    assert load_labels(tmp_path) == ["cat", "dog", "", "bird"]


SEED_BODY = {"name": "bert", "platform": "pytorch", "max_batch_size": 16,
             "input_shape": {"input_ids": [1, 128], "attention_mask": [1, 128]}}


def test_a_repository_config_must_declare_its_outputs() -> None:
    with pytest.raises(ConfigError, match="field 'outputs': is required"):
        parse_config(SEED_BODY, "bert/config.json")


def test_a_registration_may_leave_outputs_to_its_trial_load() -> None:
    cfg = parse_config(SEED_BODY, "registration", discover=True)
    assert cfg.outputs == () and cfg.platform == "pytorch_torchscript"
    assert [(t.name, t.datatype, t.shape) for t in cfg.inputs] == [
        ("input_ids", "FP32", (128,)), ("attention_mask", "FP32", (128,))]
    assert "outputs" not in cfg.to_json()  # what the trial load's worker parses back
    assert parse_config(cfg.to_json(), "trial", discover=True) == cfg
    assert undeclared_datatypes(SEED_BODY) == ["input_ids", "attention_mask"]


def test_input_shape_entries_may_carry_a_datatype() -> None:
    body = {**SEED_BODY, "input_shape": {
        "input_ids": {"shape": [1, -1], "datatype": "INT64"}, "attention_mask": [1, -1],
        "scale": {"shape": [1]}}}
    cfg = parse_config(body, "registration", discover=True)
    assert [(t.name, t.datatype, t.shape) for t in cfg.inputs] == [
        ("input_ids", "INT64", (-1,)), ("attention_mask", "FP32", (-1,)), ("scale", "FP32", ())]
    assert undeclared_datatypes(body) == ["attention_mask", "scale"]
    assert undeclared_datatypes({**body, "inputs": cfg.to_json()["inputs"]}) == []


@pytest.mark.parametrize("entry, needle", [
    ({"shape": [1, 4], "dtype": "INT64"}, "input_shape.x': must be a shape"),
    ({"datatype": "INT64"}, "input_shape.x': must be a shape"),
    ({"shape": [1, 4], "datatype": "LONG"}, "must be one of"),
    ({"shape": "1,4"}, "input_shape.x': must be a list"),
])
def test_a_bad_input_shape_entry_names_the_input(entry: object, needle: str) -> None:
    with pytest.raises(ConfigError, match=needle.replace(".", r"\.").replace("(", r"\(")):
        parse_config({**SEED_BODY, "input_shape": {"x": entry}}, "registration",
                     discover=True)


def test_outputs_a_trial_run_cannot_find_must_be_declared() -> None:
    strings = {**SEED_BODY, "platform": "python",
               "input_shape": {"text": {"shape": [1], "datatype": "BYTES"}}}
    with pytest.raises(ConfigError, match=r"'outputs': is required for a model with BYTES "
                                          r"inputs \(text\)"):
        parse_config(strings, "registration", discover=True)
    stream = {**SEED_BODY, "platform": "python",
              "model_transaction_policy": {"decoupled": True}}
    with pytest.raises(ConfigError, match="'outputs': is required for a decoupled model"):
        parse_config(stream, "registration", discover=True)


def test_response_cache_defaults_to_off_and_round_trips() -> None:
    assert parse_config(linear_config("m"), "t").response_cache is False
    cfg = parse_config(linear_config("m", response_cache={"enable": True}), "t")
    assert cfg.response_cache is True
    assert cfg.to_json()["response_cache"] == {"enable": True}   # the served config shows it
    assert parse_config(cfg.to_json(), "t") == cfg


@pytest.mark.parametrize("raw", [True, {"enable": "yes"}, {"enable": True, "size": 1}])
def test_response_cache_must_be_enable_true_or_false(raw: object) -> None:
    with pytest.raises(ConfigError, match="field 'response_cache': must be"):
        parse_config(linear_config("m", response_cache=raw), "t")


def test_a_decoupled_model_cannot_cache_its_responses() -> None:
    raw = {**linear_config("m", response_cache={"enable": True}), "platform": "python",
           "model_transaction_policy": {"decoupled": True}}
    with pytest.raises(ConfigError, match="field 'response_cache': a decoupled model"):
        parse_config(raw, "t")


@pytest.mark.parametrize("shape", [[16], [16, 4]])
def test_a_forgotten_batch_dimension_is_refused_with_the_fix(shape: list[int]) -> None:
    with pytest.raises(ConfigError) as err:
        parse_config({**SEED_BODY, "input_shape": {"x": shape}}, "registration",
                     discover=True)
    assert f"starts with the batch dimension (max_batch_size 16 > 0), which must be 1 or " \
           f"-1; for one sample of shape {shape} write {[1, *shape]}" in str(err.value)
    # without batching the shape is the whole tensor's
    cfg = parse_config({**SEED_BODY, "max_batch_size": 0, "input_shape": {"x": shape}},
                       "registration", discover=True)
    assert cfg.inputs[0].shape == tuple(shape)


PADDED = {"max_queue_delay_ms": 0, "padding": {
    "inputs": [{"name": "input_ids", "dim": 0}, {"name": "attention_mask", "dim": 0}],
    "outputs": [{"name": "last_hidden_state", "dim": 0}]}}


def test_padding_of_outputs_a_trial_load_will_find_is_checked_once_they_are() -> None:
    body = {**SEED_BODY, "input_shape": {"input_ids": [1, -1], "attention_mask": [1, -1]},
            "dynamic_batching": PADDED}
    cfg = parse_config(body, "registration", discover=True)
    assert cfg.outputs == () and cfg.dynamic_batching.padding is not None
    assert parse_config(cfg.to_json(), "trial", discover=True) == cfg  # the worker's parse
    # what the trial load found: the padded output, free along dim 0, passes ...
    found = {**cfg.to_json(), "outputs": [
        {"name": "last_hidden_state", "datatype": "FP32", "shape": [-1, 8]}]}
    assert parse_config(found, "the trial load's config").outputs[0].name == \
        "last_hidden_state"
    # ... one it did not find is refused then, naming what it found
    found["outputs"] = [{"name": "output__0", "datatype": "FP32", "shape": [-1, 8]}]
    with pytest.raises(ConfigError, match=r"output 'last_hidden_state' is not declared; "
                                          r"the model has \['output__0'\]"):
        parse_config(found, "the trial load's config")
