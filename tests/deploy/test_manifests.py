"""deploy/ checked without a cluster (and without network): every manifest against its
schema (Kubernetes' own kinds through kubernetes-validate, KServe, KEDA and
prometheus-operator kinds through their vendored CRD schemas), every kustomization
rendered by kubectl and checked again, container arguments through zeroserve's parser,
the Dockerfile against the tree it copies. The broken examples at the end show that each
check can fail."""

from __future__ import annotations

import copy
import re
from pathlib import Path
from typing import Any

import pytest

from tests.deploy import kube
from tests.deploy.checks import check_dockerfile, check_pod
from tests.deploy.kube import DEPLOY, ROOT, ManifestError

needs_kubectl = pytest.mark.skipif(kube.kubectl() is None,
                                   reason="kubectl not installed: kustomizations not rendered")


def rel(p: Path) -> str:
    return str(p.relative_to(DEPLOY))


def docs_of(relpath: str) -> list[dict[str, Any]]:
    return kube.load_docs((DEPLOY / relpath).read_text())


def one(docs: list[dict[str, Any]], kind: str) -> dict[str, Any]:
    found = [d for d in docs if d["kind"] == kind]
    assert len(found) == 1, f"expected one {kind}, got {len(found)}"
    return found[0]


EXPECTED_KINDS = {
    "k8s/base": {"Deployment", "Service", "PodMonitor", "PersistentVolumeClaim"},
    "k8s/overlays/hpa": {"Deployment", "Service", "PodMonitor", "PersistentVolumeClaim",
                         "HorizontalPodAutoscaler"},
    "k8s/overlays/keda": {"Deployment", "Service", "PodMonitor", "PersistentVolumeClaim",
                          "ScaledObject"},
    "k8s/overlays/keda-peak": {"Deployment", "Service", "PodMonitor", "PersistentVolumeClaim",
                               "ScaledObject"},
    "k8s/overlays/two-gpus": {"Deployment", "Service", "PodMonitor", "PersistentVolumeClaim"},
    "k8s/prometheus-adapter": {"ConfigMap"},
    "kserve": {"ClusterServingRuntime", "InferenceService"},
}


# --- what is there ----------------------------------------------------------------------

def test_every_yaml_file_is_a_resource_or_says_what_it_is() -> None:
    for path in kube.yaml_files():
        docs = kube.load_docs(path.read_text())
        assert docs, f"{rel(path)} is empty"
        is_resource = all(isinstance(d, dict) and "apiVersion" in d and "kind" in d
                          for d in docs)
        assert is_resource != (rel(path) in kube.NOT_RESOURCES), rel(path)
    for name in kube.NOT_RESOURCES:
        assert (DEPLOY / name).is_file(), name
    assert {rel(k) for k in kube.kustomizations()} == set(EXPECTED_KINDS)


def test_vendored_schemas_name_their_source() -> None:
    from tests.deploy.schemas.vendor import SOURCES

    crds = kube.crd_schemas()
    assert {("monitoring.coreos.com/v1", "PodMonitor"), ("keda.sh/v1alpha1", "ScaledObject"),
            ("serving.kserve.io/v1alpha1", "ClusterServingRuntime"),
            ("serving.kserve.io/v1beta1", "InferenceService")} <= set(crds)
    recorded = {(f"https://github.com/{r}", t, c, p, lic) for r, t, c, p, lic in SOURCES}
    for crd in crds.values():
        s = crd.source
        assert (s["repository"], s["tag"], s["commit"], s["path"], s["license"]) in recorded
    listed = (kube.SCHEMAS / "SOURCES.md").read_text()
    for repo, tag, commit, path, _ in SOURCES:
        assert repo in listed and tag in listed and commit in listed and path in listed


# --- schemas -----------------------------------------------------------------------------

@pytest.mark.parametrize("path", kube.resource_files(), ids=rel)
def test_manifest_matches_its_schema(path: Path) -> None:
    for doc in kube.load_docs(path.read_text()):
        kube.validate(doc)


@needs_kubectl
@pytest.mark.parametrize("folder", kube.kustomizations(), ids=rel)
def test_kustomization_renders_to_valid_resources(folder: Path) -> None:
    docs = kube.render(folder)
    assert {d["kind"] for d in docs} == EXPECTED_KINDS[rel(folder)]
    for doc in docs:
        kube.validate(doc)
    for name, spec in kube.pod_specs(docs):
        assert check_pod(name, spec) == []
        # the images: setting reached every container (patches added after it too)
        images = {c["image"] for c in spec["containers"]}
        assert len(images) == 1 and "zeroserve" not in images, (name, images)


