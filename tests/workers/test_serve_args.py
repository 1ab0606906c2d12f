"""``zeroserve serve`` builds each child's command line from the child's own parser:
every option a broker, worker or gateway declares reaches it with serve's value, so an
option added to a component needs no second edit in workers/serve.py."""

from __future__ import annotations

import argparse

import pytest

from zeroserve.broker import options
from zeroserve.workers import serve, supervisor


def _child_args(serve_argv: list[str], command: str) -> argparse.Namespace:
    args = options.parser().parse_args(["serve", *serve_argv])
    argv = serve._base(args, command)
    assert argv[1:3] == ["-m", serve.MODULES[command]]
    return options.parser().parse_args([command, *argv[3:]])


def _a_value(action: argparse.Action) -> tuple[list[str], object]:
    """Flags giving ``action`` a value other than its default, and that value."""
    flag = max(action.option_strings, key=len)
    if isinstance(action, argparse._StoreTrueAction):
        return [flag], True
    if isinstance(action, argparse._AppendAction):
        return [flag, "one", flag, "two"], ["one", "two"]
    if action.choices:
        value = next(c for c in action.choices if c != action.default)
        return [flag, str(value)], value
    kind = action.type or str
    value = kind(7) if kind in (int, float, options.size) else "/tmp/zs-value"
    return [flag, str(value)], value


@pytest.mark.parametrize("command", ["broker", "worker", "gateway"])
def test_every_option_of_a_child_reaches_it_with_serves_value(command: str) -> None:
    child = options.subparsers(options.parser())[command]
    serve_dests = {a.dest for a in options.subparsers(options.parser())["serve"]._actions}
    checked = 0
    for action in child._actions:
        if action.dest in serve.DECIDED or not action.option_strings \
                or action.dest not in serve_dests:
            continue
        flags, value = _a_value(action)
        assert getattr(_child_args(flags, command), action.dest) == value, action.dest
        checked += 1
    assert checked >= 8, "the child parsers' options were not found"


def test_what_serve_decides_is_its_own() -> None:
    argv = serve._base(options.parser().parse_args(
        ["serve", "--runtime-dir", "/tmp/zs-rt", "--threads", "3"]), "worker")
    assert argv[3:5] == ["--runtime-dir", "/tmp/zs-rt"]
    assert "--threads" not in argv   # serve computes each worker's threads itself


@pytest.mark.parametrize("visible, devices", [
    ("3,5", ["3", "5"]),                       # a host's restriction is kept, not renumbered
    (" GPU-8f2a , MIG-1c0d", ["GPU-8f2a", "MIG-1c0d"]),
    ("2,-1,4", ["2"]),                         # CUDA reads up to the first non-device
    ("", []),
    ("-1", []),
])
def test_workers_take_the_gpus_the_host_left_visible(
        monkeypatch: pytest.MonkeyPatch, visible: str, devices: list[str]) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    assert supervisor.visible_gpus() == devices


MIG = [f"MIG-4f1b2c3d-0000-5000-8000-00000000000{i}" for i in range(7)]


@pytest.mark.parametrize("devices, visible, workers, expected", [
    ("", ["3", "5"], 0, ["3", "5"]),               # one worker per visible GPU
    ("", [], 0, [None]),                           # a CPU host: one worker, as it is
    ("", ["0"], 3, ["0", None, None]),             # more workers than GPUs
    ("0,0", ["0", "1"], 0, ["0", "0"]),            # two workers share GPU 0
    ("0,0", [], 2, ["0", "0"]),                    # --workers agreeing with the map
    (",".join(MIG), ["0"], 0, MIG),                # one A100 in 7 slices, one worker each
    (" GPU-8f2a , MIG-1c0d ", [], 0, ["GPU-8f2a", "MIG-1c0d"]),
])
def test_the_device_map_gives_each_worker_its_device(devices: str, visible: list[str],
                                                    workers: int, expected: list[str | None]
                                                    ) -> None:
    assert supervisor.device_map(devices, visible, workers) == expected


@pytest.mark.parametrize("devices, workers, why", [
    ("0,,1", 0, "'' is not a device"),
    ("0,-1", 0, "'-1' is not a device"),
    ("MIG-a b", 0, "'MIG-a b' is not a device"),
    ("0,0", 3, "names 2 device.s., one per worker, but --workers asks for 3"),
])
def test_a_device_map_that_cannot_be_meant_is_refused(devices: str, workers: int,
                                                      why: str) -> None:
    with pytest.raises(ValueError, match=why):
        supervisor.device_map(devices, ["0"], workers)
