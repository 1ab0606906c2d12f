"""A served model's config changed over the API (``PATCH /v1/models/{name}/config``, the
broker's ``configure`` verb).

The fields given replace the config's own at the top level (``null`` drops a field back
to its default); the result is validated as the repository's ``config.json`` is, and
written by one rename, so the watcher's own path applies it: a field that needs a
reload swaps in two phases, the old config serving until the new loads are ready and
going on serving if one fails. Nothing is written when the result does not validate.
"""

from __future__ import annotations

import itertools
import json
import logging
import os
from typing import Any, Callable

from zeroserve.broker import wording
from zeroserve.broker.server.catalog import Catalog
from zeroserve.broker.server.control import ControlError
from zeroserve.models.repository import ConfigError, parse_config, raw_config

logger = logging.getLogger(__name__)


class ConfigWriter:
    """Reads the catalog (which models it serves); tells ``published(name)`` once the
    model's config.json was replaced."""

    def __init__(self, catalog: Catalog, published: Callable[[str], None]) -> None:
        self.catalog = catalog
        self.root = catalog.root
        self._published = published
        self._ids = itertools.count(1)

    def configure(self, args: dict[str, Any]) -> dict[str, Any]:
        name, changes = args.get("model"), args.get("changes")
        if not isinstance(name, str) or self.catalog.get(name) is None:
            raise ControlError("not_found", wording.unknown_model(name))
        if not isinstance(changes, dict) or not changes:
            raise ControlError("bad_input", "the body must be a JSON object of the config "
                               "fields to change, e.g. {\"version_policy\": {\"latest\": 2}}")
        if changes.get("name", name) != name:
            raise ControlError("bad_input", "a model's name cannot change: register the "
                               "model under the new name instead")
        folder = self.root / name
        try:
            raw, path = raw_config(folder)
            if path.name != "config.json":
                raise ConfigError(f"{path} is Triton's config.pbtxt: change it on the host "
                                  "(or replace it with a config.json)")
            merged = {k: v for k, v in {**raw, **changes}.items() if v is not None}
            cfg = parse_config(merged, f"config of {name}", expected_name=name)
        except ConfigError as exc:
            raise ControlError("bad_input", str(exc)) from None
        temp = folder / f".config-{os.getpid()}-{next(self._ids)}.json"
        try:
            temp.write_text(json.dumps(cfg.to_json(), indent=2))
            os.rename(temp, folder / "config.json")   # the watcher sees MOVED_TO
        except OSError as exc:
            temp.unlink(missing_ok=True)
            raise ControlError("internal", f"cannot write {folder / 'config.json'}: "
                               f"{exc}") from None
        self._published(name)
        logger.info("model %s: config changed over the API (%s)", name,
                    ", ".join(sorted(changes)))
        return {"model": name, "config": cfg.to_json()}
