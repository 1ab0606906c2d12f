"""``GET /openapi.json``: every route with every status it can answer.

The document is built from one table (ROUTES below); a test checks that it names
every route the app serves. When a model is ready, its name and a zero-filled v2
body become the examples, so a fuzzer's example phase reaches a real model.
"""

from __future__ import annotations

import logging
from typing import Any, Awaitable, Callable, Sequence

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import BaseRoute, Route

from zeroserve.broker import __version__
from zeroserve.broker.client import InferError
from zeroserve.gateway.http import json_response

logger = logging.getLogger(__name__)

Example = tuple[str, dict[str, Any]]  # (model name, request body per route family)
ERROR = {"$ref": "#/components/schemas/Error"}
ANY_JSON: dict[str, Any] = {}
WHY = {
    200: "OK", 201: "registered", 400: "bad input (the message says what)",
    401: "a key is needed: the admin token (Authorization: Bearer <token>), or with "
         "tenants an API key (Authorization: Bearer <key> or X-API-Key)",
    403: "management refused (not loopback, wrong token, registration disabled, "
         "model_path outside the import roots, or shared memory off)",
    404: "unknown model, version or shared-memory region", 409: "the model already exists",
    422: "the model failed to load (the loader's message)",
    413: "request body too large", 429: "overloaded or over quota (Retry-After)",
    500: "the model raised", 503: "no worker, draining, or broker down (Retry-After)",
    501: "a unary call to a model with a decoupled transaction policy (use generate_stream)",
    504: "deadline exceeded",
}
VERSION = {"type": "string", "pattern": "^[1-9][0-9]{0,8}$"}
SEED_VERSION = {"type": "string", "pattern": "^v?[1-9][0-9]{0,8}$"}   # the seed writes "v2"
MODEL_READ = [200, 400, 404, 503]
INFER = [200, 400, 404, 413, 429, 500, 501, 503, 504, 507]
GENERATE = [200, 400, 404, 413, 429, 500, 503, 504, 507]
GENERATE_REQUEST = {"type": "object", "description": "members naming the model's inputs are "
                    "their data; parameters.priority and parameters.timeout (us) as for infer",
                    "properties": {"text_input": {"type": "string"},
                                   "parameters": {"type": "object"}}}

V2_REQUEST = {
    "type": "object", "required": ["inputs"],
    "properties": {
        "id": {"type": "string"},
        "parameters": {"type": "object", "properties": {
            "priority": {"type": "integer", "minimum": 0},
            "timeout": {"type": "integer", "minimum": 0, "description": "microseconds"},
            "binary_data_output": {"type": "boolean"}}},
        "inputs": {"type": "array", "items": {
            "type": "object", "required": ["name", "shape", "datatype"],
            "properties": {"name": {"type": "string"},
                           "shape": {"type": "array", "items": {"type": "integer"}},
                           "datatype": {"type": "string"},
                           "parameters": {"type": "object"}, "data": ANY_JSON}}},
        "outputs": {"type": "array", "items": {
            "type": "object", "required": ["name"],
            "properties": {"name": {"type": "string"}, "parameters": {"type": "object"}}}},
    },
}
SEED_REQUEST = {"type": "object", "required": ["inputs"], "properties": {
    "inputs": {"type": "object", "additionalProperties": ANY_JSON},
    "outputs": {"type": "array", "items": {"type": "string"}}, "id": {"type": "string"}}}
EMBEDDINGS_REQUEST = {"type": "object", "required": ["model", "input"], "properties": {
    "model": {"type": "string"}, "input": ANY_JSON,
    "encoding_format": {"type": "string", "enum": ["float", "base64"]},
    "dimensions": {"type": "integer"}, "user": {"type": "string"}}}
EMBEDDINGS = [200, 400, 401, 403, 404, 413, 429, 500, 503, 504]
COMPLETIONS_REQUEST = {"type": "object", "required": ["model", "prompt"], "properties": {
    "model": {"type": "string"}, "prompt": ANY_JSON, "max_tokens": {"type": "integer"},
    "stream": {"type": "boolean"}, "stop": ANY_JSON}}
CHAT_REQUEST = {"type": "object", "required": ["model", "messages"], "properties": {
    "model": {"type": "string"}, "messages": {"type": "array"},
    "max_completion_tokens": {"type": "integer"}, "stream": {"type": "boolean"},
    "stop": ANY_JSON}}
