"""The model repository extension (Triton's ``/v2/repository/...``) and model control
modes (Triton's ``--model-control-mode``).

``poll`` (the default): the watcher serves every folder and keeps it in line with
its files; load and unload calls are refused, as Triton does when it polls.
``none``: every folder is loaded at start, the repository is not watched (SIGHUP and
``zeroserve reload`` still rescan), load and unload are refused. ``explicit``: only
the models named by ``--load-model`` are loaded at start; the repository is not
watched; a load call loads a model (or reloads one already loaded, two-phase, from
its files as they are now), an unload call unloads it. A load may override the
config (``parameters.config``); the override holds until the next load or unload of
that model. A load that carries files (``file:<path>`` parameters, with the config
they need) persists like a push: the files and the config become the model's folder
in the repository by rename, the folder before them set aside; if the load fails the
folder before is put back, so nothing of a failed load stays. A file that cannot be
written fails as Triton's does, an internal error that failed to poll the repository.
"""

from __future__ import annotations

import itertools
import json
import logging
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Protocol

from zeroserve.broker.server.catalog import Catalog
from zeroserve.broker.server.control import ControlError, ControlTable
from zeroserve.broker.server.lifecycle import Rescans
from zeroserve.broker.server.pool import WorkerPool
from zeroserve.broker.server.stats import ModelStatistics
from zeroserve.models.repository import NAME_RE, ConfigError, RepoModel, list_versions, \
    parse_config, scan, select_versions

logger = logging.getLogger(__name__)

MODES = ("none", "poll", "explicit")

Found = tuple[dict[str, RepoModel], dict[str, str]]


@dataclass
class LoadJob:
    token: str
    model: str
    started: float   # wall clock, as the lifecycle's failure times


def _failed(name: str, why: str) -> ControlError:
    return ControlError("bad_input", f"failed to load '{name}': {why}")


class ModelControl:
    """The model control mode and, under explicit control, the models asked for
    (``--load-model``, a load, a registration) with their config overrides. The lifecycle
    sees the repository through :meth:`source`: under explicit control a rescan sees only
    the models asked for. The registrar and ``configure`` tell :meth:`published` when they
    publish or remove a folder; it asks the lifecycle, through its outbox ``rescans``, to
    look at that folder again. :class:`RepositoryControl`'s verbs ask for models here."""

    def __init__(self, mode: str, load_models: tuple[str, ...], catalog: Catalog,
                 rescans: Rescans) -> None:
        if mode not in MODES:
            raise ValueError(f"model control mode must be one of {', '.join(MODES)}")
        self.mode = mode
        self.catalog = catalog
        self.root = catalog.root
        self.rescans = rescans
        self.wanted: set[str] = set(load_models)
        self.overrides: dict[str, RepoModel] = {}

    def source(self, found: Found) -> Found:
        if self.mode != "explicit":
            return found
        models, errors = found
        models = {n: self.overrides.get(n, rm) for n, rm in models.items() if n in self.wanted}
        models.update({n: rm for n, rm in self.overrides.items() if n in self.wanted})
        return models, {n: e for n, e in errors.items() if n in self.wanted and n not in models}

    def prime(self) -> None:
        """At start, before hashing: explicit control serves only what was asked for."""
        if self.mode == "explicit":
            self.catalog.restrict(self.wanted, "--load-model {name}: no such model folder")

    def published(self, name: str) -> None:
        """Registration published (or removed) a folder, or ``configure`` wrote its
        config: the lifecycle looks at it again; registering asks for the model."""
        if self.mode == "explicit":
            if (self.root / name).is_dir():
                self.wanted.add(name)
            else:
                self.drop(name)
        self.rescans.add(name)

    def ask(self, name: str, override: RepoModel | None) -> None:
        """A load asks for ``name``, with its config ``override`` (None: the repository's)."""
        self.wanted.add(name)
        if override is not None:
            self.overrides[name] = override
        else:
            self.overrides.pop(name, None)

    def drop(self, name: str) -> None:
        """An unload, or a folder removed: ``name`` is no longer asked for."""
        self.wanted.discard(name)
        self.overrides.pop(name, None)


class Changes(Protocol):
    """What the repository extension asks of the model lifecycle (lifecycle.Lifecycle):
    a fresh load of a model's versions, its removal, and whether a change of it is on its
    way (hashing, swapping or deferred)."""

    def load_now(self, rm: RepoModel, versions: list[int]) -> object: ...

    def remove_model(self, name: str, why: str) -> None: ...

    def busy(self, name: str) -> bool: ...


