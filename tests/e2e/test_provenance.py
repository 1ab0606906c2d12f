"""Provenance end to end: a version's metadata.json, written by hand or by a push (HTTP
and the CLI), shown by ``zeroserve models``, the registration API and v2's model metadata,
kept across a restart, and never part of the build id."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import ZEROSERVE, http, linear_config, short_tmpdir, wait_for
from tests.e2e.test_lifecycle import save_versioned
from tests.e2e.test_push import push, serving
from zeroserve.broker.client import Client
from zeroserve.models.repository import version_sha256

pytestmark = pytest.mark.timeout(180)

RUN_1 = {"source": "s3://models/m/1", "run_id": "run-1", "commit": "abc123",
         "created_by": "alice", "labels": {"team": "search"}}


@pytest.fixture
def dirs():
    repo, imports = short_tmpdir("zsrepo"), short_tmpdir("zsimp")
    save_versioned(repo / "m" / "1", 1.0)
    (repo / "m" / "config.json").write_text(
        json.dumps(linear_config("m", version_policy={"all": True})))
    yield repo, imports
    shutil.rmtree(repo, ignore_errors=True)
    shutil.rmtree(imports, ignore_errors=True)


def models(runtime: Path, human: bool = False) -> Any:
    out = subprocess.run([*ZEROSERVE, "models", "--runtime-dir", str(runtime),
                          *([] if human else ["--json"])],
                         capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stderr
    return out.stdout if human else json.loads(out.stdout)


def swaps(control: str) -> float:
    with Client(control, timeout_s=5) as c:
        text = c.control("metrics")["broker"]
    [value] = re.findall(r'^zeroserve_model_swaps_total\{model="m"\} (\S+)$', text, re.M)
    return float(value)


def get(url: str) -> dict[str, Any]:
    status, _, body = http("GET", url)
    assert status == 200, body
    return json.loads(body)  # type: ignore[no-any-return]


def test_provenance_is_shown_everywhere_kept_across_a_restart_and_not_in_the_build(
        dirs, serve) -> None:
    repo, imports = dirs
    sha1 = version_sha256(repo / "m" / "1")
    (repo / "m" / "1" / "metadata.json").write_text(json.dumps(RUN_1))
    assert version_sha256(repo / "m" / "1") == sha1      # no part of the build
    srv = serve(repo, extra=["--import-root", str(imports)])
    assert models(srv.runtime)["models"]["m"]["provenance"] == {"1": RUN_1}
    assert models(srv.runtime)["models"]["m"]["sha256"] == {"1": sha1[:12]}

    # a push over HTTP with its fields; a bad one is refused in its own words
    save_versioned(imports / "v2", 2.0)
    run2 = {"run_id": "run-2", "data_version": "2026-11", "labels": {"ticket": "ML-7"}}
    status, doc = push(srv.url, "m", {"model_path": str(imports / "v2"),
                                      "metadata": {"color": "blue"}})
    assert status == 400 and "unknown field(s) 'color'" in doc["error"], doc
    status, doc = push(srv.url, "m", {"model_path": str(imports / "v2"),
                                      "metadata": {"run_id": "x" * 300}})
    assert status == 400 and "at most 256" in doc["error"], doc
    status, doc = push(srv.url, "m", {"model_path": str(imports / "v2"), "metadata": run2})
    assert status == 201 and doc["sha256"] == version_sha256(imports / "v2"), doc
    wait_for(lambda: serving(srv.url, 2), 30, "version 2 to serve")

    # the registration API and v2's model metadata (the default version, or the one named)
    assert get(srv.url + "/v1/models/m")["provenance"]["2"] == run2
    assert get(srv.url + "/v2/models/m")["parameters"] == {"provenance": run2}
    assert get(srv.url + "/v2/models/m/versions/1")["parameters"] == {"provenance": RUN_1}

    # a registration's body may carry it too
    body = {**linear_config("r"), "model_path": str(imports / "v2"),
            "metadata": {"source": "registry://r"}}
    status, _, raw = http("POST", srv.url + "/v1/models", json.dumps(body).encode(),
                          {"Content-Type": "application/json"})
    assert status == 201, raw
    wait_for(lambda: http("GET", srv.url + "/v1/models/r")[0] == 200, 30, "r served")
    assert get(srv.url + "/v1/models/r")["provenance"] == {"1": {"source": "registry://r"}}

    # a push from the command line
    out = subprocess.run([*ZEROSERVE, "push", "m", str(imports / "v2" / "model.pt"),
                          "--version", "3", "--meta", "created_by=bob",
                          "--meta", "commit=def456", "--label", "stage=canary",
                          "--runtime-dir", str(srv.runtime)],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and "version 3 published" in out.stdout, out.stderr
    wait_for(lambda: serving(srv.url, 3), 30, "version 3 to serve")
    run3 = {"created_by": "bob", "commit": "def456", "labels": {"stage": "canary"}}
    assert "m/3: commit=def456, created_by=bob, label stage=canary" in \
        models(srv.runtime, human=True)

    # metadata corrected in place: shown, and nothing reloads (the same build)
    before = swaps(srv.control)
    fixed = {**run3, "created_by": "bob@example.com"}
    (repo / "m" / "3" / "metadata.json").write_text(json.dumps(fixed))
    wait_for(lambda: models(srv.runtime)["models"]["m"]["provenance"]["3"] == fixed, 20,
             "the corrected metadata")
    assert swaps(srv.control) == before
    assert srv.log().count("preparing version(s) [3]") == 1

    # a restart reads it all back from the repository
    srv.stop()
    srv = serve(repo, extra=["--import-root", str(imports)])
    shown = models(srv.runtime)["models"]["m"]
    assert shown["provenance"]["3"] == fixed and shown["provenance"]["1"] == RUN_1
    assert get(srv.url + "/v2/models/m/versions/3")["parameters"] == {"provenance": fixed}
