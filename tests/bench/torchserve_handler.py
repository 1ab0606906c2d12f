"""The TorchServe handler bench_peers.py archives the bundled TorchScript models with:
each request's JSON body is ``{"data": [...]}`` (one sample, flat), a batch is their
stack, each answer the model's row. It runs inside TorchServe's own venv, not ours."""

from __future__ import annotations

import json
import os
from typing import Any

import torch
from ts.torch_handler.base_handler import BaseHandler


class Handler(BaseHandler):  # type: ignore[misc]
    def initialize(self, context: Any) -> None:
        model_dir = context.system_properties["model_dir"]
        serialized = context.manifest["model"]["serializedFile"]
        # one thread a worker: TorchServe runs two workers on a two-core host
        torch.set_num_threads(int(os.environ.get("TS_TORCH_THREADS", "1")))
        self.model = torch.jit.load(os.path.join(model_dir, serialized)).eval()
        # zeroserve's config.json travels in the archive: one sample's shape
        with open(os.path.join(model_dir, "config.json")) as f:
            self.shape = json.load(f)["inputs"][0]["shape"]
        self.initialized = True

    def preprocess(self, data: list[dict[str, Any]]) -> torch.Tensor:
        rows = []
        for row in data:
            body = row.get("data") or row.get("body")
            if isinstance(body, (bytes, bytearray)):
                body = json.loads(body)
            rows.append(torch.tensor(body["data"], dtype=torch.float32))
        x = torch.stack(rows)
        return x.reshape(len(rows), *self.shape)

    def inference(self, data: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        with torch.inference_mode():
            return self.model(data)

    def postprocess(self, data: torch.Tensor) -> list[Any]:
        return [{"output": r} for r in data.tolist()]
