"""Config fields and side files the gateway's extensions and the broker rely on:
``optional`` (strict readiness), ``labels.txt`` (classification) and ``response_cache``."""

from __future__ import annotations

from pathlib import Path

import pytest

from zeroserve.models.repository import ConfigError, load_labels, parse_config
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
