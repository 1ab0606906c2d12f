"""zeroserve's own step handler for a save_pretrained causal LM (models/causal_lm.py),
loaded as a worker loads it and driven by the worker's sequence table in-process:
requests of mixed prompt lengths join at different steps and leave at different
lengths, and each one's tokens equal ``model.generate(do_sample=False)`` in-process, token
for token (where the in-process top two logits lie within 1e-4, a flip is allowed and
named)."""

from __future__ import annotations

import dataclasses
import itertools
import shutil
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import pytest

from zeroserve.broker import protocol as p
from zeroserve.models.kv_slab import ATTENTION
from zeroserve.models.loader import LoadError, LoadedModel, load
from zeroserve.models.repository import load_config, parse_config
from zeroserve.workers.sequences import SequenceTable
from tests.conftest import short_tmpdir
from tests.lm import greedy, lm_config, prompt_ids, write_lm

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def lm() -> Iterator[tuple[Path, Any]]:
    repo = short_tmpdir("zslm")
    folder, tokenizer = write_lm(repo, most=6)
    yield folder, tokenizer
    shutil.rmtree(repo, ignore_errors=True)


def loaded_lm(folder: Path, prefill_tokens: int = 0, step_ratio: float = 0.0) -> LoadedModel:
    """The model as a worker loads it; ``prefill_tokens`` and ``step_ratio``: its config's
    ``sequences.prefill_tokens`` and ``sequences.step_ratio`` (0: not given, the default)."""
    cfg = dataclasses.replace(load_config(folder.parent), prefill_tokens=prefill_tokens,
                              step_ratio=step_ratio)
    return load(cfg, 1, folder, "cpu", lambda: 0)


def modeled_clock(loaded: LoadedModel, fixed: float, per_token: float) -> None:
    """The handler's clock made a model of the forwards' cost: each forward advances it by
    ``fixed`` and ``per_token`` for each token it feeds, so that the token budget of a
    decode that carries prefill (step_ratio) is the same at every run."""
    now = [0.0]

    def spend(_: Any, args: Any, kwargs: dict[str, Any]) -> None:
        now[0] += fixed + per_token * kwargs["input_ids"].shape[1]
    loaded.handler.model.register_forward_pre_hook(spend, with_kwargs=True)
    loaded.handler.clock = lambda: now[0]


class Drive:
    """A sequence table over the loaded model, its responses kept per request."""

    def __init__(self, loaded: LoadedModel) -> None:
        self.tokens: dict[str, list[int]] = {}
        self.errors: list[str] = []
        self.batch_ids = itertools.count(1)
        self.pauses: dict[int, dict[str, int]] = {}
        self.table = SequenceTable(loaded, self._emit, self._finish, lambda b: frozenset(),
                                   itertools.count(1), lambda b: self.pauses.pop(b, {}))

    def _emit(self, step: list[p.Partial]) -> None:
        for x in (x for part in step for x in part.parts):
            got = self.tokens.setdefault(x.item, [])
            if x.tensors:
                got.append(int(p.to_numpy(x.tensors[0]).reshape(-1)[0]))

    def _finish(self, batch: p.Batch, result: p.BatchResult, taken_ns: int) -> None:
        if result.error:
            self.errors.append(result.error)

    def join(self, rid: str, ids: list[int], max_tokens: int) -> int:
        item = p.BatchItem(rid, [p.from_numpy("input_ids", np.array([ids], np.int64)),
                                 p.from_numpy("max_tokens", np.array([[max_tokens]], np.int32))])
        batch_id = next(self.batch_ids)
        self.table.join(p.Batch(batch_id, "lm", 1, [item]), 0)
        return batch_id


def same_as_generate(folder: Path, ids: list[int], max_tokens: int, got: list[int]) -> str:
    """'' when ``got`` is what generate() makes, else why it may still be right."""
    want, gaps = greedy(folder, ids, max_tokens)
    if got == want:
        return ""
    at = next(i for i, (a, b) in enumerate(zip(got + [-1] * len(want), want)) if a != b)
    assert at < len(gaps) and gaps[at] < 1e-4, (
        f"prompt of {len(ids)} tokens: token {at} is {got[at:at + 3]} where generate() "
        f"has {want[at:at + 3]} (its top two logits {gaps[at]:.2e} apart)")
    return f"a near-tie flipped at token {at} (top two logits {gaps[at]:.1e} apart)"


