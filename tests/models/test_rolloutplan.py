"""A rollout plan in config.json: refused with the field named, or kept normalized."""

from __future__ import annotations

from typing import Any

import pytest

from tests.conftest import linear_config
from zeroserve.models.repository import ConfigError, parse_config


def config(**extra: Any) -> dict[str, Any]:
    return linear_config("m", version_policy={"latest": 2}, **extra)


def test_a_plan_is_kept_normalized() -> None:
    cfg = parse_config(config(rollout={"steps": [10, 100], "dwell_s": 30}), "m/config.json")
    assert cfg.rollout is not None
    assert cfg.rollout["steps"] == [10, 100] and cfg.rollout["dwell_s"] == 30.0
    assert cfg.rollout["min_requests"] == 50   # the defaults filled in
    assert cfg.to_json()["rollout"] == cfg.rollout
    assert "rollout" not in parse_config(config(), "m/config.json").to_json()


@pytest.mark.parametrize("rollout, message", [
    ({"steps": [50, 10, 100]}, "must ascend"),
    ({"steps": [10, 50]}, "must end at 100"),
    ({"steps": [10, 100], "dwell": 5}, "unknown field 'dwell'"),
    ({"max_error_rate": "high"}, "max_error_rate must be a number"),
])
def test_a_bad_plan_names_the_field(rollout: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=f"field 'rollout': .*{message}"):
        parse_config(config(rollout=rollout), "m/config.json")


def test_a_plan_needs_the_previous_version_kept() -> None:
    with pytest.raises(ConfigError, match='"latest": 2'):
        parse_config(linear_config("m", rollout={}, version_policy={"latest": 1}),
                     "m/config.json")


def test_a_plan_without_a_version_policy_keeps_the_version_before_loaded() -> None:
    """The default policy (one version) would unload the version a rollout compares with;
    with a plan and no policy, the default keeps two (a registration writes it so)."""
    assert parse_config(linear_config("m", rollout={}), "m/config.json").version_policy \
        == {"latest": 2}
    assert parse_config(linear_config("m"), "m/config.json").version_policy == {"latest": 1}
