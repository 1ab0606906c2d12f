"""A recurrent language model the tests make (no download): a GRU with an embedding and a
head, random weights (seeded), written as an iterative Python handler whose state per
sequence is the GRU's hidden state (no key/value cache), with tests/lm.py's byte-level
BPE tokenizer and a chat template, served as a generating text model. ``greedy`` runs
the same weights alone in-process, a token at a time, as the reference."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tests.lm import write_tokenizer

TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}<|assistant|>{% endif %}")

HANDLER = '''
import time
import torch


class Model:
    """Greedy decoding of a GRU language model. join runs the prompt through the GRU at
    once and keeps its last hidden state; each step answers every sequence's chosen token
    and runs one batched GRU step of those that go on, their hidden states stacked."""

    def load(self, version_dir, device):
        saved = torch.load(version_dir / "gru.pt", weights_only=True)
        vocab, hidden, layers = saved["vocab"], saved["hidden"], saved["layers"]
        self.embed = torch.nn.Embedding(vocab, hidden)
        self.gru = torch.nn.GRU(hidden, hidden, layers, batch_first=True)
        self.head = torch.nn.Linear(hidden, vocab)
        for name in ("embed", "gru", "head"):
            part = getattr(self, name)
            part.load_state_dict(saved[name])
            part.to(device).eval()
        self.eos, self.device = saved["eos"], device
        self.step_s = float((version_dir / "step_s").read_text()) \\
            if (version_dir / "step_s").exists() else 0.0
        # where each step's sequence ids go, one line a step (the tests read who stepped)
        self.trace = (version_dir / "trace_to").read_text() \\
            if (version_dir / "trace_to").exists() else ""

    def join(self, seq_id, inputs):
        ids = torch.as_tensor(inputs["input_ids"]).reshape(1, -1).to(self.device)
        out, h = self.gru(self.embed(ids))
        return {"h": h, "next": int(self.head(out[0, -1]).argmax()),
                "left": int(inputs["max_tokens"].reshape(-1)[0])}

    def step(self, states):
        time.sleep(self.step_s)  # noqa: sleep-ok (a slower model's step, for the tests)
        if self.trace:
            with open(self.trace, "a") as f:
                f.write(" ".join(str(s) for s in sorted(states)) + "\\n")
        out, going = {}, []
        for seq_id, st in states.items():
            if st["left"] <= 0:
                out[seq_id] = (None, True)
                continue
            tok, st["left"] = st["next"], st["left"] - 1
            final = tok == self.eos or st["left"] <= 0
            out[seq_id] = ({"token_id": torch.tensor([[tok]])}, final)
            if not final:
                going.append(st)
        if going:
            x = torch.tensor([[st["next"]] for st in going], device=self.device)
            y, h = self.gru(self.embed(x), torch.cat([st["h"] for st in going], dim=1))
            nxt = self.head(y[:, -1]).argmax(-1).tolist()
            for i, st in enumerate(going):
                st["h"], st["next"] = h[:, i:i + 1].clone(), nxt[i]
        return out
'''


def write_gru(repo: Path, name: str = "gru", most: int = 4, hidden: int = 64,
              layers: int = 2, step_s: float = 0.0,
              trace_to: Path | None = None) -> tuple[Path, Any]:
    """``repo/name/1`` holds the handler, its weights (``gru.pt``) and the tokenizer with a
    chat template; ``most``: sequences.max; ``step_s``: what a step takes at least;
    ``trace_to``: a file each step appends its sequence ids to. Returns the folder and the
    tokenizer."""
    import torch

    folder = repo / name / "1"
    folder.mkdir(parents=True, exist_ok=True)
    hf = write_tokenizer(folder)
    (folder / "chat_template.jinja").write_text(TEMPLATE)
    torch.manual_seed(0)
    vocab = len(hf)
    embed = torch.nn.Embedding(vocab, hidden)
    gru = torch.nn.GRU(hidden, hidden, layers, batch_first=True)
    head = torch.nn.Linear(hidden, vocab)
    with torch.no_grad():
        # wider than the default init: the next token then depends on the context, and
        # the top two logits rarely tie
        for p in gru.parameters():
            p.mul_(3.0)
        head.weight.mul_(8.0)
        # random weights would often end at once: the end token's logit is held at 0
        head.weight[hf.eos_token_id].zero_()
        head.bias[hf.eos_token_id] = 0.0
    torch.save({"vocab": vocab, "hidden": hidden, "layers": layers, "eos": hf.eos_token_id,
                "embed": embed.state_dict(), "gru": gru.state_dict(),
                "head": head.state_dict()}, folder / "gru.pt")
    (folder / "model.py").write_text(HANDLER)
    if step_s:
        (folder / "step_s").write_text(str(step_s))
    if trace_to is not None:
        (folder / "trace_to").write_text(str(trace_to))
    (repo / name / "config.json").write_text(json.dumps(
        {"name": name, "platform": "python", "max_batch_size": 8,
         "inputs": [{"name": "input_ids", "datatype": "INT64", "shape": [-1]},
                    {"name": "max_tokens", "datatype": "INT32", "shape": [1]}],
         "outputs": [{"name": "token_id", "datatype": "INT64", "shape": [1]}],
         "sequences": {"max": most}, "text": {"task": "generate", "max_length": 512},
         "warmup": {"batch_sizes": []}}))
    return folder, hf


def greedy(folder: Path, ids: list[int], max_tokens: int) -> tuple[list[int], list[float]]:
    """The GRU of ``folder`` alone in-process, fed one token at a time (the prompt too),
    greedy, up to ``max_tokens`` or its end token (sent); and at each step the gap between
    its top two logits (a gap under 1e-4 may flip in another batch's float sums)."""
    import torch

    saved = torch.load(folder / "gru.pt", weights_only=True)
    embed = torch.nn.Embedding(saved["vocab"], saved["hidden"])
    gru = torch.nn.GRU(saved["hidden"], saved["hidden"], saved["layers"], batch_first=True)
    head = torch.nn.Linear(saved["hidden"], saved["vocab"])
    for part, key in ((embed, "embed"), (gru, "gru"), (head, "head")):
        part.load_state_dict(saved[key])
    tokens: list[int] = []
    gaps: list[float] = []
    with torch.no_grad():
        h = None
        for t in ids:
            y, h = gru(embed(torch.tensor([[t]])), h)
        for _ in range(max_tokens):
            top = head(y[0, -1]).topk(2)
            gaps.append(float(top.values[0] - top.values[1]))
            tokens.append(int(top.indices[0]))
            if tokens[-1] == saved["eos"]:
                break
            y, h = gru(embed(torch.tensor([[tokens[-1]]])), h)
    return tokens, gaps
