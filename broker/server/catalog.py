"""The broker's model catalog: what the repository offers, the per-model lifecycle
state (committed sha256s, failures, versions routable), and how to check a request
against a model's declared inputs. Reads config.json only; never imports torch.

:class:`Catalog` is the one owner of that state: every other object reads it and asks
the catalog's verbs (``commit``, ``fail``, ``remove``, ``mark_ready``, ``routable``...)
to change it. What each worker holds, loads and retires is the worker pool's (pool.py).
"""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

from zeroserve.broker import wording
from zeroserve.broker.protocol import TensorMeta
from zeroserve.broker.server.pool import WorkerState
from zeroserve.broker.server.scheduler import Policy
from zeroserve.broker.server.split import pick, point
from zeroserve.models import provenance
from zeroserve.models.repository import ConfigError, ModelConfig, RepoModel, TensorSpec, \
    load_config, load_labels, scan


class RequestError(ValueError):
    """A request that does not match the model; the message says how."""


@dataclass
class CatalogModel:
    config: ModelConfig
    path: Path
    versions: tuple[int, ...]          # versions the policy serves
    ready: set[int] = field(default_factory=set)  # versions routable (loaded somewhere)
    labels: list[str] | None = None    # labels.txt, read once per commit (classification)
    weights: dict[int, int] | None = None   # a rollout's split, in place of ``traffic``
    failed: dict[int, tuple[str, str]] = field(default_factory=dict)  # rolled back: why, sha
    # each version's metadata.json (models/provenance.py), read per commit and rescan
    provenance: dict[int, dict[str, Any]] = field(default_factory=dict)
    _json: tuple[ModelConfig, dict[str, Any]] | None = field(default=None, repr=False,
                                                             compare=False)

    def config_json(self) -> dict[str, Any]:
        """The config as a LOAD carries it (read-only), made once per config: load on
        demand sends one on every turn, and ``asdict`` over a config was a tenth of the
        broker's work for a turn."""
        if self._json is None or self._json[0] is not self.config:
            self._json = (self.config, self.config.to_json())
        return self._json[1]

    @property
    def default_version(self) -> int:
        """Where a request without a version goes when the split names none: the
        heaviest of the split, else the newest ready version not rolled back."""
        if not self.failed and self.weights is None and not self.config.traffic:
            # no split and nothing rolled back, the common case: asked on every dispatch
            return max(self.ready) if self.ready else max(self.versions)
        weights = self.split()
        if weights:
            return max(weights, key=lambda v: (weights[v], v))
        ready = sorted(self.ready - set(self.failed)) or sorted(self.ready) \
            or sorted(self.versions)
        return ready[-1]

    @property
    def routed(self) -> bool:
        """Whether unpinned requests are routed by key (a split, or a rolled-back version
        to keep them from)."""
        return bool(self.config.traffic) or self.weights is not None or bool(self.failed)

    def split(self) -> dict[int, int]:
        """The weights in force among ready versions not rolled back."""
        raw = self.weights if self.weights is not None else \
            {int(v): w for v, w in self.config.traffic.items()}
        return {v: w for v, w in raw.items()
                if w > 0 and v in self.ready and v not in self.failed}

    def route(self, key: str) -> int:
        """The version an unpinned request goes to: by its routing key's place in the
        split among ready versions (broker/server/split.py), else the default."""
        weights = self.split()
        if not weights:
            return self.default_version
        return pick(weights, point(self.config.name, key))

    def policy(self) -> Policy:
        db = self.config.dynamic_batching
        return Policy(max_batch_size=self.config.max_batch_size,
                      max_queue_delay_s=db.max_queue_delay_ms / 1000.0,
                      preferred_batch_sizes=db.preferred_batch_sizes,
                      max_queue_size=db.max_queue_size,
                      aging_s=db.aging_ms / 1000.0,
                      max_batch_tokens=db.max_batch_tokens,
                      packed=db.token_cost == "packed",
                      mixed_batch_s=db.mixed_batch_ms / 1000.0)

    def metadata(self) -> dict[str, Any]:
        cfg = self.config
        lead = [-1] if cfg.max_batch_size > 0 else []
        return {
            "name": cfg.name,
            "versions": [str(v) for v in sorted(self.versions)],
            "platform": cfg.platform,
            "inputs": [{"name": t.name, "datatype": t.datatype, "shape": lead + list(t.shape)}
                       for t in cfg.inputs],
            "outputs": [{"name": t.name, "datatype": t.datatype, "shape": lead + list(t.shape)}
                        for t in cfg.outputs],
        }


