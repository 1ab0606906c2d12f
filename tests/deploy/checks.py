"""What the schemas cannot see: a pod whose components would not find each other, and a
Dockerfile that would not build. Each check returns its problems as sentences (empty:
none), so the tests can show a broken example being caught."""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path
from typing import Any, Mapping

from tests.deploy.kube import ManifestError, parse_args, zeroserve_argv

READY_PATH = "/v2/health/ready"


def env_of(container: Mapping[str, Any]) -> dict[str, str]:
    return {e["name"]: str(e.get("value", "")) for e in container.get("env", [])}


def covering_mount(container: Mapping[str, Any], path: str) -> dict[str, Any] | None:
    """The deepest volume mount of the container that holds PATH."""
    best = None
    for m in container.get("volumeMounts", []):
        mp = m["mountPath"].rstrip("/")
        if (path == mp or path.startswith(mp + "/")) and (
                best is None or len(mp) > len(best["mountPath"].rstrip("/"))):
            best = m
    return best


def check_pod(name: str, spec: Mapping[str, Any]) -> list[str]:
    """Problems of one pod spec whose containers run zeroserve components."""
    problems: list[str] = []
    parsed: list[tuple[dict[str, Any], Any]] = []
    for c in spec["containers"]:
        try:
            parsed.append((c, parse_args(zeroserve_argv(c), env_of(c))))
        except ManifestError as exc:
            problems.append(f"{name}: container {c['name']}: {exc}")
    if problems:
        return problems
    roles: dict[str, list[tuple[dict[str, Any], Any]]] = {}
    for c, args in parsed:
        roles.setdefault(args.command, []).append((c, args))
    if set(roles) == {"serve"} and len(roles["serve"]) == 1:
        brokers, http, workers = roles["serve"], roles["serve"], []
    elif len(roles.get("broker", [])) == 1 and roles.get("gateway") and roles.get("worker") \
            and set(roles) == {"broker", "gateway", "worker"}:
        brokers, http, workers = roles["broker"], roles["gateway"], roles["worker"]
    else:
        return [f"{name}: needs one `serve` container, or one broker, gateways and workers; "
                f"has {sorted((k, len(v)) for k, v in roles.items())}"]
    volumes = {v["name"]: v for v in spec.get("volumes", [])}
    problems += _runtime_dir(name, parsed, volumes)
    problems += _model_dir(name, brokers[0][1].model_dir, brokers + workers)
    problems += _workers(name, workers)
    if brokers is not http:   # `serve` alone: the gateway's probe answers for the host
        problems += _liveness(name, brokers + workers)
    for c, args in http:
        problems += _http(name, c, args)
    for c, args in brokers:
        if args.model_control_mode != "none":
            problems.append(f"{name}: {c['name']}: --model-control-mode {args.model_control_mode}"
                            ": a pod's models change by rollout, not by watching (use none)")
    return problems


def _runtime_dir(name: str, parsed: list[tuple[dict[str, Any], Any]],
                 volumes: Mapping[str, Any]) -> list[str]:
    dirs = {args.runtime_dir for _, args in parsed}
    if len(dirs) != 1 or None in dirs:
        return [f"{name}: containers disagree on --runtime-dir (or leave it out): {dirs}"]
    folder = dirs.pop()
    problems = []
    for c, _ in parsed:
        m = covering_mount(c, folder)
        if m is None and len(parsed) == 1:
            continue  # `serve` alone: its own filesystem will do, nobody shares it
        if m is None:
            problems.append(f"{name}: {c['name']} mounts no volume holding {folder}")
        elif "emptyDir" not in volumes.get(m["name"], {}):
            problems.append(f"{name}: {c['name']}: {folder} is not on an emptyDir")
        elif m["mountPath"].rstrip("/") == folder:
            # an emptyDir is created world-writable; the broker refuses such a folder
            problems.append(f"{name}: {c['name']}: --runtime-dir {folder} must be a "
                            "folder inside the emptyDir, not its mount point")
    return problems


def _model_dir(name: str, model_dir: str | None,
               holders: list[tuple[dict[str, Any], Any]]) -> list[str]:
    if not model_dir:
        return [f"{name}: the broker has no --model-dir"]
    if len(holders) == 1:  # `serve`: KServe's storage initializer mounts /mnt/models
        return []
    seen = set()
    problems = []
    for c, _ in holders:
        m = covering_mount(c, model_dir)
        if m is None:
            problems.append(f"{name}: {c['name']} does not mount the model folder {model_dir}")
        else:
            seen.add((m["name"], m["mountPath"], m.get("subPath", "")))
    if len(seen) > 1:  # workers open the paths the broker names
        problems.append(f"{name}: broker and workers mount {model_dir} differently: {seen}")
    return problems


def _workers(name: str, workers: list[tuple[dict[str, Any], Any]]) -> list[str]:
    problems = []
    indexes = [args.index for _, args in workers]
    if len(set(indexes)) != len(indexes):
        problems.append(f"{name}: worker indexes repeat: {indexes} (ids are <pod>/<index>)")
    for c, _ in workers:
        gpus = c.get("resources", {}).get("limits", {}).get("nvidia.com/gpu")
        if str(gpus) != "1":
            problems.append(f"{name}: {c['name']}: limits nvidia.com/gpu is {gpus}, not 1")
    return problems


