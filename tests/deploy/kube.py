"""Checks of deploy/ without a cluster: Kubernetes' own kinds against the schemas that
kubernetes-validate ships, the CRD kinds (KServe, KEDA, prometheus-operator) against the
CRD schemas vendored in schemas/, kustomizations rendered with ``kubectl kustomize``,
and container arguments parsed by zeroserve's own parser. No network at any point."""

from __future__ import annotations

import contextlib
import io
import json
import os
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Mapping

import jsonschema
import kubernetes_validate
import yaml
from kubernetes_validate import utils as kv_utils

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
SCHEMAS = Path(__file__).resolve().parent / "schemas"
# the oldest Kubernetes the manifests claim, and the newest kubernetes-validate knows
KUBERNETES_VERSIONS = ("1.30", kv_utils.major_minor(kv_utils.latest_version()))
# YAML under deploy/ that is not a Kubernetes resource, and what it is instead
NOT_RESOURCES = {
    "k8s/prometheus-adapter/rules.yaml": "prometheus-adapter's own config file",
    "k8s/overlays/two-gpus/worker-1.yaml": "a JSON patch (RFC 6902) of the Deployment",
}


class ManifestError(ValueError):
    """A manifest that a cluster would refuse (or that zeroserve would not run); the
    message names the resource and the field."""


def name_of(doc: Mapping[str, Any]) -> str:
    return f"{doc.get('kind')}/{doc.get('metadata', {}).get('name')}"


def load_docs(text: str) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(text) if d is not None]


def yaml_files() -> list[Path]:
    return sorted(p for p in DEPLOY.rglob("*.yaml") if p.name != "kustomization.yaml")


def resource_files() -> list[Path]:
    return [p for p in yaml_files() if str(p.relative_to(DEPLOY)) not in NOT_RESOURCES]


def kustomizations() -> list[Path]:
    return sorted(p.parent for p in DEPLOY.rglob("kustomization.yaml"))


# --- CRD kinds: the vendored openAPIV3Schema, checked with jsonschema ----------------