@pytest.mark.parametrize("step_ratio", [0.0, 2.0], ids=["prefill-alone", "in-the-decode"])
def test_greedy_tokens_equal_generate_as_requests_join_and_leave(
        lm: tuple[Path, Any], step_ratio: float) -> None:
    """Requests join mid-stream, their prefills a forward of their own at the join, or
    (step_ratio 2) in chunks inside the running sequences' decode forward."""
    folder, tokenizer = lm
    drive = Drive(loaded_lm(folder, step_ratio=step_ratio))
    plan = [(4, 12), (37, 30), (9, 1), (120, 25), (16, 40), (63, 7), (5, 33), (88, 18),
            (23, 3), (2, 26)]   # (prompt length, max_tokens): mixed, more than 6 slots
    requests = {f"r{i}": (prompt_ids(tokenizer, i, n), m) for i, (n, m) in enumerate(plan)}
    pending = list(requests.items())
    step = 0
    while pending or drive.table.busy:
        # two requests arrive every third step: they join while others are mid-stream
        if step % 3 == 0:
            for rid, (ids, m) in pending[:2]:
                drive.join(rid, ids, m)
            pending = pending[2:]
        drive.table.step()
        # a sequence that left gave its row of the slab up: decodes run the running only
        slab = drive.table.loaded.handler._slab
        assert len(slab.ids if slab else []) <= drive.table.running, step
        step += 1
    assert not drive.errors
    notes = [note for rid, (ids, m) in requests.items()
             if (note := same_as_generate(folder, ids, m, drive.tokens[rid]))]
    assert len(notes) <= 1, notes   # a flip is rare; one is allowed, and named
    for rid, (_, m) in requests.items():
        assert 1 <= len(drive.tokens[rid]) <= m


@pytest.mark.parametrize("keep_bytes, prefill_tokens, step_ratio",
                         [(None, 0, 0.0), (0, 0, 0.0), (0, 70, 0.0), (0, 0, 2.0)],
                         ids=["kept", "recomputed", "recomputed-in-chunks",
                              "recomputed-in-the-decode"])
def test_paused_sequences_finish_with_the_tokens_they_had_unpaused(
        lm: tuple[Path, Any], keep_bytes: int | None, prefill_tokens: int,
        step_ratio: float) -> None:
    """Six sequences fill the slots; newcomers pause two of them at a time, mid-stream,
    and join at the next step; the paused ones resume (their caches kept, or dropped and
    prefilled again, at most 70 prompt tokens a step in the last case, behind the
    newcomers' prompts) and end with generate()'s tokens."""
    folder, tokenizer = lm
    loaded = loaded_lm(folder, prefill_tokens, step_ratio)
    loaded.handler.keep_bytes = keep_bytes
    # in the decode: the first chunk as long as the decode's time buys at the cost a
    # token had in a prefill of its own (the first prompt's 7 tokens and the fixed cost),
    # then at what one in the decode added (about 0.02 a token, a budget of about 50):
    # the first newcomers' tokens two steps after their arrival, the next ones' one step
    # (a prefill in the decode after the boundary they join at)
    modeled_clock(loaded, 1.0, 0.02)
    later = {"vip0": 2, "vip1": 2, "vip2": 1, "vip3": 1} if step_ratio else \
        dict.fromkeys(("vip0", "vip1", "vip2", "vip3"), 0)
    drive = Drive(loaded)
    plan = [(7, 40), (51, 36), (13, 44), (90, 30), (4, 38), (33, 42)]
    requests = {f"low{i}": (prompt_ids(tokenizer, i, n), m) for i, (n, m) in enumerate(plan)}
    batch_of = {rid: drive.join(rid, ids, m) for rid, (ids, m) in requests.items()}
    for rid in ("vip0", "vip1", "vip2", "vip3"):
        requests[rid] = (prompt_ids(tokenizer, 10 + len(requests), 20), 6)
    step, firsts, seen = 0, {}, {}
    while drive.table.busy or step < 12:
        if step in (3, 9):   # two newcomers take two slots, the sequences in them pause
            for k in (0, 1):
                vip = f"vip{k + (step == 9) * 2}"
                victim = f"low{k * 2 + (step == 9)}"
                drive.pauses[batch_of[victim]] = {victim: 0}
                drive.join(vip, *requests[vip])
                firsts[vip] = step
        drive.table.step()
        for vip in firsts:
            if drive.tokens.get(vip):
                seen.setdefault(vip, step)
        step += 1
    assert not drive.errors
    # joined at the boundary after it arrived: a token at once, or where its prefill
    # rides in the decodes, in the steps after
    assert {vip: seen[vip] - at for vip, at in firsts.items()} == later, (seen, firsts)
    notes = [note for rid, (ids, m) in requests.items()
             if (note := same_as_generate(folder, ids, m, drive.tokens[rid]))]
    assert len(notes) <= 1, notes
    if keep_bytes is None:
        assert loaded.handler._kept == 0   # every kept cache given back


