"""The model repository: layout, ``config.json`` schema and validation. No torch here.

Layout (Triton's)::

    <model-dir>/<name>/config.json            (or Triton's config.pbtxt: triton_config.py)
    <model-dir>/<name>/<version>/model.pt     TorchScript
    <model-dir>/<name>/<version>/model.pt2    torch.export program or AOTInductor package
    <model-dir>/<name>/<version>/model.py     Python handler

The formats (platform, file, loader) are models/formats.py's registry.
Shapes in the config leave out the batch dimension when ``max_batch_size`` > 0
and use -1 for free dimensions.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Callable

from zeroserve.models import ensemble as ens, formats
from zeroserve.models.rolloutplan import PlanError, parse_plan
from zeroserve.models.provenance import FILE as PROVENANCE_FILE
from zeroserve.models.text import EMBEDDING, IDS, MASK, MAX_TOKENS, SAMPLING, TOKEN, TextConfig, \
    TextConfigError, parse_text

DATATYPES = ("BOOL", "UINT8", "UINT16", "UINT32", "UINT64", "INT8", "INT16", "INT32",
             "INT64", "FP16", "FP32", "FP64", "BF16", "BYTES")
NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.\-]{0,127}$")
PBTXT = "config.pbtxt"   # Triton's, read where a model has no config.json


DEFAULT_INSTANCES: dict[str, Any] = {"count": 0, "workers": [], "min": 0, "max": 0}
# the replica controller's tuning (broker/server/autoscale.py says what each one does)
DEFAULT_AUTOSCALING: dict[str, float] = {
    "queue_slo_ms": 100.0, "window_s": 5.0, "down_window_s": 15.0, "up_cooldown_s": 5.0,
    "down_cooldown_s": 30.0, "low_utilization": 0.3, "high_utilization": 0.7,
    "depth_per_replica": 0.0}


class ConfigError(ValueError):
    """A config that does not validate; the message names the file and the field."""


@dataclass(frozen=True)
class TensorSpec:
    name: str
    datatype: str
    shape: tuple[int, ...]

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "datatype": self.datatype, "shape": list(self.shape)}


@dataclass(frozen=True)
class PaddedInput:
    """An input whose requests may be padded along ``dim`` (counted as in the config's
    shape: the batch dimension left out) with ``value``, so lengths share a batch."""

    name: str
    dim: int
    value: float = 0


@dataclass(frozen=True)
class PaddedOutput:
    """An output cut back along ``dim`` to each request's own length."""

    name: str
    dim: int


@dataclass(frozen=True)
class Padding:
    """``dynamic_batching.padding``: which free dimension of which inputs may be padded,
    the lengths to pad to (``buckets``, ascending; none: the longest in the batch), and
    which outputs are cut back to each request's length. Only safe where the model
    masks what was padded (a transformer's attention mask padded with 0)."""

    inputs: tuple[PaddedInput, ...]
    outputs: tuple[PaddedOutput, ...] = ()
    buckets: tuple[int, ...] = ()


@dataclass(frozen=True)
class DynamicBatching:
    max_queue_delay_ms: float = 0.0
    preferred_batch_sizes: tuple[int, ...] = ()
    max_queue_size: int = 1024
    priority_levels: int = 2
    default_priority: int = 2
    default_timeout_ms: float = 0.0
    aging_ms: float = 1000.0
    max_execution_ms: float = 30000.0
    padding: Padding | None = None
    # a batch's tokens at most (0: no budget), counted by ``token_cost``: "padded" (rows x
    # the longest row: what a padded batch computes) or "packed" (the sum of the rows'
    # lengths, for a handler that takes ragged rows); needs a padded input to count by
    max_batch_tokens: int = 0
    token_cost: str = "padded"
    # while the model's recent requests come from more than one tenant or priority, a
    # batch is cut where its predicted run time would pass this (0: never cut)
    mixed_batch_ms: float = 0.0


