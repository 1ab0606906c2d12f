"""Write the CRD schemas the manifest tests check against, from the projects' own CRDs.

Run from the repository root with a clone (or bare mirror) of each source repository:

    python -m tests.deploy.schemas.vendor kserve/kserve=PATH kedacore/keda=PATH \
        prometheus-operator/prometheus-operator=PATH

For each CRD in SOURCES it reads the file at the pinned tag (``git show TAG:PATH``, so a
clone at any branch will do), checks the tag still names the recorded commit, takes the
``openAPIV3Schema`` of every served version, drops the ``description`` texts (they are
most of the bytes and no part of validation) and writes ``<group>_<plural>.json`` here.
SOURCES.md lists the same sources for people.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import yaml

HERE = Path(__file__).resolve().parent

# (repository, tag, commit the tag named when vendored, path, license)
SOURCES: list[tuple[str, str, str, str, str]] = [
    ("kserve/kserve", "v0.20.0", "1fb781055dd1567164358233e1125142ca6ef1fe",
     "config/crd/full/serving.kserve.io_clusterservingruntimes.yaml", "Apache-2.0"),
    ("kserve/kserve", "v0.20.0", "1fb781055dd1567164358233e1125142ca6ef1fe",
     "config/crd/full/serving.kserve.io_inferenceservices.yaml", "Apache-2.0"),
    ("kedacore/keda", "v2.20.2", "68a5b5028f35b22d50597c69819ab32c4e92f21a",
     "config/crd/bases/keda.sh_scaledobjects.yaml", "Apache-2.0"),
    ("prometheus-operator/prometheus-operator", "v0.93.0",
     "f8fafd475f3d132e239432ae6172de60a6cb6516",
     "example/prometheus-operator-crd/monitoring.coreos.com_podmonitors.yaml", "Apache-2.0"),
]


def strip_descriptions(node: Any) -> Any:
    """The schema without its ``description`` texts; a property *named* description
    (under ``properties``) is kept."""
    if isinstance(node, dict):
        return {k: (strip_properties(v) if k == "properties" else strip_descriptions(v))
                for k, v in node.items() if k != "description"}
    if isinstance(node, list):
        return [strip_descriptions(v) for v in node]
    return node


def strip_properties(props: dict[str, Any]) -> dict[str, Any]:
    return {name: strip_descriptions(schema) for name, schema in props.items()}


def crd_schemas(crd: dict[str, Any]) -> dict[str, Any]:
    """One file's content: the CRD's identity and each served version's schema."""
    spec = crd["spec"]
    return {
        "group": spec["group"],
        "kind": spec["names"]["kind"],
        "versions": {v["name"]: strip_descriptions(v["schema"]["openAPIV3Schema"])
                     for v in spec["versions"] if v.get("served", True)},
    }


def vendor(repo_dirs: dict[str, Path]) -> None:
    for repo, tag, commit, path, _license in SOURCES:
        git = ["git", "-C", str(repo_dirs[repo])]
        found = subprocess.run([*git, "rev-list", "-n1", tag], check=True,
                               capture_output=True, text=True).stdout.strip()
        if found != commit:
            raise SystemExit(f"{repo} {tag} names {found}, not {commit}: update SOURCES")
        text = subprocess.run([*git, "show", f"{tag}:{path}"], check=True,
                              capture_output=True, text=True).stdout
        out = crd_schemas(yaml.safe_load(text))
        out["source"] = {"repository": f"https://github.com/{repo}", "tag": tag,
                         "commit": commit, "path": path, "license": _license}
        name = Path(path).name.removesuffix(".yaml") + ".json"
        (HERE / name).write_text(json.dumps(out, separators=(",", ":"), sort_keys=True) + "\n")
        print(f"{name}: {', '.join(out['versions'])}")


if __name__ == "__main__":
    vendor({arg.split("=", 1)[0]: Path(arg.split("=", 1)[1]) for arg in sys.argv[1:]})