@pytest.mark.parametrize("path", ["k8s/base/deployment.yaml", "kserve/clusterservingruntime.yaml"])
def test_pods_run_real_zeroserve_commands(path: str) -> None:
    specs = list(kube.pod_specs(docs_of(path)))
    assert specs
    for name, spec in specs:
        assert check_pod(name, spec) == []


@needs_kubectl
def test_two_gpus_means_two_workers_of_one_gpu_each() -> None:
    pod = one(kube.render(DEPLOY / "k8s/overlays/two-gpus"), "Deployment")["spec"]["template"]
    workers = [c for c in pod["spec"]["containers"] if c["args"][0] == "worker"]
    assert [c["name"] for c in workers] == ["worker-0", "worker-1"]
    assert all(c["resources"]["limits"]["nvidia.com/gpu"] == 1 for c in workers)


# --- autoscaling: the metric is one the broker exports -------------------------------

def broker_series() -> set[str]:
    """Series names the broker's registry exports once a request has been queued."""
    from prometheus_client import generate_latest

    from zeroserve.broker.server.metrics import BrokerMetrics

    m = BrokerMetrics()
    m.queued("mlp", [(1, 0.004)])
    m.queue_depth.labels("mlp").set(1)   # set at each scrape
    text = generate_latest(m.registry).decode()
    return {line.split("{")[0].split()[0] for line in text.splitlines()
            if line and not line.startswith("#")}


def series_in(query: str) -> set[str]:
    return set(re.findall(r"\bzeroserve_[a-z_]+", query))


def test_autoscalers_read_series_the_broker_exports() -> None:
    import yaml

    exported = broker_series()
    rules = yaml.safe_load((DEPLOY / "k8s/prometheus-adapter/rules.yaml").read_text())["rules"]
    used: set[str] = set()
    for rule in rules:
        # per pod: without the adapter's matchers and grouping every pod would read the sum
        assert "<<.LabelMatchers>>" in rule["metricsQuery"] and \
            "<<.GroupBy>>" in rule["metricsQuery"]
        assert set(rule["resources"]["overrides"]) == {"namespace", "pod"}
        used |= series_in(rule["seriesQuery"]) | series_in(rule["metricsQuery"])
    scaled = one(docs_of("k8s/overlays/keda/scaledobject.yaml"), "ScaledObject")
    triggers = scaled["spec"]["triggers"]
    for trigger in triggers:
        used |= series_in(trigger["metadata"]["query"])
    assert used and used <= exported, used - exported
    # queue time and queue length, both ways
    assert {"zeroserve_inference_queue_seconds_sum", "zeroserve_queue_depth"} <= used
    # the HPA asks for the metrics the rules make, for the Deployment the base makes
    hpa = one(docs_of("k8s/overlays/hpa/hpa.yaml"), "HorizontalPodAutoscaler")
    asked = [m["pods"]["metric"]["name"] for m in hpa["spec"]["metrics"] if m["type"] == "Pods"]
    assert len(asked) == len(hpa["spec"]["metrics"]) == len(rules)
    assert sorted(asked) == sorted(r["name"]["as"] for r in rules)
    deployment = one(docs_of("k8s/base/deployment.yaml"), "Deployment")["metadata"]["name"]
    assert hpa["spec"]["scaleTargetRef"]["name"] == deployment
    assert scaled["spec"]["scaleTargetRef"]["name"] == deployment
    # KEDA's queries name the namespace and pods the base puts them in
    namespace = kube.load_docs((DEPLOY / "k8s/base/kustomization.yaml").read_text())[0]["namespace"]
    for trigger in triggers:
        assert f'namespace="{namespace}"' in trigger["metadata"]["query"]
        assert f'pod=~"{deployment}-.*"' in trigger["metadata"]["query"]


@needs_kubectl
@pytest.mark.parametrize("folder, kind, field", [
    ("k8s/overlays/hpa", "HorizontalPodAutoscaler", "maxReplicas"),
    ("k8s/overlays/keda", "ScaledObject", "maxReplicaCount"),
    ("k8s/overlays/keda-peak", "ScaledObject", "maxReplicaCount")])