@dataclass(frozen=True)
class ModelConfig:
    name: str
    platform: str
    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]
    max_batch_size: int = 0
    dynamic_batching: DynamicBatching = field(default_factory=DynamicBatching)
    version_policy: dict[str, Any] = field(default_factory=lambda: {"latest": 1})
    traffic: dict[str, int] = field(default_factory=dict)
    # replicas: "count" N fixes N; "min"/"max" bound the autoscaler; all 0: every worker
    instances: dict[str, Any] = field(default_factory=lambda: {**DEFAULT_INSTANCES,
                                                                       "workers": []})
    autoscaling: dict[str, Any] = field(default_factory=lambda: dict(DEFAULT_AUTOSCALING))
    warmup: dict[str, Any] = field(default_factory=lambda: {"batch_sizes": [1, 8]})
    # exempt from strict server readiness: a failure to load it is reported, not fatal
    optional: bool = False
    # Triton's model_transaction_policy.decoupled: a request gets a sequence of responses
    # (a Python handler whose predict is a generator; docs/streaming.md)
    decoupled: bool = False
    # an iterative model (``"sequences": {"max": N}``): a decoupled handler whose worker runs
    # its steps, up to N sequences at once, joining and retiring them at every step
    # (continuous batching; docs/generation.md). 0: not iterative
    max_sequences: int = 0
    # ``sequences.prefill_tokens``: prompt tokens a step of zeroserve's own causal LM step
    # handler prefills at most (a longer prompt goes on in chunks at the next steps;
    # models/causal_lm.py). 0: its default
    prefill_tokens: int = 0
    # ``sequences.step_ratio``: where above 1, prefills ride in the decode's forward in
    # chunks that keep it within this many decodes' time (models/causal_lm.py). 0: off
    step_ratio: float = 0.0
    # Triton's response_cache.enable: identical requests answered by the broker from
    # its response cache (docs/many-models.md)
    response_cache: bool = False
    # a new build is canaried against the previous version by this plan (models/
    # rolloutplan.py, docs/rollouts.md), in its normalized JSON form
    rollout: dict[str, Any] | None = None

    # Triton's ensemble_scheduling: the steps a pipeline runs (platform "ensemble")
    ensemble: tuple[ens.Step, ...] = ()

    # loaded when a request asks for it, within the worker's memory budget (None: the
    # broker's --load-on-demand decides; docs/many-models.md)
    load_on_demand: bool | None = None

    # a model that takes text: its tokenizer and what the OpenAI routes do (models/text.py)
    text: TextConfig | None = None

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        if out["rollout"] is None:
            del out["rollout"]
        del out["ensemble"]
        if self.ensemble:
            out["ensemble_scheduling"] = {"step": [s.to_json() for s in self.ensemble]}
        out["model_transaction_policy"] = {"decoupled": out.pop("decoupled")}
        out["response_cache"] = {"enable": out.pop("response_cache")}
        if out.pop("max_sequences"):
            out["sequences"] = {"max": self.max_sequences}
        if out.pop("prefill_tokens"):
            out["sequences"]["prefill_tokens"] = self.prefill_tokens
        if out.pop("step_ratio"):
            out["sequences"]["step_ratio"] = self.step_ratio
        if self.text is None:
            del out["text"]
        else:
            out["text"] = self.text.to_json()
        out["inputs"] = [t.to_json() for t in self.inputs]
        out["outputs"] = [t.to_json() for t in self.outputs]
        if not self.outputs:   # still to be found by a registration's trial load
            del out["outputs"]
        out["dynamic_batching"]["preferred_batch_sizes"] = list(
            self.dynamic_batching.preferred_batch_sizes)
        pad = self.dynamic_batching.padding
        if pad is None:
            del out["dynamic_batching"]["padding"]
        else:
            out["dynamic_batching"]["padding"] = {
                "inputs": [{"name": i.name, "dim": i.dim, "value": i.value}
                           for i in pad.inputs],
                "outputs": [{"name": o.name, "dim": o.dim} for o in pad.outputs],
                "buckets": list(pad.buckets)}
        return out

    @property
    def model_file(self) -> str:
        return "" if self.platform == ens.ENSEMBLE else formats.model_file(self.platform)

    def signature(self) -> ens.Signature:
        """What an ensemble's validation reads of this model as one of its steps."""
        lead = (-1,) if self.max_batch_size > 0 else ()
        return ens.Signature({t.name: (t.datatype, lead + t.shape) for t in self.inputs},
                             {t.name: (t.datatype, lead + t.shape) for t in self.outputs},
                             self.max_batch_size, self.decoupled,
                             self.platform == ens.ENSEMBLE)


def _fail(where: str, fld: str, msg: str) -> ConfigError:
    return ConfigError(f"{where}: field '{fld}': {msg}")


def _int(where: str, fld: str, v: Any, minimum: int = 0) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or v < minimum:
        raise _fail(where, fld, f"must be an integer >= {minimum}, got {v!r}")
    return v


def _num(where: str, fld: str, v: Any) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or v < 0:
        raise _fail(where, fld, f"must be a number >= 0, got {v!r}")
    return float(v)


def _tensors(where: str, fld: str, raw: Any) -> tuple[TensorSpec, ...]:
    if not isinstance(raw, list) or not raw:
        raise _fail(where, fld, "must be a non-empty list of {name, datatype, shape}")
    specs, seen = [], set()
    for i, t in enumerate(raw):
        f = f"{fld}[{i}]"
        if not isinstance(t, dict):
            raise _fail(where, f, "must be an object")
        unknown = set(t) - {"name", "datatype", "shape", "data_type", "dims"}
        if unknown:
            raise _fail(where, f, f"unknown keys {sorted(unknown)}")
        name = t.get("name")
        datatype = t.get("datatype", t.get("data_type"))
        shape = t.get("shape", t.get("dims"))
        if not isinstance(name, str) or not name:
            raise _fail(where, f + ".name", "must be a non-empty string")
        if name in seen:
            raise _fail(where, f + ".name", f"duplicate tensor name {name!r}")
        seen.add(name)
        if isinstance(datatype, str) and datatype.startswith("TYPE_"):  # Triton pbtxt spelling
            datatype = {"TYPE_STRING": "BYTES"}.get(datatype, datatype[5:])
        if datatype not in DATATYPES:
            raise _fail(where, f + ".datatype", f"must be one of {', '.join(DATATYPES)}, "
                        f"got {datatype!r}")
        if not isinstance(shape, list) or not all(
                isinstance(d, int) and not isinstance(d, bool) and (d == -1 or d > 0)
                for d in shape):
            raise _fail(where, f + ".shape",
                        f"must be a list of positive ints or -1, got {shape!r}")
        specs.append(TensorSpec(name, datatype, tuple(shape)))
    return tuple(specs)


_DB_FIELDS = {f: f for f in DynamicBatching.__dataclass_fields__}
_TOP_FIELDS = {"name", "platform", "inputs", "outputs", "max_batch_size", "dynamic_batching",
               "version_policy", "traffic", "instances", "warmup", "input_shape", "backend",
               "optional", "autoscaling", "model_transaction_policy", "response_cache",
               "rollout", "ensemble_scheduling", "load_on_demand", "text", "sequences"}