def normalize_priority(priority: int, cfg: ModelConfig) -> int:
    """Triton's rule: 0, or a level above priority_levels, means the default."""
    db = cfg.dynamic_batching
    if priority <= 0 or priority > db.priority_levels:
        return db.default_priority
    return priority


def check_inputs(cfg: ModelConfig, metas: Sequence[TensorMeta],
                 outputs: Sequence[str] | None) -> int:
    """Validate request tensors against the config; return the batch size (samples).
    The checks run in Triton's order (InferenceRequest::Normalize), with its words."""
    samples = _samples_if_valid(cfg, metas, outputs)
    if samples is not None:
        return samples
    model = cfg.name
    known = {t.name for t in cfg.outputs}
    for name in outputs or ():
        if name not in known:
            raise RequestError(wording.unexpected_output(name, model))
    declared = {t.name: t for t in cfg.inputs}
    names = [m.name for m in metas]
    if len(set(names)) != len(names):
        raise RequestError(wording.input_twice(next(n for n in names if names.count(n) > 1)))
    if len(names) != len(declared):   # every input is required: none is optional
        raise RequestError(wording.input_count(model, list(declared), names))
    for name in names:
        if name not in declared:
            raise RequestError(wording.unexpected_input(name, model))
    batch = _batch_size(cfg, metas)
    for meta in metas:
        spec = declared[meta.name]
        if meta.datatype != spec.datatype:
            raise RequestError(wording.wrong_datatype(meta.name, meta.datatype, model,
                                                      spec.datatype))
        shape = list(meta.shape)[1:] if cfg.max_batch_size > 0 else list(meta.shape)
        expected = list(spec.shape)
        if len(shape) != len(expected) or any(
                e != -1 and d != e for d, e in zip(shape, expected)):
            raise RequestError(wording.wrong_shape(meta.name, model, expected, meta.shape,
                                                   cfg.max_batch_size > 0))
    return batch


@functools.lru_cache(maxsize=256)
def _declared(inputs: tuple[TensorSpec, ...], outputs: tuple[TensorSpec, ...]
              ) -> tuple[dict[str, tuple[str, tuple[int, ...]]], frozenset[str]]:
    return {t.name: (t.datatype, tuple(t.shape)) for t in inputs}, \
        frozenset(t.name for t in outputs)


def _samples_if_valid(cfg: ModelConfig, metas: Sequence[TensorMeta],
                      outputs: Sequence[str] | None) -> int | None:
    """The samples of a request that passes every check, at a lookup per tensor; None for
    any other (the checks above then find, in Triton's order, what is wrong). Run for
    every request: building the checks' sets and lists each time cost the broker about
    4 us a request."""
    declared, known = _declared(cfg.inputs, cfg.outputs)
    if len(metas) != len(declared) or (outputs and not known.issuperset(outputs)):
        return None
    batching = cfg.max_batch_size > 0
    batch = 1 if not batching else -1
    for meta in metas:
        spec = declared.get(meta.name)
        if spec is None or spec[0] != meta.datatype:
            return None
        shape = meta.shape
        if batching:
            if not shape or (batch != -1 and shape[0] != batch):
                return None
            batch, shape = shape[0], shape[1:]
        expected = spec[1]
        if shape != expected and (len(shape) != len(expected) or any(
                e != -1 and d != e for d, e in zip(shape, expected))):
            return None
    if len({m.name for m in metas}) != len(metas) or not 1 <= batch <= max(
            cfg.max_batch_size, 1):
        return None
    return batch


def _batch_size(cfg: ModelConfig, metas: Sequence[TensorMeta]) -> int:
    """The samples of a request: dim 0 of every input of a batching model, else 1."""
    if cfg.max_batch_size <= 0:
        return 1
    batch: int | None = None
    for meta in metas:
        if not meta.shape:
            raise RequestError(wording.no_batch_dim(meta.name, cfg.name))
        if batch is not None and meta.shape[0] != batch:
            raise RequestError(wording.batch_mismatch(meta.name, cfg.name))
        batch = meta.shape[0]
    if batch is None or batch > cfg.max_batch_size:
        raise RequestError(wording.batch_too_large(cfg.max_batch_size, cfg.name))
    if batch < 1:
        raise RequestError(wording.batch_empty(cfg.name))
    return batch


