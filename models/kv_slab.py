"""The key/value caches of a causal LM's running sequences, one row each, in buffers that
are allocated once and written in place (models/causal_lm.py's batched decode).

Each layer's keys and values are a buffer ``[rows, heads, columns, head_dim]``; row r
holds sequence ``ids[r]``'s tokens at columns ``[0, lengths[r])``, and the rows in use
are the first ``len(ids)``. Why not transformers' ``DynamicCache``: its ``update``
concatenates, so every step copies every layer's whole cache into new memory (at batch
32 and 200 positions about 2/3 of a CPU decode step), and a batch of caches of different
lengths had to be left-padded to the longest and rebuilt whenever one joined or left.

A forward over the slab feeds each row any number of tokens (a decode: one; a prefill's
chunk: its tokens; none), packed in one row of input ids, each with its own position id
(its column). The model attends through ``Slab.attend`` (an attention function
registered with transformers, ``use_slab_attention``): the one-token rows in one batched
attention over the columns up to the longest, each masked to its own, and each chunk
causally over its row. So a prefill's chunk rides in the decode's forward (Sarathi-Serve)
at the cost of its tokens, not of a forward of its own; padding the decode rows to the
chunk's length instead ([rows, T] with a 4D mask) computes T positions a row, measured on
a CPU at twice the cost of the two forwards apart.

A sequence joins into the first free row (its own cache copied in, or none), and one that
leaves is replaced by the last row (one row's copy), so no forward runs over an empty row
and nothing is repacked. The buffers double (rows or columns) when full.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.cache_utils import Cache, DynamicLayer
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

Layers = list[tuple[torch.Tensor, torch.Tensor]]   # a cache: (keys, values) per layer
# the attention implementation a model runs a slab's forward with (use_slab_attention),
# and the forward's keyword that names the slab
ATTENTION = "zeroserve_slab"


def use_slab_attention(model: Any) -> None:
    """The model attends through ``Slab.attend`` in a forward given ``zeroserve_slab=``
    a slab, and as with transformers' sdpa in any other forward (a prefill over its own
    cache). Only a model whose attention is transformers' AttentionInterface (GPT-2,
    Llama, most since transformers 4.48) can: another raises ``ValueError``."""
    if not getattr(model, "_supports_attention_backend", False):
        raise ValueError(f"{type(model).__name__} does not attend through transformers' "
                         f"AttentionInterface: its step cannot carry a prefill's chunk")
    AttentionInterface.register(ATTENTION, _attention)
    AttentionMaskInterface.register(ATTENTION, sdpa_mask)
    model.set_attn_implementation(ATTENTION)


def _attention(module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
               attention_mask: torch.Tensor | None, scaling: float | None = None,
               dropout: float = 0.0, **kwargs: Any) -> tuple[torch.Tensor, None]:
    slab = kwargs.pop(ATTENTION, None)
    if slab is None:
        out, _ = sdpa_attention_forward(module, query, key, value, attention_mask,
                                        dropout=dropout, scaling=scaling, **kwargs)
        return out, None
    return slab.attend(module.layer_idx, query, scaling), None


@dataclass
class _Plan:
    """One forward's tokens, as ``Slab.begin`` packed them."""
    rows: torch.Tensor                     # [N] each token's row
    columns: torch.Tensor                  # [N] its column (its position)
    # the rows that feed one token and their places in the input; None: every row in
    # use does, in its order (a decode alone)
    placed: tuple[torch.Tensor, torch.Tensor] | None
    any_single: bool                       # some row feeds one token
    runs: list[tuple[int, int, int, int]]  # (row, first place, tokens, length): chunks
    width: int                             # columns the one-token rows attend over
    mask: torch.Tensor                     # [rows, 1, 1, width] theirs
    feeds: list[int]                       # tokens each row feeds