# three short prompts that run long and three long ones that join mid-stream: (prompt
# tokens, max_tokens), and the step each joins at
MIXED_PLAN = {"short0": (5, 60), "short1": (12, 60), "short2": (9, 60),
              "long0": (120, 20), "long1": (37, 20), "long2": (64, 20)}
MIXED_ARRIVALS = {"short0": 0, "short1": 0, "short2": 0, "long0": 3, "long1": 3,
                  "long2": 12}


def mixed_requests(tokenizer: Any) -> dict[str, tuple[list[int], int]]:
    return {rid: (prompt_ids(tokenizer, i, n), m)
            for i, (rid, (n, m)) in enumerate(MIXED_PLAN.items())}


def test_prompts_longer_than_a_steps_prefill_join_a_running_batch_in_chunks(
        lm: tuple[Path, Any]) -> None:
    """prefill_tokens 16: three short sequences run; prompts of 37-120 tokens join
    mid-stream, two at once. No step prefills more than 16 prompt tokens, the running
    sequences answer a token at every step while the newcomers prefill, a newcomer's first
    token comes at the step its prompt's last chunk ran (the first joined first), and
    every stream equals generate() token for token."""
    folder, tokenizer = lm
    loaded = loaded_lm(folder, 16)
    prefilled: list[int] = []   # prompt tokens of each prefill forward (decodes pass a mask)

    def count(_: Any, args: Any, kwargs: dict[str, Any]) -> None:
        if kwargs.get("attention_mask") is None:
            prefilled.append(kwargs["input_ids"].shape[1])
    hook = loaded.handler.model.register_forward_pre_hook(count, with_kwargs=True)
    drive = Drive(loaded)
    requests = mixed_requests(tokenizer)
    arrive = MIXED_ARRIVALS
    firsts: dict[str, int] = {}
    try:
        for step in range(40):
            for rid, at in arrive.items():
                if at == step:
                    drive.join(rid, *requests[rid])
            before = {rid: len(t) for rid, t in drive.tokens.items()}
            prefilled.clear()
            drive.table.step()
            assert sum(prefilled) <= 16, (step, prefilled)
            for rid, got in drive.tokens.items():
                if got and rid not in firsts:
                    firsts[rid] = step
                if rid.startswith("short") and step > 0:   # never stalled by a prefill
                    assert len(got) == before.get(rid, 0) + 1, (rid, step)
        while drive.table.busy:
            drive.table.step()
    finally:
        hook.remove()
    assert not drive.errors
    # 16 prompt tokens a step, the first joined first: the short prompts over steps 0-1
    # (5 + 11, then 1 + 9); long0's 120 over steps 3-10 (16 x 7 + 8), long1's 37 behind
    # it over 10-12 (8 + 16 + 13), long2's 64 over 12-16 (3 + 16 x 3 + 13)
    assert firsts == {"short0": 0, "short1": 1, "short2": 1, "long0": 10, "long1": 12,
                      "long2": 16}, firsts
    notes = [note for rid, (ids, m) in requests.items()
             if (note := same_as_generate(folder, ids, m, drive.tokens[rid]))]
    assert len(notes) <= 1, notes   # a flip is rare; one is allowed, and named
    assert all(len(drive.tokens[rid]) == m for rid, (_, m) in requests.items())


