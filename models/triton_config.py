"""Triton's model configuration read as zeroserve's: a ``config.pbtxt`` (protobuf text
format, parsed into ``inference.ModelConfig`` from the vendored ``model_config.proto``)
and the Triton-JSON fields of a load's config override, both turned into the
``config.json`` form that :func:`zeroserve.models.repository.parse_config` validates.
No torch here: the broker reads configs.

Every field of ``ModelConfig`` is either converted, ignored with a logged warning
(where serving without it gives the same answers: tuning, warm-up data, placement),
or refused with a ConfigError naming it (where ignoring it would change what a
request gets). docs/triton-compatibility.md has the table; :data:`IGNORED`
and :data:`REFUSED` below are its source.
"""

from __future__ import annotations

import functools
import logging
from pathlib import Path
from typing import Any, Callable

from google.protobuf import json_format, text_format
from google.protobuf.message import Message

from zeroserve.models import formats
from zeroserve.models.proto import model_config_pb2 as mc
from zeroserve.models.repository import ConfigError, raw_config

logger = logging.getLogger(__name__)

# ModelConfig fields ignored, and why serving without them answers the same
IGNORED = {
    "instance_group": "zeroserve places a model on its workers itself (one per GPU, or "
                      "config.json's instances)",
    "optimization": "backend tuning only",
    "model_warmup": "zeroserve warms every version up with its own sample inputs",
    "metric_tags": "zeroserve's metrics carry their own labels",
    "model_metrics": "zeroserve's metrics carry their own labels",
    "cc_model_filenames": "one model file per version (model.pt)",
}
# ModelConfig fields refused, and why
REFUSED = {
    "sequence_batching": "stateful (sequence) models are not served",
    "batch_input": "ragged batching is not served",
    "batch_output": "ragged batching is not served",
    "model_repository_agents": "repository agents (checksum, decryption) are not run",
    "model_operations": "model operations are not served",
    "runtime": "zeroserve runs TorchScript with its own loader",
}


class TritonConfigError(ValueError):
    """A Triton config zeroserve cannot serve as written; names the field."""

    def __init__(self, fld: str, message: str) -> None:
        super().__init__(f"field '{fld}': {message}")
        self.field = fld


def read(path: Path) -> dict[str, Any]:
    """A config.pbtxt in the config.json form; ConfigError naming the file and the line
    or field. Fields ignored are logged once per version of the file (the repository
    is scanned again on every index call)."""
    try:
        raw, warnings = read_pbtxt(path)
        mtime_ns = path.stat().st_mtime_ns
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{path}: cannot be read: {exc}") from None
    except (TritonConfigError, text_format.ParseError) as exc:
        raise ConfigError(f"{path}: {exc}") from None
    for line in warnings:
        _warn_once(str(path), mtime_ns, line)
    return raw


@functools.lru_cache(maxsize=1024)
def _warn_once(path: str, mtime_ns: int, line: str) -> None:
    logger.warning("%s: %s", path, line)


# fields that say the same thing two ways: an override giving one replaces both
_SYNONYMS = ({"inputs", "input_shape"}, {"platform", "backend"})


def overridden(model_dir: Path, given: Any) -> dict[str, Any]:
    """A load's config override completed as Triton completes one: its fields replace
    those of the model's stored config (config.json or config.pbtxt, where it has one),
    the rest stays. Fields written as Triton's JSON are read as its parser reads them
    (numbers as strings, ``input`` with ``data_type`` and ``dims``, ...)."""
    if not isinstance(given, dict):
        raise ConfigError("config override: must be a JSON object")
    try:
        fields = override(given)
    except TritonConfigError as exc:
        raise ConfigError(f"config override: {exc}") from None
    try:
        stored, _ = raw_config(model_dir)
    except ConfigError:   # none, or unreadable: the override must then be whole
        stored = {}
    for group in _SYNONYMS:
        if group & set(fields):
            stored = {k: v for k, v in stored.items() if k not in group}
    return {**stored, **fields}


def read_pbtxt(path: Path) -> tuple[dict[str, Any], list[str]]:
    """(the config.json form of ``path``, warnings about ignored fields);
    TritonConfigError, or text_format.ParseError naming line and column, when it cannot
    be served. OSError and UnicodeDecodeError go to the caller."""
    msg = text_format.Parse(path.read_text(), mc.ModelConfig())
    return from_message(msg, [f.name for f, _ in msg.ListFields()])


