"""Platform ``transformers`` with ``sequences``: a ``save_pretrained`` causal LM served as
an iterative model by zeroserve's own step handler, so that no ``model.py`` is written.

The version folder is what ``AutoModelForCausalLM``'s and the tokenizer's
``save_pretrained`` wrote. Each request is one sequence: its prompt's token ids
(``input_ids``, INT64, one row) and how many tokens it may generate (``max_tokens``);
each step answers one token (``token_id``, INT64), the last one final, at ``max_tokens``
or at the model's end token (which is sent, as ``generate`` returns it).

- ``join`` runs the prompt's prefill and keeps its key/value cache and the greedy next
  token: the first step answers it at once. A step prefills at most ``prefill_tokens``
  prompt tokens (chunked prefill, as vLLM's and Sarathi-Serve's): a longer prompt, or
  one that joins behind others still prefilling, goes on in chunks over its own cache at
  the next steps, the first joined first, and its first token is answered at the step
  its last chunk ran. A step then costs a decode and at most that many prompt tokens,
  so a joiner no longer stalls the running sequences for its whole prefill.
- With ``step_ratio`` R (``sequences.step_ratio``), a prefill that joins while sequences
  decode runs instead inside their decode's forward (Sarathi-Serve's stall-free batching;
  models/kv_slab.py packs both), in chunks of as many prompt tokens as keep that forward
  within R times a decode alone, both costs measured as the forwards run. Its first
  token is answered at the step after the forward its last chunk rode in. With nothing
  decoding, a prompt is prefilled whole at its join, as without R.
- ``step`` answers each sequence's token; ``advance``, which the sequence table calls once
  the step's tokens are sent, runs one batched decode of every sequence that goes on (a
  caller that never calls ``advance`` gets that decode at the start of the next ``step``).
  Their caches are the rows of one slab (models/kv_slab.py): buffers allocated once, a
  row per sequence, each decode writing every row's new key and value in place at its
  own length and attending over its own positions (an attention function of the slab's,
  so the model must attend through transformers' AttentionInterface: GPT-2, Llama). A
  sequence's cache moves into a row at its first decode (or, with ``step_ratio``, at its
  first chunk in a decode) and out when it leaves or pauses (one row's copy); nothing
  else is copied.
- ``pause`` takes a sequence out of the slab: its cache is copied out and kept while the
  paused caches fit ``keep_bytes`` (on a GPU, by default, what its free memory allows),
  else dropped, and ``resume`` rebuilds it with a prefill of its prompt and the tokens
  it generated (in chunks, as a joiner's). Either way it goes on with the token it had
  chosen.

Decoding is greedy (argmax), as ``model.generate(do_sample=False)``; float32 batching may
flip a near-tie, where the top two logits differ by less than the sums' rounding. A config
that adds ``temperature``, ``top_p`` and ``seed`` inputs samples instead, where a request's
temperature is above 0, with a generator of the sequence's own (seeded: the same request
draws the same tokens).
Torch and transformers are imported by the loader only (models/pretrained.py calls it).
"""

from __future__ import annotations

import inspect
import time
from dataclasses import dataclass
from typing import Any, Callable

import torch

from zeroserve.models.kv_slab import ATTENTION, Layers, Slab, use_slab_attention
from zeroserve.models.loader import LoadError, Opened, Source
from zeroserve.models.text import IDS

MAX_TOKENS = "max_tokens"   # INT32 or INT64 [1]: tokens a request may generate
TOKEN = "token_id"          # INT64 [1]: each step's token
# inputs a config may add, each then sent with every request: sampling instead of greedy
SAMPLING = {"temperature": ("FP32", (1,)),   # 0: greedy; above: softmax(logits / t)
            "top_p": ("FP32", (1,)),         # the smallest set of tokens of that mass
            "seed": ("INT64", (1,))}         # the sequence's own generator; none: random
