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


# -- a generating model: an iterative handler that counts up from its prompt's last word --
GEN_WORDS = 100   # w0 .. w99; id 0 is the end token, ids 1..100 the words
COUNTER = '''
import time
import torch

class Model:
    """Each step answers the word after the prompt's last word (w41 after w40; the chat
    roles are not words); after w99 the end token. A step takes at least STEP_S, so that
    sequences overlap."""

    def load(self, version_dir, device):
        pass

    def join(self, seq_id, inputs):
        words = [i for i in inputs["input_ids"].reshape(-1).tolist() if 0 < i <= WORDS]
        return {"last": words[-1] if words else 1,
                "left": int(inputs["max_tokens"].reshape(-1)[0])}

    def step(self, states):
        time.sleep(STEP_S)  # noqa: sleep-ok (a model's step, so that sequences overlap)
        out = {}
        for seq_id, st in states.items():
            nxt = st["last"] + 1 if 0 < st["last"] < WORDS else 0
            st["last"], st["left"] = nxt, st["left"] - 1
            out[seq_id] = ({"token_id": torch.tensor([[nxt]])}, nxt == 0 or st["left"] <= 0)
        return out
'''
CHAT_TEMPLATE = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }} {% endfor %}"
                 "{% if add_generation_prompt %}assistant:{% endif %}")


def write_generator(repo: Path, name: str = "gen", step_s: float = 0.005,
                    most: int = 8) -> Path:
    """An iterative handler with a word tokenizer (``<eos>`` w0 .. w99, and the roles of
    the chat template) and a chat template, served as a generating text model."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    folder = repo / name / "1"
    folder.mkdir(parents=True, exist_ok=True)
    words = ["<eos>"] + [f"w{i}" for i in range(GEN_WORDS)] + \
        ["system:", "user:", "assistant:", "<unk>"]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")   # joins words with spaces
    tok.add_special_tokens(["<eos>"])
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps(
        {"eos_token": "<eos>", "chat_template": CHAT_TEMPLATE}))
    (folder / "model.py").write_text(COUNTER.replace("STEP_S", repr(step_s))
                                     .replace("WORDS", str(GEN_WORDS)))
    (repo / name / "config.json").write_text(json.dumps(
        {"name": name, "platform": "python", "max_batch_size": 8,
         "sequences": {"max": most}, "text": {"task": "generate", "max_length": 64},
         "warmup": {"batch_sizes": []}}))
    return folder


def counted(prompt_last: int, n: int) -> str:
    """What the counter answers after a prompt ending in w<prompt_last - 1>: up to n words,
    fewer where it reaches the end token."""
    out, last = [], prompt_last
    for _ in range(n):
        last = last + 1 if 0 < last < GEN_WORDS else 0
        if last == 0:
            break
        out.append(f"w{last - 1}")
    return " ".join(out)