def from_message(msg: Message, fields: list[str]) -> tuple[dict[str, Any], list[str]]:
    """The config.json form of ``fields`` of a ModelConfig (read whether set or zero:
    an override's ``"max_batch_size": 0`` counts), and a warning per ignored one."""
    out: dict[str, Any] = {}
    warnings = []
    for name in fields:
        if name in REFUSED:
            raise TritonConfigError(name, f"not supported: {REFUSED[name]}")
        if name in IGNORED:
            warnings.append(f"field '{name}' is ignored: {IGNORED[name]}")
            continue
        convert = _CONVERT.get(name)
        if convert is None:   # a field newer than this list: refused until it is read
            raise TritonConfigError(name, "not supported by zeroserve")
        for key, value in convert(msg).items():
            out[key] = value
    for group in ("input", "output"):
        for i, tensor in enumerate(getattr(msg, group) if group in fields else ()):
            warnings += _tensor_warnings(f"{group}[{i}]", tensor)
    if "dynamic_batching" in fields:
        warnings += _batching_warnings(msg.dynamic_batching)
    if "parameters" in fields:
        warnings += [f"field 'parameters.{k}' is ignored: backend-specific settings; "
                     "zeroserve reads only load_on_demand" for k in sorted(msg.parameters)
                     if k != ON_DEMAND]
    return out, warnings


def override(raw: dict[str, Any]) -> dict[str, Any]:
    """A load's config override in the config.json form: each key that parses as
    Triton's JSON for that ModelConfig field (numbers as strings, ``TYPE_FP32``, ``dims``,
    ``max_queue_delay_microseconds``, ...) is converted; any other key is left as
    written, for parse_config to read as zeroserve's own (``inputs``, ``traffic``, ...)."""
    out: dict[str, Any] = {}
    for key, value in raw.items():
        fld = mc.ModelConfig.DESCRIPTOR.fields_by_name.get(key) or \
            mc.ModelConfig.DESCRIPTOR.fields_by_camelcase_name.get(key)
        msg = mc.ModelConfig()
        try:
            if fld is None:
                raise json_format.ParseError("not a ModelConfig field")
            json_format.ParseDict({key: value}, msg)
        except json_format.ParseError:
            out[key] = value
            continue
        converted, warnings = from_message(msg, [fld.name])
        for line in warnings:
            logger.warning("config override: %s", line)
        out.update(converted)
    return out


# -- one converter per ModelConfig field ------------------------------------------

def _platform(msg: Any) -> dict[str, Any]:
    if msg.platform:
        return {"platform": msg.platform}
    return {}


def _backend(msg: Any) -> dict[str, Any]:
    if not msg.backend:
        return {}
    # the first format Triton reports under this backend names its platform
    served = [f.triton_platform for f in formats.FORMATS
              if f.triton_backend == msg.backend and f.triton_platform]
    if served:
        return {"platform": served[0]}
    if msg.backend == "python":
        raise TritonConfigError("backend", "Triton's Python backend (TritonPythonModel) is "
                                "not zeroserve's handler API: give the model a config.json "
                                "with \"platform\": \"python\" and a class Model")
    raise TritonConfigError("backend", f"{msg.backend!r} is not served (zeroserve serves "
                            "pytorch: TorchScript model.pt)")


def _default_filename(msg: Any) -> dict[str, Any]:
    if msg.default_model_filename not in ("", "model.pt"):
        raise TritonConfigError("default_model_filename", f"{msg.default_model_filename!r}: "
                                "zeroserve loads <version>/model.pt")
    return {}


DATATYPE_OF: dict[str, str] = {"TYPE_STRING": "BYTES"}


def _datatype(where: str, value: int) -> str:
    name: str = mc.DataType.Name(value)
    if name == "TYPE_INVALID":
        raise TritonConfigError(f"{where}.data_type", "is required (TYPE_FP32, ...)")
    return DATATYPE_OF.get(name, name.removeprefix("TYPE_"))


def _tensors(group: str, plural: str) -> Callable[[Any], dict[str, Any]]:
    def convert(msg: Any) -> dict[str, Any]:
        out = []
        for i, t in enumerate(getattr(msg, group)):
            where = f"{group}[{i}]"
            for flag in ("is_shape_tensor", "is_non_linear_format_io", "allow_ragged_batch",
                         "optional"):
                if getattr(t, flag, False):
                    raise TritonConfigError(f"{where}.{flag}", "not supported: every input is "
                                            "a required, linear, batch-aligned tensor")
            if t.HasField("reshape"):
                raise TritonConfigError(f"{where}.reshape", "not supported: give the model "
                                        "the shape it takes")
            out.append({"name": t.name, "datatype": _datatype(where, t.data_type),
                        "shape": list(t.dims)})
        return {plural: out}
    return convert


def _tensor_warnings(where: str, t: Any) -> list[str]:
    out = []
    if getattr(t, "format", 0):
        out.append(f"field '{where}.format' is ignored: a layout hint for other backends")
    if getattr(t, "label_filename", "") not in ("", "labels.txt"):
        out.append(f"field '{where}.label_filename' is ignored: zeroserve reads the "
                   "model's labels.txt")
    return out