TOKEN_COSTS = ("padded", "packed")
# a text model's queue holds one entry per text: a request of 2,048 texts fits many times
TEXT_QUEUE_SIZE = 16384
TEXT_MAX_BATCH_SIZE = 64
TEXT_SEQUENCES = 16   # a generating text model's sequences at once, unless it says


def _dynamic_batching(where: str, raw: Any) -> DynamicBatching:
    if raw is None:
        return DynamicBatching()
    if not isinstance(raw, dict):
        raise _fail(where, "dynamic_batching", "must be an object")
    unknown = set(raw) - set(_DB_FIELDS)
    if unknown:
        raise _fail(where, "dynamic_batching", f"unknown keys {sorted(unknown)}")
    d = DynamicBatching()
    kw: dict[str, Any] = {}
    for key, value in raw.items():
        fld = f"dynamic_batching.{key}"
        if key == "preferred_batch_sizes":
            if not isinstance(value, list):
                raise _fail(where, fld, "must be a list of positive ints")
            kw[key] = tuple(sorted(_int(where, fld, v, 1) for v in value))
        elif key in ("max_queue_size", "priority_levels", "default_priority"):
            kw[key] = _int(where, fld, value, 1)
        elif key == "max_batch_tokens":
            kw[key] = _int(where, fld, value)
        elif key == "token_cost":
            if value not in TOKEN_COSTS:
                raise _fail(where, fld, f"must be one of {', '.join(TOKEN_COSTS)}, got {value!r}")
            kw[key] = value
        elif key == "padding":
            continue   # checked against the inputs and outputs: _padding
        else:
            kw[key] = _num(where, fld, value)
    d = DynamicBatching(**kw)
    if d.default_priority > d.priority_levels:
        raise _fail(where, "dynamic_batching.default_priority",
                    f"{d.default_priority} is above priority_levels {d.priority_levels}")
    return d


def _padding(where: str, raw: Any, inputs: tuple[TensorSpec, ...],
             outputs: tuple[TensorSpec, ...], max_batch_size: int) -> Padding | None:
    """``dynamic_batching.padding``; every name and dim checked against the tensors the
    config declares, so a typo is refused at load, not met as a wrong answer (padded
    outputs of a registration that leaves ``outputs`` out: once its trial load found
    them)."""
    if raw is None:
        return None
    fld = "dynamic_batching.padding"
    if not isinstance(raw, dict) or set(raw) - {"inputs", "outputs", "buckets"}:
        raise _fail(where, fld, 'must be {"inputs": [{"name", "dim", "value"}], '
                    '"outputs": [{"name", "dim"}], "buckets": [lengths]}')
    if max_batch_size <= 0:
        raise _fail(where, fld, "needs max_batch_size > 0: a model that does not batch "
                    "has nothing to pad")
    declared_in = {t.name: t for t in inputs}
    declared_out = {t.name: t for t in outputs}

    def dim_of(f: str, item: Any, declared: dict[str, TensorSpec], kind: str) -> tuple[str, int]:
        if not isinstance(item, dict) or "name" not in item or "dim" not in item:
            raise _fail(where, f, 'must be {"name": ..., "dim": ...}')
        name = item["name"]
        spec = declared.get(name) if isinstance(name, str) else None
        if spec is None and kind == "output" and not outputs and isinstance(name, str):
            # outputs left for a registration's trial load to find: its config is parsed
            # again once they are, and this output checked then
            return name, _int(where, f + ".dim", item["dim"])
        if spec is None:
            raise _fail(where, f + ".name", f"{kind} {name!r} is not declared; the model "
                        f"has {sorted(declared)}")
        dim = _int(where, f + ".dim", item["dim"])
        if dim >= len(spec.shape):
            raise _fail(where, f + ".dim", f"{kind} {name!r} has {len(spec.shape)} "
                        f"dimension(s) (the batch dimension left out), no dim {dim}")
        if spec.shape[dim] != -1:
            raise _fail(where, f + ".dim", f"dim {dim} of {kind} {name!r} is fixed at "
                        f"{spec.shape[dim]}: only a free dimension (-1) can be padded")
        return name, dim

    raw_in = raw.get("inputs")
    if not isinstance(raw_in, list) or not raw_in:
        raise _fail(where, fld + ".inputs", "must be a non-empty list")
    padded_in = []
    for i, item in enumerate(raw_in):
        f = f"{fld}.inputs[{i}]"
        name, dim = dim_of(f, item, declared_in, "input")
        value = item.get("value", 0)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or \
                set(item) - {"name", "dim", "value"}:
            raise _fail(where, f, f"value must be a number, got {value!r}")
        if declared_in[name].datatype == "BYTES":
            raise _fail(where, f, f"input {name!r} is BYTES: only numeric tensors are padded")
        padded_in.append(PaddedInput(name, dim, value))
    if len({i.name for i in padded_in}) != len(padded_in):
        raise _fail(where, fld + ".inputs", "names an input twice")
    raw_out = raw.get("outputs", [])
    if not isinstance(raw_out, list):
        raise _fail(where, fld + ".outputs", "must be a list")
    padded_out = [PaddedOutput(*dim_of(f"{fld}.outputs[{i}]", item, declared_out, "output"))
                  for i, item in enumerate(raw_out)]
    raw_buckets = raw.get("buckets", [])
    if not isinstance(raw_buckets, list):
        raise _fail(where, fld + ".buckets", "must be a list of lengths")
    buckets = tuple(_int(where, fld + ".buckets", b, 1) for b in raw_buckets)
    if list(buckets) != sorted(set(buckets)):
        raise _fail(where, fld + ".buckets", f"must ascend without repeats, got {list(buckets)}")
    return Padding(tuple(padded_in), tuple(padded_out), buckets)