REGISTER = {"type": "object", "required": ["name", "platform", "model_path"], "properties": {
    "name": {"type": "string"}, "platform": {"type": "string"},
    "model_path": {"type": "string"}, "max_batch_size": {"type": "integer", "minimum": 0},
    "input_shape": {"type": "object"}, "inputs": {"type": "array"},
    "outputs": {"type": "array"}}}
PUSH = {"type": "object", "properties": {
    "model_path": {"type": "string"}, "version": {"type": "integer", "minimum": 1}}}
SHM_REGISTER = {"type": "object", "required": ["key", "byte_size"], "properties": {
    "key": {"type": "string", "description": "POSIX shm name, /dev/shm/<key>"},
    "offset": {"type": "integer", "minimum": 0},
    "byte_size": {"type": "integer", "minimum": 0}}}
LOG_SETTINGS = {"type": "object", "properties": {
    "log_info": {"type": "boolean"}, "log_warning": {"type": "boolean"},
    "log_error": {"type": "boolean"},
    "log_verbose_level": {"type": "integer", "minimum": 0},
    "log_format": {"type": "string", "enum": ["default", "ISO8601"]},
    "log_file": {"type": "string", "description": "read-only: always empty (stderr)"}}}
_STR_OR_NULL = {"type": "string", "nullable": True}
TRACE_SETTINGS = {"type": "object", "properties": {
    "trace_level": {"type": "array", "nullable": True, "items": {
        "type": "string", "enum": ["OFF", "TIMESTAMPS", "TENSORS"]}},
    "trace_rate": _STR_OR_NULL, "trace_count": _STR_OR_NULL, "log_frequency": _STR_OR_NULL,
    "trace_file": {"type": "string", "description": "read-only: set by --trace-config"}}}
SHM = "/v2/systemsharedmemory"
CUDA_SHM = "/v2/cudasharedmemory"
REPO_INDEX = {"type": "object", "properties": {"ready": {
    "type": "boolean", "description": "true: only the READY entries"}}}
REPO_LOAD = {"type": "object", "properties": {"parameters": {
    "type": "object", "properties": {"config": {
        "type": "string", "description": "JSON of a config overriding the model's"}},
    "additionalProperties": {"type": "string", "description": "file:<path>: base64 "
                             "contents of a file of the model folder (needs config)"}}}}
REPO_UNLOAD = {"type": "object", "properties": {"parameters": {
    "type": "object", "properties": {"unload_dependents": {"type": "boolean"}}}}}
STATS_READ = [200, 400, 404, 503]
REPO_WRITE = [200, 400, 401, 403, 404, 413, 503]
SIMPLE_HEADERS = [
    {"name": "X-Priority", "in": "header", "schema": {"type": "integer", "minimum": 0},
     "example": 1},
    {"name": "X-Timeout-Ms", "in": "header", "schema": {"type": "integer", "minimum": 0},
     "example": 0},
]