def _liveness(name: str, parsed: list[tuple[dict[str, Any], Any]]) -> list[str]:
    """The broker and each worker: a livenessProbe running `zeroserve probe` for its own
    role, runtime folder and index (a hung loop is seen by nothing else)."""
    problems = []
    for c, args in parsed:
        command = c.get("livenessProbe", {}).get("exec", {}).get("command", [])
        if not command or Path(command[0]).name != "zeroserve":
            problems.append(f"{name}: {c['name']}: no livenessProbe running zeroserve probe")
            continue
        try:
            probe = parse_args([str(a) for a in command[1:]], env_of(c))
        except ManifestError as exc:
            problems.append(f"{name}: {c['name']}: livenessProbe: {exc}")
            continue
        want = (args.command, args.runtime_dir, getattr(args, "index", 0))
        got = (getattr(probe, "role", None), probe.runtime_dir, getattr(probe, "index", 0))
        if probe.command != "probe" or got != want:
            problems.append(f"{name}: {c['name']}: livenessProbe probes {got}, not its own "
                            f"{want}")
    return problems


def _http(name: str, c: Mapping[str, Any], args: Any) -> list[str]:
    problems = []
    ports = {p.get("name"): p["containerPort"] for p in c.get("ports", [])}
    if args.http_port not in ports.values():
        problems.append(f"{name}: {c['name']}: --http-port {args.http_port} is not a "
                        f"containerPort ({ports})")
    if args.http_host in ("127.0.0.1", "localhost", "::1"):
        problems.append(f"{name}: {c['name']}: --http-host {args.http_host} is loopback only")
    probe = c.get("readinessProbe", {}).get("httpGet", {})
    port = ports.get(probe.get("port"), probe.get("port"))
    if probe.get("path") != READY_PATH or port != args.http_port:
        problems.append(f"{name}: {c['name']}: readiness must be GET {READY_PATH} on "
                        f"{args.http_port}, is {probe}")
    return problems


# --- the Dockerfile -------------------------------------------------------------------

def instructions(text: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, rest) for each instruction, continuation lines joined."""
    out, pending = [], ""
    for line in text.splitlines():
        if not pending and (not line.strip() or line.lstrip().startswith("#")):
            continue
        if line.rstrip().endswith("\\"):
            pending += line.rstrip()[:-1] + " "
            continue
        full = (pending + line).strip()
        pending = ""
        word, _, rest = full.partition(" ")
        out.append((word.upper(), rest.strip()))
    return out


def _exec_form(rest: str) -> list[str] | None:
    try:
        value = json.loads(rest)
    except ValueError:
        return None
    return value if isinstance(value, list) and all(isinstance(v, str) for v in value) else None


def check_dockerfile(text: str, root: Path, ignore: str) -> list[str]:
    """Problems of a Dockerfile built with ROOT as its context and IGNORE as its
    .dockerignore (a whitelist: ``**`` then ``!path`` lines)."""
    problems: list[str] = []
    steps = instructions(text)
    args = {}
    for word, rest in steps:
        if word == "ARG" and "=" in rest:
            k, v = rest.split("=", 1)
            args[k] = v
    allowed = [ln[1:].rstrip("/") for ln in ignore.splitlines() if ln.startswith("!")]
    stages = set()
    for word, rest in steps:
        if word == "FROM":
            image = re.sub(r"\$\{?(\w+)\}?", lambda m: args.get(m.group(1), ""), rest.split()[0])
            if "AS" in rest.upper().split():
                stages.add(rest.split()[-1])
            if image not in stages and not re.search(r":\d+\.\d+\.\d+|@sha256:[0-9a-f]{64}", image):
                problems.append(f"FROM {image}: not pinned to a full version or digest")
        elif word == "COPY" and "--from=" not in rest:
            for src in shlex.split(rest)[:-1]:
                if not (root / src).exists():
                    problems.append(f"COPY {src}: no such file in the build context")
                elif not any(src.rstrip("/") == a or src.startswith(a + "/") for a in allowed):
                    problems.append(f"COPY {src}: excluded by the .dockerignore")
    users = [rest for word, rest in steps if word == "USER"]
    if not users or not re.fullmatch(r"[1-9]\d*(:\d+)?", users[-1]):
        problems.append(f"USER {users[-1] if users else '(none)'}: run as a numeric, non-root uid")
    entry = [_exec_form(rest) for word, rest in steps if word == "ENTRYPOINT"]
    if entry != [["zeroserve"]]:
        problems.append(f"ENTRYPOINT {entry}: must be exec-form [\"zeroserve\"]")
    for word, rest in steps:
        if word == "CMD":
            argv = _exec_form(rest)
            try:
                parse_args(argv or [], {})
            except ManifestError as exc:
                problems.append(f"CMD: {exc}")
    return problems
