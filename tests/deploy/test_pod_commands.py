"""The pods of deploy/, run here as plain processes: each container's command line from
the manifest, its volumes as folders (the runtime emptyDir world-writable, as the kubelet
makes it; the model claim with its subPath), so the components really find each other,
become ready on the probe's path, export the autoscalers' series on the scrape path, and
stop on SIGTERM sent to every container at once, as the kubelet sends it."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path
from typing import Any, Iterator

import pytest

from tests.conftest import ZEROSERVE, free_port, http, linear_config, short_tmpdir, wait_for, \
    write_model
from tests.deploy import kube
from tests.deploy.kube import DEPLOY


def cuda() -> bool:
    import torch

    return bool(torch.cuda.is_available())


class Pod:
    """The containers of one pod spec as process groups on this host."""

    def __init__(self, spec: dict[str, Any], root: Path, mounted: dict[str, Path]) -> None:
        self.spec, self.root, self.port = spec, root, free_port()
        self.volumes = mounted  # volume name -> host folder
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.logs: dict[str, Path] = {}

    def host_path(self, container: dict[str, Any], path: str) -> str:
        for m in sorted(container.get("volumeMounts", []), key=lambda m: -len(m["mountPath"])):
            mp = m["mountPath"].rstrip("/")
            if path == mp or path.startswith(mp + "/"):
                base = self.volumes[m["name"]] / m.get("subPath", "")
                return str(base) + path[len(mp):]
        return str(self.root / "rootfs") + path  # the container's own filesystem

    def argv(self, container: dict[str, Any]) -> list[str]:
        out = []
        for arg in kube.zeroserve_argv(container):
            flag, eq, value = arg.partition("=")
            if eq and value.startswith("/"):
                value = self.host_path(container, value)
            elif flag == "--http-port":
                value = str(self.port)
            elif flag == "--http-host":
                value = "127.0.0.1"  # the pod's 0.0.0.0, kept off this host's network
            elif flag == "--device" and not cuda():
                value = "cpu"
            out.append(f"{flag}{eq}{value}" if eq else arg)
        return out

    def probe(self, name: str, *extra: str) -> subprocess.CompletedProcess[str]:
        """The container's livenessProbe command, run here as the kubelet runs it."""
        (c,) = [c for c in self.spec["containers"] if c["name"] == name]
        argv = self.argv({**c, "command": c["livenessProbe"]["exec"]["command"], "args": []})
        return subprocess.run([*ZEROSERVE, *argv, *extra], capture_output=True, text=True,
                              timeout=60)

    def start(self) -> None:
        for c in self.spec["containers"]:
            log = self.root / f"{c['name']}.log"
            self.logs[c["name"]] = log
            env = {**os.environ, "ZEROSERVE_CACHE_DIR": str(self.root / "cache"),
                   **{e["name"]: e.get("value", "") for e in c.get("env", [])}}
            with open(log, "wb") as out:
                self.procs[c["name"]] = subprocess.Popen(
                    [*ZEROSERVE, *self.argv(c)], stdout=out, stderr=subprocess.STDOUT,
                    env=env, start_new_session=True)

    def output(self) -> str:
        return "\n".join(f"--- {n}\n{p.read_text(errors='replace')[-3000:]}"
                         for n, p in self.logs.items())

    def get(self, path: str) -> tuple[int, bytes]:
        try:
            status, _, body = http("GET", f"http://127.0.0.1:{self.port}{path}", timeout=2)
            return status, body
        except OSError:
            return 0, b""

    def sigterm_all(self) -> dict[str, int | None]:
        for p in self.procs.values():
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        grace = float(self.spec.get("terminationGracePeriodSeconds", 30))
        end = time.monotonic() + grace
        for p in self.procs.values():
            try:
                p.wait(max(end - time.monotonic(), 0.1))
            except subprocess.TimeoutExpired:
                pass
        return {n: p.poll() for n, p in self.procs.items()}

    def reap(self) -> None:
        for p in self.procs.values():
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            p.wait()


def volumes_for(spec: dict[str, Any], root: Path) -> dict[str, Path]:
    """A host folder per volume; emptyDirs world-writable as the kubelet creates them,
    the model claim holding a repository in the subPath the containers mount."""
    out = {}
    for v in spec.get("volumes", []):
        folder = root / "volumes" / v["name"]
        folder.mkdir(parents=True)
        if "emptyDir" in v:
            folder.chmod(0o777)
        out[v["name"]] = folder
    subpaths = {m.get("subPath", "") for c in spec["containers"]
                for m in c.get("volumeMounts", []) if m["mountPath"] == "/mnt/models"}
    models = out.setdefault("models", root / "volumes" / "models")  # KServe's own mount
    for sub in subpaths or {""}:
        write_model(models / sub, "linear", 1, "nn.Linear(4, 3)", linear_config("linear"))
    return out


