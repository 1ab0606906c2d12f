"""The key/value caches of a causal LM's running sequences, one row each, in buffers that
are allocated once and written in place (models/causal_lm.py's batched decode).

Each layer's keys and values are a buffer ``[rows, heads, columns, head_dim]``; row r
holds sequence ``ids[r]``'s tokens at columns ``[0, lengths[r])``, and the rows in use
are the first ``len(ids)``. A decode step writes each row's new key and value at that
row's own length (one indexed write per layer) and attends over a view of the first
``max(lengths) + 1`` columns, each row masked to its own. Why not transformers'
``DynamicCache``: its ``update`` concatenates, so every step copies every layer's whole
cache into new memory (at batch 32 and 200 positions about 2/3 of a CPU decode step),
and a batch of caches of different lengths had to be left-padded to the longest and
rebuilt whenever one joined or left.

A sequence joins into the first free row (its own cache copied in), and one that leaves
is replaced by the last row (one row's copy), so no decode runs over an empty row and
nothing is repacked. The buffers double (rows or columns) when full.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers.cache_utils import Cache, DynamicLayer

Layers = list[tuple[torch.Tensor, torch.Tensor]]   # a cache: (keys, values) per layer


class Slab:
    """Sequences' caches as rows of preallocated buffers; see the module's text."""

    def __init__(self, like: Layers, rows: int, columns: int) -> None:
        # shaped as the first sequence's own cache: [1, heads, length, head_dim] a layer
        self.keys = [torch.zeros(rows, k.shape[1], columns, k.shape[3], dtype=k.dtype,
                                 device=k.device) for k, _ in like]
        self.values = [torch.zeros_like(k) for k in self.keys]
        self.ids: list[int] = []       # row r's sequence
        self.lengths: list[int] = []   # row r's tokens in the cache
        self.width = 0                 # columns a step's forward sees before its write
        self._at: tuple[torch.Tensor, torch.Tensor] | None = None   # a step's rows, columns
        self.cache = Cache(layers=[_SlabLayer(self, i) for i in range(len(like))])

    @property
    def rows(self) -> int:
        return self.keys[0].shape[0]

    @property
    def columns(self) -> int:
        return self.keys[0].shape[2]

    def add(self, seq_id: int, own: Layers) -> None:
        """A sequence's own cache into the first free row."""
        length = own[0][0].shape[2]
        self._grow(len(self.ids) + 1, length)
        row = len(self.ids)
        for (k, v), (own_k, own_v) in zip(zip(self.keys, self.values), own):
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

    def begin(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Set up one decode step of every row in use: answers its attention mask
        ``[rows, max(lengths) + 1]`` (each row's own positions and the new one) and its
        new token's position ids ``[rows, 1]`` (each row's length)."""
        device = self.keys[0].device
        self.width = max(self.lengths)
        self._grow(len(self.ids), self.width + 1)
        lengths = torch.tensor(self.lengths, device=device)
        self._at = (torch.arange(len(self.ids), device=device), lengths)
        return (torch.arange(self.width + 1, device=device)[None, :] <= lengths[:, None],
                lengths[:, None])

    def write(self, layer: int, keys: torch.Tensor, values: torch.Tensor
              ) -> tuple[torch.Tensor, torch.Tensor]:
        """The step's new keys and values ``[rows, heads, 1, head_dim]``, each row's at its
        own length; answers the columns the step attends over."""
        assert self._at is not None and keys.shape[2] == 1, "one token a row, after begin()"
        rows, at = self._at
        k, v = self.keys[layer], self.values[layer]
        k[rows, :, at] = keys[:, :, 0]
        v[rows, :, at] = values[:, :, 0]
        n = len(self.ids)
        return k[:n, :, :self.width + 1], v[:n, :, :self.width + 1]

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
        return self.slab.width
