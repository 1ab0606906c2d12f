"""The HTTP ceiling of WORKLOADS.md: a bare Starlette endpoint under uvicorn (uvloop,
httptools, orjson) that parses a v2 JSON body into numpy and answers, doing nothing
else. zeroserve's gateway does this much and more per request, so its throughput is
read against this one's, measured in the same run.

    python -m uvicorn tests.bench.ceiling_app:app --port 8090 --loop uvloop --http httptools
"""

from __future__ import annotations

import json

import numpy as np
import orjson
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from zeroserve.broker.runtime import cache_dir


async def metadata(request: Request) -> Response:
    """The model's v2 metadata (zeroserve bench reads it to make its inputs)."""
    name = request.path_params["model"]
    cfg = json.loads((cache_dir() / "examples" / name / "config.json").read_text())
    return Response(orjson.dumps({"name": name, "versions": ["1"], "platform": "ceiling",
                                  "inputs": [{**i, "shape": [-1, *i["shape"]]}
                                             for i in cfg["inputs"]], "outputs": []}),
                    media_type="application/json")


async def infer(request: Request) -> Response:
    body = orjson.loads(await request.body())
    arrays = [np.asarray(t["data"], dtype=np.float32).reshape(t["shape"])
              for t in body["inputs"]]
    return Response(orjson.dumps({"model_name": request.path_params["model"],
                                  "outputs": [{"name": "sum", "shape": [1], "datatype": "FP32",
                                               "data": [float(arrays[0].sum())]}]}),
                    media_type="application/json")


app = Starlette(routes=[Route("/v2/models/{model}", metadata),
                        Route("/v2/models/{model}/infer", infer, methods=["POST"])])