def mount_models(spec: dict[str, Any]) -> dict[str, Any]:
    """A serving runtime's container, with the /mnt/models mount KServe adds to it."""
    c = spec["containers"][0]
    mounts = [*c.get("volumeMounts", []), {"name": "models", "mountPath": "/mnt/models"}]
    return {**spec, "containers": [{**c, "volumeMounts": mounts}]}


@pytest.fixture
def run_pod() -> Iterator[Any]:
    pods: list[Pod] = []
    roots: list[Path] = []

    def start(spec: dict[str, Any]) -> Pod:
        root = short_tmpdir("zspod")
        roots.append(root)
        pod = Pod(spec, root, volumes_for(spec, root))
        pods.append(pod)
        pod.start()
        return pod

    yield start
    for pod in pods:
        pod.reap()
    for root in roots:
        shutil.rmtree(root, ignore_errors=True)


def pod_spec(relpath: str) -> dict[str, Any]:
    docs = kube.load_docs((DEPLOY / relpath).read_text())
    ((_, spec),) = list(kube.pod_specs(docs))
    return spec


def serves_and_scrapes(pod: Pod, scrape_path: str) -> None:
    def ready() -> bool:
        dead = {n: p.returncode for n, p in pod.procs.items() if p.poll() is not None}
        assert not dead, f"exited {dead}:\n{pod.output()}"
        return pod.get("/v2/health/ready")[0] == 200
    wait_for(ready, 90, "the pod's readiness probe to pass")
    body = json.dumps({"inputs": [{"name": "input", "shape": [1, 4], "datatype": "FP32",
                                   "data": [1, 2, 3, 4]}]}).encode()
    status, _, out = http("POST", f"http://127.0.0.1:{pod.port}/v2/models/linear/infer", body,
                          {"Content-Type": "application/json"})
    assert status == 200, out
    text = pod.get(scrape_path)[1].decode()
    assert "zeroserve_inference_queue_seconds_count{" in text, text[:2000]


def test_the_deployments_pod_serves_and_stops(run_pod: Any) -> None:
    spec = pod_spec("k8s/base/deployment.yaml")
    pod = run_pod(spec)
    monitor = kube.load_docs((DEPLOY / "k8s/base/podmonitor.yaml").read_text())[0]
    (endpoint,) = monitor["spec"]["podMetricsEndpoints"]
    serves_and_scrapes(pod, endpoint["path"])
    codes = pod.sigterm_all()
    assert codes == {n: 0 for n in codes}, f"{codes}\n{pod.output()}"


def test_the_kserve_runtime_serves_and_stops(run_pod: Any) -> None:
    docs = kube.load_docs((DEPLOY / "kserve/clusterservingruntime.yaml").read_text())
    spec = mount_models(docs[0]["spec"])
    pod = run_pod(spec)
    serves_and_scrapes(pod, docs[0]["spec"]["annotations"]["prometheus.kserve.io/path"])
    codes = pod.sigterm_all()
    assert codes == {n: 0 for n in codes}, f"{codes}\n{pod.output()}"


def test_the_liveness_probes_fail_on_a_stopped_loop_and_pass_on_a_turning_one(
        run_pod: Any) -> None:
    """SIGSTOP: the process is alive, its loop turns no more. The worker's bound is
    scaled down from the manifest's 30 s to 2 s to keep the test short."""
    pod = run_pod(pod_spec("k8s/base/deployment.yaml"))
    wait_for(lambda: pod.get("/v2/health/ready")[0] == 200, 90, "the pod to be ready")
    for name in ("broker", "worker-0"):
        out = pod.probe(name)
        assert out.returncode == 0, (name, out.stderr)
    for name, extra, bound_s in (("broker", (), 5.0), ("worker-0", ("--max-age-s=2",), 2.0)):
        os.killpg(pod.procs[name].pid, signal.SIGSTOP)
        try:
            start = time.monotonic()
            out = wait_for(lambda: (got := pod.probe(name, *extra)).returncode != 0 and got,
                           30, f"{name}'s probe to fail")
            assert time.monotonic() - start < bound_s + 10, "failed, but late"
            assert f"zeroserve probe {name.split('-')[0]}:" in out.stderr
        finally:
            os.killpg(pod.procs[name].pid, signal.SIGCONT)
        wait_for(lambda: pod.probe(name, *extra).returncode == 0, 30,
                 f"{name}'s probe to pass again")