def _version_policy(where: str, raw: Any, rollout: bool) -> dict[str, Any]:
    if raw is None:   # a rollout compares with the version before: it must stay loaded
        return {"latest": 2 if rollout else 1}
    if not isinstance(raw, dict) or len(raw) != 1:
        raise _fail(where, "version_policy",
                    'must be {"latest": N}, {"all": true} or {"specific": [versions]}')
    (kind, value), = raw.items()
    if kind == "latest":
        return {"latest": _int(where, "version_policy.latest", value, 1)}
    if kind == "all" and value is True:
        return {"all": True}
    if kind == "specific" and isinstance(value, list) and value:
        return {"specific": sorted(_int(where, "version_policy.specific", v, 1) for v in value)}
    raise _fail(where, "version_policy",
                'must be {"latest": N}, {"all": true} or {"specific": [versions]}')


def _input_shape(where: str, raw: Any, max_batch_size: int) -> list[dict[str, Any]]:
    """The seed's shorthand, batch dim first: ``{"input_ids": [1, 128]}`` (FP32, unless a
    registration's trial load finds the model wants INT64), or with the datatype given,
    ``{"input_ids": {"shape": [1, 128], "datatype": "INT64"}}``."""
    if not isinstance(raw, dict) or not raw:
        raise _fail(where, "input_shape", "must be an object {name: shape}")
    inputs = []
    for name, entry in raw.items():
        fld = f"input_shape.{name}"
        datatype: Any = "FP32"
        if isinstance(entry, dict):
            if set(entry) - {"shape", "datatype"} or "shape" not in entry:
                raise _fail(where, fld, 'must be a shape [dims] or {"shape": [dims], '
                            '"datatype": "INT64"}')
            shape, datatype = entry["shape"], entry.get("datatype", "FP32")
        else:
            shape = entry
        if not isinstance(shape, list):
            raise _fail(where, fld, "must be a list")
        if max_batch_size > 0 and shape and shape[0] not in (1, -1):
            # the batch dim forgotten: [16] would declare 16 rows of a scalar each
            raise _fail(where, fld, f"{shape} starts with the batch dimension (max_batch_size "
                        f"{max_batch_size} > 0), which must be 1 or -1; for one sample of "
                        f"shape {shape} write {[1, *shape]}")
        dims = shape[1:] if max_batch_size > 0 and shape else shape
        inputs.append({"name": name, "datatype": datatype, "shape": dims})
    return inputs


def undeclared_datatypes(raw: dict[str, Any]) -> list[str]:
    """The inputs of a registration body whose datatype is FP32 only by default (the
    seed's plain ``input_shape`` lists): its trial load may find them INT64 instead."""
    shapes = raw.get("input_shape")
    if "inputs" in raw or not isinstance(shapes, dict):
        return []
    return [name for name, entry in shapes.items()
            if not isinstance(entry, dict) or "datatype" not in entry]


def _instances(where: str, raw: Any) -> dict[str, Any]:
    """``{"count", "workers", "min", "max"}``: ``count`` N > 0 means exactly N replicas
    (min = max = N); ``min``/``max`` let the autoscaler choose between them (``max`` 0:
    up to every eligible worker; ``min`` 0 with a ``max``: 1). All 0, the default: every
    eligible worker holds the model, as before replicas were counted."""
    raw = raw or {}
    if not isinstance(raw, dict) or set(raw) - set(DEFAULT_INSTANCES):
        raise _fail(where, "instances",
                    'must be {"count": N, "workers": [ids], "min": N, "max": N}')
    out: dict[str, Any] = {k: _int(where, f"instances.{k}", raw.get(k, 0))
                           for k in ("count", "min", "max")}
    workers = raw.get("workers", [])
    if not isinstance(workers, list) or not all(isinstance(w, str) for w in workers):
        raise _fail(where, "instances.workers", "must be a list of worker ids")
    out["workers"] = list(workers)
    if out["count"] and (out["min"] or out["max"]):
        raise _fail(where, "instances.count", "give either count or min/max, not both")
    if out["max"] and out["min"] > out["max"]:
        raise _fail(where, "instances.min", f"{out['min']} is above max {out['max']}")
    return out


def _autoscaling(where: str, raw: Any) -> dict[str, float]:
    raw = raw or {}
    if not isinstance(raw, dict) or set(raw) - set(DEFAULT_AUTOSCALING):
        raise _fail(where, "autoscaling", f"keys must be among {sorted(DEFAULT_AUTOSCALING)}")
    out = {k: _num(where, f"autoscaling.{k}", raw.get(k, d))
           for k, d in DEFAULT_AUTOSCALING.items()}
    for k in ("low_utilization", "high_utilization"):
        if out[k] > 1:
            raise _fail(where, f"autoscaling.{k}", f"must be a fraction 0..1, got {out[k]}")
    if out["low_utilization"] >= out["high_utilization"]:
        raise _fail(where, "autoscaling.low_utilization", "must be below high_utilization")
    return out


