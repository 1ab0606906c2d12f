"""A text model's answer (models/text.py): the model's hidden states pooled over the
attention mask into one vector a row, normalized where the config says.

The batch ran padded to its longest row: pooling reads only each row's own positions
(those its mask marks), so a row's vector is the same whatever it was batched with.
"""

from __future__ import annotations

from typing import Any

import torch

from zeroserve.models.text import TextConfig

__all__ = ["PoolingError", "hidden_of", "pool"]


class PoolingError(ValueError):
    """The model answered something that cannot be pooled; the message says what."""


def hidden_of(text: TextConfig, out: Any) -> torch.Tensor:
    """The output to pool: ``text.output`` of a model answering by name (a handler's dict,
    transformers' ModelOutput), else the model's first output (a traced BertModel's tuple
    starts with its last hidden state, as a ModelOutput does)."""
    if isinstance(out, dict):
        if text.output:
            if text.output not in out:
                raise PoolingError(f"text.output {text.output!r} is not among the model's "
                                   f"outputs {sorted(out)}")
            out = out[text.output]
        elif out:
            out = next(iter(out.values()))
    elif text.output:
        raise PoolingError(f"text.output {text.output!r} names an output, but the model "
                           f"answers {type(out).__name__}, whose outputs have no names: "
                           f"leave text.output out (its first output is pooled)")
    elif isinstance(out, (tuple, list)) and out:
        out = out[0]
    if not isinstance(out, torch.Tensor) or out.dim() not in (2, 3):
        what = f"a tensor of shape {list(out.shape)}" if isinstance(out, torch.Tensor) \
            else type(out).__name__
        raise PoolingError(f"the output pooled must be hidden states [rows, length, hidden] "
                           f"(or vectors [rows, hidden]), got {what}")
    return out


def pool(text: TextConfig, out: Any, mask: torch.Tensor,
         cu_seqlens: torch.Tensor | None = None) -> torch.Tensor:
    """One FP32 vector a row of ``mask`` ([rows, length], 1 where a token is the row's
    own): the mean over its tokens, its first token (CLS) or its last one. A model that
    answers vectors already ([rows, hidden]) is only normalized. A packed batch
    (workers/packing.py): hidden states and mask of one row [1, total], cut into rows
    by ``cu_seqlens``."""
    hidden = hidden_of(text, out).float()
    if cu_seqlens is not None and hidden.dim() == 3:
        hidden, mask = _unpacked(hidden, mask, cu_seqlens)
    if hidden.shape[0] != mask.shape[0]:
        raise PoolingError(f"the model answered {hidden.shape[0]} rows for a batch of "
                           f"{mask.shape[0]}")
    if hidden.dim() == 3:
        if hidden.shape[1] != mask.shape[1]:
            raise PoolingError(f"the model answered {hidden.shape[1]} positions for "
                               f"inputs of length {mask.shape[1]}")
        hidden = _pooled(text.pooling, hidden, mask.to(hidden.device))
    if text.normalize:
        hidden = torch.nn.functional.normalize(hidden, p=2.0, dim=1)
    return hidden


def _pooled(how: str, hidden: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    if how == "cls":
        return hidden[:, 0]
    weights = mask.to(hidden.dtype)
    if how == "last":
        # the position of each row's last marked token (a row with none: its first)
        positions = torch.arange(mask.shape[1], device=mask.device)
        last = (positions * (mask != 0)).argmax(dim=1)
        return hidden[torch.arange(hidden.shape[0], device=hidden.device), last]
    summed = (hidden * weights.unsqueeze(-1)).sum(dim=1)
    return summed / weights.sum(dim=1, keepdim=True).clamp(min=1.0)


def _unpacked(hidden: torch.Tensor, mask: torch.Tensor, cu_seqlens: torch.Tensor
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """A packed row's segments as rows padded to the longest, with their mask."""
    total = int(cu_seqlens[-1])
    if hidden.shape[0] != 1 or hidden.shape[1] != total:
        raise PoolingError(f"the hidden states of a packed batch must be [1, {total}, "
                           f"hidden], got {list(hidden.shape)}")
    lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).tolist()
    pad = torch.nn.utils.rnn.pad_sequence
    return (pad(list(hidden[0].split(lengths)), batch_first=True),
            pad(list(mask.reshape(-1).to(hidden.device).split(lengths)), batch_first=True))