def test_prefills_ride_in_the_decode_within_step_ratio_decodes(lm: tuple[Path, Any]) -> None:
    """step_ratio 2, each forward's cost modeled (1 + 0.02 a token it feeds): three short
    prompts join with nothing decoding and are prefilled whole at their join (a token at
    once); prompts of 37-120 tokens join mid-stream and ride in the decodes' forwards, each
    forward within twice its decodes' cost alone; the running sequences answer a token at
    every step, and every stream equals generate() token for token."""
    folder, tokenizer = lm
    loaded = loaded_lm(folder, step_ratio=2.0)
    forwards: list[tuple[int, int]] = []   # a slab forward's tokens, and its decodes

    def record(_: Any, args: Any, kwargs: dict[str, Any]) -> None:
        slab = kwargs.get(ATTENTION)
        if slab is not None:
            # a chunk feeds 2 tokens or more here (the budget is above 1 once measured)
            forwards.append((kwargs["input_ids"].shape[1], slab._plan.feeds.count(1)))
    loaded.handler.model.register_forward_pre_hook(record, with_kwargs=True)
    modeled_clock(loaded, 1.0, 0.02)
    drive = Drive(loaded)
    requests = mixed_requests(tokenizer)
    arrive = MIXED_ARRIVALS
    for step in range(40):
        for rid, at in arrive.items():
            if at == step:
                drive.join(rid, *requests[rid])
        before = {rid: len(t) for rid, t in drive.tokens.items()}
        drive.table.step()
        for rid in ("short0", "short1", "short2"):   # never stalled by a prefill
            assert len(drive.tokens[rid]) == before.get(rid, 0) + 1, (rid, step)
    while drive.table.busy:
        drive.table.step()
    assert not drive.errors
    carried = [(n, d) for n, d in forwards if n > d]
    assert sum(n - d for n, d in carried) >= 120 + 37 + 64 - 1   # (a 1-token chunk: a decode)
    for n, d in carried:
        assert 1 + 0.02 * n <= 2 * (1 + 0.02 * d) + 0.02, (n, d, forwards)
    notes = [note for rid, (ids, m) in requests.items()
             if (note := same_as_generate(folder, ids, m, drive.tokens[rid]))]
    assert len(notes) <= 1, notes   # a flip is rare; one is allowed, and named
    assert all(len(drive.tokens[rid]) == m for rid, (_, m) in requests.items())


def test_a_prompt_past_the_models_positions_fails_its_own_join(lm: tuple[Path, Any]) -> None:
    """A prompt of 600 tokens where the model has 512 positions, prefilled 256 a step: its
    join fails with the message, and the sequence running beside it ends with its tokens
    (the chunk past the positions would have failed a later step, and it with it)."""
    folder, tokenizer = lm
    drive = Drive(loaded_lm(folder, 256))
    ids = prompt_ids(tokenizer, 2, 9)
    drive.join("ok", ids, 12)
    drive.table.step()
    drive.join("long", prompt_ids(tokenizer, 1, 600), 5)
    while drive.table.busy:
        drive.table.step()
    assert len(drive.errors) == 1 and "prompt of 600 tokens" in drive.errors[0], drive.errors
    assert not same_as_generate(folder, ids, 12, drive.tokens["ok"])


def test_zero_max_tokens_is_an_empty_final_answer(lm: tuple[Path, Any]) -> None:
    folder, tokenizer = lm
    drive = Drive(loaded_lm(folder))
    drive.join("none", prompt_ids(tokenizer, 1, 5), 0)
    drive.table.step()
    assert drive.tokens == {"none": []} and not drive.table.busy


def test_a_config_that_does_not_fit_the_step_handler_is_refused(lm: tuple[Path, Any]) -> None:
    folder, _ = lm
    raw = lm_config()
    raw["outputs"] = [{"name": "logits", "datatype": "FP32", "shape": [-1]}]
    with pytest.raises(LoadError, match="token_id"):
        load(parse_config(raw, "test"), 1, folder, "cpu", lambda: 0)