def test_the_maximum_is_set_in_the_kustomization_and_reaches_the_autoscaler(
        folder: str, kind: str, field: str) -> None:
    import yaml

    ours = yaml.safe_load((DEPLOY / folder / "kustomization.yaml").read_text())
    ops = [op for p in ours["patches"] if p["target"]["kind"] == kind
           for op in yaml.safe_load(p["patch"]) if op["path"] == f"/spec/{field}"]
    assert len(ops) == 1 and ops[0]["op"] == "replace"
    rendered = one(kube.render(DEPLOY / folder), kind)["spec"]
    assert rendered[field] == ops[0]["value"] > rendered.get("minReplicas",
                                                              rendered.get("minReplicaCount"))


def _cron_minutes(expr: str) -> int:
    """A weekday cron's time of day in minutes (``M H * * D``: one minute, one hour)."""
    minute, hour, dom, month, _ = expr.split()
    assert dom == month == "*", expr
    return int(hour) * 60 + int(minute)


@needs_kubectl
def test_the_peak_overlay_scales_out_on_a_schedule_beside_the_queue_triggers() -> None:
    scaled = one(kube.render(DEPLOY / "k8s/overlays/keda-peak"), "ScaledObject")["spec"]
    kinds = [t["type"] for t in scaled["triggers"]]
    assert kinds == ["prometheus", "prometheus", "cron"]
    cron = scaled["triggers"][-1]["metadata"]
    assert set(cron) == {"timezone", "start", "end", "desiredReplicas"}
    assert _cron_minutes(cron["start"]) < _cron_minutes(cron["end"])
    assert cron["start"].split()[4] == cron["end"].split()[4]
    assert scaled["minReplicaCount"] < int(cron["desiredReplicas"]) <= scaled["maxReplicaCount"]
    from zoneinfo import ZoneInfo

    ZoneInfo(cron["timezone"])   # a zone KEDA can find (an IANA name)


# --- KServe --------------------------------------------------------------------------

def test_kserve_runtime_speaks_v2_on_the_port_it_says() -> None:
    runtime = one(docs_of("kserve/clusterservingruntime.yaml"), "ClusterServingRuntime")
    spec = runtime["spec"]
    assert spec["protocolVersions"] == ["v2"]
    assert "pytorch" in {f["name"] for f in spec["supportedModelFormats"]}
    (c,) = spec["containers"]
    assert c["name"] == "kserve-container"  # the container KServe fills with the model
    args = kube.parse_args(kube.zeroserve_argv(c), {})
    assert args.command == "serve" and args.model_dir == "/mnt/models"
    assert spec["annotations"]["prometheus.kserve.io/port"] == str(args.http_port)
    assert spec["annotations"]["prometheus.kserve.io/path"] == "/metrics"
    isvc = one(docs_of("kserve/inferenceservice.yaml"), "InferenceService")
    model = isvc["spec"]["predictor"]["model"]
    assert model["runtime"] == runtime["metadata"]["name"]
    assert model["protocolVersion"] == "v2"
    assert model["modelFormat"] in [{k: f[k] for k in ("name", "version")}
                                    for f in spec["supportedModelFormats"]]


# --- the image -----------------------------------------------------------------------

def test_dockerfile_copies_what_exists_and_runs_zeroserve() -> None:
    text = (DEPLOY / "Dockerfile").read_text()
    ignore = (DEPLOY / "Dockerfile.dockerignore").read_text()
    assert check_dockerfile(text, ROOT, ignore) == []
    # the torch pin it installs first is the one constraints.txt holds
    assert re.search(r"^torch==\S+$", (ROOT / "constraints.txt").read_text(), re.M)


# --- each check can fail -------------------------------------------------------------

def broken(relpath: str, change: Any) -> dict[str, Any]:
    doc = copy.deepcopy(kube.load_docs((DEPLOY / relpath).read_text())[0])
    change(doc)
    return doc


def _pod(d: dict[str, Any]) -> dict[str, Any]:
    return d["spec"]["template"]["spec"]