# (method, path, summary, statuses, request body schema or None, media type of a 200)
ROUTES: list[tuple[str, str, str, list[int], dict[str, Any] | None, str | None]] = [
    ("get", "/v2/health/live", "Server live", [200], None, None),
    ("get", "/v2/health/ready", "Server ready: broker reachable and every model ready on a "
     "live worker (--readiness strict), or one model (--readiness any)", [200, 503], None,
     None),
    ("get", "/healthz", "Liveness", [200], None, None),
    ("get", "/readyz", "Readiness (as /v2/health/ready)", [200, 503], None, None),
    ("get", "/v2", "Server metadata", [200], None, "application/json"),
    ("get", "/v2/models/{name}", "Model metadata", MODEL_READ, None, "application/json"),
    ("get", "/v2/models/{name}/versions/{version}", "Model version metadata", MODEL_READ,
     None, "application/json"),
    ("get", "/v2/models/{name}/ready", "Model ready", MODEL_READ, None, None),
    ("get", "/v2/models/{name}/versions/{version}/ready", "Model version ready", MODEL_READ,
     None, None),
    ("get", "/v2/models/{name}/config", "Model configuration", MODEL_READ, None,
     "application/json"),
    ("get", "/v2/models/{name}/versions/{version}/config", "Model configuration",
     MODEL_READ, None, "application/json"),
    ("post", "/v2/models/{name}/infer", "KServe v2 inference (JSON or binary tensors)",
     INFER, V2_REQUEST, "application/json"),
    ("post", "/v2/models/{name}/versions/{version}/infer", "KServe v2 inference, pinned "
     "version", INFER, V2_REQUEST, "application/json"),
    ("post", "/v2/models/{name}/generate", "Triton's generate extension: one JSON response",
     GENERATE, GENERATE_REQUEST, "application/json"),
    ("post", "/v2/models/{name}/versions/{version}/generate", "generate, pinned version",
     GENERATE, GENERATE_REQUEST, "application/json"),
    ("post", "/v2/models/{name}/generate_stream", "Triton's generate extension: each "
     "response as a Server-Sent Event", GENERATE, GENERATE_REQUEST, "text/event-stream"),
    ("post", "/v2/models/{name}/versions/{version}/generate_stream", "generate_stream, "
     "pinned version", GENERATE, GENERATE_REQUEST, "text/event-stream"),
    ("post", "/models/{name}/predict", "Simple JSON predict", INFER, SEED_REQUEST,
     "application/json"),
    ("post", "/models/{name}/{version}/predict", "Simple JSON predict, pinned version "
     "(2 or v2)",
     INFER, SEED_REQUEST, "application/json"),
    ("post", "/predictions/{name}", "TorchServe-compatible predict", INFER, ANY_JSON,
     "application/json"),
    ("post", "/predictions/{name}/{version}", "TorchServe-compatible predict, pinned "
     "version", INFER, ANY_JSON, "application/json"),
    ("get", "/ping", "TorchServe-compatible health", [200, 503], None, "application/json"),
    ("get", "/metrics", "Prometheus scrape of the gateway, the broker and every worker "
     "(with tenants: the admin token or --metrics-allow)", [200, 403], None, "text/plain"),
    ("get", "/openapi.json", "This document", [200], None, "application/json"),
    ("post", "/v1/models", "Register a model from model_path (copied, trial-loaded, then "
     "published)", [201, 400, 401, 403, 409, 413, 422, 503, 504], REGISTER,
     "application/json"),
    ("get", "/v1/models", "Registered models, in the registration's shape and OpenAI's "
     "(object, data)", [200, 401, 403, 503], None, "application/json"),
    ("get", "/openai/v1/models", "As /v1/models, under KServe's OpenAI prefix",
     [200, 401, 403, 503], None, "application/json"),
    ("post", "/v1/embeddings", "OpenAI's embeddings: text or token ids in, one vector an "
     "input", EMBEDDINGS, EMBEDDINGS_REQUEST, "application/json"),
    ("post", "/openai/v1/embeddings", "As /v1/embeddings, under KServe's OpenAI prefix",
     EMBEDDINGS, EMBEDDINGS_REQUEST, "application/json"),
    ("post", "/v1/completions", "OpenAI's completions: a prompt in, text out, streamed as "
     "server-sent events with stream", EMBEDDINGS, COMPLETIONS_REQUEST, "application/json"),
    ("post", "/openai/v1/completions", "As /v1/completions, under KServe's OpenAI prefix",
     EMBEDDINGS, COMPLETIONS_REQUEST, "application/json"),
    ("post", "/v1/chat/completions", "OpenAI's chat: messages in through the model's chat "
     "template, a reply out, streamed as server-sent events with stream", EMBEDDINGS,
     CHAT_REQUEST, "application/json"),
    ("post", "/openai/v1/chat/completions", "As /v1/chat/completions, under KServe's "
     "OpenAI prefix", EMBEDDINGS, CHAT_REQUEST, "application/json"),
    ("get", "/v1/models/{name}", "A registered model", [200, 401, 403, 404, 503], None,
     "application/json"),
    ("delete", "/v1/models/{name}", "Remove a model from the repository",
     [200, 400, 401, 403, 404, 503], None, "application/json"),
    ("post", "/v1/models/{name}/versions", "Push a version: model_path (or the model file "
     "as application/octet-stream, ?version=N) trial-loaded, then published",
     [200, 201, 400, 401, 403, 404, 409, 413, 422, 503, 504], PUSH, "application/json"),
    ("patch", "/v1/models/{name}/config", "Change a served model's config: the fields "
     "given replace its own (null: the default), validated, applied by a swap",
     [200, 400, 401, 403, 404, 413, 503, 504], {"type": "object"}, "application/json"),
    ("delete", "/v1/models/{name}/versions/{version}", "Remove one version",
     [200, 400, 401, 403, 404, 503], None, "application/json"),
    ("get", SHM + "/status", "Registered system shared-memory regions", [200, 403], None,
     "application/json"),
    ("get", SHM + "/region/{region}/status", "One shared-memory region", [200, 403, 404],
     None, "application/json"),
    ("post", SHM + "/region/{region}/register", "Register a region of /dev/shm/<key>",
     [200, 400, 401, 403], SHM_REGISTER, None),
    ("post", SHM + "/unregister", "Unregister every region", [200, 401, 403], None, None),
    ("post", SHM + "/region/{region}/unregister", "Unregister one region (unknown: no "
     "error)", [200, 401, 403], None, None),
    ("get", CUDA_SHM + "/status", "CUDA shared-memory regions: none (zeroserve takes "
     "tensors from host memory)", [200], None, "application/json"),
    ("get", CUDA_SHM + "/region/{region}/status", "One CUDA region: never registered",
     [404], None, None),
    ("post", CUDA_SHM + "/region/{region}/register", "Refused: GPUs not supported for "
     "CUDA shared memory", [400, 401, 403], ANY_JSON, None),
    ("post", CUDA_SHM + "/unregister", "Unregister every CUDA region (there are none)",
     [200, 401, 403], None, None),
    ("post", CUDA_SHM + "/region/{region}/unregister", "Unregister one CUDA region (no "
     "error)", [200, 401, 403], None, None),
    ("get", "/v2/logging", "Log settings", [200], None, "application/json"),
    ("post", "/v2/logging", "Change log settings (the keys given)", [200, 400, 401, 403],
     LOG_SETTINGS, "application/json"),
    ("get", "/v2/trace/setting", "The global trace setting (Triton's trace extension)",
     [200], None, "application/json"),
    ("post", "/v2/trace/setting", "Change the global trace setting (null: the default)",
     [200, 400, 401, 403, 503], TRACE_SETTINGS, "application/json"),
    ("get", "/v2/models/{name}/trace/setting", "A model's trace setting", [200, 400, 503],
     None, "application/json"),
    ("post", "/v2/models/{name}/trace/setting", "Change a model's trace setting (null: "
     "back to the global one)", [200, 400, 401, 403, 503], TRACE_SETTINGS,
     "application/json"),
    ("get", "/v2/models/stats", "Statistics of every served model version (Triton's "
     "statistics extension)", [200, 503], None, "application/json"),
    ("get", "/v2/models/{name}/stats", "Statistics of a model's versions", STATS_READ, None,
     "application/json"),
    ("get", "/v2/models/{name}/versions/{version}/stats", "Statistics of one version",
     STATS_READ, None, "application/json"),
    ("post", "/v2/repository/index", "Repository index: name, version, state (READY, "
     "UNAVAILABLE, LOADING, UNLOADING) and reason", [200, 400, 413, 503], REPO_INDEX,
     "application/json"),
    ("post", "/v2/repository/models/{name}/load", "Load (or reload) a model, optionally "
     "with a config override and files (--model-control-mode explicit)", REPO_WRITE,
     REPO_LOAD, None),
    ("post", "/v2/repository/models/{name}/unload", "Unload a model "
     "(--model-control-mode explicit)", REPO_WRITE, REPO_UNLOAD, None),
]


