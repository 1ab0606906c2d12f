"""OpenAI's API, the codec: request bodies checked as OpenAI checks them, answers and
errors in its shapes. No I/O here (the routes: gateway/routes/openai.py).

Errors are OpenAI's object, ``{"error": {"message", "type", "param", "code"}}``, with
the statuses its clients act on: 400 for a bad request, 401 without a valid key, 404
for an unknown model (code ``model_not_found``), 413 for a body over the limit, 429
with Retry-After (type ``requests`` or ``tokens``: which quota ran out), 503 when no
worker can take it, 504 past the deadline, 500 when the model failed.
"""

from __future__ import annotations

import base64
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from zeroserve.broker.protocol import ErrorCode
from zeroserve.gateway import errors

__all__ = ["EmbeddingsRequest", "OpenAIError", "embeddings_answer", "error_body",
           "error_of", "parse_embeddings"]

MAX_INPUTS = 2048     # OpenAI's own bound on the items of one embeddings request
FORMATS = ("float", "base64")


class OpenAIError(ValueError):
    """A request refused before it reached the broker, in OpenAI's terms."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None,
                 status: int = 400, kind: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code
        self.status = status
        self.kind = kind


def error_body(message: str, kind: str, param: str | None, code: str | None
               ) -> dict[str, Any]:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


# the broker's codes as OpenAI names them: (type, code); the status is the table's
_KINDS: dict[ErrorCode, tuple[str, str | None]] = {
    ErrorCode.BAD_INPUT: ("invalid_request_error", None),
    ErrorCode.NOT_FOUND: ("invalid_request_error", "model_not_found"),
    ErrorCode.UNAUTHORIZED: ("invalid_request_error", "invalid_api_key"),
    ErrorCode.FORBIDDEN: ("invalid_request_error", "model_not_found"),
    ErrorCode.QUOTA: ("requests", "rate_limit_exceeded"),
    ErrorCode.OVERLOADED: ("server_error", "overloaded"),
    ErrorCode.DEADLINE: ("timeout", "deadline_exceeded"),
    ErrorCode.TOO_LARGE: ("invalid_request_error", "request_too_large"),
}


def error_of(exc: BaseException) -> tuple[int, dict[str, Any], dict[str, str] | None] | None:
    """(status, body, headers) of an error a client provoked, None for a bug."""
    if isinstance(exc, OpenAIError):
        return exc.status, error_body(exc.message, exc.kind, exc.param, exc.code), None
    got = errors.answer(exc)
    if got is None:
        return None
    code = getattr(exc, "code", ErrorCode.BAD_INPUT)
    kind, name = _KINDS.get(code, ("server_error", None)) if isinstance(code, ErrorCode) \
        else ("invalid_request_error", None)
    if code is ErrorCode.QUOTA and "tokens" in got.message:
        kind = "tokens"
    status = got.status.http
    if code is ErrorCode.FORBIDDEN:   # a model the key may not call: as if absent
        status = 404
    param = "model" if name == "model_not_found" else None
    return status, error_body(got.message, kind, param, name), got.http_headers()


@dataclass(frozen=True)
class EmbeddingsRequest:
    model: str
    texts: list[str] | None           # text inputs, or
    ids: list[list[int]] | None       # token ids
    base64: bool
    dimensions: int | None
    user: str


def parse_embeddings(doc: Any) -> EmbeddingsRequest:
    """The body of ``POST /v1/embeddings``: ``input`` a string, a list of strings, a list
    of token ids or a list of lists of them (at most :data:`MAX_INPUTS` items, none
    empty), ``model``, ``encoding_format``, ``dimensions``, ``user``."""
    if not isinstance(doc, dict):
        raise OpenAIError("the body must be a JSON object")
    model = doc.get("model")
    if not isinstance(model, str) or not model:
        raise OpenAIError("'model' is required: the name of a served model", "model")
    if "input" not in doc:
        raise OpenAIError("'input' is required: a string, a list of strings, or token ids",
                          "input")
    texts, ids = _inputs(doc["input"])
    fmt = doc.get("encoding_format", "float")
    if fmt is None:
        fmt = "float"
    if fmt not in FORMATS:
        raise OpenAIError(f"'encoding_format' must be one of {', '.join(FORMATS)}, got "
                          f"{fmt!r}", "encoding_format")
    dims = doc.get("dimensions")
    if dims is not None and (isinstance(dims, bool) or not isinstance(dims, int) or dims < 1):
        raise OpenAIError(f"'dimensions' must be a positive integer, got {dims!r}",
                          "dimensions")
    user = doc.get("user", "")
    if not isinstance(user, str):
        raise OpenAIError("'user' must be a string", "user")
    return EmbeddingsRequest(model, texts, ids, fmt == "base64", dims, user)


def _inputs(raw: Any) -> tuple[list[str] | None, list[list[int]] | None]:
    if isinstance(raw, str):
        raw = [raw]
    if not isinstance(raw, list) or not raw:
        raise OpenAIError("'input' must be a non-empty string, or a non-empty list of "
                          "strings or of token ids", "input")
    if all(isinstance(x, int) and not isinstance(x, bool) for x in raw):
        raw = [raw]   # one input given as token ids
    if len(raw) > MAX_INPUTS:
        raise OpenAIError(f"'input' has {len(raw)} items, more than the {MAX_INPUTS} one "
                          "request may hold", "input")
    if all(isinstance(x, str) for x in raw):
        for i, text in enumerate(raw):
            if not text:
                raise OpenAIError(f"input[{i}] is an empty string", "input")
        return raw, None
    ids: list[list[int]] = []
    for i, row in enumerate(raw):
        if not isinstance(row, list) or not all(
                isinstance(x, int) and not isinstance(x, bool) for x in row):
            raise OpenAIError(f"input[{i}] must be a string or a list of token ids (all "
                              "items of one kind)", "input")
        if not row:
            raise OpenAIError(f"input[{i}] is an empty list of token ids", "input")
        ids.append(row)
    return None, ids


def check_ids(ids: Sequence[Sequence[int]], vocab_size: int) -> None:
    for i, row in enumerate(ids):
        bad = next((x for x in row if not 0 <= x < vocab_size), None)
        if bad is not None:
            raise OpenAIError(f"input[{i}] holds token id {bad}, outside the model's "
                              f"vocabulary of {vocab_size}", "input")


def vectors(rows: Sequence[np.ndarray], dimensions: int | None, matryoshka: bool,
            normalize: bool) -> list[np.ndarray]:
    """Each input's vector, cut to ``dimensions`` where the model allows it, and then
    normalized again where the model normalizes."""
    if dimensions is None:
        return list(rows)
    size = rows[0].shape[-1] if rows else 0
    if dimensions == size:
        return list(rows)
    if not matryoshka:
        raise OpenAIError(f"this model does not support 'dimensions' other than its own "
                          f"{size}", "dimensions")
    if dimensions > size:
        raise OpenAIError(f"'dimensions' is {dimensions}, more than the model's {size}",
                          "dimensions")
    out = []
    for v in rows:
        cut = v[:dimensions]
        if normalize:
            norm = float(np.linalg.norm(cut))
            cut = cut / norm if norm > 0 else cut
        out.append(cut.astype(np.float32, copy=False))
    return out


def embeddings_answer(model: str, rows: Sequence[np.ndarray], as_base64: bool,
                      tokens: int) -> dict[str, Any]:
    """OpenAI's answer; base64 is the float32 vector's little-endian bytes, which is what
    the OpenAI clients decode (numpy's frombuffer as float32)."""
    data = [{"object": "embedding", "index": i,
             "embedding": base64.b64encode(np.ascontiguousarray(v, "<f4").tobytes()).decode()
             if as_base64 else v}
            for i, v in enumerate(rows)]
    return {"object": "list", "data": data, "model": model,
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}


def model_entry(name: str, created: int = 0, owned_by: str = "zeroserve") -> dict[str, Any]:
    """A model as OpenAI's ``GET /v1/models`` lists it."""
    return {"id": name, "object": "model", "created": created, "owned_by": owned_by}
