"""Server readiness: one rule for ``/v2/health/ready``, systemd's ``READY=1`` and the
"ready" line of ``zeroserve serve`` (which polls the route).

Under either mode at least one worker must be connected: without one nothing can load,
and a registration cannot be trial-loaded, so "ready" would be a promise nobody keeps.

``strict`` (the default, Triton's ``--strict-readiness``): the broker answers, every
model of the repository has a version ready on a live worker, and no model whose
config is broken or whose load failed is waiting in the broker's ``errors``, unless
its config says ``"optional": true``. ``any`` (weaker): one model ready on a live
worker is enough; load balancers then send traffic that other models cannot take.
"""

from __future__ import annotations

from typing import Any, Awaitable, Callable

from zeroserve.broker.client import InferError

STRICT = "strict"
ANY = "any"
MODES = (STRICT, ANY)
MAX_REASON_CHARS = 300   # a loader's traceback tail must not flood a probe's answer

Control = Callable[..., Awaitable[Any]]


def serving(entry: dict[str, Any]) -> bool:
    """A version the broker routes to, held by a worker it counts as live; or a model
    loaded on demand that a live worker could load."""
    return bool(entry.get("ready")) and bool(entry.get("workers")) or \
        bool(entry.get("on_demand")) and bool(entry.get("loadable"))


async def not_ready(control: Control, mode: str = STRICT) -> str | None:
    """None when the server is ready under ``mode``; else why not, naming the models."""
    doc = await control("models")
    if doc.get("workers_connected") == 0:
        # models load, and registrations trial-load, on workers: none can yet
        return "no worker is connected to the broker yet (zeroserve status lists them)"
    models: dict[str, Any] = doc["models"]
    errors: dict[str, str] = doc.get("errors") or {}
    if mode == ANY:
        if any(serving(m) for m in models.values()):
            return None
        return "no model is ready on any live worker"
    problems: dict[str, str] = {}
    for name, entry in models.items():
        if entry.get("state") == "too_big":
            problems[name] = f"is too big: {entry.get('reason', '')}"
        elif not serving(entry):
            problems[name] = "has no version ready on a live worker" + _retrying(entry)
    for name, error in errors.items():
        reason = " ".join(str(error).split())[:MAX_REASON_CHARS]
        problems[name] = f"failed: {reason}"
    exempt = set(doc.get("optional") or ())   # names, failed first loads included
    blocking = [(name, why) for name, why in sorted(problems.items())
                if name not in exempt and not await _optional(control, name, models.get(name))]
    if not blocking:
        return None
    return "not ready (strict readiness): " + "; ".join(
        f"model {name!r} {why}" for name, why in blocking)


def _retrying(entry: dict[str, Any]) -> str:
    """A load that failed for a reason that may pass and is tried again: how far it is."""
    parts = [f"version {v}: attempt {r['attempts']} of {r['of']} failed "
             f"({' '.join(str(r['last_error']).split())[:MAX_REASON_CHARS]}), tried again "
             f"in {r['next_in_s']:.1f} s" for v, r in (entry.get("load_retries") or {}).items()]
    return f" ({'; '.join(parts)})" if parts else ""


async def _optional(control: Control, name: str, entry: dict[str, Any] | None) -> bool:
    """Whether the model's config exempts it. A model that never loaded is not in the
    catalog, so only the broker's top-level ``optional`` list can exempt it; one whose
    config does not parse cannot be exempt at all: fix the config or remove it."""
    if entry is None:
        return False
    if "optional" in entry:  # a broker that reports it saves a round trip per model
        return bool(entry["optional"])
    try:
        config = await control("config", model=name, version=None)
    except InferError:
        return False   # removed meanwhile: the next probe sees the new catalog
    return bool(config.get("optional", False))