def parse_config(raw: Any, where: str, expected_name: str | None = None,
                 discover: bool = False) -> ModelConfig:
    """Validate a decoded config.json (or registration body) into a ModelConfig.

    ``discover``: ``outputs`` may be left out, leaving them empty for a trial load to find
    (registration only: a repository's config must declare them, as the broker serves
    its metadata without running the model)."""
    if not isinstance(raw, dict):
        raise ConfigError(f"{where}: must be a JSON object")
    unknown = set(raw) - _TOP_FIELDS
    if unknown:
        raise _fail(where, sorted(unknown)[0], "unknown field")
    name = raw.get("name", expected_name)
    if not isinstance(name, str) or not NAME_RE.match(name):
        raise _fail(where, "name", f"must match {NAME_RE.pattern}, got {name!r}")
    if expected_name is not None and name != expected_name:
        raise _fail(where, "name", f"{name!r} does not match its folder {expected_name!r}")
    given = raw.get("platform", raw.get("backend"))
    platform = ens.ENSEMBLE if given == ens.ENSEMBLE else formats.canonical(given)
    if platform is None:
        raise _fail(where, "platform", f"must be one of {formats.platforms() + [ens.ENSEMBLE]}"
                    f", got {given!r}")
    try:
        text = parse_text(raw.get("text"))
    except TextConfigError as exc:
        raise _fail(where, exc.field, str(exc)) from None
    if text is not None:
        raw = _text_defaults(raw)
    mbs = _int(where, "max_batch_size", raw.get("max_batch_size", 0))
    if "inputs" in raw:
        inputs = _tensors(where, "inputs", raw["inputs"])
    elif "input_shape" in raw:
        inputs = _tensors(where, "input_shape", _input_shape(where, raw["input_shape"], mbs))
    else:
        raise _fail(where, "inputs", "is required")
    if "outputs" in raw:
        outputs = _tensors(where, "outputs", raw["outputs"])
    elif discover:
        outputs = ()
    else:
        raise _fail(where, "outputs", "is required")
    traffic = raw.get("traffic") or {}
    if not isinstance(traffic, dict) or not all(
            isinstance(k, str) and k.isdigit() and isinstance(v, int) and v >= 0
            for k, v in traffic.items()):
        raise _fail(where, "traffic", 'must map version strings to weights, e.g. {"3": 90}')
    instances = _instances(where, raw.get("instances"))
    autoscaling = _autoscaling(where, raw.get("autoscaling"))
    warmup = raw.get("warmup") or {"batch_sizes": [1, 8]}
    if not isinstance(warmup, dict) or not isinstance(warmup.get("batch_sizes", []), list):
        raise _fail(where, "warmup", 'must be {"batch_sizes": [sizes]}')
    optional = raw.get("optional", False)
    if not isinstance(optional, bool):
        raise _fail(where, "optional", f"must be true or false, got {optional!r}")
    max_sequences, prefill_tokens, step_ratio = _sequences(where, raw, platform)
    decoupled = _transaction_policy(where, raw.get("model_transaction_policy"), platform,
                                    max_sequences > 0) or max_sequences > 0
    if not outputs:
        _check_discoverable(where, inputs, decoupled)
    cache = _response_cache(where, raw.get("response_cache"), decoupled)
    on_demand = raw.get("load_on_demand")
    if on_demand is not None and not isinstance(on_demand, bool):
        raise _fail(where, "load_on_demand", f"must be true or false, got {on_demand!r}")
    batching = _dynamic_batching(where, raw.get("dynamic_batching"))
    version_policy = _version_policy(where, raw.get("version_policy"),
                                     raw.get("rollout") is not None)
    rollout = _rollout(where, raw.get("rollout"), version_policy)
    padding = _padding(where, (raw.get("dynamic_batching") or {}).get("padding"), inputs,
                       outputs, mbs)
    if padding is not None:
        batching = replace(batching, padding=padding)
    if batching.max_batch_tokens and padding is None:
        raise _fail(where, "dynamic_batching.max_batch_tokens", "counts tokens along a padded "
                    "dimension: declare dynamic_batching.padding")
    if batching.token_cost == "packed" and platform != "python":
        # only a handler is given its rows packed (with cu_seqlens); any other format
        # runs its batch padded, which a budget of packed tokens would underprice
        raise _fail(where, "dynamic_batching.token_cost", f'"packed" needs platform '
                    f'"python" (a handler that takes ragged rows), not {platform!r}')
    if text is not None:
        _check_text(where, text, inputs, outputs, max_sequences)
    steps = _ensemble(where, raw.get("ensemble_scheduling"), platform, inputs, outputs, cache)
    return ModelConfig(
        name=name, platform=platform, inputs=inputs, outputs=outputs,
        max_batch_size=mbs, dynamic_batching=batching,
        version_policy=version_policy, rollout=rollout,
        traffic={k: int(v) for k, v in traffic.items()}, instances=instances,
        autoscaling=autoscaling,
        warmup={"batch_sizes": [_int(where, "warmup.batch_sizes", b, 1)
                                for b in warmup.get("batch_sizes", [])]},
        optional=optional, decoupled=decoupled, max_sequences=max_sequences,
        prefill_tokens=prefill_tokens, step_ratio=step_ratio,
        response_cache=cache, ensemble=steps,
        load_on_demand=on_demand, text=text)


