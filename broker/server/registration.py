"""Registration (``POST /v1/models``) and pushes (``POST /v1/models/{name}/versions``),
run by the broker, which owns the repository.

``register`` copies ``model_path`` (only from under the configured import roots) into
the repository under a temp name, has one worker trial-load the newest version, and
only then publishes it by an atomic rename, so the watcher's own path loads it. A
failure anywhere removes the temp folder: nothing is left half-registered. The copy
runs in a thread so a large model never stalls the loop; the gateway follows the
job with ``register_status``.

A push adds one version to a served model the same way: the files (from an import
root, or uploaded) go to a temp folder inside the model's folder, a worker trial-loads
them under the model's config, and one rename makes them ``<model>/<version>``, which
the watcher's swap serves. A version that exists is refused, unless its files are the
same (sha256): then the push is answered as done and nothing changes.
"""

from __future__ import annotations

import itertools
import json
import logging
import os
import shutil
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from zeroserve.broker import protocol as p
from zeroserve.broker import wording
from zeroserve.broker.server.catalog import Catalog
from zeroserve.broker.server.control import ControlError
from zeroserve.broker.server.pool import WorkerPool, WorkerState
from zeroserve.broker.server.types import ModelVersion
from zeroserve.models import provenance
from zeroserve.models.repository import NAME_RE, ConfigError, ModelConfig, is_temp_name, \
    parse_config, undeclared_datatypes, version_sha256

logger = logging.getLogger(__name__)

_TRIAL_PREFIX = ".trial-"
MAX_VERSION = 2**31 - 1   # what the wire and Triton's int64 version strings both carry


@dataclass
class Job:
    token: str
    config: ModelConfig
    source: Path
    temp: Path
    state: str = "copying"             # copying, loading, published, failed
    error: str = ""
    kind: str = ""                     # why it failed: copy, load, publish, no_worker
    versions: list[int] = field(default_factory=list)
    copier: threading.Thread | None = None
    worker: bytes = b""
    # what the trial load is to find (LoadModel.discover): empty when the body said all
    discover: dict[str, Any] = field(default_factory=dict)
    push: int = 0                      # the version a push adds; 0 for a registration
    data: bytes | None = None          # a push's uploaded model file
    sha256: str = ""                   # a push's content, once copied
    provenance: dict[str, Any] = field(default_factory=dict)   # the body's "metadata"


