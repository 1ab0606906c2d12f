"""Text models the tests make: a WordPiece tokenizer written here (no download) and a
Python handler that embeds token ids, so the OpenAI routes can be checked against the
same computation in-process."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

SPECIAL = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
WORDS = 2000
HIDDEN = 16


def vocab() -> list[str]:
    return SPECIAL + [f"w{i}" for i in range(WORDS)]


def text(n: int) -> str:
    """A text of exactly n tokens, [CLS] and [SEP] included (n >= 3)."""
    return " ".join(f"w{(i * 7919) % WORDS}" for i in range(n - 2))


def distinct(i: int, n: int) -> str:
    """A text of exactly n tokens (n >= 3) that differs from distinct(j, n) for j != i
    below WORDS: its first word is w<i>."""
    return " ".join([f"w{i % WORDS}"] + [f"w{(k * 7919) % WORDS}" for k in range(1, n - 2)])


def write_tokenizer(folder: Path) -> Path:
    """BERT's tokenizer shape (lower case, WordPiece, [CLS] ... [SEP]) as tokenizer.json."""
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors

    words = vocab()
    tok = Tokenizer(models.WordPiece({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1",
        special_tokens=[("[CLS]", 2), ("[SEP]", 3)])
    path = folder / "tokenizer.json"
    tok.save(str(path))
    return path


HANDLER = f'''
import time
import torch

class Model:
    def load(self, version_dir, device):
        g = torch.Generator().manual_seed(0)
        self.table = torch.randn({len(SPECIAL) + WORDS}, {HIDDEN}, generator=g)
        self.delay_s = float((version_dir / "delay_s").read_text()) \\
            if (version_dir / "delay_s").exists() else 0.0

    def predict(self, inputs):
        time.sleep(self.delay_s)  # noqa: sleep-ok (a model's compute, for fault tests)
        ids, mask = inputs["input_ids"], inputs["attention_mask"].float()
        summed = (self.table[ids] * mask.unsqueeze(-1)).sum(1)
        vec = summed / mask.sum(1, keepdim=True).clamp(min=1.0)
        return {{"embedding": torch.nn.functional.normalize(vec, dim=1)}}
'''


def reference(ids: list[int]) -> Any:
    """The handler's vector for one row of ids, computed here."""
    import torch

    g = torch.Generator().manual_seed(0)
    table = torch.randn(len(SPECIAL) + WORDS, HIDDEN, generator=g)
    vec = table[torch.tensor(ids)].mean(0)
    return torch.nn.functional.normalize(vec, dim=0).numpy()


def write_embedder(repo: Path, name: str = "emb", version: int = 1,
                   text_section: dict[str, Any] | None = None,
                   batching: dict[str, Any] | None = None, delay_s: float = 0.0) -> Path:
    """A handler embeddings model with its tokenizer, in ``repo``; ``delay_s``: what a
    batch takes, at least."""
    folder = repo / name / str(version)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "model.py").write_text(HANDLER)
    if delay_s:
        (folder / "delay_s").write_text(str(delay_s))
    write_tokenizer(folder)
    config: dict[str, Any] = {"name": name, "platform": "python",
                              "text": {"task": "embeddings", "max_length": 64,
                                       **(text_section or {})},
                              "outputs": [{"name": "embedding", "datatype": "FP32",
                                           "shape": [HIDDEN]}]}
    if batching:
        config["dynamic_batching"] = batching
    (repo / name / "config.json").write_text(json.dumps(config))
    return folder
