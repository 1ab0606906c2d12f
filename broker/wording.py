"""Triton's wording of the errors a client can provoke, one definition each.

Client code written against Triton matches these texts (``"Request for unknown model"``,
``"unexpected shape for input"``), so the broker, the HTTP routes and the gRPC service
all answer with them; only the status differs by protocol. Each text follows
triton-inference-server/core (``src/infer_request.cc``, ``src/model.cc``,
``src/model_repository_manager/``) and server (``src/common.cc``, ``src/http_server.cc``);
docs/triton-compatibility.md lists them. Where Triton has no message for a case, the
text here is zeroserve's own and says so in its docstring.

Triton prefixes what it finds while checking a request's tensors with the request's id
(``[request id: <id_unknown>] ``). The broker never sees the id a client gave over HTTP
or gRPC, so it writes the unknown form and the front end, which knows the id, puts it
in with :func:`with_request_id`.
"""

from __future__ import annotations

from typing import Sequence

NO_ID = "[request id: <id_unknown>] "


def with_request_id(message: str, request_id: str | None) -> str:
    """``message`` with the client's request id in Triton's prefix, where it has one."""
    if request_id and message.startswith(NO_ID):
        return f"[request id: {request_id}] {message[len(NO_ID):]}"
    return message


def dims(shape: Sequence[int]) -> str:
    """Triton's DimsListToString: ``[-1,4]``, no spaces."""
    return "[" + ",".join(str(d) for d in shape) + "]"


# -- models and versions -----------------------------------------------------------

def unknown_model(name: object) -> str:
    return f"Request for unknown model: '{name}' is not found"


def is_unknown_model(message: str) -> bool:
    """Whether ``message`` is :func:`unknown_model`'s (not :func:`unknown_version`'s):
    Triton finds the first before any model is looked up (INVALID_ARG, its
    FindModelIdentifier), the second in the model's versions (NOT_FOUND)."""
    return message.startswith(_UNKNOWN) and "' is not found" in message


_UNKNOWN = "Request for unknown model: '"


def unknown_version(name: object, version: int) -> str:
    return f"Request for unknown model: '{name}' version {version} is not found"


def bad_version(raw: str) -> str:
    """A version that is not an integer (Triton's GetModelVersionFromString; the details
    are std::stol's what(), which is what Triton's answer carries)."""
    return (f"failed to get model version from specified version string '{raw}' "
            "(details: stol), version should be an integral value > 0")


def invalid_version(raw: str) -> str:
    """An integer version below 1 (Triton refuses negative ones with this text)."""
    return f"invalid model version specified '{raw}' , version should be an integral value > 0"


# -- decoupled models ------------------------------------------------------------

# A unary call to a model with a decoupled transaction policy (Triton's http_server.cc and
# grpc infer handler, TRITONSERVER_ERROR_UNSUPPORTED: HTTP 501, gRPC UNIMPLEMENTED). The
# broker cannot tell which front end asked, so it answers decoupled_unary() with the code
# UNSUPPORTED and each front end answers its own text for that code.
DECOUPLED_HTTP = "HTTP end point doesn't support models with decoupled transaction policy"
DECOUPLED_GRPC = "ModelInfer RPC doesn't support models with decoupled transaction policy"


def decoupled_unary(name: object) -> str:
    """zeroserve's own text (the direct client's): Triton has none for its C API."""
    return (f"a unary infer doesn't support models with decoupled transaction policy: "
            f"model '{name}' answers with a stream (Client.stream, HTTP generate_stream, "
            f"gRPC ModelStreamInfer)")


# -- the request's body ---------------------------------------------------------

def bad_json(reason: str, offset: int) -> str:
    """A body that is not JSON (TritonJson::Parse); the reason is the parser's own."""
    return f"failed to parse the request JSON buffer: {reason} at {offset}"


# -- the request's tensors against the model (InferenceRequest::Normalize) --------

def unexpected_output(name: str, model: str) -> str:
    return f"unexpected inference output '{name}' for model '{model}'"


def unexpected_input(name: str, model: str) -> str:
    return f"unexpected inference input '{name}' for model '{model}'"


def input_twice(name: str) -> str:
    return f"{NO_ID}input '{name}' already exists in request"


def input_count(model: str, declared: Sequence[str], given: Sequence[str]) -> str:
    """Too few or too many inputs. Triton lists the given ones sorted (they are a map)
    and the missing ones in the config's order."""
    got = ",".join(f"'{n}'" for n in sorted(given))
    missing = ",".join(f"'{n}'" for n in declared if n not in given)
    return (f"{NO_ID}expected {len(declared)} inputs but got {len(given)} inputs for model "
            f"'{model}'. Got input(s) [{got}], but missing required input(s) [{missing}]. "
            "Please provide all required input(s).")


def no_batch_dim(name: str, model: str) -> str:
    return f"{NO_ID}input '{name}' has no shape but model requires batch dimension for '{model}'"


def batch_mismatch(name: str, model: str) -> str:
    return f"{NO_ID}input '{name}' batch size does not match other inputs for '{model}'"


def batch_too_large(max_batch_size: int, model: str) -> str:
    return f"{NO_ID}inference request batch-size must be <= {max_batch_size} for '{model}'"


def batch_empty(model: str) -> str:
    """zeroserve's own: Triton has no word for a batch of 0 samples."""
    return f"{NO_ID}inference request batch-size must be >= 1 for '{model}'"


def wrong_datatype(name: str, given: str, model: str, expected: str) -> str:
    return (f"{NO_ID}inference input '{name}' data-type is '{given}', but model '{model}' "
            f"expects '{expected}'")


BATCH_NOTE = ("NOTE: Setting a non-zero max_batch_size in the model config requires a batch "
              "dimension to be prepended to each input shape. If you want to specify the "
              "full shape including the batch dim in your input dims config, try setting "
              "max_batch_size to zero. See the model configuration docs for more info on "
              "max_batch_size.")


def wrong_shape(name: str, model: str, expected: Sequence[int], given: Sequence[int],
                batched: bool) -> str:
    """``expected`` is the config's dims; a batched model's gets the -1 batch dim first."""
    full = ([-1] if batched else []) + list(expected)
    return (f"{NO_ID}unexpected shape for input '{name}' for model '{model}'. Expected "
            f"{dims(full)}, got {dims(given)}. {BATCH_NOTE if batched else ''}")


# -- shared memory ----------------------------------------------------------------

CUDA_SHM_NO_NAME = "'region name' is necessary to register cuda shared memory region"


def cuda_shm_unsupported(region: str) -> str:
    """Register on a server built without GPUs."""
    return f"failed to register CUDA shared memory region: '{region}', GPUs not supported"


def cuda_shm_unknown(region: str) -> str:
    return f"Unable to find cuda shared memory region: '{region}'"
