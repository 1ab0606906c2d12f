"""The broker's read-only control verbs (``status``, ``models``, ``metadata``, ``config``,
``metrics``): what its parts say of themselves, put together. Each part is given here as
what is read of it; nothing is changed but the queue-depth gauges a scrape refreshes."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any, Callable

from zeroserve.broker import wording
from zeroserve.broker.runtime import hostname
from zeroserve.broker.server.catalog import Catalog, CatalogModel, optional_models
from zeroserve.broker.server.control import ControlTable
from zeroserve.broker.server.metrics import BrokerMetrics
from zeroserve.broker.server.pool import WorkerPool
from zeroserve.broker.server.scheduler import Scheduler


class ReadVerbs:
    """``describe_model(name)``: the lifecycle's part of a model's entry; ``status()``:
    the other parts' sections of ``zeroserve status``."""

    def __init__(self, catalog: Catalog, pool: WorkerPool, scheduler: Scheduler,
                 metrics: BrokerMetrics, clock: Callable[[], float], *,
                 describe_model: Callable[[str], dict[str, Any]],
                 status: Callable[[], dict[str, Any]]) -> None:
        self.catalog = catalog
        self.pool = pool
        self.scheduler = scheduler
        self.metrics = metrics
        self.clock = clock
        self._describe_model = describe_model
        self._status = status
        # the last tokenizer read: (path, mtime, size), its bytes, their sha256
        self._tokenizer: tuple[tuple[str, int, int] | None, bytes, str] = (None, b"", "")

    def add_verbs(self, c: ControlTable) -> None:
        c.add("status", self.status)
        c.add("models", self.models)
        c.add("metadata", self.metadata)
        c.add("config", lambda a: self.model(a).config.to_json())
        c.add("metrics", self.scrape)
        c.add("text", self.text)

    def model(self, args: dict[str, Any]) -> CatalogModel:
        name, version = args.get("model"), args.get("version")
        model = self.catalog.get(name) if isinstance(name, str) else None
        if model is None:
            raise LookupError(wording.unknown_model(name))
        if version is not None and version not in model.versions:
            raise LookupError(wording.unknown_version(name, version))
        return model

    def status(self, _: dict[str, Any]) -> dict[str, Any]:
        now = self.clock()
        return {"workers": [w.describe(now) for w in self.pool.workers.values()],
                "queues": {m: self.scheduler.depth(m) for m in self.catalog.models},
                "inflight_batches": len(self.pool.inflight), "pid": os.getpid(),
                **self._status()}

    def models(self, _: dict[str, Any]) -> dict[str, Any]:
        out = {}
        for name, m in sorted(self.catalog.models.items()):
            out[name] = {"versions": list(m.versions), "ready": sorted(m.ready),
                         "default_version": m.default_version if m.ready else None,
                         "platform": m.config.platform, "optional": m.config.optional,
                         "workers": self._workers(m),
                         **self._describe_model(name)}
        errors = dict(self.catalog.errors)
        for name, failure in self.catalog.failures.items():
            errors.setdefault(name, failure["error"])
        return {"models": out, "errors": errors,
                "optional": optional_models(self.catalog, errors),
                "workers_connected": len(self.pool.workers)}

    def _workers(self, model: CatalogModel) -> list[str]:
        """The workers holding the model; for an ensemble (held by none: the broker
        runs it), those holding any of its steps."""
        names = [s.model_name for s in model.config.ensemble] or [model.config.name]
        return sorted({w.worker_id for n in names for w in self.pool.holders(n)})

    def metadata(self, args: dict[str, Any]) -> dict[str, Any]:
        model = self.model(args)
        meta = model.metadata()
        meta["ready"] = bool(model.ready if args.get("version") is None
                             else args["version"] in model.ready)
        meta["max_batch_size"] = model.config.max_batch_size
        meta["labels"] = model.labels
        version = args.get("version")
        found = model.provenance.get(model.default_version if version is None else version)
        if found:   # where the version came from: v2's metadata has room in parameters
            meta["parameters"] = {"provenance": found}
        return meta

    def text(self, args: dict[str, Any]) -> dict[str, Any]:
        """A text model's ``text`` section and its version's tokenizer file, for the
        gateway that turns texts into tokens: the version asked for, else the default
        one. Read from the repository, kept by the file's size and time."""
        model = self.model(args)
        text = model.config.text
        if text is None:
            raise LookupError(f"model {model.config.name!r} takes no text (its config has "
                              "no 'text' section)")
        version = args.get("version") or model.default_version
        folder = model.path / str(version)
        path = folder / text.tokenizer
        try:
            stat = path.stat()
            key = (str(path), stat.st_mtime_ns, stat.st_size)
            if self._tokenizer[0] != key:
                data = path.read_bytes()
                self._tokenizer = (key, data, hashlib.sha256(data).hexdigest())
        except OSError as exc:
            raise LookupError(f"model {model.config.name!r} version {version}: its tokenizer "
                              f"{text.tokenizer!r} cannot be read ({exc.strerror})") from None
        _, data, digest = self._tokenizer
        return {"model": model.config.name, "version": version, "text": text.to_json(),
                "tokenizer": data, "tokenizer_sha256": digest,
                "inputs": {t.name: t.datatype for t in model.config.inputs},
                **chat_settings(folder)}

    def scrape(self, _: dict[str, Any]) -> dict[str, Any]:
        for name in self.catalog.models:
            self.metrics.queue_depth.labels(name).set(self.scheduler.depth(name))
        return {"broker": self.metrics.render(), "instance": f"{hostname()}:{os.getpid()}",
                "workers": {w.worker_id: w.metrics_text for w in self.pool.workers.values()}}


CHAT_TEMPLATE_FILE = "chat_template.jinja"   # where transformers 5 saves it
MAX_SETTINGS_BYTES = 1 << 20


def chat_settings(folder: Path) -> dict[str, Any]:
    """A tokenizer's chat template and special tokens, as ``save_pretrained`` writes them
    (``chat_template.jinja``, or ``tokenizer_config.json``'s ``chat_template``), for the
    gateway that renders chat messages; none where the folder has none."""
    config: dict[str, Any] = {}
    try:
        raw = (folder / "tokenizer_config.json").read_bytes()[:MAX_SETTINGS_BYTES]
        loaded = json.loads(raw)
        config = loaded if isinstance(loaded, dict) else {}
    except (OSError, ValueError):
        pass
    try:
        template: Any = (folder / CHAT_TEMPLATE_FILE).read_text()[:MAX_SETTINGS_BYTES]
    except (OSError, UnicodeDecodeError):
        template = config.get("chat_template")
    if not isinstance(template, str):
        template = None   # a list of named templates: the default is not chosen here
    special = {}
    for name in ("bos_token", "eos_token"):
        token = config.get(name)
        token = token.get("content") if isinstance(token, dict) else token
        if isinstance(token, str):
            special[name] = token
    return {"chat_template": template, "special_tokens": special}