class RepositoryControl:
    """The repository extension's verbs. Reads the catalog and the pool; asks for models
    in ``models`` (the model control mode); asks the lifecycle, its ``changes`` port, to
    ``load_now`` a model, ``remove_model`` one, and whether a change of a model is
    ``busy``; asks ``demand(name)`` an on-demand model's state and reason."""

    def __init__(self, models: ModelControl, catalog: Catalog, pool: WorkerPool,
                 stats: ModelStatistics, changes: Changes,
                 demand: Callable[[str], tuple[str, str] | None]) -> None:
        self.models = models
        self.catalog = catalog
        self.pool = pool
        self.root = catalog.root
        self.stats = stats
        self.changes = changes
        self._demand = demand   # an on-demand model's state and reason (ondemand.py)
        self.unloaded: set[str] = set()
        self.jobs: dict[str, LoadJob] = {}
        self._ids = itertools.count(1)
        # a load with files: the folder it replaced (None: there was none), until it ends
        self._replaced: dict[str, Path | None] = {}

    def add_verbs(self, control: ControlTable) -> None:
        control.add("repository_index", self.index)
        control.add("repository_load", self.load, mutates=True)
        control.add("repository_load_status", self.load_status, mutates=True)
        control.add("repository_unload", self.unload, mutates=True)

    def prime(self) -> None:
        self.models.prime()

    def close(self) -> None:
        for name in list(self._replaced):
            self._settle(name, ok=True)   # what is in place now was asked for last

    # -- verbs ----------------------------------------------------------------
    def _check_mode(self, verb: str) -> None:
        if self.models.mode != "explicit":
            raise ControlError("bad_input", f"explicit model {verb} is not allowed with model "
                               f"control mode '{self.models.mode}' (start the broker with "
                               "--model-control-mode explicit)")

    def load(self, args: dict[str, Any]) -> dict[str, Any]:
        name = _name(args)
        self._check_mode("load")
        if name in self._replaced:
            if self.changes.busy(name):
                raise ControlError("conflict", f"a load of '{name}' with files is under way")
            self._settle(name, ok=True)   # its outcome was never asked for: it stays
        rm = self._repo_model(name, args.get("config"), args.get("files") or {})
        overridden = args.get("config") is not None and not args.get("files")
        # else from the repository, where a load with files has just put them
        self.models.ask(name, rm if overridden else None)
        self.unloaded.discard(name)
        self.stats.forget(name)      # statistics count since load
        self.catalog.clear_error(name)
        self.changes.load_now(rm, list(rm.versions))
        job = LoadJob(str(next(self._ids)), name, time.time())
        self.jobs[job.token] = job
        logger.info("model %s: load asked for (versions %s%s)", name, list(rm.versions),
                    ", config overridden" if overridden else "")
        return {"token": job.token, "model": name}

    def _repo_model(self, name: str, config: Any, files: Any) -> RepoModel:
        if not isinstance(files, dict) or not all(
                isinstance(k, str) and isinstance(v, bytes) for k, v in files.items()):
            raise ControlError("bad_input", "'files' must map relative paths to bytes")
        if files and config is None:
            raise _failed(name, "file: parameters need a config parameter as well")
        folder = self.root / name
        if files:
            folder = self._write_files(name, files)
        try:
            rm = self._configured(name, config, folder)
        except ControlError:
            if files:
                shutil.rmtree(folder, ignore_errors=True)
            raise
        if files:
            (folder / "config.json").write_text(json.dumps(rm.config.to_json(), indent=2))
            rm = RepoModel(rm.config, self._persist(name, folder), rm.versions)
        return rm

    def _configured(self, name: str, config: Any, folder: Path) -> RepoModel:
        if config is None:
            found, errors = scan(self.root)
            if name not in found:
                raise _failed(name, errors.get(name, "no such model in the repository"))
            return found[name]
        try:
            from zeroserve.models import triton_config   # protobuf: only once overridden
            raw = triton_config.overridden(
                self.root / name, json.loads(config) if isinstance(config, str) else config)
            cfg = parse_config(raw, f"config override of {name}", expected_name=name)
        except (ValueError, ConfigError) as exc:   # JSONDecodeError is a ValueError
            raise _failed(name, str(exc)) from None
        if not folder.is_dir():
            raise _failed(name, "no such model in the repository")
        versions = select_versions(cfg, list_versions(folder, cfg))
        if not versions:
            raise _failed(name, f"no version folder of {folder} holds {cfg.model_file}")
        return RepoModel(cfg, folder, tuple(versions))

    def _write_files(self, name: str, files: dict[str, bytes]) -> Path:
        # a temp name in the repository (so the publish is a rename), which a broker
        # cut short removes at its next start (registration.py's clean_leftovers)
        folder = self.root / f".register-load-{name}-{next(self._ids)}"
        for rel, data in files.items():
            try:
                target = (folder / rel).resolve()
                if folder.resolve() not in target.parents:
                    raise _failed(name, f"file:{rel} leaves the model folder")
                target.parent.mkdir(parents=True, exist_ok=True)
                target.write_bytes(data)
            except ValueError as exc:   # a NUL in the name
                shutil.rmtree(folder, ignore_errors=True)
                raise _failed(name, f"file:{rel} cannot be written: {exc}") from None
            except OSError as exc:   # a name too long, a full disk: Triton's words
                shutil.rmtree(folder, ignore_errors=True)
                raise ControlError("internal", "failed to poll from model repository: "
                                   f"failed to load '{name}': file:{rel[:80]} cannot be "
                                   f"written: {exc.strerror}") from None
        return folder

    def _persist(self, name: str, folder: Path) -> Path:
        """The written folder becomes the model's; the one before waits aside until the
        load ends (:meth:`_settle`)."""
        target = self.root / name
        aside: Path | None = None
        if target.exists():
            aside = self.root / f".deleted-{name}-load{next(self._ids)}"
            os.rename(target, aside)
        os.rename(folder, target)
        self._replaced[name] = aside
        return target

    def _settle(self, name: str, ok: bool) -> None:
        """A load with files ended: the folder before goes, or comes back."""
        if name not in self._replaced:
            return
        aside = self._replaced.pop(name)
        if ok:
            if aside is not None:
                shutil.rmtree(aside, ignore_errors=True)
            return
        failed = self.root / f".deleted-{name}-failed{next(self._ids)}"
        os.rename(self.root / name, failed)
        if aside is not None:
            os.rename(aside, self.root / name)
        shutil.rmtree(failed, ignore_errors=True)
        logger.info("model %s: the load with files failed; its folder before is back", name)

    def load_status(self, args: dict[str, Any]) -> dict[str, Any]:
        job = self.jobs.get(str(args.get("token")))
        if job is None:
            raise ControlError("not_found", f"no load {args.get('token')!r}")
        state, error = self._outcome(job)
        if state != "loading":
            del self.jobs[job.token]   # reported once; the gateway asks until it ends
            self._settle(job.model, ok=state == "ready")
        return {"state": state, "model": job.model,
                "error": f"failed to load '{job.model}': {error}" if error else ""}

    def _outcome(self, job: LoadJob) -> tuple[str, str]:
        name = job.model
        if self.changes.busy(name):
            return "loading", ""
        failure = self.catalog.failures.get(name)
        if failure is not None and failure["time"] >= job.started:
            return "failed", str(failure["error"])
        if name in self.catalog.errors:
            return "failed", self.catalog.errors[name]
        model = self.catalog.get(name)
        if model is None:
            return "failed", "it left the repository while loading"
        workers = list(self.pool.workers.values())
        if any(m == name for w in workers for m, _ in w.loading):
            return "loading", ""
        if model.ready:
            return "ready", ""
        errors = [f"{w.worker_id}: {e}" for w in workers for k, e in w.load_errors.items()
                  if k.name == name]
        return "failed", "; ".join(errors) or "no live worker holds it"

    def unload(self, args: dict[str, Any]) -> dict[str, Any]:
        name = _name(args)
        self._check_mode("unload")
        self.models.drop(name)
        was = name in self.catalog.models
        self.changes.remove_model(name, "unloaded by the operator")
        self.stats.forget(name)
        self.unloaded.add(name)
        return {"model": name, "unloaded": was}

    def index(self, args: dict[str, Any]) -> list[dict[str, Any]]:
        ready_only = args.get("ready") is True
        try:
            found, errors = scan(self.root)
        except ConfigError:
            found, errors = {}, {}
        names = set(found) | set(errors) | set(self.catalog.models) | set(self.models.overrides)
        out: list[dict[str, Any]] = []
        for name in sorted(names):
            out += self._entries(name, found.get(name), errors.get(name))
        return [e for e in out if e["state"] == "READY"] if ready_only else out

    def _entries(self, name: str, rm: RepoModel | None, error: str | None
                 ) -> list[dict[str, Any]]:
        model = self.catalog.get(name)
        busy = self.changes.busy(name)
        workers = list(self.pool.workers.values())
        if model is None:
            failure = self.catalog.failures.get(name)
            reason = (self.catalog.errors.get(name) or (failure or {}).get("error") or error
                      or ("unloaded" if name in self.unloaded else "not loaded"))
            versions = [str(v) for v in rm.versions] if rm is not None else [""]
            return [{"name": name, "version": v, "state": "LOADING" if busy else "UNAVAILABLE",
                     "reason": "" if busy else str(reason)} for v in versions]
        out = []
        for v in sorted(model.versions):
            loading = busy or any((name, v) in w.loading for w in workers)
            state = "READY" if v in model.ready else "LOADING" if loading else "UNAVAILABLE"
            reason = "" if state != "UNAVAILABLE" else "; ".join(
                e for w in workers for k, e in w.load_errors.items() if k == (name, v)
            ) or "no live worker holds it"
            if v in model.failed:   # loaded, but no unpinned request goes to it
                reason = f"rolled back: {model.failed[v][0]}"
            demand = self._demand(name) if state == "UNAVAILABLE" else None
            if demand is not None:
                state, reason = demand
            out.append({"name": name, "version": str(v), "state": state, "reason": reason})
        retiring = {key.version for _, key in self.pool.retiring if key.name == name}
        for v in sorted(retiring - set(model.versions)):
            out.append({"name": name, "version": str(v), "state": "UNLOADING", "reason": ""})
        return out


def _name(args: dict[str, Any]) -> str:
    name = args.get("model")
    if not isinstance(name, str) or not NAME_RE.match(name):
        raise ControlError("bad_input", "'model' must name a model")
    return name
