"""Triton ensembles as configs: the steps of ``ensemble_scheduling``, their validation at
load (as Triton validates them) and the graph the broker runs. Pure: no torch, no broker,
no files; :mod:`zeroserve.models.repository` reads the config and gives each check the
other models' signatures.

A step maps its model's inputs to ensemble tensors (``input_map``: step input ->
ensemble tensor) and its outputs to new ones (``output_map``: step output -> ensemble
tensor). An ensemble tensor is an input of the ensemble or the output of exactly one
step; a step runs once every tensor it reads exists.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterable, Mapping, Sequence

ENSEMBLE = "ensemble"   # the platform, as Triton names it

Shape = tuple[int, ...]
Spec = tuple[str, Shape]   # (datatype, full shape: the batch dimension first when it batches)


class EnsembleError(ValueError):
    """An ensemble that cannot be served; the message names the step and the tensor."""


@dataclass(frozen=True)
class Step:
    model_name: str
    model_version: int                       # -1: the version requests are routed to
    input_map: tuple[tuple[str, str], ...]   # (the step model's input, ensemble tensor)
    output_map: tuple[tuple[str, str], ...]  # (the step model's output, ensemble tensor)

    def to_json(self) -> dict[str, Any]:
        return {"model_name": self.model_name, "model_version": self.model_version,
                "input_map": dict(self.input_map), "output_map": dict(self.output_map)}

    def reads(self) -> list[str]:
        return [t for _, t in self.input_map]

    def writes(self) -> list[str]:
        return [t for _, t in self.output_map]


@dataclass(frozen=True)
class Signature:
    """What validation reads of a step's model."""

    inputs: Mapping[str, Spec]
    outputs: Mapping[str, Spec]
    max_batch_size: int
    decoupled: bool = False
    ensemble: bool = False


def where_of(i: int, step: Step) -> str:
    return f"step[{i}] (model {step.model_name!r})"


def _pairs(where: str, fld: str, raw: Any) -> tuple[tuple[str, str], ...]:
    if not isinstance(raw, dict) or not raw or not all(
            isinstance(k, str) and k and isinstance(v, str) and v for k, v in raw.items()):
        raise EnsembleError(f"{where}: {fld} must map tensor names to tensor names")
    return tuple(sorted(raw.items()))


def parse_steps(raw: Any, inputs: Sequence[str], outputs: Sequence[str]) -> tuple[Step, ...]:
    """``ensemble_scheduling`` (``{"step": [...]}``) checked on its own: each tensor
    produced once, read only once produced, every output produced, no cycle. What needs
    the steps' models is :func:`check_models`."""
    if not isinstance(raw, dict) or set(raw) - {"step"} or not isinstance(
            raw.get("step"), list) or not raw["step"]:
        raise EnsembleError('must be {"step": [{"model_name", "model_version", "input_map", '
                            '"output_map"}, ...]} with at least one step')
    steps = []
    for i, s in enumerate(raw["step"]):
        where = f"step[{i}]"
        if not isinstance(s, dict) or set(s) - {"model_name", "model_version", "input_map",
                                                "output_map"}:
            raise EnsembleError(f"{where}: must be an object with model_name, model_version, "
                                "input_map and output_map")
        name, version = s.get("model_name"), s.get("model_version", -1)
        if not isinstance(name, str) or not name:
            raise EnsembleError(f"{where}: model_name must be a model's name")
        if isinstance(version, str) and version.lstrip("-").isdigit():
            version = int(version)   # Triton's JSON writes int64 as a string
        if isinstance(version, bool) or not isinstance(version, int) or version == 0 \
                or version < -1:
            raise EnsembleError(f"{where}: model_version must be -1 or a version >= 1, "
                                f"got {version!r}")
        where = f"step[{i}] (model {name!r})"
        steps.append(Step(name, version, _pairs(where, "input_map", s.get("input_map")),
                          _pairs(where, "output_map", s.get("output_map"))))
    check_graph(steps, inputs, outputs)
    return tuple(steps)


def check_graph(steps: Sequence[Step], inputs: Sequence[str], outputs: Sequence[str]) -> None:
    producer = producers(steps, inputs)
    for i, step in enumerate(steps):
        for tensor in step.reads():
            if tensor not in producer:
                raise EnsembleError(f"{where_of(i, step)}: input tensor {tensor!r} is neither "
                                    "an ensemble input nor produced by any step")
    for name in outputs:
        if name not in producer or producer[name] < 0:
            raise EnsembleError(f"ensemble output {name!r} is not produced by any step")
    order(steps, inputs)


def producers(steps: Sequence[Step], inputs: Iterable[str]) -> dict[str, int]:
    """Ensemble tensor -> the step that produces it (-1: an ensemble input)."""
    out = {name: -1 for name in inputs}
    for i, step in enumerate(steps):
        for tensor in step.writes():
            if tensor in out:
                first = "the ensemble's input" if out[tensor] < 0 else \
                    where_of(out[tensor], steps[out[tensor]])
                raise EnsembleError(f"{where_of(i, step)}: output tensor {tensor!r} is "
                                    f"already produced by {first}")
            out[tensor] = i
    return out


