"""Platform ``transformers`` with ``sequences``: a ``save_pretrained`` causal LM served as
an iterative model by zeroserve's own step handler, so that no ``model.py`` is written.

The version folder is what ``AutoModelForCausalLM``'s and the tokenizer's
``save_pretrained`` wrote. Each request is one sequence: its prompt's token ids
(``input_ids``, INT64, one row) and how many tokens it may generate (``max_tokens``);
each step answers one token (``token_id``, INT64), the last one final, at ``max_tokens``
or at the model's end token (which is sent, as ``generate`` returns it).

- ``join`` runs the prompt's prefill and keeps its key/value cache and the greedy next
  token: the first step answers it at once.
- ``step`` answers each sequence's token, then runs one batched decode of every sequence
  that goes on. Their caches are packed into one batch, left-padded to the longest, with
  an attention mask over each one's own positions and its own position ids; the pack is
  kept while the same sequences step on (a column more per step) and rebuilt from each
  sequence's own cache when one joins or leaves.
- ``pause`` takes a sequence out of the pack: its cache is copied out and kept while the
  paused caches fit ``keep_bytes`` (on a GPU, by default, what its free memory allows),
  else dropped, and ``resume`` rebuilds it with one prefill of its prompt and the tokens
  it generated. Either way it goes on with the token it had chosen.

Decoding is greedy (argmax), as ``model.generate(do_sample=False)``; float32 batching may
flip a near-tie, where the top two logits differ by less than the sums' rounding. A config
that adds ``temperature``, ``top_p`` and ``seed`` inputs samples instead, where a request's
temperature is above 0, with a generator of the sequence's own (seeded: the same request
draws the same tokens).
Torch and transformers are imported by the loader only (models/pretrained.py calls it).
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any

import torch

from zeroserve.models.loader import LoadError, Opened, Source
from zeroserve.models.text import IDS

MAX_TOKENS = "max_tokens"   # INT32 or INT64 [1]: tokens a request may generate
TOKEN = "token_id"          # INT64 [1]: each step's token
# inputs a config may add, each then sent with every request: sampling instead of greedy
SAMPLING = {"temperature": ("FP32", (1,)),   # 0: greedy; above: softmax(logits / t)
            "top_p": ("FP32", (1,)),         # the smallest set of tokens of that mass
            "seed": ("INT64", (1,))}         # the sequence's own generator; none: random
Layers = list[tuple[torch.Tensor, torch.Tensor]]   # a cache: (keys, values) per layer


def check_signature(src: Source) -> None:
    """The inputs and output the step handler reads and answers, as the config declares."""
    cfg = src.cfg
    got = {t.name: (t.datatype, t.shape) for t in cfg.inputs}
    want = {IDS: {("INT64", (-1,))}, MAX_TOKENS: {("INT32", (1,)), ("INT64", (1,))},
            **{name: {spec} for name, spec in SAMPLING.items() if name in got}}
    outs = {t.name: (t.datatype, t.shape) for t in cfg.outputs}
    if set(got) != set(want) or any(got[k] not in v for k, v in want.items()) or \
            outs != {TOKEN: ("INT64", (1,))} or cfg.max_batch_size <= 0:
        raise LoadError(
            f"{cfg.name}: a transformers causal LM with sequences takes inputs "
            f"{IDS!r} (INT64 [-1]) and {MAX_TOKENS!r} (INT32 or INT64 [1]), and any of "
            f"temperature and top_p (FP32 [1]) and seed (INT64 [1]), answers output "
            f"{TOKEN!r} (INT64 [1]), with max_batch_size > 0; the config declares inputs "
            f"{got} and outputs {outs}")


def load_causal_lm(src: Source, transformers: Any, dtype_arg: str) -> Opened:
    check_signature(src)
    try:
        model = transformers.AutoModelForCausalLM.from_pretrained(
            str(src.version_dir), **{dtype_arg: "auto"})
    except (OSError, ValueError, KeyError) as exc:
        raise LoadError(f"{src.version_dir}: not a folder transformers' "
                        f"AutoModelForCausalLM loads (what save_pretrained writes): "
                        f"{exc}") from None
    steps = CausalLMSteps(model.to(src.device).eval())
    return Opened(steps.step, handler=steps)


@dataclass
class _Seq:
    length: int              # tokens in its cache
    next_token: int          # the greedy token its last forward chose
    left: int                # tokens it may still answer
    layers: Layers | None    # its own cache; None while it lives in the pack (or dropped)
    tokens: list[int]        # its prompt and what it sent: a dropped cache's prefill
    sent: int = 0
    dropped: bool = False    # paused with its cache let go: resume prefills it again
    temperature: float = 0.0
    top_p: float = 1.0
    generator: torch.Generator | None = None   # a sampled sequence's own


@dataclass
class _Pack:
    """The caches of the sequences that stepped together last, one batch."""

    rows: list[int | None]                   # each row's sequence; None: a row let go
    cache: Any
    mask: torch.Tensor                       # [batch, positions]: 1 where a token is
    width: int                               # positions, padding included


class CausalLMSteps:
    """The iterative contract (workers/sequences.py) over a transformers causal LM."""

    def __init__(self, model: Any) -> None:
        self.model = model
        self.device = next(model.parameters()).device
        eos = model.generation_config.eos_token_id
        self.eos = set(eos if isinstance(eos, list) else [] if eos is None else [eos])
        params = inspect.signature(model.forward).parameters
        # transformers 5 renamed past_key_values to cache
        self._cache_arg = "cache" if "cache" in params else "past_key_values"
        self._pack: _Pack | None = None
        self._states: dict[int, _Seq] = {}
        # bytes of paused caches kept at most (None: on a GPU half its free memory, on a
        # CPU no bound); one over it is dropped and prefilled again on resume
        self.keep_bytes: int | None = None
        self._kept = 0
        self._paused: set[int] = set()

    def join(self, seq_id: int, inputs: dict[str, torch.Tensor]) -> _Seq:
        ids = inputs[IDS].reshape(1, -1).to(self.device, torch.long)
        if ids.shape[1] == 0:
            raise ValueError("a prompt of no tokens: nothing to continue")
        seq = _Seq(ids.shape[1], 0, int(inputs[MAX_TOKENS].reshape(-1)[0]), None,
                   ids[0].tolist())
        self._sampling(seq, inputs)
        out = self.model(input_ids=ids, use_cache=True)
        seq.layers = _layers(self._cache_of(out))
        seq.next_token = self._choose(seq, out.logits[0, -1])
        self._states[seq_id] = seq
        return seq

    def _sampling(self, seq: _Seq, inputs: dict[str, torch.Tensor]) -> None:
        def given(name: str) -> float | None:
            value = inputs.get(name)
            return None if value is None else float(value.reshape(-1)[0])
        temperature, top_p, seed = given("temperature"), given("top_p"), given("seed")
        if temperature is not None and not temperature >= 0.0:
            raise ValueError(f"temperature must be 0 (greedy) or more, got {temperature}")
        if not temperature:
            return   # greedy: top_p and seed play no part
        if top_p is not None and not 0.0 < top_p <= 1.0:
            raise ValueError(f"top_p must be above 0 and at most 1, got {top_p}")
        seq.temperature, seq.top_p = temperature, top_p or 1.0
        seq.generator = torch.Generator(device=self.device)
        if seed is None:
            seq.generator.seed()
        else:
            seq.generator.manual_seed(int(seed))

    @staticmethod
    def _choose(seq: _Seq, logits: torch.Tensor) -> int:
        """The next token: argmax, or drawn with the sequence's own generator from the
        tempered distribution cut to its top_p mass (the first token always kept)."""
        if seq.generator is None:
            return int(logits.argmax())
        probs = torch.softmax(logits.float() / seq.temperature, dim=-1)
        if seq.top_p < 1.0:
            ranked, order = probs.sort(descending=True)
            keep = ranked.cumsum(0) - ranked < seq.top_p
            probs = torch.zeros_like(probs).scatter(0, order[keep], ranked[keep])
        return int(torch.multinomial(probs, 1, generator=seq.generator))

    def leave(self, seq_id: int) -> None:
        seq = self._states.pop(seq_id, None)
        if seq_id in self._paused:
            self._paused.discard(seq_id)
            if seq is not None and seq.layers is not None:
                self._kept -= _nbytes(seq.layers)
        self._let_go(seq_id)

    def _let_go(self, seq_id: int) -> None:
        pack = self._pack
        if pack is not None and seq_id in pack.rows:   # its row is let go, its id free
            pack.rows[pack.rows.index(seq_id)] = None

    def pause(self, seq_id: int) -> None:
        """It sits out the steps: its cache out of the pack, kept if it fits, else
        dropped (resume prefills it again)."""
        seq = self._states[seq_id]
        pack = self._pack
        if seq.layers is None and pack is not None and seq_id in pack.rows:
            row, start = pack.rows.index(seq_id), pack.width - seq.length
            own = [(k[row:row + 1, :, start:], v[row:row + 1, :, start:])
                   for k, v in _layers(pack.cache)]
            size = _nbytes(own)
            if self._may_keep(size):
                # a copy: the pack's row is written over by the next sequence that joins
                seq.layers = [(k.clone(), v.clone()) for k, v in own]
                self._kept += size
            else:
                seq.dropped = True
            self._let_go(seq_id)
        elif seq.layers is not None:
            self._kept += _nbytes(seq.layers)   # joined, never stepped: its own already
        self._paused.add(seq_id)

    def _may_keep(self, size: int) -> bool:
        if self.keep_bytes is not None:
            return self._kept + size <= self.keep_bytes
        if self.device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(self.device)
            return size <= free // 2
        return True

    def resume(self, seq_id: int) -> None:
        seq = self._states[seq_id]
        self._paused.discard(seq_id)
        if seq.dropped:
            # its prompt and the tokens it sent but the last (which the next decode feeds)
            ids = torch.tensor([seq.tokens[:seq.length]], device=self.device)
            seq.layers = _layers(self._cache_of(self.model(input_ids=ids, use_cache=True)))
            seq.dropped = False
        elif seq.layers is not None:
            self._kept -= _nbytes(seq.layers)

    def step(self, states: dict[int, _Seq]) -> dict[int, tuple[Any, bool]]:
        out: dict[int, tuple[Any, bool]] = {}
        going = []
        for seq_id, seq in states.items():
            if seq.left <= 0:
                out[seq_id] = (None, True)
                continue
            seq.sent += 1
            seq.tokens.append(seq.next_token)
            final = seq.sent >= seq.left or seq.next_token in self.eos
            out[seq_id] = ({TOKEN: torch.tensor([[seq.next_token]])}, final)
            if not final:
                going.append(seq_id)
        if going:
            self._decode(going, states)
        return out

    def _decode(self, ids: list[int], states: dict[int, _Seq]) -> None:
        pack = self._fit(ids, states)
        rows = pack.rows
        # a row let go still runs (its output unread) until a repack drops it: cheaper
        # than copying every cache each time a sequence leaves
        tokens = torch.tensor([[states[i].next_token if i is not None else 0] for i in rows],
                              device=self.device)
        positions = torch.tensor([[states[i].length if i is not None else 0] for i in rows],
                                 device=self.device)
        mask = torch.cat([pack.mask, torch.ones(len(rows), 1, dtype=pack.mask.dtype,
                                                device=self.device)], dim=1)
        out = self.model(input_ids=tokens, attention_mask=mask, position_ids=positions,
                         use_cache=True, **{self._cache_arg: pack.cache})
        logits = out.logits[:, -1]
        greedy = logits.argmax(dim=-1).tolist()
        for row, seq_id in enumerate(rows):
            if seq_id is None:
                continue
            seq = states[seq_id]
            seq.length += 1
            seq.next_token = greedy[row] if seq.generator is None else \
                self._choose(seq, logits[row])
        self._pack = _Pack(rows, self._cache_of(out), mask, pack.width + 1)

    def _fit(self, ids: list[int], states: dict[int, _Seq]) -> _Pack:
        """The pack whose live rows are ``ids``: the last one, its rows of sequences gone
        let go and newcomers written into such rows where they fit (one row's copy);
        else a new one, as one is once half its rows are let go or its width (which grows
        a position a step) is over twice its longest sequence."""
        pack = self._pack
        if pack is None:
            return self._repack(ids, states)
        going = set(ids)
        rows = [i if i in going else None for i in pack.rows]
        placed = set(rows)
        new = [i for i in ids if i not in placed]
        free = [r for r, i in enumerate(rows) if i is None]
        longest = max(states[i].length for i in ids)
        if len(new) > len(free) or (len(free) - len(new)) * 2 > len(rows) or \
                longest > pack.width or pack.width > 2 * longest:
            return self._repack(ids, states)   # no room, half idle, or mostly padding
        layers = _layers(pack.cache)
        for seq_id, row in zip(new, free):
            seq = states[seq_id]
            start = pack.width - seq.length
            for (k, v), (own_k, own_v) in zip(layers, _own(seq)):
                k[row].zero_()
                v[row].zero_()
                k[row, :, start:] = own_k[0]
                v[row, :, start:] = own_v[0]
            pack.mask[row].zero_()
            pack.mask[row, start:] = 1
            rows[row] = seq_id
            seq.layers = None   # it lives in the pack from now on
        pack.rows = rows
        return pack

    def _repack(self, ids: list[int], states: dict[int, _Seq]) -> _Pack:
        """The sequences' own caches, left-padded into one batch; those of the old pack
        taken out of it first (a sequence that left is dropped with it)."""
        old = self._pack
        if old is not None:
            layers = _layers(old.cache)
            for row, seq_id in enumerate(old.rows):
                seq = self._states.get(seq_id) if seq_id is not None else None
                if seq is not None and seq.layers is None:
                    start = old.width - seq.length
                    seq.layers = [(k[row:row + 1, :, start:], v[row:row + 1, :, start:])
                                  for k, v in layers]
        width = max(states[i].length for i in ids)
        mask = torch.zeros(len(ids), width, dtype=torch.long, device=self.device)
        packed: Layers = []
        for layer in range(len(_own(states[ids[0]]))):
            keys, values = [], []
            for seq_id in ids:
                k, v = _own(states[seq_id])[layer]
                pad = width - k.shape[2]
                keys.append(torch.nn.functional.pad(k, (0, 0, pad, 0)))
                values.append(torch.nn.functional.pad(v, (0, 0, pad, 0)))
            packed.append((torch.cat(keys), torch.cat(values)))
        for row, seq_id in enumerate(ids):
            seq = states[seq_id]
            mask[row, width - seq.length:] = 1
            seq.layers = None   # it lives in the pack from now on
        from transformers import DynamicCache
        rows: list[int | None] = list(ids)
        return _Pack(rows, DynamicCache(ddp_cache_data=packed), mask, width)

    def _cache_of(self, out: Any) -> Any:
        return getattr(out, self._cache_arg)


def _own(seq: _Seq) -> Layers:
    assert seq.layers is not None, "a sequence outside the pack has its own cache"
    return seq.layers


def _nbytes(layers: Layers) -> int:
    return sum(k.nbytes + v.nbytes for k, v in layers)


def _layers(cache: Any) -> Layers:
    return [(layer.keys, layer.values) for layer in cache.layers]
