"""How long a release takes to reach every worker: a version pushed under load, timed
from its commit (the broker's monotonic clock, the same on this host) by the build each
answer names.

    python -m tests.bench.bench_switch [--rounds 3] [--clients 4] [--workers 1,2,4]
        [--no-remote]

For each pool (1, 2, 4 local workers, and one worker over tcp:// with CurveZMQ) and
each round, a new version is pushed (``push`` over the control socket, the model file
uploaded) while ``--clients`` direct clients send one request after another. Printed
per round: publish -> commit (the prepare: hashing, loading and warming up on every
worker), commit -> the first answer by the new build, commit -> the last answer by the
old build (after it, no worker answers with the old build), and how many requests
sent after the commit the old build answered (the goal: none). The baseline beside
them, from the same run: the median round trip of one request under the same load.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from tests.conftest import ROOT, Server, free_port, linear_config, short_tmpdir, wait_for
from zeroserve.broker import curve
from zeroserve.broker.client import Client
from zeroserve.models.repository import version_sha256

X = {"input": np.ones((1, 4), np.float32)}


def model_file(folder: Path, value: float) -> bytes:
    folder.mkdir(parents=True, exist_ok=True)
    module = torch.nn.Linear(4, 3)
    with torch.no_grad():
        module.weight.zero_()
        module.bias.fill_(value)
    torch.jit.save(torch.jit.script(module.eval()), str(folder / "model.pt"))
    return (folder / "model.pt").read_bytes()


def new_repo() -> Path:
    repo = short_tmpdir("zsswitch")
    model_file(repo / "m" / "1", 1.0)
    (repo / "m" / "config.json").write_text(json.dumps(linear_config("m")))
    return repo


@dataclass
class Load:
    """Clients sending one request after another; each answer's (sent, received, build)."""
    frontend: str
    clients: int
    got: list[tuple[float, float, str]] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    stop: threading.Event = field(default_factory=threading.Event)
    threads: list[threading.Thread] = field(default_factory=list)

    def start(self) -> None:
        self.threads = [threading.Thread(target=self._run, daemon=True)
                        for _ in range(self.clients)]
        for t in self.threads:
            t.start()

    def _run(self) -> None:
        with Client(self.frontend, timeout_s=30) as c:
            while not self.stop.is_set():
                sent = time.monotonic()
                try:
                    r = c.infer("m", X)
                except Exception as exc:  # noqa: BLE001 - reported with the figures
                    self.errors.append(repr(exc))
                    continue
                self.got.append((sent, time.monotonic(), r.build))

    def end(self) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(30)


def one_round(control: str, load: Load, version: int, data: bytes, sha: str
              ) -> dict[str, float]:
    with Client(control, timeout_s=30, admin_token=os.environ.get(
            "ZEROSERVE_ADMIN_TOKEN", "")) as c:
        before = len(load.got)
        t0 = time.monotonic()
        job = c.control("push", model="m", version=version, data=data)
        while (st := c.control("register_status", token=job["token"]))["state"] not in (
                "published", "failed"):
            time.sleep(0.005)  # noqa: sleep-ok (polling the push job)
        published = time.monotonic()
        assert st["state"] == "published", st

        def committed() -> float | None:
            m = c.control("models")["models"]["m"]
            return m.get("committed_s") if m["versions"] == [version] else None
        commit = wait_for(committed, 120, f"version {version} committed")
        wait_for(lambda: sum(1 for s, _, _ in load.got[before:] if s > commit + 0.2) > 20,
                 60, "answers after the commit")
    answers = load.got[before:]
    old = [r for s, r, b in answers if b != sha]
    new = [r for s, r, b in answers if b == sha]
    return {"push_to_publish_ms": (published - t0) * 1000,
            "publish_to_commit_ms": (commit - published) * 1000,
            "first_new_ms": (min(new) - commit) * 1000,
            "last_old_ms": (max(old) - commit) * 1000 if old else float("nan"),
            "old_after_commit": sum(1 for s, _, b in answers if s > commit and b != sha),
            "rtt_p50_ms": statistics.median(r - s for s, r, _ in answers) * 1000}