# prompt tokens a step prefills at most where the config does not say
# (sequences.prefill_tokens): see CausalLMSteps
PREFILL_TOKENS = 512
# with step_ratio, one forward in this many runs its decodes alone: their time, measured
# again (see CausalLMSteps._budget)
REMEASURE = 16


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
    try:
        steps = CausalLMSteps(model.to(src.device).eval(),
                              src.cfg.prefill_tokens or PREFILL_TOKENS, src.cfg.step_ratio)
    except ValueError as exc:
        raise LoadError(f"{src.version_dir}: {exc}") from None
    return Opened(steps.step, handler=steps)


@dataclass
class _Seq:
    length: int              # tokens in its cache
    next_token: int          # the greedy token its last forward chose
    left: int                # tokens it may still answer
    layers: Layers | None    # its own cache; None while it has a row of the slab (or dropped)
    tokens: list[int]        # its prompt and what it sent: a dropped cache's prefill
    sent: int = 0
    chosen: bool = True      # next_token is not sent yet (False: the decode is due)
    dropped: bool = False    # paused with its cache let go: resume prefills it again
    todo: int = 0            # tokens[length:length + todo] are still to prefill
    cache: Any = None        # its cache while its prefill runs in chunks (then layers)
    temperature: float = 0.0
    top_p: float = 1.0
    generator: torch.Generator | None = None   # a sampled sequence's own


