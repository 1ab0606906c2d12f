"""The e2e marker follows the tests' code: a test that starts a process, directly or
through a helper, a class or a fixture, is e2e; one that does not is in the fast layer."""

from __future__ import annotations

from pathlib import Path

from tests.conftest import ROOT
from tests.layers import starts_processes

PLANTED = '''
import subprocess


class Rig:
    def __init__(self):
        self.proc = subprocess.Popen(["true"])


def helper():
    return Rig()


def test_through_a_helper_and_a_class():
    helper()


def test_in_process():
    assert sorted([2, 1]) == [1, 2]
'''


def test_a_planted_module_is_split_by_what_its_tests_start(tmp_path: Path) -> None:
    module = tmp_path / "test_planted.py"
    module.write_text(PLANTED)
    assert starts_processes(module, "test_through_a_helper_and_a_class")
    assert not starts_processes(module, "test_in_process")


def test_fixtures_of_a_conftest_count() -> None:
    # api_server (tests/gateway/conftest.py) starts a Server; the client fixture uses it
    assert starts_processes(ROOT / "tests/gateway/test_triton.py", "test_health_and_metadata")
    assert not starts_processes(ROOT / "tests/broker/test_scheduler.py",
                                "test_idle_worker_takes_a_lone_request_at_once")
