"""A causal LM the tests make, as /work/shared/bench/make_text_models.py's ``make_lm``
does (no download): a byte-level BPE tokenizer trained here with the ``tokenizers``
library and a GPT-2 of a small config with random weights, both saved with
``save_pretrained``, and the zeroserve config that serves the folder as an iterative
model (models/causal_lm.py)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable

SYLLABLES = ["ka", "to", "ri", "ne", "mu", "sa", "lo", "pe", "di", "fu", "ge", "ho", "ji",
             "wa", "zo", "be", "chi", "ru", "ta", "mi", "an", "el", "or", "us"]


def corpus(lines: int = 800) -> list[str]:
    n = len(SYLLABLES)
    words = [SYLLABLES[i % n] + SYLLABLES[(i // n) % n] + (SYLLABLES[(i * 7) % n] if i % 3
                                                           else "") for i in range(n * n)]
    return [" ".join(words[(i * 31 + k * 17) % len(words)] for k in range(16)) + "."
            for i in range(lines)]


def lm_config(name: str = "lm", most: int = 16) -> dict[str, Any]:
    return {"name": name, "platform": "transformers", "max_batch_size": 8,
            "inputs": [{"name": "input_ids", "datatype": "INT64", "shape": [-1]},
                       {"name": "max_tokens", "datatype": "INT32", "shape": [1]}],
            "outputs": [{"name": "token_id", "datatype": "INT64", "shape": [1]}],
            "sequences": {"max": most}, "warmup": {"batch_sizes": [1]}}


def write_tokenizer(out: Path) -> Any:
    """A byte-level BPE tokenizer trained on ``corpus()`` (end token ``<|endoftext|>``),
    saved with ``save_pretrained`` in ``out``; returns it (a ``PreTrainedTokenizerFast``)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(corpus(), trainers.BpeTrainer(
        vocab_size=1024, special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|endoftext|>",
                                 eos_token="<|endoftext|>", pad_token="<|endoftext|>",
                                 model_max_length=512)
    hf.save_pretrained(str(out))
    return hf


def write_lm(repo: Path, name: str = "lm", most: int = 16, hidden: int = 64,
             layers: int = 2, **config: Any) -> tuple[Path, Any]:
    """``repo/name/1`` holds the model and its tokenizer; returns the folder and the
    tokenizer (a ``PreTrainedTokenizerFast``). ``config``: fields of the model's config
    over :func:`lm_config`'s."""
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    out = repo / name / "1"
    out.mkdir(parents=True, exist_ok=True)
    hf = write_tokenizer(out)
    torch.manual_seed(0)
    # wider random weights than the default 0.02: the next token then depends on the
    # context (positions, the whole prompt), rather than one token repeated for ever
    cfg = GPT2Config(vocab_size=len(hf), n_positions=512, n_embd=hidden, n_layer=layers,
                     n_head=4, bos_token_id=hf.eos_token_id, eos_token_id=hf.eos_token_id,
                     initializer_range=0.3)
    model = GPT2LMHeadModel(cfg).eval()
    with torch.no_grad():   # random weights would often end at once: the end token's (tied)
        model.transformer.wte.weight[hf.eos_token_id].zero_()   # row at 0 makes its logit 0
    model.save_pretrained(str(out))
    (repo / name / "config.json").write_text(json.dumps({**lm_config(name, most), **config}))
    return out, hf


def prompt_ids(tokenizer: Any, i: int, length: int) -> list[int]:
    """``length`` token ids of the corpus's text, from line i."""
    text = " ".join(corpus(i + 40)[i:i + 40])
    ids: list[int] = tokenizer(text)["input_ids"][:length]
    assert len(ids) == length, (len(ids), length)
    return ids


def greedy(folder: Path, ids: list[int], max_tokens: int) -> tuple[list[int], list[float]]:
    """``model.generate(do_sample=False)`` in-process, and at each step the gap between
    its top two logits (a gap under 1e-4 may flip in another batch's float sums)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = _models.get(folder)
    if model is None:
        model = _models[folder] = AutoModelForCausalLM.from_pretrained(str(folder)).eval()
    x = torch.tensor([ids])
    with torch.no_grad():
        out = model.generate(x, attention_mask=torch.ones_like(x), do_sample=False,
                             max_new_tokens=max_tokens, output_scores=True,
                             return_dict_in_generate=True,
                             pad_token_id=model.generation_config.eos_token_id)
    gaps = [float(s[0].topk(2).values[0] - s[0].topk(2).values[1]) for s in out.scores]
    return out.sequences[0, len(ids):].tolist(), gaps


def differs(tokenizer: Any, want: list[int], gaps: list[float], text: str) -> str:
    """'' where ``text`` is the decoded ``want``; else the first token whose text it
    leaves, which must be a near-tie (its top two logits within 1e-4 in-process)."""
    expected = tokenizer.decode(want, skip_special_tokens=True)
    if text == expected:
        return ""
    prefixes = [tokenizer.decode(want[:k + 1], skip_special_tokens=True)
                for k in range(len(want))]
    # a prefix that ends in part of a character (U+FFFD) is not the text's yet
    at = next((k for k, p in enumerate(prefixes)
               if not p.endswith("\ufffd") and not text.startswith(p)), len(want) - 1)
    assert gaps[at] < 1e-4, (f"{text!r} where the reference says {expected!r}: token {at} "
                             f"differs, its top two logits {gaps[at]:.2e} apart")
    return f"a near-tie flipped at token {at} (top two logits {gaps[at]:.1e} apart)"


_models: dict[Path, Any] = {}



def check(folder: Path, tokenizer: Any, ids: list[int], m: int, text: str, notes: list[str],
          reference: Callable[[Path, list[int], int], tuple[list[int], list[float]]] = greedy
          ) -> None:
    """A served text against ``reference``'s greedy tokens (the GPT-2's ``generate`` by
    default): equal, or a near-tie named in ``notes`` and printed; else it fails."""
    want, gaps = reference(folder, ids, m)
    if note := differs(tokenizer, want, gaps, text):
        notes.append(f"prompt of {len(ids)} tokens: {note}")
        print(notes[-1])   # said where it happens (pytest -rP shows it)

def complete_all(url: str, model: str, prompts: list[list[int]], most: list[int]
                 ) -> list[tuple[str, str | None]]:
    """Every prompt completed at once through the `openai` client, half of them streamed:
    (text, finish_reason) each, in order. Each answer's usage is checked against its
    prompt and ``max_tokens``."""
    import asyncio

    import openai

    async def run() -> list[tuple[str, str | None]]:
        c = openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
        try:
            async def one(k: int, ids: list[int], m: int) -> tuple[str, str | None]:
                if k % 2:   # half streamed
                    stream = await c.completions.create(model=model, prompt=ids,
                                                        max_tokens=m, stream=True)
                    chunks = [ch async for ch in stream]
                    return "".join(ch.choices[0].text for ch in chunks), \
                        chunks[-1].choices[0].finish_reason
                got = await c.completions.create(model=model, prompt=ids, max_tokens=m)
                assert got.usage is not None and got.usage.prompt_tokens == len(ids)
                assert got.usage.completion_tokens <= m
                return got.choices[0].text, got.choices[0].finish_reason
            return list(await asyncio.gather(*(one(k, ids, m) for k, (ids, m)
                                               in enumerate(zip(prompts, most)))))
        finally:
            await c.close()
    return asyncio.run(run())
