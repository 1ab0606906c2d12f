"""Text to tokens in the gateway, with each text model's own tokenizer.

A tokenizer is data of a model version (models/text.py): the broker reads the file from
the version folder (the ``text`` verb) and the gateway builds it once with Hugging
Face's ``tokenizers`` (Rust, no torch), kept by the file's sha256, so versions that
share a tokenizer share one object. When an answer comes from another version than
the one the tokenizer was read for, the next request reads it again (a swap).

Where the tokens are made: short inputs on the event loop, long ones on a thread
(``Tokenizer.encode_batch`` releases the GIL). Measured (tests/bench/bench_tokenize.py,
the ``bert-emb`` tokenizer, 2026-12-06): a text of 64 tokens takes 80 µs on the loop and
the hand-off to a thread adds 40 µs; 2,048 characters (about 300 tokens) hold the loop
about 0.4 ms; 32 texts of 64 tokens would hold it 2.7 ms, which a thread leaves free.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable, Sequence

from tokenizers import Tokenizer

from zeroserve.models.text import TextConfig

__all__ = ["INLINE_CHARS", "TextModel", "Tokenizers", "TooLong"]

# inputs of up to this many characters in all are tokenized on the event loop
# (docs/openai.md: where the cost was measured)
INLINE_CHARS = 2048
MAX_TOKENIZERS = 32


class TooLong(ValueError):
    """An input longer than the model takes, where the config says not to cut it."""

    def __init__(self, index: int, length: int, limit: int) -> None:
        super().__init__(f"input[{index}] has {length} tokens, more than the model's maximum "
                         f"of {limit}; shorten it, or set \"truncate\": true in the model's "
                         "text section")
        self.index = index


@dataclass(frozen=True)
class TextModel:
    """A text model as the gateway uses it: its settings and its tokenizer; for a
    generating one, its chat template, special tokens and inputs (name: datatype)."""

    name: str
    version: int
    text: TextConfig
    tokenizer: Tokenizer
    vocab_size: int
    chat_template: str | None = None
    special: dict[str, str] = field(default_factory=dict)
    inputs: dict[str, str] = field(default_factory=dict)

    def prompt(self, text: str, special_tokens: bool) -> list[int]:
        """A prompt's ids, uncut (a generating model refuses one past its context)."""
        return list(self.tokenizer.encode(text, add_special_tokens=special_tokens).ids)

    def decode(self, ids: list[int]) -> str:
        return str(self.tokenizer.decode(ids, skip_special_tokens=True))

    def end_token(self) -> int | None:
        """The id of the end token the model stops at, where its tokenizer names one."""
        name = self.special.get("eos_token")
        return self.tokenizer.token_to_id(name) if name else None

    def encode(self, texts: Sequence[str]) -> list[list[int]]:
        """The token ids of each text, special tokens included, cut or refused past
        ``max_length`` as the config says."""
        encodings = self.tokenizer.encode_batch(list(texts))
        return self.limit([e.ids for e in encodings])

    def limit(self, rows: list[list[int]]) -> list[list[int]]:
        """Rows past ``max_length`` refused, or cut (token ids a client sent; texts are
        cut by the tokenizer itself, which keeps the special tokens at the end)."""
        cap = self.text.max_length
        for i, ids in enumerate(rows):
            if len(ids) > cap:
                if not self.text.truncate:
                    raise TooLong(i, len(ids), cap)
                rows[i] = ids[:cap]
        return rows


Control = Callable[..., Awaitable[Any]]


class Tokenizers:
    """Each text model's tokenizer, read from the broker once per file."""

    def __init__(self, control: Control) -> None:
        self._control = control
        self._by_model: dict[str, TextModel] = {}
        self._by_sha: dict[tuple[str, int], Tokenizer] = {}
        self._threads = concurrent.futures.ThreadPoolExecutor(
            max_workers=2, thread_name_prefix="zeroserve-tokenize")

    async def model(self, name: str, api_key: str | None) -> TextModel:
        """The model's settings and tokenizer; LookupError-backed InferErrors (not found,
        not a text model) come from the broker's ``text`` verb."""
        got = self._by_model.get(name)
        if got is not None:
            return got
        args: dict[str, Any] = {"model": name}
        if api_key is not None:
            args["api_key"] = api_key
        doc = await self._control("text", **args)
        text = TextConfig(**doc["text"])
        cut = text.truncate and text.task == "embeddings"   # a prompt is never cut
        key = (doc["tokenizer_sha256"], text.max_length if cut else 0)
        tok = self._by_sha.get(key)
        if tok is None:
            tok = Tokenizer.from_str(bytes(doc["tokenizer"]).decode("utf-8"))
            tok.no_padding()   # one row a text: the batch pads, in the worker
            if cut:
                tok.enable_truncation(text.max_length)
            else:
                tok.no_truncation()   # counted, and refused past max_length
            if len(self._by_sha) >= MAX_TOKENIZERS:
                self._by_sha.clear()
            self._by_sha[key] = tok
        got = TextModel(name, int(doc["version"]), text, tok, tok.get_vocab_size(),
                        doc.get("chat_template"), dict(doc.get("special_tokens") or {}),
                        dict(doc.get("inputs") or {}))
        self._by_model[name] = got
        return got

    def answered_by(self, model: TextModel, version: int) -> None:
        """An answer came from ``version``: another than the tokenizer's means a swap, so
        the next request reads the tokenizer again."""
        if version != model.version and self._by_model.get(model.name) is model:
            del self._by_model[model.name]

    async def encode(self, model: TextModel, texts: Sequence[str]) -> list[list[int]]:
        if sum(map(len, texts)) <= INLINE_CHARS:
            return model.encode(texts)
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._threads, model.encode, texts)

    def close(self) -> None:
        self._threads.shutdown(wait=False, cancel_futures=True)