class Registrar:
    """Reads the catalog (whether a name is taken) and the pool (a worker to trial-load
    on); tells ``published(name)`` when a folder appears in or leaves the repository."""

    def __init__(self, catalog: Catalog, pool: WorkerPool, import_roots: tuple[Path, ...],
                 published: Callable[[str], None]) -> None:
        self.catalog = catalog
        self.pool = pool
        self.root = catalog.root
        self.import_roots = import_roots
        self._published = published
        self.jobs: dict[str, Job] = {}
        self._ids = itertools.count(1)

    # -- register -----------------------------------------------------------
    def register(self, args: dict[str, Any]) -> dict[str, Any]:
        if not self.import_roots:
            self._source(None)   # refused: no import roots
        body = args.get("body")
        if not isinstance(body, dict):
            raise ControlError("bad_input", "the body must be a JSON object")
        body = dict(body)
        meta = _provenance(body.pop("metadata", None))
        source_raw = body.pop("model_path", None)
        if not isinstance(source_raw, str) or not source_raw:
            self._source(source_raw)   # refused: the message names the field
        try:
            cfg = parse_config(body, "registration", discover=True)
        except ConfigError as exc:
            raise ControlError("bad_input", str(exc)) from None
        guessed = undeclared_datatypes(body)
        source = self._source(source_raw)
        if (self.root / cfg.name).exists() or cfg.name in self.catalog.models or \
                self._busy(cfg.name):
            raise ControlError("conflict", f"model {cfg.name!r} already exists")
        token = f"{next(self._ids)}-{os.getpid()}"
        job = Job(token, cfg, source, self.root / f".register-{cfg.name}-{token}",
                  provenance=meta)
        if guessed or not cfg.outputs:
            job.discover = {"datatypes": guessed}
        job.copier = threading.Thread(target=self._copy, args=(job,), daemon=True,
                                      name="register-copy")
        self.jobs[token] = job
        job.copier.start()
        return {"token": token, "state": job.state}

    def _busy(self, name: str) -> bool:
        return any(j.config.name == name and j.state in ("copying", "loading")
                   for j in self.jobs.values())

    def _source(self, raw: Any) -> Path:
        roots = self.import_roots
        if not roots:
            raise ControlError("forbidden", "registration is disabled: start the broker with "
                               "--import-root DIR to allow copying models from DIR")
        if not isinstance(raw, str) or not raw:
            raise ControlError("bad_input", "field 'model_path': required, a path on the "
                               "broker's host")
        if not Path(raw).is_absolute():   # relative to what? the broker's cwd is no answer
            raise ControlError("bad_input", f"model_path {raw!r} must be absolute (a path on "
                               "the broker's host, under an import root)")
        source = Path(raw).resolve()
        if not any(source.is_relative_to(r.resolve()) for r in roots):
            raise ControlError("forbidden", f"model_path {raw!r} is outside the import "
                               f"roots ({', '.join(str(r) for r in roots)})")
        if not source.exists():
            raise ControlError("bad_input", f"model_path {raw!r} does not exist")
        return source

    # -- push ---------------------------------------------------------------
    def push(self, args: dict[str, Any]) -> dict[str, Any]:
        """Add a version to a served model: ``model``, ``version`` (the next one if left
        out), and the files: ``model_path`` under an import root (the model file, or a
        version folder), or ``data``, the model file's bytes."""
        name = args.get("model")
        if not isinstance(name, str) or not NAME_RE.match(name) or is_temp_name(name):
            raise ControlError("not_found", wording.unknown_model(name))
        model = self.catalog.get(name)
        folder = self.root / name
        if model is None or not folder.is_dir():
            raise ControlError("not_found", wording.unknown_model(name) + ": push adds a "
                               "version to a served model; register a new one")
        meta = _provenance(args.get("metadata"))
        data = args.get("data")
        if data is not None:
            if not isinstance(data, bytes) or not data:
                raise ControlError("bad_input", "'data' must be the model file's bytes")
            source = Path("upload")
        else:
            source = self._source(args.get("model_path"))
        version = args.get("version")
        if version is None:
            version = max([int(d.name) for d in folder.iterdir() if d.name.isdigit()] +
                          list(model.versions) + [0]) + 1
        if isinstance(version, bool) or not isinstance(version, int) or \
                not 0 < version <= MAX_VERSION:
            raise ControlError("bad_input", f"version must be an integer in [1, {MAX_VERSION}]")
        if self._busy(name):
            raise ControlError("conflict", f"a push or registration of {name!r} is under way")
        token = f"{next(self._ids)}-{os.getpid()}"
        job = Job(token, model.config, source, folder / f".push-{version}-{token}",
                  push=version, data=data, provenance=meta)
        job.copier = threading.Thread(target=self._copy, args=(job,), daemon=True,
                                      name="push-copy")
        self.jobs[token] = job
        job.copier.start()
        return {"token": token, "state": job.state}

    def _copy_push(self, job: Job) -> None:
        """Thread: the version folder at <temp>; the same content as the version's folder
        ends the job at once (published: nothing to do), other content is a conflict."""
        cfg, src, dst = job.config, job.source, job.temp
        if job.data is not None:
            dst.mkdir()
            (dst / cfg.model_file).write_bytes(job.data)
            job.data = None
        else:
            self._check_links(src)
            if src.is_file():
                dst.mkdir()
                shutil.copy2(src, dst / cfg.model_file)
            elif (src / cfg.model_file).is_file():
                shutil.copytree(src, dst, ignore=shutil.ignore_patterns("__pycache__"))
            else:
                raise ValueError(f"model_path {str(src)!r} holds no {cfg.model_file}")
        _add_provenance(dst, job.provenance)
        job.sha256 = version_sha256(dst)
        job.versions = [job.push]
        existing = dst.parent / str(job.push)
        if existing.is_dir():
            if version_sha256(existing) != job.sha256:
                job.kind, job.error = "conflict", (
                    f"version {job.push} of model {cfg.name!r} exists with other content "
                    f"(sha256 {version_sha256(existing)[:12]}); push a new version number")
            else:
                job.kind = "same"

    def _copy(self, job: Job) -> None:
        """Thread: lay the files out as <temp>/config.json and <temp>/<version>/."""
        if job.push:
            try:
                self._copy_push(job)
            except (OSError, ValueError) as exc:
                job.kind, job.error = "copy", str(exc)
            return
        cfg, src, dst = job.config, job.source, job.temp
        try:
            self._check_links(src)
            dst.mkdir()
            if src.is_file():
                (dst / "1").mkdir()
                shutil.copy2(src, dst / "1" / cfg.model_file)
            elif (src / cfg.model_file).is_file():
                shutil.copytree(src, dst / "1", ignore=shutil.ignore_patterns("__pycache__"))
            else:
                versions = [d for d in src.iterdir() if d.name.isdigit() and int(d.name) > 0
                            and (d / cfg.model_file).is_file()]
                if not versions:
                    raise ValueError(f"model_path {str(src)!r} holds no {cfg.model_file} "
                                     "(nor version folders that do)")
                for d in versions:
                    shutil.copytree(d, dst / d.name,
                                    ignore=shutil.ignore_patterns("__pycache__"))
            (dst / "config.json").write_text(json.dumps(cfg.to_json(), indent=2))
            job.versions = sorted(int(d.name) for d in dst.iterdir() if d.name.isdigit())
            for v in job.versions:
                _add_provenance(dst / str(v), job.provenance)
        except (OSError, ValueError) as exc:
            job.kind, job.error = "copy", str(exc)

    def _check_links(self, src: Path) -> None:
        """Links inside model_path may not lead out of the import roots (copying follows
        them, so a link could otherwise pull any readable file into the repository)."""
        roots = [r.resolve() for r in self.import_roots]
        paths = [src] if src.is_file() else [src, *src.rglob("*")]
        for path in paths:
            if path.is_symlink() and not any(path.resolve().is_relative_to(r) for r in roots):
                raise ValueError(f"{path} links outside the import roots")

    def clean_leftovers(self) -> None:
        """Temp folders of registrations and deletions cut short by a crash."""
        for entry in self.root.glob(".register-*"):
            shutil.rmtree(entry, ignore_errors=True)
        for entry in self.root.glob("*/.push-*"):
            shutil.rmtree(entry, ignore_errors=True)
        for entry in self.root.glob("*/.deleted-*"):
            shutil.rmtree(entry, ignore_errors=True)
        for entry in self.root.glob(".deleted-*"):
            shutil.rmtree(entry, ignore_errors=True)

    def tick(self) -> None:
        for job in self.jobs.values():
            if job.state == "copying" and job.copier is not None and not job.copier.is_alive():
                job.copier = None
                if job.error:
                    self._finish(job, ok=False)
                elif job.kind == "same":
                    shutil.rmtree(job.temp, ignore_errors=True)
                    job.state = "published"
                else:
                    self._trial(job)

    def next_due(self, now: float) -> float | None:
        # copies run in threads: look again soon while one is running
        return now + 0.02 if any(j.state == "copying" for j in self.jobs.values()) else None

    def _trial(self, job: Job) -> None:
        worker = next((w for w in self.pool.workers.values() if not w.draining), None)
        if worker is None:
            # a wait that passes when a worker connects, not a fault of the model
            job.kind, job.error = "no_worker", ("no worker is connected yet to trial-load "
                                                "the model; retry when one is (zeroserve "
                                                "status lists them)")
            self._finish(job, ok=False)
            return
        version = job.versions[-1]
        job.state, job.worker = "loading", worker.identity
        path = job.temp if job.push else job.temp / str(version)
        self.pool.load(worker, p.LoadModel(_TRIAL_PREFIX + job.token, version, str(path),
                                           job.config.to_json(), discover=job.discover))

    def on_loaded(self, worker: WorkerState, msg: p.ModelLoaded) -> bool:
        """A trial load's outcome (True), or not a trial (False)."""
        if not msg.model.startswith(_TRIAL_PREFIX):
            return False
        self.pool.end_load(worker, ModelVersion(msg.model, msg.version))
        job = self.jobs.get(msg.model[len(_TRIAL_PREFIX):])
        if job is None or job.state != "loading":
            return True
        ok = msg.ok
        if ok:
            self.pool.unload(worker, msg.model, msg.version)
            ok = not job.discover or self._settle(job, msg.config)
        else:
            job.kind, job.error = "load", msg.error
        self._finish(job, ok=ok)
        return True

    def _settle(self, job: Job, found: dict[str, Any]) -> bool:
        """The config the trial load completed replaces the body's, in the folder about to
        be published, so no later load has anything left to find."""
        try:
            if not found:
                raise ConfigError("the worker did not report the outputs and datatypes it "
                                  "found (a worker older than the broker?)")
            cfg = parse_config(found, "the trial load's config", expected_name=job.config.name)
            (job.temp / "config.json").write_text(json.dumps(cfg.to_json(), indent=2))
        except (ConfigError, OSError) as exc:
            job.kind, job.error = "load", str(exc)
            return False
        job.config = cfg
        return True

    def check_workers(self) -> None:
        """A trial worker that left cannot answer: fail its job."""
        for job in self.jobs.values():
            if job.state == "loading" and self.pool.get(job.worker) is None:
                job.kind, job.error = "load", "the worker trial-loading the model went away"
                self._finish(job, ok=False)

    def _finish(self, job: Job, ok: bool) -> None:
        if ok:
            try:
                # the publish: one rename; the watcher sees MOVED_TO and loads it
                target = self.root / job.config.name
                if job.push:
                    target = target / str(job.push)
                    if target.exists():   # pushed meanwhile by hand: never replaced
                        raise OSError(f"{target} appeared meanwhile")
                os.rename(job.temp, target)
                job.state = "published"
                self._published(job.config.name)
                logger.info("%s model %s (versions %s) from %s",
                            "pushed to" if job.push else "registered", job.config.name,
                            job.versions, job.source)
                return
            except OSError as exc:
                job.kind, job.error = "publish", f"cannot publish: {exc}"
        job.state = "failed"
        shutil.rmtree(job.temp, ignore_errors=True)
        logger.error("%s of %s failed (%s): %s", "push" if job.push else "registration",
                     job.config.name, job.kind, job.error)

    def status(self, args: dict[str, Any]) -> dict[str, Any]:
        job = self.jobs.get(str(args.get("token")))
        if job is None:
            raise ControlError("not_found", f"no registration {args.get('token')!r}")
        if job.state in ("published", "failed"):
            del self.jobs[job.token]  # reported once; the gateway asks until it ends
        return {"state": job.state, "name": job.config.name, "versions": job.versions,
                "error": job.error, "kind": job.kind, "sha256": job.sha256,
                "inputs": [t.to_json() for t in job.config.inputs],
                "outputs": [t.to_json() for t in job.config.outputs]}

    # -- unregister ---------------------------------------------------------
    def unregister(self, args: dict[str, Any]) -> dict[str, Any]:
        name = args.get("model")
        if not isinstance(name, str) or not NAME_RE.match(name) or is_temp_name(name):
            raise ControlError("not_found", wording.unknown_model(name))
        target = self.root / name
        version = args.get("version")
        if version is not None:
            if isinstance(version, bool) or not isinstance(version, int) or version < 1:
                raise ControlError("bad_input", "version must be a positive integer")
            target = target / str(version)
        if not target.is_dir():
            what = f"version {version} of model {name!r}" if version else f"model {name!r}"
            raise ControlError("not_found", f"unknown {what}")
        # out of sight in one rename (the watcher sees MOVED_FROM), then deleted
        doomed = target.parent / f".deleted-{target.name}-{next(self._ids)}"
        os.rename(target, doomed)
        shutil.rmtree(doomed, ignore_errors=True)
        self._published(name)
        logger.info("unregistered %s", ModelVersion(name, version) if version else name)
        return {"deleted": name, "version": version}


def _provenance(raw: Any) -> dict[str, Any]:
    """A push's or registration's ``metadata`` (models/provenance.py), checked."""
    if raw is None:
        return {}
    try:
        return provenance.parse(raw, "field 'metadata'")
    except provenance.ProvenanceError as exc:
        raise ControlError("bad_input", str(exc)) from None


def _add_provenance(version_dir: Path, fields: dict[str, Any]) -> None:
    """Thread: the request's fields over those of a metadata.json copied with the files
    (a copied one that does not parse is replaced, not kept half-read)."""
    if not fields:
        return
    try:
        found = provenance.read(version_dir)
    except provenance.ProvenanceError:
        found = {}
    provenance.write(version_dir, provenance.merge(found, fields))
