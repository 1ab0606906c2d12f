"""Config fields and side files the gateway's extensions rely on: ``optional`` (strict
readiness) and ``labels.txt`` (classification)."""

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
