"""Triton's config.pbtxt and a load's Triton-JSON override, read into zeroserve's config:
what converts, what is refused naming the field, what is ignored with a warning."""

from __future__ import annotations

import json
import re
import logging
from pathlib import Path

import pytest

from zeroserve.models import triton_config
from zeroserve.models.repository import ConfigError, load_config, parse_config

FULL = '''
name: "m"
platform: "pytorch_libtorch"
max_batch_size: 8
input [ { name: "INPUT__0" data_type: TYPE_FP32 dims: [ 4 ] },
        { name: "TEXT" data_type: TYPE_STRING dims: [ -1 ] } ]
output [ { name: "OUTPUT__0" data_type: TYPE_INT64 dims: [ 3, -1 ] } ]
dynamic_batching {
  preferred_batch_size: [ 4, 8 ]
  max_queue_delay_microseconds: 1500
  priority_levels: 3
  default_priority_level: 2
  default_queue_policy { default_timeout_microseconds: 5000 max_queue_size: 100 }
}
version_policy: { specific: { versions: [ 1, 3 ] } }
model_transaction_policy { decoupled: false }
'''

SAME_AS_JSON = {
    "name": "m", "platform": "pytorch_torchscript", "max_batch_size": 8,
    "inputs": [{"name": "INPUT__0", "datatype": "FP32", "shape": [4]},
               {"name": "TEXT", "datatype": "BYTES", "shape": [-1]}],
    "outputs": [{"name": "OUTPUT__0", "datatype": "INT64", "shape": [3, -1]}],
    "dynamic_batching": {"preferred_batch_sizes": [4, 8], "max_queue_delay_ms": 1.5,
                         "priority_levels": 3, "default_priority": 2,
                         "default_timeout_ms": 5.0, "max_queue_size": 100},
    "version_policy": {"specific": [1, 3]}}


def model_dir(tmp_path: Path, pbtxt: str, name: str = "m") -> Path:
    folder = tmp_path / name
    folder.mkdir()
    (folder / "config.pbtxt").write_text(pbtxt)
    return folder


def test_a_pbtxt_reads_as_the_same_config_json(tmp_path: Path) -> None:
    got = load_config(model_dir(tmp_path, FULL))
    assert got == parse_config(SAME_AS_JSON, "<json>")
    assert got.to_json() == parse_config(SAME_AS_JSON, "<json>").to_json()


def test_config_json_wins_over_a_pbtxt_beside_it(tmp_path: Path) -> None:
    folder = model_dir(tmp_path, FULL)
    (folder / "config.json").write_text(json.dumps({**SAME_AS_JSON, "max_batch_size": 2}))
    assert load_config(folder).max_batch_size == 2


def test_the_name_defaults_to_the_folder_and_backend_pytorch_is_torchscript(tmp_path) -> None:
    text = FULL.replace('name: "m"', "").replace('platform: "pytorch_libtorch"',
                                                   'backend: "pytorch"')
    cfg = load_config(model_dir(tmp_path, text))
    assert cfg.name == "m" and cfg.platform == "pytorch_torchscript"


@pytest.mark.parametrize("policy, expected", [
    ("{ all: {} }", {"all": True}), ("{ latest: { num_versions: 2 } }", {"latest": 2}),
])
def test_version_policies(tmp_path: Path, policy: str, expected: dict) -> None:
    text = FULL.replace("{ specific: { versions: [ 1, 3 ] } }", policy)
    assert load_config(model_dir(tmp_path, text)).version_policy == expected


def test_no_priority_levels_means_one(tmp_path: Path) -> None:
    text = FULL.replace("priority_levels: 3", "").replace("default_priority_level: 2", "")
    db = load_config(model_dir(tmp_path, text)).dynamic_batching
    assert (db.priority_levels, db.default_priority) == (1, 1)


@pytest.mark.parametrize("extra, field", [
    ("sequence_batching { }", "sequence_batching"),
    ("ensemble_scheduling { }", "ensemble_scheduling"),
    ('backend: "onnxruntime"', "backend"),
    ('backend: "python"', "backend"),
    ('default_model_filename: "model.onnx"', "default_model_filename"),
    ('model_repository_agents { agents [ { name: "checksum" } ] }', "model_repository_agents"),
    ("dynamic_batching { priority_levels: 2 default_priority_level: 1 "
     "priority_queue_policy { key: 1 value: { max_queue_size: 4 } } }",
     "dynamic_batching.priority_queue_policy"),
    ("dynamic_batching { default_queue_policy { timeout_action: DELAY } }",
     "dynamic_batching.default_queue_policy.timeout_action"),
    ("dynamic_batching { priority_levels: 2 default_priority_level: 5 }",
     "dynamic_batching.default_priority_level"),
])
def test_what_cannot_be_served_is_refused_naming_the_field(tmp_path, extra, field) -> None:
    # the scheduling fields are one of: the others go in without dynamic_batching
    text = FULL if extra.startswith(("backend", "default", "model")) else \
        FULL[:FULL.index("dynamic_batching")]
    with pytest.raises(ConfigError) as err:
        load_config(model_dir(tmp_path, text + "\n" + extra))
    assert f"config.pbtxt: field '{field}'" in str(err.value)