BROKEN_RESOURCES = {
    "deployment: a misspelt container field": ("k8s/base/deployment.yaml",
        lambda d: _pod(d)["containers"][0].update(imagePullPolicyy="Always")),
    "deployment: replicas as a word": ("k8s/base/deployment.yaml",
        lambda d: d["spec"].update(replicas="two")),
    "hpa: a metric target without its type": ("k8s/overlays/hpa/hpa.yaml",
        lambda d: d["spec"]["metrics"][0]["pods"]["target"].pop("type")),
    "podmonitor: a misspelt endpoint field": ("k8s/base/podmonitor.yaml",
        lambda d: d["spec"]["podMetricsEndpoints"][0].update(paht="/metrics")),
    "scaledobject: no triggers": ("k8s/overlays/keda/scaledobject.yaml",
        lambda d: d["spec"].pop("triggers")),
    "runtime: protocolVersions as a string": ("kserve/clusterservingruntime.yaml",
        lambda d: d["spec"].update(protocolVersions="v2")),
    "inferenceservice: storageURI": ("kserve/inferenceservice.yaml",
        lambda d: d["spec"]["predictor"]["model"].update(
            storageURI=d["spec"]["predictor"]["model"].pop("storageUri"))),
    "an unknown kind of a vendored group": ("k8s/overlays/keda/scaledobject.yaml",
        lambda d: d.update(kind="ScaledThing")),
    "an unknown built-in kind": ("k8s/base/deployment.yaml",
        lambda d: d.update(kind="Deploymint")),
}


@pytest.mark.parametrize("case", sorted(BROKEN_RESOURCES))
def test_a_broken_resource_is_refused(case: str) -> None:
    path, change = BROKEN_RESOURCES[case]
    with pytest.raises(ManifestError):
        kube.validate(broken(path, change))


def _worker(d: dict[str, Any]) -> dict[str, Any]:
    return _pod(d)["containers"][2]


BROKEN_PODS = {
    "a renamed flag": lambda d: _pod(d)["containers"][0]["args"].append("--model-dirr=/m"),
    "an unknown ZEROSERVE_ variable": lambda d: _worker(d).update(
        env=[{"name": "ZEROSERVE_WORKER_GPUS", "value": "1"}]),
    "a worker without its GPU": lambda d: _worker(d)["resources"]["limits"].pop("nvidia.com/gpu"),
    "runtime dirs that differ": lambda d: _worker(d)["args"].__setitem__(
        1, "--runtime-dir=/run/zeroserve/other"),
    "the emptyDir itself as runtime dir": lambda d: [
        c["args"].__setitem__(1, "--runtime-dir=/run/zeroserve") for c in _pod(d)["containers"]],
    "a worker without the models": lambda d: _worker(d)["volumeMounts"].pop(),
    "readiness on another path": lambda d: _pod(d)["containers"][1]["readinessProbe"][
        "httpGet"].update(path="/healthz/ready"),
    "a watcher in the pod": lambda d: _pod(d)["containers"][0]["args"].append(
        "--model-control-mode=poll"),
    "no broker": lambda d: _pod(d)["containers"].pop(0),
    "a broker without its liveness probe": lambda d: _pod(d)["containers"][0].pop(
        "livenessProbe"),
    "a worker's probe of another worker": lambda d: _worker(d)["livenessProbe"]["exec"][
        "command"].__setitem__(4, "--index=3"),
    "a worker probed as a broker": lambda d: _worker(d)["livenessProbe"]["exec"][
        "command"].__setitem__(2, "broker"),
}


@pytest.mark.parametrize("case", sorted(BROKEN_PODS))
def test_a_broken_pod_is_caught(case: str) -> None:
    doc = broken("k8s/base/deployment.yaml", BROKEN_PODS[case])
    assert check_pod("Deployment/zeroserve", _pod(doc)) != []


@needs_kubectl
def test_a_broken_kustomization_is_refused(tmp_path: Path) -> None:
    (tmp_path / "kustomization.yaml").write_text("resources:\n  - missing.yaml\n")
    with pytest.raises(ManifestError, match="missing.yaml"):
        kube.render(tmp_path)


@pytest.mark.parametrize("edit, says", [
    (lambda t: t.replace("COPY models/ models/", "COPY modelz/ models/"), "COPY modelz/"),
    (lambda t: t.replace("slim-bookworm", "slim").replace("3.11.11", "3.11"), "not pinned"),
    (lambda t: t.replace("USER 10001:10001", "USER zeroserve"), "USER"),
    (lambda t: t.replace('"--http-port", "8080"', '"--port", "8080"'), "CMD"),
])
def test_a_broken_dockerfile_is_caught(edit: Any, says: str) -> None:
    text = edit((DEPLOY / "Dockerfile").read_text())
    ignore = (DEPLOY / "Dockerfile.dockerignore").read_text()
    problems = check_dockerfile(text, ROOT, ignore)
    assert any(says in p for p in problems), problems