class CausalLMSteps:
    """The iterative contract (workers/sequences.py) over a transformers causal LM."""

    def __init__(self, model: Any, prefill_tokens: int = PREFILL_TOKENS,
                 step_ratio: float = 0.0, clock: Callable[[], float] | None = None) -> None:
        self.model = model
        use_slab_attention(model)
        # a forward over the slab takes a 4D mask as it is: the slab attends by its own
        # prompt tokens a step prefills at most: what a joiner adds to the running
        # sequences' step. Spent from the end of one step to the end of the next (the
        # joins and resumes of a step boundary, then the step itself)
        self.prefill_tokens = prefill_tokens
        self._left = prefill_tokens
        # sequences whose prefill is not done, the first joined first (a dict: ordered)
        self._prefilling: dict[int, None] = {}
        # where set (above 1): prefills go on in the decode's own forward, while any
        # sequence decodes, in chunks that keep that forward within step_ratio times a
        # decode alone (Sarathi-Serve's stall-free batching; see _budget). 0: a prefill
        # is a forward of its own, at the join, in chunks of prefill_tokens
        self.step_ratio = step_ratio
        # the forwards' cost: on a CPU the compute thread's own time, which the host's
        # other processes do not stretch; on a GPU the wall clock (the thread waits on the
        # device, which its CPU time does not count)
        self.device = next(model.parameters()).device
        self.clock = clock or (time.perf_counter if self.device.type == "cuda"
                               else time.thread_time)
        # a forward over the slab takes a 4D mask as it is: the slab attends by its own
        self._no_mask = torch.ones(1, 1, 1, 1, dtype=torch.bool, device=self.device)
        self._decode_s: float | None = None   # a decode forward's seconds (averaged)
        self._chunk_s = self._chunk_n = 0.0   # what prompt tokens added to it (averaged)
        self._in_decode = False   # those measured in a decode's forward (not alone)
        self._with_chunks = 0   # forwards with decodes and chunks since a decode alone
        self._advanced = False   # advance ran since the last step (its forward is done)
        eos = model.generation_config.eos_token_id
        self.eos = set(eos if isinstance(eos, list) else [] if eos is None else [eos])
        params = inspect.signature(model.forward).parameters
        # transformers 5 renamed past_key_values to cache
        self._cache_arg = "cache" if "cache" in params else "past_key_values"
        # the running sequences' caches; None while none is in it (its memory given back)
        self._slab: Slab | None = None
        # a prefill computes the logits of the prompt's last position only, where the
        # model's forward can (transformers 4.45 named it num_logits_to_keep)
        keep = next((k for k in ("logits_to_keep", "num_logits_to_keep") if k in params), None)
        self._last_only = {keep: 1} if keep else {}
        self._states: dict[int, _Seq] = {}
        # the positions the model has (GPT-2's learned ones; None where it does not say)
        self.context: int | None = getattr(model.config, "max_position_embeddings", None)
        # bytes of paused caches kept at most (None: on a GPU half its free memory, on a
        # CPU no bound); one over it is dropped and prefilled again on resume
        self.keep_bytes: int | None = None
        self._kept = 0
        self._paused: set[int] = set()

    def join(self, seq_id: int, inputs: dict[str, torch.Tensor]) -> _Seq:
        ids = inputs[IDS].reshape(1, -1).to(self.device, torch.long)
        if ids.shape[1] == 0:
            raise ValueError("a prompt of no tokens: nothing to continue")
        if self.context is not None and ids.shape[1] > self.context:
            # said here, with the request's own join: a chunk past the positions would
            # raise in a later step, and fail every sequence in it
            raise ValueError(f"a prompt of {ids.shape[1]} tokens; the model's context is "
                             f"{self.context}")
        left = int(inputs[MAX_TOKENS].reshape(-1)[0])
        # max_tokens 0 answers an empty final response at once: nothing to prefill
        seq = _Seq(0, 0, left, None, ids[0].tolist(), chosen=left <= 0,
                   todo=ids.shape[1] if left > 0 else 0)
        self._sampling(seq, inputs)
        self._states[seq_id] = seq
        if seq.todo:
            self._prefilling[seq_id] = None
            try:
                self._prefill()
            except Exception:   # its join fails: the table never steps it, nor lets it leave
                self.leave(seq_id)
                raise
        return seq

    def _prefill(self) -> None:
        """Chunks of the prefills not done, the first joined first, while this step has
        prompt tokens left. Each chunk goes on over the sequence's own cache; the last one
        of a joiner's prompt chooses its first token. Joiners go before resumed sequences
        (a sequence is paused for a request of a higher priority: the request it made
        room for must not wait behind its recompute)."""
        if self.step_ratio and self._slab is not None:
            return   # the slab's forwards carry the chunks (advance)
        for seq_id in sorted(self._prefilling, key=lambda i: self._states[i].sent > 0):
            if self._left <= 0:
                return
            if seq_id in self._paused:
                continue
            seq = self._states[seq_id]
            n = min(seq.todo, self._left)
            ids = torch.tensor([seq.tokens[seq.length:seq.length + n]], device=self.device)
            started = self.clock()
            out = self.model(input_ids=ids, use_cache=True, **self._last_only,
                             **({self._cache_arg: seq.cache} if seq.cache is not None else {}))
            self._learn(self.clock() - started, n, 0)
            seq.cache = self._cache_of(out)
            seq.length += n
            seq.todo -= n
            self._left -= n
            if seq.todo:
                return   # the step's tokens are spent
            del self._prefilling[seq_id]
            seq.layers, seq.cache = _layers(seq.cache), None
            if seq.sent == 0:   # a joiner (a resumed one goes on with the token it had)
                seq.next_token = self._choose(seq, out.logits[0, -1])
                seq.chosen = True

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
        self._prefilling.pop(seq_id, None)
        if seq_id in self._paused:
            self._paused.discard(seq_id)
            if seq is not None:
                self._kept -= _own_bytes(seq)
        self._let_go(seq_id)

    def _let_go(self, seq_id: int, keep: bool = False) -> Layers | None:
        """Its row of the slab given up (its cache copied out where ``keep``); the slab
        itself once empty."""
        slab = self._slab
        if slab is None or seq_id not in slab.ids:
            return None
        own = slab.take(seq_id, keep)
        if not slab.ids:
            self._slab = None
        return own

    def pause(self, seq_id: int) -> None:
        """It sits out the steps: its cache out of the slab, kept if it fits, else
        dropped (resume prefills it again)."""
        seq = self._states[seq_id]
        slab = self._slab
        if seq.layers is None and slab is not None and seq_id in slab.ids:
            size = slab.nbytes_of(seq_id)
            keep = self._may_keep(size)
            seq.layers = self._let_go(seq_id, keep)
            if keep:
                self._kept += size
            else:
                seq.dropped = True
        else:   # joined, never stepped (or mid-prefill): its own cache already
            self._kept += _own_bytes(seq)
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
            # its prompt and the tokens it sent but the last (which the next decode
            # feeds), prefilled again as a joiner's prompt is
            seq.todo, seq.length, seq.dropped = seq.length + seq.todo, 0, False
            self._prefilling[seq_id] = None
            self._prefill()
        else:
            self._kept -= _own_bytes(seq)

    def step(self, states: dict[int, _Seq]) -> dict[int, tuple[Any, bool]]:
        """Each sequence's chosen token, sent before the next decode runs (``advance``);
        a sequence whose decode is still due (no ``advance`` since its last token) gets
        it here first. The prefills not done go on with the prompt tokens the step's
        joins left; a sequence still prefilling is not answered."""
        if not self._advanced:
            self.advance(states)
        self._advanced = False
        self._prefill()
        self._left = self.prefill_tokens   # the next step's
        out: dict[int, tuple[Any, bool]] = {}
        for seq_id, seq in states.items():
            if seq.left <= 0:
                out[seq_id] = (None, True)
                continue
            if seq.todo:
                continue
            seq.sent += 1
            seq.tokens.append(seq.next_token)
            final = seq.sent >= seq.left or seq.next_token in self.eos
            out[seq_id] = ({TOKEN: torch.tensor([[seq.next_token]])}, final)
            seq.chosen = final
        return out

    def advance(self, states: dict[int, _Seq]) -> None:
        """One batched decode of the sequences whose last token is sent; where
        ``step_ratio`` is set, the chunks of the prefills not done ride in its forward."""
        self._advanced = True
        due = [seq_id for seq_id, seq in states.items() if not seq.chosen and not seq.todo]
        chunks = self._chunks(states, bool(due)) if due or self._slab is not None else []
        if due or chunks:
            self._forward(due, chunks, states)

    def _chunks(self, states: dict[int, _Seq], decoding: bool) -> list[tuple[int, int]]:
        """The prefills' chunks a slab forward carries (``step_ratio`` set): the first
        joined first, within the token budget (``_budget`` while sequences decode, else
        ``prefill_tokens``)."""
        if not self.step_ratio:
            return []
        left = self._budget() if decoding else self.prefill_tokens
        chunks = []
        for seq_id in sorted(self._prefilling, key=lambda i: self._states[i].sent > 0):
            if left <= 0:
                break
            if seq_id in self._paused or seq_id not in states:
                continue
            n = min(self._states[seq_id].todo, left)
            chunks.append((seq_id, n))
            left -= n
        return chunks

    def _budget(self) -> int:
        """Prompt tokens a forward with decodes may carry so that it lasts at most
        ``step_ratio`` decodes alone: a decode's time over a prompt token's, both
        measured as the forwards run (``_learn``). None where a decode alone is due: the
        first, and one in every ``REMEASURE`` (the decode's time moves with its rows and
        their lengths, and chunks may ride in every forward for long)."""
        if self._decode_s is None or self._with_chunks >= REMEASURE:
            return 0
        if not self._chunk_n:
            return 1   # no prompt token measured yet: one, which measures
        per_token = max(self._chunk_s, 0.0) / self._chunk_n or 1e-9
        room = (self.step_ratio - 1.0) * self._decode_s / per_token
        return max(1, min(self.prefill_tokens, int(room)))

    def _learn(self, seconds: float, tokens: int, decodes: int) -> None:
        """A forward's time: a decode alone's (averaged), or what its ``tokens`` of prompt
        added to the decode's (sums averaged: large chunks weigh more than the noise of
        small ones). A prefill of its own gives the first estimate of a token's cost, an
        overestimate (its forward's fixed cost in it) that the first chunk in a decode
        replaces."""
        a = 0.2
        self._with_chunks = self._with_chunks + 1 if tokens and decodes else 0
        if not tokens:
            self._decode_s = seconds if self._decode_s is None else \
                (1 - a) * self._decode_s + a * seconds
        elif decodes and self._decode_s is not None:
            added = seconds - self._decode_s
            if not self._in_decode:
                self._chunk_s, self._chunk_n, self._in_decode = added, float(tokens), True
            else:
                self._chunk_s = (1 - a) * self._chunk_s + a * added
                self._chunk_n = (1 - a) * self._chunk_n + a * tokens
        elif not decodes and not self._chunk_n:
            self._chunk_s, self._chunk_n = seconds, float(tokens)

    def _forward(self, due: list[int], chunks: list[tuple[int, int]],
                 states: dict[int, _Seq]) -> None:
        """One forward over the slab: a token of each sequence in ``due`` and the
        ``chunks``' prompt tokens, packed in one row (models/kv_slab.py)."""
        slab = self._slab
        fed = {seq_id: 1 for seq_id in due}
        fed.update(chunks)
        for seq_id in fed:   # newcomers (joined, resumed, prefilling) move into rows
            seq = states[seq_id]
            own = seq.layers if seq.layers is not None else \
                _layers(seq.cache) if seq.cache is not None else None
            if slab is None:
                assert own is not None, "a slab begins with a decoding sequence's cache"
                length = max(states[i].length for i in fed)
                # room for most of the sequences' growth before the first doubling
                slab = self._slab = Slab(own, len(fed), 2 * length + 64)
            if seq_id not in slab.ids:
                slab.add(seq_id, own)
                seq.layers = seq.cache = None
        assert slab is not None, "a forward of sequences"
        feeds = [fed.get(seq_id, 0) for seq_id in slab.ids]
        tokens = [t for seq_id in slab.ids if seq_id in fed for t in self._feed(
            states[seq_id], fed[seq_id], seq_id in due)]
        positions, places = slab.begin(feeds)
        keep = torch.tensor(places, device=self.device)   # each row's last token's logits
        started = self.clock()
        out = self.model(input_ids=torch.tensor([tokens], device=self.device),
                         position_ids=positions, attention_mask=self._no_mask,
                         use_cache=True, logits_to_keep=keep,
                         **{self._cache_arg: slab.cache, ATTENTION: slab})
        slab.end()
        logits = out.logits[0]
        greedy = logits.argmax(dim=-1).tolist()
        self._learn(self.clock() - started, sum(n for _, n in chunks), len(due))
        for at, seq_id in enumerate(i for i in slab.ids if i in fed):
            seq = states[seq_id]
            seq.length += fed[seq_id]
            if seq_id not in due:   # a chunk of its prefill
                seq.todo -= fed[seq_id]
                if seq.todo or seq.sent:   # more to come, or a resumed one's token kept
                    if not seq.todo:
                        del self._prefilling[seq_id]
                    continue
                del self._prefilling[seq_id]
            seq.chosen = True
            seq.next_token = greedy[at] if seq.generator is None else \
                self._choose(seq, logits[at])

    @staticmethod
    def _feed(seq: _Seq, n: int, decode: bool) -> list[int]:
        """A sequence's tokens in a forward: its chosen one (a decode), else its prompt's
        next ``n``."""
        return [seq.next_token] if decode else seq.tokens[seq.length:seq.length + n]

    def _cache_of(self, out: Any) -> Any:
        return getattr(out, self._cache_arg)


def _nbytes(layers: Layers) -> int:
    return sum(k.nbytes + v.nbytes for k, v in layers)


def _own_bytes(seq: _Seq) -> int:
    """The bytes of a sequence's cache out of the slab (a prefill's cache so far)."""
    if seq.layers is not None:
        return _nbytes(seq.layers)
    return _nbytes(_layers(seq.cache)) if seq.cache is not None else 0


def _layers(cache: Any) -> Layers:
    return [(layer.keys, layer.values) for layer in cache.layers]