@pytest.mark.parametrize("tensor, field", [
    ('{ name: "X" data_type: TYPE_FP32 dims: [ 4 ] reshape: { shape: [ 2, 2 ] } }',
     "input[0].reshape"),
    ('{ name: "X" data_type: TYPE_FP32 dims: [ 4 ] optional: true }', "input[0].optional"),
    ('{ name: "X" data_type: TYPE_FP32 dims: [ 4 ] allow_ragged_batch: true }',
     "input[0].allow_ragged_batch"),
    ('{ name: "X" dims: [ 4 ] }', "input[0].data_type"),
])
def test_a_tensor_zeroserve_cannot_take_is_refused(tmp_path, tensor, field) -> None:
    text = 'platform: "pytorch_libtorch"\nmax_batch_size: 2\n' \
        f'input [ {tensor} ]\noutput [ {{ name: "Y" data_type: TYPE_FP32 dims: [ 1 ] }} ]\n'
    with pytest.raises(ConfigError, match=re.escape(f"field '{field}'")):
        load_config(model_dir(tmp_path, text))


def test_a_syntax_error_names_the_line(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"config.pbtxt: 3:\d+ .*no field named \"inputs\""):
        load_config(model_dir(tmp_path, 'name: "m"\nmax_batch_size: 1\ninputs: []\n'))


def test_safe_fields_are_ignored_with_one_warning_each(tmp_path, caplog) -> None:
    text = FULL + '''
instance_group [ { count: 2 kind: KIND_GPU gpus: [ 0 ] } ]
parameters: { key: "INFERENCE_MODE" value: { string_value: "true" } }
optimization { input_pinned_memory { enable: true } }
model_warmup [ { name: "w" batch_size: 1 } ]
'''
    folder = model_dir(tmp_path, text)
    with caplog.at_level(logging.WARNING, "zeroserve.models.triton_config"):
        first = load_config(folder)
        load_config(folder)   # the same file again: no second warning
    assert first == parse_config(SAME_AS_JSON, "<json>")
    warned = [r.getMessage() for r in caplog.records]
    for fld in ("instance_group", "parameters.INFERENCE_MODE", "optimization", "model_warmup",
                "dynamic_batching.default_queue_policy.allow_timeout_override"):
        assert sum(f"field '{fld}' is ignored" in w for w in warned) == 1, warned


def test_load_on_demand_is_read_from_parameters(tmp_path: Path) -> None:
    on = 'parameters: { key: "load_on_demand" value: { string_value: "true" } }\n'
    for sub in "abcd":
        (tmp_path / sub).mkdir()
    assert load_config(model_dir(tmp_path / "a", FULL + on)).load_on_demand is True
    off = on.replace('"true"', '"False"')
    assert load_config(model_dir(tmp_path / "b", FULL + off)).load_on_demand is False
    assert load_config(model_dir(tmp_path / "c", FULL)).load_on_demand is None
    with pytest.raises(ConfigError, match="parameters.load_on_demand"):
        load_config(model_dir(tmp_path / "d", FULL + on.replace('"true"', '"yes"')))


def test_an_override_completes_from_the_stored_config(tmp_path: Path) -> None:
    folder = model_dir(tmp_path, FULL)
    raw = triton_config.overridden(folder, {"max_batch_size": "16"})
    cfg = parse_config(raw, "<override>", "m")
    assert cfg.max_batch_size == 16 and cfg == parse_config(
        {**SAME_AS_JSON, "max_batch_size": 16}, "<json>")


def test_an_override_in_triton_json_or_zeroserve_json(tmp_path: Path) -> None:
    folder = tmp_path / "m"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(SAME_AS_JSON))
    triton_json = {"input": [{"name": "x", "data_type": "TYPE_INT32", "dims": ["2"]}],
                   "dynamic_batching": {"max_queue_delay_microseconds": "250"}}
    cfg = parse_config(triton_config.overridden(folder, triton_json), "<override>", "m")
    assert [t.to_json() for t in cfg.inputs] == [{"name": "x", "datatype": "INT32",
                                                 "shape": [2]}]
    assert cfg.dynamic_batching.max_queue_delay_ms == 0.25 and cfg.outputs[0].name == \
        "OUTPUT__0"
    native = {"input_shape": {"z": [1, 5]}, "dynamic_batching": {"max_queue_delay_ms": 3}}
    cfg = parse_config(triton_config.overridden(folder, native), "<override>", "m")
    assert [t.name for t in cfg.inputs] == ["z"] and cfg.dynamic_batching.max_queue_delay_ms == 3
    with pytest.raises(ConfigError, match="field 'sequence_batching'"):
        triton_config.overridden(folder, {"sequence_batching": {}})
    with pytest.raises(ConfigError, match="must be a JSON object"):
        triton_config.overridden(folder, [1])


def test_an_override_of_a_model_without_a_stored_config_must_be_whole(tmp_path) -> None:
    raw = triton_config.overridden(tmp_path / "m", {"max_batch_size": 4})
    with pytest.raises(ConfigError, match="field 'platform'"):
        parse_config(raw, "<override>", "m")


def test_response_cache_is_read_not_ignored(tmp_path: Path, caplog) -> None:
    folder = model_dir(tmp_path, FULL + "response_cache { enable: true }\n")
    with caplog.at_level(logging.WARNING, "zeroserve.models.triton_config"):
        cfg = load_config(folder)
    assert cfg == parse_config({**SAME_AS_JSON, "response_cache": {"enable": True}}, "<json>")
    assert not [r for r in caplog.records if "field 'response_cache'" in r.getMessage()]