class Catalog:
    """Models by name, read from the repository folder, and what the lifecycle knows of
    each: the only object that changes either."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.models: dict[str, CatalogModel] = {}
        self.errors: dict[str, str] = {}                   # folders not served, and why
        self.shas: dict[str, dict[int, str]] = {}         # committed sha256 per version
        # the commit before: versions it retired still answer their batches in flight
        self._previous: dict[str, dict[int, str]] = {}
        self._committed_s: dict[str, float] = {}   # the last swap's commit, monotonic
        self.failures: dict[str, dict[str, Any]] = {}     # the last failed swap or load
        self.failed: set[tuple[str, int, str]] = set()    # content that failed: not again

    def rescan(self) -> tuple[set[str], set[str], set[str]]:
        """Re-read the repository; returns (added, changed, removed) model names."""
        found, self.errors = scan(self.root)
        added, changed = set(), set()
        for name, rm in found.items():
            old = self.models.get(name)
            if old is None:
                self.models[name] = self._entry(rm)
                added.add(name)
            elif old.config != rm.config or old.versions != rm.versions:
                old.config, old.versions, old.path = rm.config, rm.versions, rm.path
                old.labels = load_labels(rm.path)
                old.ready &= set(rm.versions)
                changed.add(name)
        removed = set(self.models) - set(found)
        for name in removed:
            del self.models[name]
        return added, changed, removed

    @staticmethod
    def _entry(rm: RepoModel) -> CatalogModel:
        return CatalogModel(rm.config, rm.path, rm.versions, labels=load_labels(rm.path),
                            provenance=provenance.of_versions(rm.path, rm.versions))

    def get(self, name: str) -> CatalogModel | None:
        return self.models.get(name)

    def build(self, name: str, version: int) -> str:
        """The sha256 of the files of ``version`` that answers: committed, or retired by
        the last commit and finishing its batches; empty if unknown."""
        sha = self.shas.get(name, {}).get(version)
        return sha if sha is not None else self._previous.get(name, {}).get(version, "")

    # -- changes --------------------------------------------------------------
    def commit(self, rm: RepoModel, shas: dict[int, str], ready: Iterable[int] = (),
               at_s: float | None = None) -> tuple[CatalogModel, bool]:
        """``rm`` is served from now on, with these sha256s and ``ready`` routable; its
        failure and error are cleared. Returns the entry and whether it replaced one.
        ``at_s``: when, on the broker's monotonic clock (what measures a switch)."""
        name = rm.config.name
        model = self.models.get(name)
        replaced = model is not None
        if model is None:
            model = self.models[name] = CatalogModel(rm.config, rm.path, rm.versions)
        else:
            model.config, model.path, model.versions = rm.config, rm.path, rm.versions
        model.labels = load_labels(rm.path)
        model.provenance = provenance.of_versions(rm.path, rm.versions)
        model.ready = set(ready) & set(rm.versions)
        self._previous[name] = self.shas.get(name, {})
        # a version rolled back stays so until new content comes under its number
        model.failed = {v: f for v, f in model.failed.items() if shas.get(v) == f[1]}
        self.shas[name] = dict(shas)
        if at_s is not None:
            self._committed_s[name] = at_s
        self.failures.pop(name, None)
        self.errors.pop(name, None)
        return model, replaced

    def fail(self, name: str, error: str, versions: Iterable[int],
             content: dict[int, str] | None = None) -> None:
        """A swap or load of ``name`` failed: shown until the next commit. With
        ``content`` (version -> sha256) that exact content is not tried again."""
        listed = sorted(versions)
        self.failures[name] = {"error": error, "versions": listed, "time": time.time()}
        if content is not None:
            self.failed.update((name, v, content[v]) for v in listed)

    def clear_failure(self, name: str) -> None:
        """A load of ``name`` succeeded since, or its failure was only for now (a load on
        demand refused for memory waits for room)."""
        self.failures.pop(name, None)

    def failed_before(self, name: str, version: int, sha: str) -> bool:
        return (name, version, sha) in self.failed

    def retry(self, name: str) -> None:
        """An operator's load: content that failed before may be tried again."""
        self.failed = {f for f in self.failed if f[0] != name}

    def reread_provenance(self, name: str) -> None:
        """A rescan found the same builds: their metadata.json may have changed (it is
        no part of the sha256, so nothing else does)."""
        model = self.models.get(name)
        if model is not None:
            model.provenance = provenance.of_versions(model.path, model.versions)

    def set_error(self, name: str, error: str) -> None:
        self.errors[name] = error

    def clear_error(self, name: str) -> None:
        self.errors.pop(name, None)

    def remove(self, name: str) -> bool:
        """Forget ``name`` (its failure and error too); whether it was served."""
        self.failures.pop(name, None)
        self.errors.pop(name, None)
        self.shas.pop(name, None)
        self._previous.pop(name, None)
        self._committed_s.pop(name, None)
        return self.models.pop(name, None) is not None

    def restrict(self, wanted: set[str], missing: str) -> None:
        """Serve only ``wanted`` (explicit model control); a wanted name with no folder
        gets the error ``missing`` (formatted with ``name``)."""
        for name in [n for n in self.models if n not in wanted]:
            del self.models[name]
        self.errors = {n: e for n, e in self.errors.items() if n in wanted}
        for name in sorted(wanted - set(self.models) - set(self.errors)):
            self.errors[name] = missing.format(name=name)

    def prime(self, sha256: Callable[[Path], str]) -> None:
        """At startup: the sha256 of every served version, by ``sha256(path)``."""
        for name, model in self.models.items():
            self.shas[name] = {v: sha256(model.path / str(v)) for v in model.versions}

    # -- routing ----------------------------------------------------------------
    def mark_ready(self, name: str, version: int) -> bool:
        """A worker holds ``name/version``: routable, if it is served (else False)."""
        model = self.models.get(name)
        if model is None or version not in model.versions:
            return False
        model.ready.add(version)
        return True

    def routable(self, workers: Iterable[WorkerState], name: str | None = None) -> None:
        """Versions (of ``name``, or of every model) that no worker holds are no longer
        routable."""
        holders = list(workers)
        for model in [self.models[name]] if name in self.models else \
                self.models.values() if name is None else []:
            model.ready = {v for v in model.ready
                           if any(w.holds(model.config.name, v) for w in holders)}

    # -- releases (broker/server/releases.py) -----------------------------------
    def set_weights(self, name: str, weights: dict[int, int] | None) -> None:
        """A rollout's split in place of the config's ``traffic`` (None: the config's)."""
        self.models[name].weights = None if weights is None else dict(weights)

    def mark_failed(self, name: str, version: int, reason: str) -> None:
        """``version`` was rolled back: no unpinned request goes to it any more."""
        sha = self.shas.get(name, {}).get(version, "")
        self.models[name].failed[version] = (reason, sha)

    def clear_failed(self, name: str, version: int) -> None:
        self.models[name].failed.pop(version, None)

    def retire_version(self, name: str, version: int) -> None:
        """A promotion's old version leaves the served set (until the next rescan)."""
        model = self.models[name]
        model.versions = tuple(v for v in model.versions if v != version)
        model.ready.discard(version)

    def status(self, name: str) -> dict[str, Any]:
        """The lifecycle's part of ``zeroserve models`` for one model."""
        out: dict[str, Any] = {"sha256": {str(v): s[:12] for v, s in
                                          sorted(self.shas.get(name, {}).items())}}
        if name in self.failures:
            out["last_failure"] = self.failures[name]
        if name in self._committed_s:
            out["committed_s"] = self._committed_s[name]
        model = self.models.get(name)
        if model is not None and model.weights is not None:
            out["weights"] = {str(v): w for v, w in sorted(model.weights.items())}
        if model is not None and model.provenance:
            out["provenance"] = {str(v): p for v, p in sorted(model.provenance.items())}
        if model is not None and model.failed:
            out["rolled_back"] = {str(v): why for v, (why, _) in sorted(model.failed.items())}
        return out


def optional_models(catalog: Catalog, failed: Iterable[str]) -> list[str]:
    """Models whose config says ``"optional": true``, including folders whose config
    parses but whose first load failed (not in the catalog), so strict readiness can
    exempt them; a config that does not parse is never optional."""
    names = {n for n, m in catalog.models.items() if m.config.optional}
    for name in set(failed) - set(catalog.models):
        try:
            if load_config(catalog.root / name).optional:
                names.add(name)
        except (ConfigError, OSError):
            pass
    return sorted(names)
