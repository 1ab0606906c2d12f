"""The broker's model catalog: what the repository offers and how to check a request
against a model's declared inputs. Reads config.json only; never imports torch."""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Sequence

from zeroserve.broker import wording
from zeroserve.broker.protocol import TensorMeta
from zeroserve.broker.server.scheduler import Policy
from zeroserve.models.repository import ConfigError, ModelConfig, RepoModel, load_config, \
    load_labels, scan


class RequestError(ValueError):
    """A request that does not match the model; the message says how."""


@dataclass
class CatalogModel:
    config: ModelConfig
    path: Path
    versions: tuple[int, ...]          # versions the policy serves
    ready: set[int] = field(default_factory=set)  # versions routable (loaded somewhere)
    labels: list[str] | None = None    # labels.txt, read once per commit (classification)

    @property
    def default_version(self) -> int:
        ready = sorted(self.ready) or sorted(self.versions)
        return ready[-1]

    def route(self, rng: random.Random) -> int:
        """The version an unpinned request goes to: a weighted draw over ``traffic``
        among ready versions, else the newest ready one."""
        weights = {int(v): w for v, w in self.config.traffic.items()
                   if int(v) in self.ready and w > 0}
        if not weights:
            return self.default_version
        pick = rng.uniform(0, sum(weights.values()))
        for version, weight in sorted(weights.items()):
            pick -= weight
            if pick <= 0:
                return version
        return max(weights)

    def policy(self) -> Policy:
        db = self.config.dynamic_batching
        return Policy(max_batch_size=self.config.max_batch_size,
                      max_queue_delay_s=db.max_queue_delay_ms / 1000.0,
                      preferred_batch_sizes=db.preferred_batch_sizes,
                      max_queue_size=db.max_queue_size,
                      aging_s=db.aging_ms / 1000.0)

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
    """Models by name, read from the repository folder."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.models: dict[str, CatalogModel] = {}
        self.errors: dict[str, str] = {}

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
        return CatalogModel(rm.config, rm.path, rm.versions, labels=load_labels(rm.path))

    def get(self, name: str) -> CatalogModel | None:
        return self.models.get(name)


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