def _text_defaults(raw: dict[str, Any]) -> dict[str, Any]:
    """What a text model's config may leave out: for embeddings, the token inputs (padded
    together, with 0), the one ``embedding`` output, batching by rows and a queue for one
    entry per text; for generation, the prompt's ids and ``max_tokens`` in, a
    ``token_id`` a step out, 16 sequences at once. Anything the config gives wins."""
    out = dict(raw)
    out.setdefault("max_batch_size", TEXT_MAX_BATCH_SIZE)
    text = raw.get("text")
    if isinstance(text, dict) and text.get("task") == "generate":
        out.setdefault("inputs", [{"name": IDS, "datatype": "INT64", "shape": [-1]},
                                  {"name": MAX_TOKENS, "datatype": "INT32", "shape": [1]}])
        out.setdefault("outputs", [{"name": TOKEN, "datatype": "INT64", "shape": [1]}])
        out.setdefault("sequences", {"max": TEXT_SEQUENCES})
        return out
    out.setdefault("inputs", [{"name": IDS, "datatype": "INT64", "shape": [-1]},
                              {"name": MASK, "datatype": "INT64", "shape": [-1]}])
    out.setdefault("outputs", [{"name": EMBEDDING, "datatype": "FP32", "shape": [-1]}])
    batching = dict(out.get("dynamic_batching") or {})
    batching.setdefault("max_queue_size", TEXT_QUEUE_SIZE)
    if isinstance(out["max_batch_size"], int) and out["max_batch_size"] > 0:
        batching.setdefault("padding", {"inputs": [
            {"name": t["name"], "dim": 0, "value": 0} for t in out["inputs"]
            if isinstance(t, dict) and t.get("name") in (IDS, MASK)]})
    out["dynamic_batching"] = batching
    return out


def _check_text(where: str, text: TextConfig, inputs: tuple[TensorSpec, ...],
                outputs: tuple[TensorSpec, ...], max_sequences: int) -> None:
    """The tensors the OpenAI routes send and read: for embeddings, ``input_ids`` (and
    ``attention_mask``) of INT64 with one free length, one ``embedding`` vector out."""
    if text.task == "generate":
        _check_generate(where, inputs, outputs, max_sequences)
        return
    declared = {t.name: t for t in inputs}
    for name in (IDS, MASK):
        spec = declared.get(name)
        if spec is None and name == MASK:
            continue
        if spec is None or spec.datatype != "INT64" or spec.shape != (-1,):
            raise _fail(where, "inputs", f"a text model takes {IDS!r} (and {MASK!r}) as "
                        f'INT64 of shape [-1]; got {spec.to_json() if spec else "none"}')
    if set(declared) - {IDS, MASK}:
        raise _fail(where, "inputs", f"a text model takes only {IDS!r} and {MASK!r}; got "
                    f"{sorted(declared)}")
    if outputs and [(t.name, t.datatype, len(t.shape)) for t in outputs] != \
            [(EMBEDDING, "FP32", 1)]:
        raise _fail(where, "outputs", f"an embeddings model answers one output "
                    f"{EMBEDDING!r}, FP32 of one dimension (the pooled vector)")



def _check_generate(where: str, inputs: tuple[TensorSpec, ...],
                    outputs: tuple[TensorSpec, ...], max_sequences: int) -> None:
    """A generating text model: iterative, ``input_ids`` (INT64 [-1]) and ``max_tokens``
    (INT32 or INT64 [1]) in, and only the sampling settings besides; ``token_id`` (INT64
    [1]) out, a step at a time."""
    if not max_sequences:
        raise _fail(where, "sequences", 'a generating text model runs as sequences: set '
                    '"sequences": {"max": N}')
    declared = {t.name: (t.datatype, t.shape) for t in inputs}
    if declared.get(IDS) != ("INT64", (-1,)) or declared.get(MAX_TOKENS) not in (
            ("INT32", (1,)), ("INT64", (1,))) or set(declared) - {IDS, MAX_TOKENS, *SAMPLING}:
        raise _fail(where, "inputs", f"a generating text model takes {IDS!r} (INT64 [-1]) "
                    f"and {MAX_TOKENS!r} (INT32 or INT64 [1]), and may take "
                    f"{', '.join(SAMPLING)}; got {sorted(declared)}")
    if [(t.name, t.datatype, t.shape) for t in outputs] not in (
            [], [(TOKEN, "INT64", (1,))]):
        raise _fail(where, "outputs", f"a generating text model answers one {TOKEN!r} "
                    "(INT64 [1]) a step")

def _ensemble(where: str, raw: Any, platform: str, inputs: tuple[TensorSpec, ...],
              outputs: tuple[TensorSpec, ...], cache: bool) -> tuple[ens.Step, ...]:
    """``ensemble_scheduling``, given exactly when the platform is ``ensemble``; checked
    here on its own (its steps' models: :func:`check_ensembles`)."""
    if platform != ens.ENSEMBLE:
        if raw is not None:
            raise _fail(where, "ensemble_scheduling", 'needs platform "ensemble"')
        return ()
    if raw is None:
        raise _fail(where, "ensemble_scheduling", 'is required with platform "ensemble"')
    if cache:
        raise _fail(where, "response_cache", "an ensemble's answers are not cached (its "
                    "steps' may be)")
    try:
        return ens.parse_steps(raw, [t.name for t in inputs], [t.name for t in outputs])
    except ens.EnsembleError as exc:
        raise _fail(where, "ensemble_scheduling", str(exc)) from None


def check_ensembles(models: dict[str, RepoModel], errors: dict[str, str]) -> None:
    """Each ensemble of ``models`` against the models its steps name, as Triton checks
    it at load; one that fails moves to ``errors``, named by step and tensor."""
    def signature(name: str) -> ens.Signature | str | None:
        rm = models.get(name)
        return rm.config.signature() if rm is not None else errors.get(name)

    for name, rm in sorted(models.items()):
        cfg = rm.config
        if not cfg.ensemble:
            continue
        lead = (-1,) if cfg.max_batch_size > 0 else ()
        try:
            ens.check_models(cfg.ensemble, {t.name: (t.datatype, lead + t.shape)
                                            for t in cfg.inputs},
                             {t.name: (t.datatype, lead + t.shape) for t in cfg.outputs},
                             cfg.max_batch_size, signature)
        except ens.EnsembleError as exc:
            errors[name] = f"{rm.path}: field 'ensemble_scheduling': {exc}"
    for name in errors:
        models.pop(name, None)


