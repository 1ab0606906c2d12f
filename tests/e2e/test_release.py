"""A release end to end, under load from HTTP and direct clients, as a release pipeline
drives it: version 2 pushed over the API (``POST /v1/models/m/versions``), canaried by
routing key under the config's plan, stepped to 100 % and promoted; version 3, which
raises on a fifth of its inputs, pushed with ``zeroserve push``, rolled back by itself;
version 4, ten times slower, uploaded, held at 50 % by ``zeroserve rollout`` and rolled
back on latency; version 5, the fix, canaried against version 2 (which the version
policy would have unloaded for the two rolled back) and promoted. Every answer's build
(X-Model-Build, ``InferResult.build``) is the version its output names; one key meets
one version while the weights hold; every request is answered exactly once, none fails,
and the census is empty at the end. Then the same with a pool of one local worker and
one remote one over tcp:// with CurveZMQ (in a network namespace of its own when the
tests run as root)."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from typing import Iterator

import pytest

from tests.conftest import Server, free_port, http, linear_config, short_tmpdir, \
    wait_for
from tests.e2e.canary import SERVICE_S, Answers, Load, add_version, control, ended, \
    never_back, write_version
from tests.e2e.load import cli
from tests.e2e.test_curve import Netns, netns_unavailable
from tests.e2e.test_push import push
from zeroserve.broker import curve
from zeroserve.broker.server.split import pick, point
from zeroserve.models.repository import version_sha256

pytestmark = pytest.mark.timeout(240)

# the newest 3 stay loaded: a rolled-back version stays (and says why) while the next
# one is rolled out against the stable version
PLAN = {"steps": [10, 50, 100], "dwell_s": 0.3, "min_requests": 20, "min_errors": 3,
        "max_error_rate": 0.05, "max_latency_ratio": 3.0, "latency_floor_ms": 10.0}


class Release:
    """A repository with version 1 of ``m`` and its rollout plan, an import root for
    the versions to push, and ``zeroserve serve`` on it (with a remote worker when asked)."""

    def __init__(self, remote: bool) -> None:
        self.folder = short_tmpdir("zsrel")
        self.repo, self.imports = self.folder / "repo", self.folder / "imports"
        (self.repo / "m").mkdir(parents=True)
        self.imports.mkdir()
        (self.repo / "m" / "config.json").write_text(json.dumps(
            {**linear_config("m"), "platform": "python", "version_policy": {"latest": 3},
             "rollout": PLAN}))
        add_version(self.repo, 1)
        self.netns: Netns | None = None
        self.worker: subprocess.Popen[bytes] | None = None
        extra = ["--import-root", str(self.imports)]
        if remote:
            keys, auth = self.folder / "keys", self.folder / "auth"
            auth.mkdir()
            for name in ("broker", "w1"):
                public, _ = curve.generate(keys, name)
                shutil.copy(public, auth)
            self.netns = None if netns_unavailable() else Netns()
            port = free_port()
            extra += ["--backend", f"tcp://0.0.0.0:{port}",
                      "--curve-secret-key", str(keys / "broker.key_secret"),
                      "--curve-authorized-keys", str(auth)]
        self.srv = Server(self.repo, workers=1, extra=extra)
        try:
            if remote:   # started beside the server: it connects once the broker binds
                host = self.netns.host_ip if self.netns else "127.0.0.1"
                runtime = self.folder / "w1rt"
                runtime.mkdir(mode=0o700)
                self.worker_log = self.folder / "w1.log"
                with open(self.worker_log, "wb") as log:
                    self.worker = subprocess.Popen(
                        [*(self.netns.prefix() if self.netns else []), sys.executable,
                         "-m", "zeroserve.workers.main", "--index", "1", "--threads", "1",
                         "--runtime-dir", str(runtime), "--backend", f"tcp://{host}:{port}",
                         "--curve-server-key", str(keys / "broker.key"),
                         "--curve-secret-key", str(keys / "w1.key_secret")],
                        stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
            self.srv.wait_ready()
            if remote:
                wait_for(lambda: len(control(self.srv, "models")["models"]["m"]["workers"])
                         == 2, 90, "the remote worker to hold version 1")
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        if self.worker is not None:
            for sig in (signal.SIGTERM, signal.SIGKILL):
                try:
                    os.killpg(self.worker.pid, sig)   # `ip netns exec` and the worker
                    self.worker.wait(20)
                    break
                except (ProcessLookupError, subprocess.TimeoutExpired):
                    continue
            self.worker.wait()
        self.srv.stop()
        if self.netns is not None:
            self.netns.remove()
        shutil.rmtree(self.folder, ignore_errors=True)


@pytest.fixture(params=["local", "remote"])
def release(request: pytest.FixtureRequest) -> Iterator[Release]:
    rel = Release(remote=request.param == "remote")
    yield rel
    rel.close()


def test_a_release_end_to_end(release: Release) -> None:
    srv, imports = release.srv, release.imports
    builds = {1: version_sha256(release.repo / "m" / "1")}
    ctl = ["--runtime-dir", str(srv.runtime), "--timeout", "10"]
    load = Load(srv)
    try:
        wait_for(lambda: len(load.answers.all()) > 50, 30, "the load to run")

        # version 2: pushed over HTTP from the import root; the config's plan steps it
        # 10 -> 50 -> 100 by key, then promotes it and retires version 1
        status, doc = push(srv.url, "m", {"model_path": str(write_version(imports / "v2", 2))})
        assert status == 201 and doc["version"] == 2, doc
        builds[2] = doc["sha256"]
        promoted = wait_for(lambda: ended(srv, 2), 60, "version 2's rollout to end")
        assert promoted["outcome"] == "promoted", promoted
        m = control(srv, "models")["models"]["m"]
        assert m["ready"] == [2] and m["default_version"] == 2, m

        # version 3 fails a fifth of its inputs: pushed by `zeroserve push` (an upload),
        # rolled back by itself on errors
        out = cli("push", "m", str(write_version(imports / "v3", 3, fails=True) / "model.py"),
                  *ctl)
        assert out.returncode == 0 and "version 3 published" in out.stdout, out.stderr
        builds[3] = version_sha256(imports / "v3")
        back = wait_for(lambda: ended(srv, 3), 60, "version 3's rollout to end")
        assert back["outcome"] == "rolled back", back
        out = cli("models", *ctl)
        assert "m/3: rolled back: error rate" in out.stdout, out.stdout + out.stderr
        wait_for(lambda: sum(a.sent > back["ended_s"] for a in load.answers.all()) > 50,
                 30, "answers after the rollback")

        # version 4 is ten times slower: uploaded over HTTP; the config's plan starts it
        # at 10 %, `zeroserve rollout` holds it at 50 % (a step that would last 10 min);
        # rolled back on latency
        v4 = write_version(imports / "v4", 4, sleep_s=10 * SERVICE_S)
        status, doc = push(srv.url, "m", raw=(v4 / "model.py").read_bytes(), query="?version=4")
        assert status == 201, doc
        builds[4] = doc["sha256"]
        wait_for(lambda: 4 in control(srv, "models")["models"]["m"]["ready"], 30,
                 "version 4 to load")
        out = cli("rollout", "m", "4", "--stable", "2", "--steps", "50,100", "--dwell", "600",
                  "--min-requests", "30", *ctl)
        assert out.returncode == 0 and "version 4 takes 50%" in out.stdout, out.stderr
        held_from = time.monotonic()   # the verb has answered: 50 % holds
        slow = wait_for(lambda: ended(srv, 4), 60, "version 4's rollout to end")
        assert slow["outcome"] == "rolled back" and slow["plan"]["steps"] == [50, 100], slow

        # version 5, the fix: the newest 3 are 3, 4 and 5, both rolled back but 5, yet
        # version 2 stays loaded for it to be canaried against, and retires once 5 is
        # promoted
        status, doc = push(srv.url, "m", {"model_path": str(write_version(imports / "v5", 5))})
        assert status == 201, doc
        builds[5] = doc["sha256"]
        fixed = wait_for(lambda: ended(srv, 5), 60, "version 5's rollout to end")
        assert fixed["outcome"] == "promoted" and fixed["stable"] == 2, fixed
    finally:
        answers = load.finish()

    m = control(srv, "models")["models"]["m"]
    assert "error rate" in m["rolled_back"]["3"] and \
        "compute time p50" in m["rolled_back"]["4"], m["rolled_back"]
    status, _, raw = http("POST", f"{srv.url}/v2/repository/index", b"{}")
    index = {(e["name"], e["version"]): e for e in json.loads(raw)}
    assert index["m", "3"]["reason"].startswith("rolled back: error rate"), index
    assert index["m", "4"]["reason"].startswith("rolled back: compute time"), index
    assert index["m", "5"]["state"] == "READY" and ("m", "1") not in index \
        and ("m", "2") not in index, index

    got = answers.all()
    assert len(got) == answers.sent, "a request was not answered exactly once"
    failed = [a for a in got if isinstance(a.outcome, str)]
    assert not failed, failed[:3]   # what version 3 failed ran again on version 2
    wrong = [a for a in got if a.build != f"{a.outcome}/{builds[int(a.outcome)]}"]
    assert not wrong, wrong[:3]     # the build named is the one that computed
    assert {a.outcome for a in got} == {1, 2, 3, 4, 5}
    for version, decided in ((1, promoted["ended_s"]), (3, back["ended_s"]),
                             (4, slow["ended_s"]), (2, fixed["ended_s"])):
        late = [a for a in got if a.sent > decided and a.outcome == version]
        assert not late, (version, late[:3])
    never_back(answers, 1, 2)
    never_back(answers, 2, 5)
    held_at_50(answers, held_from, slow["ended_s"])
    if release.worker is not None:   # both workers computed answers
        assert release.worker.poll() is None, release.worker_log.read_text()
        ran = {w: re.search(r'zeroserve_worker_batch_seconds_count\{model="m"\} (\S+)', t)
               for w, t in control(srv, "metrics")["workers"].items()}
        assert len(ran) == 2 and all(r and float(r.group(1)) > 0 for r in ran.values()), ran
    census = control(srv, "census")
    assert census == {k: 0 for k in census}


def held_at_50(answers: Answers, start: float, end: float) -> None:
    """While version 4 held 50 %: each key met the one version its hash picks."""
    seen: dict[str, set[int | str]] = {}
    for key, seq in answers.by_key.items():
        for a in seq:
            if a.sent > start and a.got < end:
                seen.setdefault(key, set()).add(a.outcome)
    assert len(seen) > 20, seen
    for key, versions in seen.items():
        assert versions == {pick({4: 50, 2: 50}, point("m", key))}, (key, versions)
    assert {v for vs in seen.values() for v in vs} == {2, 4}