def _operation(method: str, path: str, summary: str, statuses: list[int],
               body: dict[str, Any] | None, media: str | None,
               example: Example | None) -> dict[str, Any]:
    params: list[dict[str, Any]] = []
    for name in ("name", "version", "region"):
        if "{" + name + "}" in path:
            schema = {"type": "string"} if name != "version" else \
                SEED_VERSION if path.startswith("/models/") else VERSION
            param: dict[str, Any] = {"name": name, "in": "path", "required": True,
                                     "schema": schema}
            if example is not None and name != "region":
                param["example"] = example[0] if name == "name" else "1"
            params.append(param)
    if path.startswith(("/models/", "/predictions/")):
        params += SIMPLE_HEADERS
    responses: dict[str, Any] = {}
    if path.startswith("/v2") and not path.startswith("/v2/health/") and 401 not in statuses:
        statuses = [*statuses, 401]   # with tenants: no key, or an unknown one
    for status in sorted(statuses):
        resp: dict[str, Any] = {"description": WHY.get(status, "")}
        if status >= 400:
            resp["content"] = {"application/json": {"schema": ERROR}}
        elif media is not None:
            resp["content"] = {media: {"schema": {"type": "string"} if media == "text/plain"
                                       else ANY_JSON}}
            if body is V2_REQUEST:  # binary outputs: JSON header + raw tensor bytes
                resp["content"]["application/octet-stream"] = {
                    "schema": {"type": "string", "format": "binary"}}
        responses[str(status)] = resp
    op: dict[str, Any] = {"summary": summary, "operationId": f"{method} {path}",
                          "responses": responses}
    if params:
        op["parameters"] = params
    if body is not None:
        content: dict[str, Any] = {"schema": body}
        if example is not None and any(body is b for b in (V2_REQUEST, SEED_REQUEST,
                                                           ANY_JSON)):
            kind = "v2" if body is V2_REQUEST else "seed" if body is SEED_REQUEST else "ts"
            content["example"] = example[1][kind]
        optional = any(body is b for b in (REPO_INDEX, REPO_LOAD, REPO_UNLOAD))  # Triton's
        op["requestBody"] = {"required": not optional,
                             "content": {"application/json": content}}
    return op