def _rollout(where: str, raw: Any, version_policy: dict[str, Any]) -> dict[str, Any] | None:
    """``rollout``: a plan whose canary is compared with the previous version, which the
    version policy must therefore keep loaded."""
    if raw is None:
        return None
    try:
        plan = parse_plan(raw)
    except PlanError as exc:
        raise _fail(where, "rollout", str(exc)) from None
    if version_policy.get("latest") == 1:
        raise _fail(where, "rollout", 'compares a new version with the previous one, which '
                    'the version policy must keep: set "version_policy": {"latest": 2}')
    return plan.to_json()


def _check_discoverable(where: str, inputs: tuple[TensorSpec, ...], decoupled: bool) -> None:
    """Outputs are found by running the model once on zeros: say now when it cannot be."""
    if decoupled:
        raise _fail(where, "outputs", "is required for a decoupled model (a trial run "
                    "does not find the outputs of a stream)")
    strings = [t.name for t in inputs if t.datatype == "BYTES"]
    if strings:
        raise _fail(where, "outputs", f"is required for a model with BYTES inputs "
                    f"({', '.join(strings)}): a trial run has no strings to give it")


def _transaction_policy(where: str, raw: Any, platform: str, iterative: bool) -> bool:
    """``{"decoupled": bool}``. Only a Python handler can answer with a sequence (its
    predict is a generator), or an iterative model (``sequences``): a TorchScript or
    export program returns once."""
    if raw is None:
        return False
    if not isinstance(raw, dict) or set(raw) - {"decoupled"}:
        raise _fail(where, "model_transaction_policy", 'must be {"decoupled": true|false}')
    decoupled = raw.get("decoupled", False)
    if not isinstance(decoupled, bool):
        raise _fail(where, "model_transaction_policy.decoupled",
                    f"must be true or false, got {decoupled!r}")
    if decoupled and platform != "python" and not iterative:
        raise _fail(where, "model_transaction_policy.decoupled",
                    f"needs platform 'python' (a handler whose predict yields responses), "
                    f"not {platform!r}")
    return decoupled


# the platforms whose models can run as sequences: a handler with join and step, or a
# save_pretrained causal LM, which zeroserve's own step handler runs (models/causal_lm.py)
ITERATIVE_PLATFORMS = ("python", "transformers")


def _sequences(where: str, raw: dict[str, Any], platform: str
               ) -> tuple[int, int, float]:
    """``{"max": N}``: an iterative model, N sequences at once (and, for a causal LM,
    ``"prefill_tokens": T``, the prompt tokens a step prefills at most, 0: not given;
    ``"step_ratio": R``, prefills in the decode's forward within R decodes' time, 0: off).
    It answers with a stream, so it is decoupled; a config that says ``decoupled: false``
    contradicts itself."""
    given = raw.get("sequences")
    if given is None:
        return 0, 0, 0.0
    if not isinstance(given, dict) or "max" not in given or \
            set(given) - {"max", "prefill_tokens", "step_ratio"}:
        raise _fail(where, "sequences", 'must be {"max": N}, N the sequences run at once '
                    '(and, for a causal LM, "prefill_tokens": T, the prompt tokens a step '
                    'prefills at most, and "step_ratio": R)')
    most = _int(where, "sequences.max", given["max"], 1)
    if platform not in ITERATIVE_PLATFORMS:
        allowed = " or ".join(map(repr, ITERATIVE_PLATFORMS))
        raise _fail(where, "sequences", f"needs platform {allowed} (a handler with join() "
                    f"and step(), or a causal LM), not {platform!r}")
    prefill, ratio = 0, 0.0
    for name in ("prefill_tokens", "step_ratio"):
        if name in given and platform != "transformers":
            raise _fail(where, f"sequences.{name}", "is read by zeroserve's own causal LM "
                        "steps (platform 'transformers'); a handler of your own prefills "
                        "as its join() and step() do")
    if "prefill_tokens" in given:
        prefill = _int(where, "sequences.prefill_tokens", given["prefill_tokens"], 1)
    if "step_ratio" in given:
        ratio = given["step_ratio"]
        if isinstance(ratio, bool) or not isinstance(ratio, (int, float)) or \
                not ratio > 1:
            raise _fail(where, "sequences.step_ratio", f"must be a number above 1 (a "
                        f"step that carries prefill at most that many decodes), got {ratio!r}")
        ratio = float(ratio)
    policy = raw.get("model_transaction_policy")
    if isinstance(policy, dict) and policy.get("decoupled") is False:
        raise _fail(where, "model_transaction_policy.decoupled", "is false, but an iterative "
                    "model (sequences) answers with a stream: leave it out or set it true")
    return most, prefill, ratio


def _response_cache(where: str, raw: Any, decoupled: bool) -> bool:
    """``{"enable": bool}``. Refused on a decoupled model, as Triton refuses it: a
    response sequence is not one answer to keep."""
    if raw is None:
        return False
    if not isinstance(raw, dict) or set(raw) - {"enable"} or \
            not isinstance(raw.get("enable", False), bool):
        raise _fail(where, "response_cache", 'must be {"enable": true|false}')
    enable: bool = raw.get("enable", False)
    if enable and decoupled:
        raise _fail(where, "response_cache", "a decoupled model's responses are not cached")
    return enable


def load_config(model_dir: Path) -> ModelConfig:
    raw, path = raw_config(model_dir)
    return parse_config(raw, str(path), expected_name=model_dir.name)