class Slab:
    """Sequences' caches as rows of preallocated buffers; see the module's text."""

    def __init__(self, like: Layers, rows: int, columns: int) -> None:
        # shaped as the first sequence's own cache: [1, heads, length, head_dim] a layer
        self.keys = [torch.zeros(rows, k.shape[1], columns, k.shape[3], dtype=k.dtype,
                                 device=k.device) for k, _ in like]
        self.values = [torch.zeros_like(k) for k in self.keys]
        self.ids: list[int] = []       # row r's sequence
        self.lengths: list[int] = []   # row r's tokens in the cache
        self._plan: _Plan | None = None   # the forward begin() set up
        self.cache = Cache(layers=[_SlabLayer(self, i) for i in range(len(like))])

    @property
    def rows(self) -> int:
        return self.keys[0].shape[0]

    @property
    def columns(self) -> int:
        return self.keys[0].shape[2]

    def add(self, seq_id: int, own: Layers | None) -> None:
        """A sequence's own cache into the first free row (None: an empty row, whose
        prefill runs in the slab's forwards)."""
        length = own[0][0].shape[2] if own is not None else 0
        self._grow(len(self.ids) + 1, length)
        row = len(self.ids)
        for (k, v), (own_k, own_v) in zip(zip(self.keys, self.values), own or []):
            k[row, :, :length] = own_k[0]
            v[row, :, :length] = own_v[0]
        self.ids.append(seq_id)
        self.lengths.append(length)

    def take(self, seq_id: int, keep: bool) -> Layers | None:
        """A sequence out of its row (a copy of its cache where ``keep``); the last row
        moves into its place."""
        row = self.ids.index(seq_id)
        length = self.lengths[row]
        own = [(k[row:row + 1, :, :length].clone(), v[row:row + 1, :, :length].clone())
               for k, v in zip(self.keys, self.values)] if keep else None
        last = len(self.ids) - 1
        if row != last:
            moved = self.lengths[last]
            for k, v in zip(self.keys, self.values):
                k[row, :, :moved] = k[last, :, :moved]
                v[row, :, :moved] = v[last, :, :moved]
            self.ids[row], self.lengths[row] = self.ids[last], moved
        self.ids.pop()
        self.lengths.pop()
        return own

    def begin(self, feeds: list[int]) -> tuple[torch.Tensor, list[int]]:
        """Set up one forward in which row r feeds ``feeds[r]`` tokens (0: none; a
        decode: 1; a prefill's chunk: its tokens), packed in one row of the input, row
        by row. Answers their position ids ``[1, N]`` (row r's from its length on) and
        where each feeding row's last token is in the input (whose logits choose its
        next token)."""
        assert len(feeds) == len(self.ids), "a feed for each row in use"
        device = self.keys[0].device
        self._grow(len(self.ids), max(n + m for n, m in zip(self.lengths, feeds)))
        rows: list[int] = []
        columns: list[int] = []
        places: list[int] = []
        runs: list[tuple[int, int, int, int]] = []
        single: list[tuple[int, int]] = []
        for r, (length, n) in enumerate(zip(self.lengths, feeds)):
            if n == 1:
                single.append((r, len(rows)))
            elif n > 1:
                runs.append((r, len(rows), n, length))
            rows += [r] * n
            columns += range(length, length + n)
            if n:
                places.append(len(rows) - 1)
        positions = torch.tensor(columns, device=device)
        # the one-token rows attend in one batch over every row in use: a row that feeds
        # no token, or a chunk, has a query of zeros there that sees column 0 only (no
        # NaN), and its output is not read
        width = max((self.lengths[r] + 1 for r, _ in single), default=1)
        alone = len(single) == len(self.ids)   # a decode of every row: nothing to place
        if alone:
            bound = positions
        else:
            bound = torch.zeros(len(self.ids), dtype=torch.long, device=device)
            bound[[r for r, _ in single]] = torch.tensor(
                [self.lengths[r] for r, _ in single], dtype=torch.long, device=device)
        mask = torch.arange(width, device=device)[None, :] <= bound[:, None]
        self._plan = _Plan(
            torch.tensor(rows, device=device), positions,
            None if alone else (torch.tensor([r for r, _ in single], device=device),
                                torch.tensor([at for _, at in single], device=device)),
            bool(single), runs, width, mask[:, None, None, :], list(feeds))
        return positions[None, :], places

    def write(self, layer: int, keys: torch.Tensor, values: torch.Tensor
              ) -> tuple[torch.Tensor, torch.Tensor]:
        """The forward's new keys and values ``[1, heads, N, head_dim]``, packed as
        ``begin`` planned: each token's at its row's column."""
        plan = self._plan
        assert plan is not None and keys.shape[2] == len(plan.rows), "after begin()"
        self.keys[layer][plan.rows, :, plan.columns] = keys[0].transpose(0, 1)
        self.values[layer][plan.rows, :, plan.columns] = values[0].transpose(0, 1)
        return keys, values

    def attend(self, layer: int, query: torch.Tensor, scaling: float | None
               ) -> torch.Tensor:
        """The attention of the packed queries ``[1, heads, N, head_dim]``, each over its
        own row's columns: the one-token rows in one batch, each chunk causally over its
        row's cache and itself. Answers ``[1, N, heads, head_dim]``, as transformers'
        attention functions do."""
        plan = self._plan
        assert plan is not None, "after begin()"
        k, v = self.keys[layer], self.values[layer]
        n, heads = len(self.ids), query.shape[1]
        gqa = heads != k.shape[1]   # grouped keys (Llama's num_key_value_heads)
        q = query[0].transpose(0, 1)   # [N, heads, head_dim]
        if plan.placed is None:   # a decode alone: the packed order is the rows'
            return F.scaled_dot_product_attention(
                q[:, :, None], k[:n, :, :plan.width], v[:n, :, :plan.width],
                attn_mask=plan.mask, scale=scaling, enable_gqa=gqa)[:, :, 0][None]
        out = torch.empty_like(q)
        if plan.any_single:
            rows, places = plan.placed
            batch = q.new_zeros(n, heads, 1, q.shape[2])
            batch[rows] = q[places, :, None]
            got = F.scaled_dot_product_attention(
                batch, k[:n, :, :plan.width], v[:n, :, :plan.width], attn_mask=plan.mask,
                scale=scaling, enable_gqa=gqa)
            out[places] = got[rows, :, 0]
        for row, first, tokens, length in plan.runs:
            end = length + tokens
            causal = torch.arange(end, device=q.device)[None, :] <= \
                torch.arange(length, end, device=q.device)[:, None]
            got = F.scaled_dot_product_attention(
                query[:, :, first:first + tokens], k[row:row + 1, :, :end],
                v[row:row + 1, :, :end], attn_mask=causal, scale=scaling, enable_gqa=gqa)
            out[first:first + tokens] = got[0].transpose(0, 1)
        return out[None]

    def end(self) -> None:
        """The forward's tokens are in the cache: each row's length grows by its feed."""
        plan = self._plan
        assert plan is not None, "after begin()"
        self.lengths = [n + m for n, m in zip(self.lengths, plan.feeds)]
        self._plan = None

    def _grow(self, rows: int, columns: int) -> None:
        """Buffers of at least ``rows`` and ``columns``, doubled where too small (a copy
        of what is in use)."""
        if rows <= self.rows and columns <= self.columns:
            return
        new_rows = max(rows, self.rows * 2) if rows > self.rows else self.rows
        new_columns = max(columns, self.columns * 2) if columns > self.columns \
            else self.columns
        used, width = len(self.ids), max(self.lengths, default=0)
        for buffers in (self.keys, self.values):
            for i, old in enumerate(buffers):
                new = old.new_zeros(new_rows, old.shape[1], new_columns, old.shape[3])
                new[:used, :, :width] = old[:used, :, :width]
                buffers[i] = new

    def nbytes_of(self, seq_id: int) -> int:
        """The bytes of a sequence's cache, taken out (what ``take`` keeps)."""
        length = self.lengths[self.ids.index(seq_id)]
        return sum(k[0, :, :length].nbytes * 2 for k in self.keys)


class _SlabLayer(DynamicLayer):  # type: ignore[no-untyped-call]
    """One layer of transformers' cache interface over a slab: the model's attention
    hands it a step's keys and values and attends over what it answers."""

    def __init__(self, slab: Slab, layer: int) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.slab, self.layer = slab, layer
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any,
               **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        self.keys, self.values = self.slab.write(self.layer, key_states, value_states)
        return self.keys, self.values

    def get_seq_length(self) -> int:
        return max(self.slab.lengths, default=0)