def _dynamic_batching(msg: Any) -> dict[str, Any]:
    d = msg.dynamic_batching
    out: dict[str, Any] = {"max_queue_delay_ms": d.max_queue_delay_microseconds / 1000.0,
                           "preferred_batch_sizes": list(d.preferred_batch_size)}
    if d.priority_levels:
        if not 1 <= d.default_priority_level <= d.priority_levels:
            raise TritonConfigError("dynamic_batching.default_priority_level", "must be in "
                                    f"1..{d.priority_levels} (priority_levels)")
        out["priority_levels"] = d.priority_levels
        out["default_priority"] = d.default_priority_level
    else:   # Triton: no priorities, every request alike
        out["priority_levels"] = out["default_priority"] = 1
    if d.priority_queue_policy:
        raise TritonConfigError("dynamic_batching.priority_queue_policy",
                                "not supported: one queue policy for every priority")
    if d.HasField("default_queue_policy"):
        q = d.default_queue_policy
        if q.timeout_action == mc.ModelQueuePolicy.DELAY:
            raise TritonConfigError("dynamic_batching.default_queue_policy.timeout_action",
                                    "DELAY is not supported: a request whose timeout "
                                    "passes is refused (REJECT)")
        out["default_timeout_ms"] = q.default_timeout_microseconds / 1000.0
        if q.max_queue_size:   # 0: Triton's unbounded; zeroserve's default bound stays
            out["max_queue_size"] = q.max_queue_size
    return {"dynamic_batching": out}


def _batching_warnings(d: Any) -> list[str]:
    out = []
    if d.preserve_ordering:
        out.append("field 'dynamic_batching.preserve_ordering' is ignored: each request "
                   "gets its own answer")
    q = d.default_queue_policy
    if d.HasField("default_queue_policy") and q.default_timeout_microseconds and \
            not q.allow_timeout_override:
        out.append("field 'dynamic_batching.default_queue_policy.allow_timeout_override' "
                   "is ignored: a request's own timeout always applies")
    return out


def _version_policy(msg: Any) -> dict[str, Any]:
    which = msg.version_policy.WhichOneof("policy_choice")
    if which == "all":
        return {"version_policy": {"all": True}}
    if which == "specific":
        return {"version_policy": {"specific": list(msg.version_policy.specific.versions)}}
    return {"version_policy": {"latest": msg.version_policy.latest.num_versions or 1}}


def _transaction_policy(msg: Any) -> dict[str, Any]:
    if msg.model_transaction_policy.decoupled:
        return {"model_transaction_policy": {"decoupled": True}}
    return {}


ON_DEMAND = "load_on_demand"


def _parameters(msg: Any) -> dict[str, Any]:
    """``parameters { key: "load_on_demand" value { string_value: "true" } }``: Triton has
    no field for it, and its parameters are where a config says what a backend reads."""
    if ON_DEMAND not in msg.parameters:
        return {}
    value = msg.parameters[ON_DEMAND].string_value.strip().lower()
    if value not in ("true", "false"):
        raise TritonConfigError(f"parameters.{ON_DEMAND}", f'must be "true" or "false", '
                                f"got {value!r}")
    return {ON_DEMAND: value == "true"}


def _response_cache(msg: Any) -> dict[str, Any]:
    return {"response_cache": {"enable": bool(msg.response_cache.enable)}}


def _ensemble_scheduling(msg: Any) -> dict[str, Any]:
    """The steps as config.json writes them; repository.py validates them."""
    steps = []
    for i, s in enumerate(msg.ensemble_scheduling.step):
        if s.model_namespace:
            raise TritonConfigError(f"ensemble_scheduling.step[{i}].model_namespace",
                                    "not supported: one repository, one namespace")
        steps.append({"model_name": s.model_name, "model_version": s.model_version or -1,
                      "input_map": dict(s.input_map), "output_map": dict(s.output_map)})
    return {"ensemble_scheduling": {"step": steps}}


_CONVERT: dict[str, Callable[[Any], dict[str, Any]]] = {
    "name": lambda m: {"name": m.name} if m.name else {},
    "platform": _platform,
    "backend": _backend,
    "default_model_filename": _default_filename,
    "max_batch_size": lambda m: {"max_batch_size": m.max_batch_size},
    "input": _tensors("input", "inputs"),
    "output": _tensors("output", "outputs"),
    "dynamic_batching": _dynamic_batching,
    "version_policy": _version_policy,
    "model_transaction_policy": _transaction_policy,
    "response_cache": _response_cache,
    "ensemble_scheduling": _ensemble_scheduling,
    "parameters": _parameters,
}
