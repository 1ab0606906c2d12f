"""The broker's JSON documents (config, metadata, statistics, repository index) as the
messages of Triton's service."""

from __future__ import annotations

from typing import Any

from google.protobuf import json_format

from zeroserve.models import formats
from zeroserve.models.proto import grpc_service_pb2 as pb
from zeroserve.models.proto import model_config_pb2 as mc

# KServe datatype -> model_config.proto's DataType (BYTES is Triton's TYPE_STRING)
DATA_TYPES = {"BOOL": mc.TYPE_BOOL, "UINT8": mc.TYPE_UINT8, "UINT16": mc.TYPE_UINT16,
              "UINT32": mc.TYPE_UINT32, "UINT64": mc.TYPE_UINT64, "INT8": mc.TYPE_INT8,
              "INT16": mc.TYPE_INT16, "INT32": mc.TYPE_INT32, "INT64": mc.TYPE_INT64,
              "FP16": mc.TYPE_FP16, "FP32": mc.TYPE_FP32, "FP64": mc.TYPE_FP64,
              "BYTES": mc.TYPE_STRING, "BF16": mc.TYPE_BF16}


def model_config(doc: dict[str, Any]) -> Any:
    """A ModelConfig from a model's ``config.json`` (as the broker's ``config`` verb
    answers it): what Triton's fields can say; zeroserve's own (traffic, warmup,
    aging, ...) stay in HTTP's ``GET .../config``."""
    platform, backend = formats.triton_names(str(doc.get("platform", "")))
    cfg = mc.ModelConfig(name=doc.get("name", ""), platform=platform, backend=backend,
                         max_batch_size=int(doc.get("max_batch_size") or 0))
    for spec in doc.get("inputs") or ():
        cfg.input.add(name=spec["name"], data_type=DATA_TYPES.get(spec["datatype"], 0),
                      dims=list(spec["shape"]))
    for spec in doc.get("outputs") or ():
        cfg.output.add(name=spec["name"], data_type=DATA_TYPES.get(spec["datatype"], 0),
                       dims=list(spec["shape"]))
    _batching(cfg, doc.get("dynamic_batching") or {})
    _versions(cfg, doc.get("version_policy") or {})
    steps = (doc.get("ensemble_scheduling") or {}).get("step") or ()
    for s in steps:   # Triton's scheduling is one of: an ensemble's replaces the batching
        step = cfg.ensemble_scheduling.step.add(model_name=s["model_name"],
                                                model_version=int(s.get("model_version", -1)))
        step.input_map.update(s.get("input_map") or {})
        step.output_map.update(s.get("output_map") or {})
    if not steps:   # an ensemble has no instances: the broker runs it
        # count 0 (every worker that holds the model) is one instance per worker
        count = int((doc.get("instances") or {}).get("count") or 1)
        cfg.instance_group.add(count=count, kind=mc.ModelInstanceGroup.KIND_AUTO)
    policy = doc.get("model_transaction_policy") or {}
    cfg.model_transaction_policy.decoupled = bool(policy.get("decoupled", False))
    cfg.response_cache.enable = bool((doc.get("response_cache") or {}).get("enable", False))
    return cfg


def _batching(cfg: Any, db: dict[str, Any]) -> None:
    if int(cfg.max_batch_size) <= 0:
        return
    dyn = cfg.dynamic_batching
    dyn.preferred_batch_size.extend(int(n) for n in db.get("preferred_batch_sizes") or ())
    dyn.max_queue_delay_microseconds = int(float(db.get("max_queue_delay_ms", 0)) * 1000)
    dyn.priority_levels = int(db.get("priority_levels", 0))
    dyn.default_priority_level = int(db.get("default_priority", 0))
    queue = dyn.default_queue_policy
    queue.default_timeout_microseconds = int(float(db.get("default_timeout_ms", 0)) * 1000)
    queue.max_queue_size = int(db.get("max_queue_size", 0))


def _versions(cfg: Any, policy: dict[str, Any]) -> None:
    if "specific" in policy:
        cfg.version_policy.specific.versions.extend(int(v) for v in policy["specific"])
    elif policy.get("all"):
        cfg.version_policy.all.SetInParent()
    else:
        cfg.version_policy.latest.num_versions = int(policy.get("latest", 1))


def model_metadata(meta: dict[str, Any]) -> Any:
    out = pb.ModelMetadataResponse(name=meta.get("name", ""), platform=meta.get("platform", ""),
                                   versions=[str(v) for v in meta.get("versions") or ()])
    for key, field in (("inputs", out.inputs), ("outputs", out.outputs)):
        for t in meta.get(key) or ():
            field.add(name=t["name"], datatype=t["datatype"], shape=list(t["shape"]))
    return out


def statistics(doc: dict[str, Any]) -> Any:
    """Triton's statistics JSON (what HTTP answers) as a ModelStatisticsResponse."""
    return json_format.ParseDict(_integral(doc), pb.ModelStatisticsResponse(),
                                 ignore_unknown_fields=True)


def repository_index(entries: Any) -> Any:
    models = entries.get("models", entries) if isinstance(entries, dict) else entries
    out = pb.RepositoryIndexResponse()
    for entry in models or ():
        out.models.add(name=str(entry.get("name", "")), version=str(entry.get("version", "")),
                       state=str(entry.get("state", "")), reason=str(entry.get("reason", "")))
    return out


def _integral(doc: Any) -> Any:
    """Counters and nanoseconds are integers in the proto; JSON may carry 12.0."""
    if isinstance(doc, dict):
        return {k: _integral(v) for k, v in doc.items()}
    if isinstance(doc, list):
        return [_integral(v) for v in doc]
    if isinstance(doc, float) and doc.is_integer():
        return int(doc)
    return doc