def document(example: Example | None = None) -> dict[str, Any]:
    paths: dict[str, dict[str, Any]] = {}
    for method, path, *rest in ROUTES:
        paths.setdefault(path, {})[method] = _operation(method, path, *rest,  # type: ignore
                                                        example=example)
    return {
        "openapi": "3.0.3",
        "info": {"title": "zeroserve", "version": __version__,
                 "description": "KServe v2 (with Triton's binary tensor extension), simple "
                 "predict and TorchServe-compatible routes. Errors are {\"error\": \"...\"}."},
        "paths": paths,
        "components": {"schemas": {"Error": {
            "type": "object", "required": ["error"],
            "properties": {"error": {"type": "string"}}}}},
    }


def _zeros_bodies(meta: dict[str, Any]) -> dict[str, Any]:
    """Zero-filled request bodies for the model, one per route family."""
    inputs, samples = [], {}
    for t in meta["inputs"]:
        shape = [d if d > 0 else 1 for d in t["shape"]]
        count = 1
        for d in shape:
            count *= d
        value: Any = "" if t["datatype"] == "BYTES" else False if t["datatype"] == "BOOL" else 0
        inputs.append({"name": t["name"], "shape": shape, "datatype": t["datatype"],
                       "data": [value] * count})
        sample: Any = value
        for d in reversed(shape):
            sample = [sample] * d
        samples[t["name"]] = sample
    ts = next(iter(samples.values())) if len(samples) == 1 else samples
    return {"v2": {"inputs": inputs}, "seed": {"inputs": samples}, "ts": ts}


async def _example(control: Callable[..., Awaitable[Any]]) -> Example | None:
    """The first ready model whose inputs JSON can carry, with a zero-filled body."""
    try:
        models = (await control("models"))["models"]
        for name in sorted(n for n, m in models.items() if m["ready"])[:8]:
            meta = await control("metadata", model=name, version=None)
            if all(t["datatype"] != "BF16" for t in meta["inputs"]):
                return name, _zeros_bodies(meta)
    except (InferError, KeyError, TypeError):
        pass  # the document must answer even with the broker down
    return None


def served(routes: Sequence[BaseRoute]) -> set[tuple[str, str]]:
    return {(m.lower(), r.path) for r in routes if isinstance(r, Route)
            for m in (r.methods or ()) if m != "HEAD"} | {("get", "/openapi.json")}


def undocumented(routes: Sequence[BaseRoute]) -> set[tuple[str, str]]:
    """Routes the app serves that ROUTES does not describe (a test keeps this empty)."""
    return served(routes) - {(m, path) for m, path, *_ in ROUTES}


def route(routes: Sequence[BaseRoute]) -> Route:
    """The /openapi.json route; a route missing from ROUTES still appears, generically."""
    extra = sorted(undocumented(routes))
    if extra:
        logger.warning("routes missing from openapi.ROUTES: %s", extra)

    async def openapi(request: Request) -> Response:
        doc = document(await _example(request.app.state.facade.control))
        for method, path in extra:
            doc["paths"].setdefault(path, {})[method] = _operation(
                method, path, "", [200, 400, 404, 500, 503], None, None, None)
        return json_response(doc)

    return Route("/openapi.json", openapi, methods=["GET"])