def raw_config(model_dir: Path) -> tuple[dict[str, Any], Path]:
    """A model folder's config in config.json's form, and the file it was read from:
    ``config.json``, else Triton's ``config.pbtxt`` (models/triton_config.py)."""
    path = model_dir / "config.json"
    if not path.exists() and (model_dir / PBTXT).exists():
        from zeroserve.models import triton_config   # protobuf only for such a repository
        return triton_config.read(model_dir / PBTXT), model_dir / PBTXT
    try:
        raw = json.loads(path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"{path}: missing (or a Triton {PBTXT})") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ConfigError(f"{path}: not valid JSON: {exc}") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: must be a JSON object")
    return raw, path


LABELS_FILE = "labels.txt"
MAX_LABELS_BYTES = 4 << 20


def load_labels(model_dir: Path) -> list[str] | None:
    """The class labels of ``<model>/labels.txt`` (line i names class i), or None.

    Read for the classification extension; an unreadable or huge file is ignored with
    None rather than failing the model, since labels only decorate its answers."""
    path = model_dir / LABELS_FILE
    try:
        if path.stat().st_size > MAX_LABELS_BYTES:
            return None
        text = path.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return None
    return text.splitlines()


def is_temp_name(name: str) -> bool:
    """Names a writer uses before publishing by rename; never loaded."""
    return (name.startswith(".") or name.endswith((".tmp", ".part", "~"))
            or name.startswith("_tmp"))


def list_versions(model_dir: Path, cfg: ModelConfig) -> list[int]:
    """Version folders that hold the platform's model file, ascending. An ensemble has no
    file: Triton's empty ``1/`` (or no folder at all) is its one version."""
    if cfg.platform == ens.ENSEMBLE:
        return sorted(int(e.name) for e in _entries(model_dir)
                      if e.is_dir() and e.name.isdigit() and int(e.name) > 0) or [1]
    versions = []
    try:
        entries = list(model_dir.iterdir())
    except OSError:
        return []
    for entry in entries:
        if entry.name.isdigit() and int(entry.name) > 0 and not is_temp_name(entry.name):
            if (entry / cfg.model_file).is_file():
                versions.append(int(entry.name))
    return sorted(versions)


def select_versions(cfg: ModelConfig, available: list[int]) -> list[int]:
    """The versions the policy keeps loaded, plus any named in ``traffic``."""
    policy = cfg.version_policy
    if "all" in policy:
        chosen = set(available)
    elif "specific" in policy:
        chosen = set(policy["specific"]) & set(available)
    else:
        chosen = set(available[-policy["latest"]:])
    chosen |= {int(v) for v in cfg.traffic} & set(available)
    return sorted(chosen)


@dataclass(frozen=True)
class RepoModel:
    config: ModelConfig
    path: Path
    versions: tuple[int, ...]          # the versions to serve


def version_sha256(version_dir: Path) -> str:
    """sha256 over the version folder's files (relative names and contents), sorted;
    its provenance (``metadata.json``, models/provenance.py) is no part of the build."""
    h = hashlib.sha256()
    for path in sorted(p for p in version_dir.rglob("*") if p.is_file()):
        rel = path.relative_to(version_dir).as_posix()
        if "__pycache__" in rel or any(is_temp_name(part) for part in rel.split("/")) \
                or rel == PROVENANCE_FILE:
            continue
        h.update(rel.encode() + b"\0")
        with path.open("rb") as f:
            while chunk := f.read(1 << 20):
                h.update(chunk)
        h.update(b"\0")
    return h.hexdigest()


def scan(root: Path, skip: Callable[[str, int], bool] | None = None
         ) -> tuple[dict[str, RepoModel], dict[str, str]]:
    """Read every model of a repository. Returns (models, errors by model name).

    ``skip(folder, version)`` hides versions not ready to load (files still being written)."""
    models: dict[str, RepoModel] = {}
    errors: dict[str, str] = {}
    if not root.is_dir():
        raise ConfigError(f"{root}: model repository folder does not exist")
    for entry in sorted(root.iterdir()):
        if not entry.is_dir() or is_temp_name(entry.name):
            continue
        try:
            cfg = load_config(entry)
        except ConfigError as exc:
            errors[entry.name] = str(exc)
            continue
        available = [v for v in list_versions(entry, cfg)
                     if skip is None or not skip(entry.name, v)]
        versions = select_versions(cfg, available)
        if not versions:
            errors[entry.name] = f"{entry}: no version folder holds {cfg.model_file}"
            continue
        cfg = _text_width(cfg, entry / str(versions[-1]))
        models[cfg.name] = RepoModel(cfg, entry, tuple(versions))
    check_ensembles(models, errors)
    return models, errors


def _text_width(cfg: ModelConfig, version_dir: Path) -> ModelConfig:
    """A ``save_pretrained`` embeddings model whose config leaves the vector's width free
    (``[-1]``, the default) answers its last hidden state's width: the ``hidden_size`` of
    the newest version's Hugging Face config.json, so its metadata says it."""
    if cfg.text is None or cfg.platform != "transformers" or cfg.text.output not in (
            "", "last_hidden_state") or [t.shape for t in cfg.outputs] != [(-1,)]:
        return cfg
    try:
        raw = json.loads((version_dir / cfg.model_file).read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return cfg   # the load says what is wrong with the folder
    width = raw.get("hidden_size") if isinstance(raw, dict) else None
    if isinstance(width, bool) or not isinstance(width, int) or width <= 0:
        return cfg
    return replace(cfg, outputs=(replace(cfg.outputs[0], shape=(width,)),))


def _entries(folder: Path) -> list[Path]:
    try:
        return list(folder.iterdir())
    except OSError:
        return []