def strict(schema: Any) -> Any:
    """The schema with unknown fields refused, as the API server's pruning would drop
    them silently (kubeconform's and kubernetes-validate's --strict do the same): an
    object that lists its properties, and neither keeps unknown fields nor says what
    extra ones may be, gets additionalProperties: false. Only nodes that carry a type:
    structural schemas put none inside allOf/anyOf/oneOf, whose properties only restate."""
    if isinstance(schema, list):
        return [strict(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: (({n: strict(s) for n, s in v.items()} if k == "properties" else strict(v)))
           for k, v in schema.items()}
    if (out.get("type") == "object" and "properties" in out
            and "additionalProperties" not in out
            and not out.get("x-kubernetes-preserve-unknown-fields")):
        out["additionalProperties"] = False
    return out


@dataclass(frozen=True)
class CrdSchema:
    api_version: str
    kind: str
    source: dict[str, str]
    validator: jsonschema.protocols.Validator


def crd_schemas() -> dict[tuple[str, str], CrdSchema]:
    out = {}
    for path in sorted(SCHEMAS.glob("*.json")):
        data = json.loads(path.read_text())
        for version, schema in data["versions"].items():
            api_version = f"{data['group']}/{version}"
            validator = jsonschema.Draft202012Validator(strict(schema))
            out[(api_version, data["kind"])] = CrdSchema(api_version, data["kind"],
                                                         data["source"], validator)
    return out


_CRDS: dict[tuple[str, str], CrdSchema] | None = None


def _crds() -> dict[tuple[str, str], CrdSchema]:
    global _CRDS
    if _CRDS is None:
        _CRDS = crd_schemas()
    return _CRDS


def crd_groups() -> set[str]:
    return {api.split("/")[0] for api, _ in _crds()}


def validate(doc: Mapping[str, Any]) -> str:
    """Raise ManifestError unless the resource matches its schema; return what checked it."""
    if not isinstance(doc, Mapping) or "apiVersion" not in doc or "kind" not in doc:
        raise ManifestError(f"not a Kubernetes resource (no apiVersion/kind): {doc!r:.80}")
    api_version, kind = str(doc["apiVersion"]), str(doc["kind"])
    if api_version.split("/")[0] in crd_groups():
        crd = _crds().get((api_version, kind))
        if crd is None:
            raise ManifestError(f"{name_of(doc)}: no vendored schema for {api_version} {kind}")
        error = jsonschema.exceptions.best_match(crd.validator.iter_errors(doc))
        if error is not None:
            where = "/".join(str(p) for p in error.absolute_path) or "(top)"
            raise ManifestError(f"{name_of(doc)}: {where}: {error.message:.300}")
        return f"{crd.source['repository']}@{crd.source['tag']}"
    for version in KUBERNETES_VERSIONS:
        try:
            kubernetes_validate.validate(dict(doc), version, strict=True)
        except kubernetes_validate.ValidationError as exc:
            where = "/".join(str(p) for p in exc.path) or "(top)"
            raise ManifestError(f"{name_of(doc)}: Kubernetes {version}: {where}: "
                                f"{exc.message:.300}") from None
        except kubernetes_validate.SchemaNotFoundError:
            raise ManifestError(f"{name_of(doc)}: Kubernetes {version} has no "
                                f"{api_version} {kind}") from None
    return "kubernetes " + ", ".join(KUBERNETES_VERSIONS)


# --- kustomize ------------------------------------------------------------------------

def kubectl() -> str | None:
    return shutil.which("kubectl")


def render(folder: Path) -> list[dict[str, Any]]:
    """``kubectl kustomize FOLDER``: kustomize as kubectl embeds it, offline."""
    exe = kubectl()
    assert exe is not None
    done = subprocess.run([exe, "kustomize", str(folder)], capture_output=True, text=True,
                          timeout=60, env={**os.environ, "KUBECONFIG": os.devnull})
    if done.returncode != 0:
        raise ManifestError(f"kubectl kustomize {folder}: {done.stderr.strip()}")
    return load_docs(done.stdout)


# --- containers: their arguments through zeroserve's own parser ---------------------

def parse_args(argv: list[str], env: Mapping[str, str]) -> Any:
    """``zeroserve ARGV`` as options.parse sees it under the container's ZEROSERVE_*
    environment (unknown variables are errors there too); ManifestError for what
    argparse or the config check refuse."""
    from zeroserve.broker import config, options

    saved = {k: v for k, v in os.environ.items() if k.startswith("ZEROSERVE_")}
    for k in saved:
        del os.environ[k]
    os.environ.update({k: v for k, v in env.items() if k.startswith("ZEROSERVE_")})
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            return options.parse(list(argv))
    except SystemExit:
        raise ManifestError(f"zeroserve {' '.join(argv)}: {err.getvalue().strip()}") from None
    except config.ConfigError as exc:
        raise ManifestError(f"zeroserve {' '.join(argv)}: {exc}") from None
    finally:
        for k in [k for k in os.environ if k.startswith("ZEROSERVE_")]:
            del os.environ[k]
        os.environ.update(saved)


def pod_specs(docs: list[dict[str, Any]]) -> Iterator[tuple[str, dict[str, Any]]]:
    """(resource name, pod spec) for every pod template among the resources; a serving
    runtime's spec stands for the pod KServe makes from it."""
    for doc in docs:
        kind = doc.get("kind")
        if kind in ("Deployment", "StatefulSet", "DaemonSet", "Job"):
            yield name_of(doc), doc["spec"]["template"]["spec"]
        elif kind in ("ServingRuntime", "ClusterServingRuntime"):
            yield name_of(doc), doc["spec"]


def zeroserve_argv(container: Mapping[str, Any]) -> list[str]:
    """The container's command line after the image's ENTRYPOINT (``zeroserve``)."""
    command = list(container.get("command", []))
    if command and Path(command[0]).name != "zeroserve":
        raise ManifestError(f"container {container['name']}: command {command} is not zeroserve")
    return [str(a) for a in command[1:] + list(container.get("args", []))]
