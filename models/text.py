"""A text model's ``config.json`` section ``text``: what the OpenAI routes do with text.

A model that takes text carries its tokenizer in each version folder, as data of the
version (hashed into its build, swapped with it), and says here how requests become
tokens and how its output becomes an answer::

    "text": {
      "task": "embeddings",          # what the model answers: "embeddings"
                                     # (/v1/embeddings) or "generate" (/v1/completions
                                     # and /v1/chat/completions)
      "tokenizer": "tokenizer.json", # the file of each version folder (Hugging Face's)
      "max_length": 512,             # tokens a text may have, special tokens included
      "truncate": false,             # past it: cut (true) or a 400 naming the item
      "pooling": "mean",             # "mean" over the attention mask, "cls", or "last"
      "normalize": true,             # L2, after pooling
      "matryoshka": false,           # the vector may be cut to `dimensions`, then
                                     # normalized again (a 400 for `dimensions` if not)
      "output": ""                   # the model output pooled (default: the first)
    }

An embeddings model gets the token ids and attention mask as ``input_ids`` and
``attention_mask`` (INT64, one row per text, padded with the batch); the worker pools
and normalizes, so a request answers ``embedding`` (FP32, one vector a text). A
generating model is an iterative one (``sequences``): it gets the prompt's ``input_ids``
and ``max_tokens``, and answers a ``token_id`` a step (``max_length`` is then its
context: the prompt and what it generates). No torch here: the broker and the gateway
read it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = ["EMBEDDING", "IDS", "MASK", "MAX_TOKENS", "POOLINGS", "SAMPLING", "TASKS", "TOKEN",
           "TextConfig", "TextConfigError", "parse_text"]

TASKS = ("embeddings", "generate")
POOLINGS = ("mean", "cls", "last")
IDS, MASK = "input_ids", "attention_mask"   # the model's inputs, as transformers names them
EMBEDDING = "embedding"                     # the answer of an embeddings model
# a generating model (an iterative one: ``sequences``) takes the prompt's ids and how many
# tokens it may answer, and answers a token a step; it may take the sampling settings
MAX_TOKENS, TOKEN = "max_tokens", "token_id"
SAMPLING = ("temperature", "top_p", "seed")
DEFAULT_MAX_LENGTH = 512


class TextConfigError(ValueError):
    """A ``text`` section that does not validate: (field, message)."""

    def __init__(self, fld: str, message: str) -> None:
        super().__init__(message)
        self.field = fld


@dataclass(frozen=True)
class TextConfig:
    task: str = "embeddings"
    tokenizer: str = "tokenizer.json"
    max_length: int = DEFAULT_MAX_LENGTH
    truncate: bool = False
    pooling: str = "mean"
    normalize: bool = True
    matryoshka: bool = False
    output: str = ""

    def to_json(self) -> dict[str, Any]:
        return {"task": self.task, "tokenizer": self.tokenizer, "max_length": self.max_length,
                "truncate": self.truncate, "pooling": self.pooling,
                "normalize": self.normalize, "matryoshka": self.matryoshka,
                "output": self.output}


_FIELDS = frozenset(TextConfig.__dataclass_fields__)


def parse_text(raw: Any) -> TextConfig | None:
    """The validated section, None where the config has none; TextConfigError naming
    the field (``text.<key>``) otherwise."""
    if raw is None:
        return None
    if not isinstance(raw, dict):
        raise TextConfigError("text", "must be an object")
    unknown = set(raw) - _FIELDS
    if unknown:
        raise TextConfigError("text", f"unknown keys {sorted(unknown)}")
    kw: dict[str, Any] = {}
    for key, value in raw.items():
        fld = f"text.{key}"
        if key == "task":
            if value not in TASKS:
                raise TextConfigError(fld, f"must be one of {', '.join(TASKS)}, got {value!r}")
        elif key == "pooling":
            if value not in POOLINGS:
                raise TextConfigError(fld, f"must be one of {', '.join(POOLINGS)}, "
                                           f"got {value!r}")
        elif key in ("truncate", "normalize", "matryoshka"):
            if not isinstance(value, bool):
                raise TextConfigError(fld, f"must be true or false, got {value!r}")
        elif key == "max_length":
            if isinstance(value, bool) or not isinstance(value, int) or value < 2:
                raise TextConfigError(fld, f"must be an integer >= 2, got {value!r}")
        elif key == "tokenizer":
            if not isinstance(value, str) or not value or "/" in value or value.startswith("."):
                raise TextConfigError(fld, f"must be a file name in the version folder, "
                                           f"got {value!r}")
        elif not isinstance(value, str):   # output
            raise TextConfigError(fld, f"must be an output's name, got {value!r}")
        kw[key] = value
    return TextConfig(**kw)