def depends(steps: Sequence[Step], inputs: Iterable[str]) -> list[set[int]]:
    """For each step, the steps it waits for."""
    producer = producers(steps, inputs)
    return [{producer[t] for t in s.reads() if producer.get(t, -1) >= 0} for s in steps]


def order(steps: Sequence[Step], inputs: Iterable[str]) -> list[int]:
    """The steps in an order that runs each after those it reads from; EnsembleError
    naming a step of the cycle when there is one."""
    deps = depends(steps, inputs)
    done: list[int] = []
    left = set(range(len(steps)))
    while left:
        runnable = sorted(i for i in left if not deps[i] - set(done))
        if not runnable:
            i = min(left)
            tensor = next(t for t in steps[i].reads()
                          if any(t in steps[j].writes() for j in left))
            raise EnsembleError(f"{where_of(i, steps[i])}: input tensor {tensor!r} is part "
                                "of a cycle between steps")
        done += runnable
        left -= set(runnable)
    return done


def critical_path_s(steps: Sequence[Step], inputs: Iterable[str],
                    cost_s: Callable[[int], float]) -> float:
    """The longest chain of predicted step times: independent steps run at once, so
    the whole takes its slowest chain."""
    deps = depends(steps, inputs)
    finish: dict[int, float] = {}
    for i in order(steps, inputs):
        finish[i] = max((finish[d] for d in deps[i]), default=0.0) + cost_s(i)
    return max(finish.values(), default=0.0)


def _fits(a: Shape, b: Shape) -> bool:
    return len(a) == len(b) and all(x == y or x == -1 or y == -1 for x, y in zip(a, b))


def _show(spec: Spec) -> str:
    return f"{spec[0]} {list(spec[1])}"


def _check_streaming(steps: Sequence[Step], i: int, outputs: Mapping[str, Spec]) -> None:
    """A decoupled model streams the pipeline's answer: it must be the last step, the one
    producing every output of the ensemble, read by no other step."""
    where, writes = where_of(i, steps[i]), set(steps[i].writes())
    for j, other in enumerate(steps):
        read = writes & set(other.reads())
        if j != i and read:
            raise EnsembleError(f"{where}: a decoupled model can only be the last step, but "
                                f"{where_of(j, other)} reads its tensor {sorted(read)[0]!r}")
    missing = sorted(set(outputs) - writes)
    if missing:
        raise EnsembleError(f"{where}: a decoupled step streams the ensemble's answer, so it "
                            f"must produce every ensemble output; {missing[0]!r} comes from "
                            "another step")


def check_models(steps: Sequence[Step], inputs: Mapping[str, Spec],
                 outputs: Mapping[str, Spec], max_batch_size: int,
                 model: Callable[[str], Signature | str | None]) -> None:
    """The steps against their models, as Triton checks them at load: each model known
    (``model`` gives its signature, or why it is not served, or None), every input of it
    mapped and nothing else, datatypes and shapes agreeing between producer and consumer
    and with the ensemble's own outputs."""
    specs: dict[str, Spec] = dict(inputs)
    sigs: list[Signature] = []
    for i, step in enumerate(steps):
        where = where_of(i, step)
        sig = model(step.model_name)
        if sig is None or isinstance(sig, str):
            why = f": {sig}" if isinstance(sig, str) else ""
            raise EnsembleError(f"{where}: model {step.model_name!r} is not in the "
                                f"repository{why}")
        if sig.ensemble:
            raise EnsembleError(f"{where}: an ensemble as a step is not served")
        if sig.decoupled:
            _check_streaming(steps, i, outputs)
        if max_batch_size > 0 and sig.max_batch_size < max_batch_size:
            raise EnsembleError(f"{where}: max_batch_size {sig.max_batch_size} is below the "
                                f"ensemble's {max_batch_size}")
        mapped = dict(step.input_map)
        for name in mapped:
            if name not in sig.inputs:
                raise EnsembleError(f"{where}: input_map names {name!r}, which is not an "
                                    f"input of the model (it has {sorted(sig.inputs)})")
        for name in sig.inputs:
            if name not in mapped:
                raise EnsembleError(f"{where}: input {name!r} of the model is not mapped "
                                    "in input_map")
        for name, tensor in step.output_map:
            if name not in sig.outputs:
                raise EnsembleError(f"{where}: output_map names {name!r}, which is not an "
                                    f"output of the model (it has {sorted(sig.outputs)})")
            specs[tensor] = sig.outputs[name]
        sigs.append(sig)
    for i, step in enumerate(steps):
        for name, tensor in step.input_map:
            want, have = sigs[i].inputs[name], specs[tensor]
            if want[0] != have[0] or not _fits(want[1], have[1]):
                raise EnsembleError(f"{where_of(i, step)}: input {name!r} takes "
                                    f"{_show(want)} but tensor {tensor!r} is {_show(have)}")
    for name, want in outputs.items():
        have = specs[name]
        if want[0] != have[0] or not _fits(want[1], have[1]):
            raise EnsembleError(f"ensemble output {name!r} is declared {_show(want)} but "
                                f"its step produces {_show(have)}")
