"""One TOML config for every component: flag > env > file > default, strict keys."""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest

from zeroserve.broker import config, options
from zeroserve.broker.bench import main as bench
from tests.conftest import load_cli


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    import os
    for name in list(os.environ):
        if name.startswith("ZEROSERVE_"):
            monkeypatch.delenv(name)


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "zeroserve.toml"
    path.write_text(text)
    return path


def test_precedence_is_flag_then_env_then_file_then_default(tmp_path: Path,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    path = write(tmp_path, '[gateway]\nhttp_port = 9001\nhttp_host = "127.0.0.2"\n'
                           'max_body_bytes = 1000\n[broker]\nheartbeat_s = 2\n')
    monkeypatch.setenv("ZEROSERVE_GATEWAY_HTTP_PORT", "9002")
    monkeypatch.setenv("ZEROSERVE_GATEWAY_MAX_BODY_BYTES", "2000")
    args = options.parse(["gateway", "--config", str(path), "--http-port", "9003"])
    assert args.http_port == 9003            # flag over env and file
    assert args.max_body_bytes == 2000       # env over file
    assert args.http_host == "127.0.0.2"     # file over default
    assert args.shutdown_timeout_s == 30.0   # default
    broker = options.parse(["broker", "--config", str(path)])
    assert broker.heartbeat_s == 2.0 and isinstance(broker.heartbeat_s, float)
    # the default file comes from $ZEROSERVE_CONFIG
    monkeypatch.delenv("ZEROSERVE_GATEWAY_HTTP_PORT")
    monkeypatch.setenv("ZEROSERVE_CONFIG", str(path))
    assert options.parse(["gateway"]).http_port == 9001


def test_control_verbs_find_the_broker_through_the_broker_table(tmp_path: Path) -> None:
    path = write(tmp_path, '[broker]\nruntime_dir = "/srv/zs"\n')
    args = options.parse(["drain", "h/0", "--config", str(path)])
    assert args.runtime_dir == "/srv/zs" and args.worker == "h/0"


@pytest.mark.parametrize("text, needle", [
    ("[gateway]\nhttp_prot = 1\n", "unknown key 'http_prot' in [gateway]"),
    ("[gatway]\nhttp_port = 1\n", "unknown table [gatway]"),
    ("[worker]\ncredits = \"two\"\n", "[worker] credits: expected int"),
    ("[broker]\nlog_level = \"loud\"\n", "'loud' is not one of"),
    ("[broker\n", "config file"),
])
def test_bad_files_are_errors_that_name_the_key(tmp_path: Path, text: str, needle: str,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    path = write(tmp_path, text)
    with pytest.raises(config.ConfigError, match=None) as err:
        options.parse(["broker", "--config", str(path)])
    assert needle in str(err.value)
    assert load_cli().main(["config", "show", "--config", str(path)]) == 2
    assert needle in capsys.readouterr().err


def test_unknown_or_malformed_environment_variables_are_errors(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("ZEROSERVE_GATEWAY_HTTP_PRT", "1")
    assert load_cli().main(["gateway", "--http-port", "1"]) == 2
    assert "ZEROSERVE_GATEWAY_HTTP_PRT" in capsys.readouterr().err
    monkeypatch.delenv("ZEROSERVE_GATEWAY_HTTP_PRT")
    monkeypatch.setenv("ZEROSERVE_WORKER_CREDITS", "many")
    with pytest.raises(config.ConfigError, match="ZEROSERVE_WORKER_CREDITS: 'many'"):
        options.parse(["worker"])


def test_config_show_prints_the_effective_config_as_toml(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    path = write(tmp_path, '[serve]\nworkers = 3\n[gateway]\nhttp_port = 9001\n')
    monkeypatch.setenv("ZEROSERVE_GATEWAY_HTTP_PORT", "9002")
    assert load_cli().main(["config", "show", "--config", str(path)]) == 0
    shown = tomllib.loads(capsys.readouterr().out)
    assert set(shown) == {"broker", "worker", "gateway", "serve"}
    assert shown["serve"]["workers"] == 3 and shown["gateway"]["http_port"] == 9002
    assert shown["broker"]["drain_timeout_s"] == 30.0
    assert "model_dir" not in shown["broker"]  # unset options are comments
    # every flag of every component is a key
    subs = options.subparsers(options.parser())
    for component in config.COMPONENTS:
        flags = {a.dest for a in subs[component]._actions if a.option_strings} - {"help", "config"}
        assert flags == set(config.options(subs[component]))


def test_a_missing_config_file_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(config.ConfigError, match="cannot read config file"):
        options.parse(["broker", "--config", str(tmp_path / "nope.toml")])


def test_a_flag_is_true_or_false_in_the_file_and_the_environment(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = write(tmp_path, "[broker]\nload_on_demand = true\n[gateway]\nreuse_port = true\n")
    assert options.parse(["broker", "--config", str(path)]).load_on_demand is True
    assert options.parse(["gateway", "--config", str(path)]).reuse_port is True
    monkeypatch.setenv("ZEROSERVE_BROKER_LOAD_ON_DEMAND", "off")
    assert options.parse(["broker", "--config", str(path)]).load_on_demand is False
    assert options.parse(["broker", "--config", str(path),
                          "--load-on-demand"]).load_on_demand is True
    monkeypatch.setenv("ZEROSERVE_BROKER_LOAD_ON_DEMAND", "maybe")
    with pytest.raises(config.ConfigError, match="expected true or false, got 'maybe'"):
        options.parse(["broker"])
    monkeypatch.delenv("ZEROSERVE_BROKER_LOAD_ON_DEMAND")
    bad = write(tmp_path, '[broker]\nload_on_demand = "yes"\n')
    with pytest.raises(config.ConfigError, match="expected true or false"):
        options.parse(["broker", "--config", str(bad)])


def test_sizes_take_units_on_the_command_line_in_the_environment_and_the_file(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    args = options.parse(["worker", "--memory-budget", "40MiB", "--memory-headroom", "64 MiB",
                          "--host-cache-bytes", "1GiB", "--memory-tolerance-bytes", "1000"])
    assert (args.memory_budget, args.memory_headroom, args.host_cache_bytes,
            args.memory_tolerance_bytes) == (40 << 20, 64 << 20, 1 << 30, 1000)
    assert options.parse(["gateway", "--max-body-bytes", "1.5MB"]).max_body_bytes == 1_500_000
    monkeypatch.setenv("ZEROSERVE_WORKER_MEMORY_BUDGET", "2GiB")
    assert options.parse(["worker"]).memory_budget == 2 << 30
    monkeypatch.delenv("ZEROSERVE_WORKER_MEMORY_BUDGET")
    path = write(tmp_path, '[worker]\nmemory_budget = "8 GiB"\nhost_cache_bytes = 4096\n'
                           '[broker]\nresponse_cache_bytes = "16MiB"\n')
    args = options.parse(["worker", "--config", str(path)])
    assert (args.memory_budget, args.host_cache_bytes) == (8 << 30, 4096)
    assert options.parse(["broker", "--config", str(path)]).response_cache_bytes == 16 << 20
    with pytest.raises(config.ConfigError, match=r"\[worker\] memory_budget: '8 Gb!' is not "
                                                 r"a size: .* KiB, MiB, GiB, TiB"):
        options.parse(["worker", "--config", str(write(tmp_path, '[worker]\n'
                                                       'memory_budget = "8 Gb!"\n'))])
    with pytest.raises(SystemExit):
        options.parse(["worker", "--memory-budget", "40M"])
    assert "'40M' is not a size" in capsys.readouterr().err


def test_every_subcommand_and_option_has_help() -> None:
    import argparse

    missing = []
    for name, sub in options.subparsers(options.parser([bench.register])).items():
        if not sub.description:
            missing.append(f"zeroserve {name}: no description")
        missing += [f"zeroserve {name} {a.option_strings or a.dest}: no help"
                    for a in sub._actions
                    if not isinstance(a, argparse._HelpAction) and not a.help]
    assert not missing, "\n".join(missing)


def test_control_verbs_list_only_the_options_they_use() -> None:
    subs = options.subparsers(options.parser())
    for verb in ("status", "models", "drain", "undrain", "reload", "push", "rollout",
                 "rollback", "promote", "tenants", "probe"):
        flags = {f for a in subs[verb]._actions for f in a.option_strings}
        assert {"--runtime-dir", "--control", "--config"} <= flags, verb
        assert not flags & {"--frontend", "--backend", "--log-level"}, (verb, flags)
