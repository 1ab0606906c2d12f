"""Hugging Face ``transformers`` models served as ``save_pretrained`` wrote them.

A version folder is what ``model.save_pretrained(folder)`` (and the tokenizer's
``save_pretrained``) wrote: ``config.json`` (Hugging Face's, which detection names as the
model file), ``model.safetensors`` or its shards with ``model.safetensors.index.json``,
the tokenizer's files. The worker loads it with ``AutoModel.from_pretrained`` in the
dtype it was saved in, on its device, in eval mode, and calls it with the config's
inputs by name (``input_ids``, ``attention_mask``).

Torch and transformers are imported inside the loader only, so that a worker without
them serves every other format; models/hfweights.py reads the folder's weights for the
memory planner, torch-free.
"""

from __future__ import annotations

from typing import Any

from zeroserve.models.loader import LoadError, Opened, Source

__all__ = ["INSTALL_HINT", "ByName", "load_pretrained"]

INSTALL_HINT = "pip install 'zeroserve[text]' (transformers and tokenizers)"


def _dtype_argument(version: str) -> str:
    """transformers 4.56 renamed ``torch_dtype`` to ``dtype`` (5 drops the old name)."""
    major, minor = (int(x) if x.isdigit() else 0 for x in version.split(".")[:2])
    return "dtype" if (major, minor) >= (4, 56) else "torch_dtype"


def load_pretrained(src: Source) -> Opened:
    try:
        import transformers
    except ImportError:
        raise LoadError(f"{src.version_dir}: platform 'transformers' needs the transformers "
                        f"library in the worker's environment: {INSTALL_HINT}") from None
    # the worker's log is lines of its own format, not a terminal's progress bars
    transformers.utils.logging.disable_progress_bar()  # type: ignore[no-untyped-call]
    if src.cfg.max_sequences:   # a causal LM run by zeroserve's own steps
        from zeroserve.models.causal_lm import load_causal_lm
        return load_causal_lm(src, transformers, _dtype_argument(transformers.__version__))
    try:
        model = transformers.AutoModel.from_pretrained(
            str(src.version_dir),
            **{_dtype_argument(transformers.__version__): "auto"})
    except (OSError, ValueError, KeyError) as exc:
        raise LoadError(f"{src.version_dir}: not a folder transformers' AutoModel loads "
                        f"(what save_pretrained writes): {exc}") from None
    model = model.to(src.device).eval()
    return Opened(ByName(model, tuple(t.name for t in src.cfg.inputs)))


class ByName:
    """The model called with the batch's inputs as keywords, in the config's order: a
    transformers model's ``forward`` names them (``input_ids``, ``attention_mask``,
    ``token_type_ids``) and takes others positionally in an order of its own."""

    def __init__(self, model: Any, names: tuple[str, ...]) -> None:
        self.model = model
        self.names = names

    def __call__(self, *inputs: Any) -> Any:
        return self.model(**dict(zip(self.names, inputs)))