def run_pool(name: str, frontend: str, control: str, rounds: int, clients: int,
             scratch: Path) -> None:
    load = Load(frontend, clients)
    load.start()
    try:
        wait_for(lambda: len(load.got) > 100, 60, "the load to run")
        for i in range(rounds):
            version = i + 2
            data = model_file(scratch / f"{name}-{version}", float(version))
            sha = version_sha256(scratch / f"{name}-{version}")
            row = one_round(control, load, version, data, sha)
            print(f"{name:>16} v{version}: publish->commit {row['publish_to_commit_ms']:7.1f} ms"
                  f" | commit->first new {row['first_new_ms']:6.1f} ms"
                  f" | commit->last old {row['last_old_ms']:6.1f} ms"
                  f" | old after commit {row['old_after_commit']:d}"
                  f" | baseline rtt p50 {row['rtt_p50_ms']:5.2f} ms", flush=True)
    finally:
        load.end()
    if load.errors:
        print(f"{name:>16}: {len(load.errors)} errors, e.g. {load.errors[0]}")


def local(workers: int, rounds: int, clients: int, scratch: Path) -> None:
    repo = new_repo()
    srv = Server(repo, workers=workers).wait_ready(120)
    try:
        run_pool(f"{workers} local", srv.frontend, srv.control, rounds, clients, scratch)
    finally:
        srv.stop()
        shutil.rmtree(repo, ignore_errors=True)


def remote(rounds: int, clients: int, scratch: Path) -> None:
    """A broker with its backend on tcp:// and CurveZMQ, and one worker over it (the same
    host: the wire, the encryption and the handshake are a remote worker's)."""
    folder = short_tmpdir("zsswcurve")
    keys, auth, runtime, repo = folder / "keys", folder / "auth", folder / "rt", new_repo()
    auth.mkdir()
    runtime.mkdir(mode=0o700)
    for key in ("broker", "w0"):
        public, _ = curve.generate(keys, key)
        if key != "broker":
            shutil.copy(public, auth)
    port = free_port()
    procs: list[subprocess.Popen[bytes]] = []

    def spawn(args: list[str], log: str) -> None:
        procs.append(subprocess.Popen([sys.executable, *args], cwd=ROOT,
                                      stdout=open(folder / log, "wb"),
                                      stderr=subprocess.STDOUT, start_new_session=True))
    try:
        spawn(["-m", "zeroserve.broker.server.main", "--model-dir", str(repo),
               "--runtime-dir", str(runtime), "--backend", f"tcp://127.0.0.1:{port}",
               "--curve-secret-key", str(keys / "broker.key_secret"),
               "--curve-authorized-keys", str(auth)], "broker.log")
        spawn(["-m", "zeroserve.workers.main", "--index", "0", "--threads", "1",
               "--backend", f"tcp://127.0.0.1:{port}",
               "--curve-server-key", str(keys / "broker.key"),
               "--curve-secret-key", str(keys / "w0.key_secret")], "worker.log")

        def ready() -> bool:
            if not (runtime / "control").exists():
                return False
            with Client(f"ipc://{runtime}/control", timeout_s=5) as c:
                return bool(c.control("models")["models"].get("m", {}).get("ready"))
        wait_for(ready, 120, "the remote worker to serve m")
        run_pool("1 remote (curve)", f"ipc://{runtime}/frontend", f"ipc://{runtime}/control",
                 rounds, clients, scratch)
    finally:
        for proc in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(20)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        shutil.rmtree(folder, ignore_errors=True)
        shutil.rmtree(repo, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--clients", type=int, default=4)
    ap.add_argument("--workers", default="1,2,4", help="local pool sizes, comma-separated")
    ap.add_argument("--no-remote", action="store_true", help="skip the tcp:// CurveZMQ pool")
    args = ap.parse_args(argv)
    scratch = short_tmpdir("zsswfiles")
    print(f"switch of a pushed version under load ({args.clients} clients, {os.cpu_count()} "
          "cores shared by clients, broker and workers)")
    try:
        for n in (int(x) for x in args.workers.split(",") if x):
            local(n, args.rounds, args.clients, scratch)
        if not args.no_remote:
            remote(args.rounds, args.clients, scratch)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