@pytest.fixture(scope="module")
def sampling_lm(lm: tuple[Path, Any]) -> Iterator[LoadedModel]:
    folder, _ = lm
    raw = lm_config()
    raw["inputs"] += [{"name": "temperature", "datatype": "FP32", "shape": [1]},
                      {"name": "top_p", "datatype": "FP32", "shape": [1]},
                      {"name": "seed", "datatype": "INT64", "shape": [1]}]
    loaded = load(parse_config(raw, "test"), 1, folder, "cpu", lambda: 0)
    yield loaded
    loaded.release()


def sample(loaded: LoadedModel, asks: list[tuple[list[int], int, float, float, int]]
           ) -> tuple[dict[str, list[int]], list[str]]:
    """Each ask (ids, max_tokens, temperature, top_p, seed) joined at once, run to the end."""
    drive = Drive(loaded)
    for i, (ids, m, t, top, seed) in enumerate(asks):
        item = p.BatchItem(f"s{i}", [
            p.from_numpy("input_ids", np.array([ids], np.int64)),
            p.from_numpy("max_tokens", np.array([[m]], np.int32)),
            p.from_numpy("temperature", np.array([[t]], np.float32)),
            p.from_numpy("top_p", np.array([[top]], np.float32)),
            p.from_numpy("seed", np.array([[seed]], np.int64))])
        drive.table.join(p.Batch(next(drive.batch_ids), "lm", 1, [item]), 0)
    while drive.table.busy:
        drive.table.step()
    return drive.tokens, drive.errors


def test_a_seeded_sampled_request_repeats_and_temperature_0_is_greedy(
        lm: tuple[Path, Any], sampling_lm: LoadedModel) -> None:
    folder, tokenizer = lm
    ids = prompt_ids(tokenizer, 3, 21)
    alone, errors = sample(sampling_lm, [(ids, 30, 1.5, 0.9, 7)])
    # the same ask among others, in another batch of sequences: the same draws
    crowd, _ = sample(sampling_lm, [(prompt_ids(tokenizer, 5, 9), 30, 1.0, 1.0, 1),
                                    (ids, 30, 1.5, 0.9, 7), (ids, 30, 1.5, 0.9, 8),
                                    (ids, 30, 0.0, 1.0, 7)])
    assert not errors
    assert alone["s0"] == crowd["s1"]
    assert crowd["s2"] != crowd["s1"]           # another seed, other draws
    assert crowd["s3"] == greedy(folder, ids, 30)[0]
    assert crowd["s1"] != crowd["s3"]           # sampled is not greedy here


@pytest.mark.parametrize("temperature, top_p, says", [
    (-1.0, 1.0, "temperature must be 0"), (1.0, 0.0, "top_p must be above 0"),
    (1.0, 1.5, "top_p must be above 0")])
def test_bad_sampling_fails_the_join_with_a_message(
        lm: tuple[Path, Any], sampling_lm: LoadedModel, temperature: float, top_p: float,
        says: str) -> None:
    _, tokenizer = lm
    _, errors = sample(sampling_lm, [(prompt_ids(tokenizer, 1, 5), 3, temperature, top_p, 1)])
    assert len(errors) == 1 and says in errors[0]


def test_an_id_used_again_after_leave_starts_afresh(lm: tuple[Path, Any]) -> None:
    """A caller that numbers its sequences from 0 for each batch (a generator handler
    using the step code) gets each batch's own tokens, never the last batch's caches."""
    folder, tokenizer = lm
    steps = loaded_lm(folder).handler
    import torch

    def run(ids_by_seq: dict[int, list[int]], m: int) -> dict[int, list[int]]:
        states = {k: steps.join(k, {"input_ids": torch.tensor([ids]),
                                    "max_tokens": torch.tensor([[m]])})
                  for k, ids in ids_by_seq.items()}
        got: dict[int, list[int]] = {k: [] for k in states}
        with torch.inference_mode():
            while states:
                for k, (out, final) in steps.step(states).items():
                    got[k].append(int(out["token_id"][0, 0]))
                    if final:
                        del states[k]
                        steps.leave(k)
        return got
    first = {0: prompt_ids(tokenizer, 2, 8), 1: prompt_ids(tokenizer, 4, 30)}
    second = {0: prompt_ids(tokenizer, 6, 15), 1: prompt_ids(tokenizer, 7, 11)}
    run(first, 12)
    again = run(second, 12)
    assert again == {k: greedy(folder, ids, 12)[0] for k, ids in second.items()}
