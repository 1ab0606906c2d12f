"""The worker's sequence table (workers/sequences.py), in-process with real torch: requests
join at step boundaries up to ``sequences.max``, each step's responses go out as one
PARTIAL per join, a stopped sequence leaves at the next step, a join's RESULT follows its
last request, and the handler contract is checked with a message."""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from zeroserve.broker import protocol as p
from zeroserve.models.loader import LoadedModel
from zeroserve.models.repository import ConfigError, parse_config
from zeroserve.workers.sequences import PREEMPTOR_WAIT_NS, SequenceTable
from tests.conftest import linear_config
from tests.lm import lm_config


class Counter:
    """Counts each sequence up to its input's first value; answers [count, step, running]."""

    def __init__(self) -> None:
        self.steps = 0
        self.joined: list[Any] = []
        self.left: list[Any] = []
        self.fail_step: int | None = None

    def join(self, seq_id: int, inputs: dict[str, torch.Tensor]) -> dict[str, int]:
        x = inputs["input"]
        assert x.shape == (1, 4)
        if float(x[0, 1]) == -2.0:
            raise ValueError("refused on purpose")
        self.joined.append(seq_id)
        return {"left": int(x[0, 0]), "sent": 0}

    def step(self, states: dict[int, dict[str, int]]) -> dict[int, Any]:
        self.steps += 1
        if self.steps == self.fail_step:
            raise RuntimeError("step failed on purpose")
        out = {}
        for seq_id, st in states.items():
            if st["left"] == 0:
                out[seq_id] = (None, True)
                continue
            st["sent"] += 1
            out[seq_id] = ({"output": torch.tensor([[st["sent"], self.steps, len(states)]],
                                                   dtype=torch.float32)},
                           st["sent"] >= st["left"])
        return out

    def leave(self, seq_id: int) -> None:
        self.left.append(seq_id)


def config(most: int = 2) -> Any:
    return parse_config({**linear_config("c", mbs=8), "platform": "python",
                         "sequences": {"max": most}}, "test")


class Rig:
    def __init__(self, most: int = 2, handler: Any = None) -> None:
        self.handler = handler or Counter()
        loaded = LoadedModel("c", 1, config(most), "0" * 64, self.handler.step, "cpu",
                             handler=self.handler, version_dir=Path("/nonexistent"))
        self.parts: list[tuple[int, str, bool, list[float]]] = []
        self.messages: list[int] = []   # each step's batches
        self.results: list[p.BatchResult] = []
        self.stops: dict[int, set[str]] = {}
        self.pauses: dict[int, dict[str, int]] = {}   # item -> when the PAUSE was read
        self.now = 0   # the table's clock (ns)
        self.table = SequenceTable(loaded, self._emit, self._finish,
                                   lambda b: frozenset(self.stops.get(b, ())),
                                   itertools.count(1), lambda b: self.pauses.pop(b, {}),
                                   clock=lambda: self.now)
        self._ids = itertools.count(1)

    def _emit(self, step: list[p.Partial]) -> None:
        self.messages.append(len(step))
        for part in step:
            for x in part.parts:
                values = p.to_numpy(x.tensors[0]).reshape(-1).tolist() if x.tensors else []
                self.parts.append((part.batch_id, x.item, x.final, values))

    def _finish(self, batch: p.Batch, result: p.BatchResult, taken_ns: int) -> None:
        self.results.append(result)

    def join(self, *counts: float, flag: float = 0.0, received_ns: int = 0) -> int:
        batch_id = next(self._ids)
        items = [p.BatchItem(f"r{batch_id}.{i}", [p.from_numpy(
            "input", np.array([[n, flag, 0, 0]], np.float32))]) for i, n in enumerate(counts)]
        self.table.join(p.Batch(batch_id, "c", 1, items), 0, received_ns)
        return batch_id

    def of(self, item: str) -> list[tuple[bool, list[float]]]:
        return [(final, v) for _, i, final, v in self.parts if i == item]


def test_a_request_joins_at_the_next_step_while_others_run() -> None:
    rig = Rig(most=4)
    long = rig.join(50)
    for _ in range(5):
        assert rig.table.step()
    short = rig.join(2)
    rig.table.step()
    rig.table.step()
    got = rig.of(f"r{short}.0")
    # joined at the step boundary after it came: its first response is from step 6
    assert got == [(False, [1.0, 6.0, 2.0]), (True, [2.0, 7.0, 2.0])]
    assert [r.batch_id for r in rig.results] == [short]   # its RESULT, the long one runs on
    assert rig.results[0].error is None
    assert len(rig.of(f"r{long}.0")) == 7 and rig.table.busy
    assert rig.messages == [1] * 5 + [2, 2]   # a step's responses leave together


def test_sequences_beyond_the_maximum_wait_for_a_slot() -> None:
    rig = Rig(most=2)
    rig.join(3, 1, 3)
    while rig.table.busy:
        rig.table.step()
    assert max(v[2] for *_, v in rig.parts) == 2   # never more than 2 in a step
    # the third joined at the boundary after the second ended (step 1), so ran steps 2-4
    assert [v[1] for _, v in rig.of("r1.2")] == [2.0, 3.0, 4.0]
    assert [len(rig.of(f"r1.{i}")) for i in range(3)] == [3, 1, 3]
    assert len(rig.results) == 1 and rig.results[0].error is None   # once all three left
    assert sorted(rig.handler.left) == sorted(rig.handler.joined)


def test_a_stopped_sequence_leaves_at_the_next_step_and_frees_its_slot() -> None:
    rig = Rig(most=1)
    first = rig.join(100)
    second = rig.join(1)
    rig.table.step()
    rig.stops[first] = {f"r{first}.0"}
    rig.table.step()   # the first leaves, the second joins and ends in the same step
    assert rig.handler.left == [1, 2]
    assert [r.batch_id for r in rig.results] == [first, second]
    assert rig.of(f"r{second}.0") == [(True, [1.0, 2.0, 1.0])]
    assert not rig.table.busy


def test_a_stopped_request_that_never_joined_never_runs() -> None:
    rig = Rig(most=1)
    rig.join(5)
    waiting = rig.join(5)
    rig.stops[waiting] = {f"r{waiting}.0"}
    rig.table.step()
    assert [r.batch_id for r in rig.results] == [waiting]
    assert rig.handler.joined == [1]


class InPlace(Counter):
    """Keeps its sequences in one buffer made in join, as the causal LM's slab of caches
    does, and clears a sequence's row in place when it leaves."""

    def __init__(self) -> None:
        super().__init__()
        self.rows: torch.Tensor | None = None

    def join(self, seq_id: int, inputs: dict[str, torch.Tensor]) -> dict[str, int]:
        if self.rows is None:
            self.rows = torch.zeros(8)   # made in join: an inference tensor
        self.rows[seq_id] = 1.0
        return super().join(seq_id, inputs)

    def leave(self, seq_id: int) -> None:
        assert self.rows is not None
        self.rows[seq_id] = 0.0   # raised outside inference mode, and the row stayed
        super().leave(seq_id)


def test_leave_writes_in_place_what_join_made_whether_ended_or_stopped() -> None:
    rig = Rig(most=2, handler=InPlace())
    rig.join(1)
    stopped = rig.join(9)
    rig.table.step()   # the first ends at its first response
    rig.stops[stopped] = {f"r{stopped}.0"}
    rig.table.step()   # the second leaves, stopped
    assert not rig.table.busy
    assert rig.handler.left == [1, 2]
    assert rig.handler.rows is not None and not rig.handler.rows.any()


class Pausing(Counter):
    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[str, int]] = []

    def pause(self, seq_id: int) -> None:
        self.calls.append(("pause", seq_id))

    def resume(self, seq_id: int) -> None:
        self.calls.append(("resume", seq_id))


def test_a_paused_sequence_sits_out_while_the_newcomer_runs_then_resumes() -> None:
    rig = Rig(most=2, handler=Pausing())
    low = rig.join(4, 4)
    rig.table.step()
    vip = rig.join(2)
    rig.pauses[low] = {f"r{low}.1": 0}
    rig.table.step()   # r.1 pauses, the newcomer joins: its first response at once
    assert rig.table.paused == 1 and rig.table.running == 2
    assert rig.of(f"r{vip}.0") == [(False, [1.0, 2.0, 2.0])]
    rig.table.step()   # the newcomer ends here; r.1 resumes at the next boundary
    assert rig.of(f"r{low}.1") == [(False, [1.0, 1.0, 2.0])]
    while rig.table.busy:
        rig.table.step()
    # the paused one counted on from where it stopped: 2, 3, 4, none lost or repeated
    assert [v[0] for _, v in rig.of(f"r{low}.1")] == [1.0, 2.0, 3.0, 4.0]
    assert [v[1] for _, v in rig.of(f"r{low}.1")] == [1.0, 4.0, 5.0, 6.0]
    assert rig.handler.calls == [("pause", 2), ("resume", 2)]
    assert [r.batch_id for r in rig.results] == [vip, low]


def test_a_joiners_first_response_leads_its_steps_message() -> None:
    """The VIP's first token leaves ahead of the running streams' tokens of the step it
    joined (in the table's order it comes last): its client gets it before theirs."""
    rig = Rig(most=2, handler=Pausing())
    low = rig.join(9, 9)
    rig.table.step()
    rig.table.step()
    vip = rig.join(2)
    rig.pauses[low] = {f"r{low}.1": 0}
    rig.table.step()
    resumed_at = len(rig.parts)
    assert [i for _, i, _, _ in rig.parts[-2:]] == [f"r{vip}.0", f"r{low}.0"]
    rig.table.step()   # the VIP's last; the paused one resumes at the next boundary
    rig.table.step()
    # a resumed sequence's next token is no first response: it keeps its place
    assert [i for _, i, _, _ in rig.parts[resumed_at + 2:]] == [f"r{low}.0", f"r{low}.1"]


def test_a_paused_sequence_that_is_stopped_leaves_and_one_not_joined_goes_behind() -> None:
    rig = Rig(most=1)
    running = rig.join(9)
    queued = rig.join(9)    # waits for the slot
    rig.table.step()
    vip = rig.join(1)
    rig.pauses[running] = {f"r{running}.0": 0}
    rig.pauses[queued] = {f"r{queued}.0": 0}   # the broker thought it ran: it goes behind
    rig.table.step()
    assert rig.of(f"r{vip}.0") == [(True, [1.0, 2.0, 1.0])]
    rig.stops[running] = {f"r{running}.0"}
    rig.table.step()   # the paused one leaves; the one behind joins
    assert [r.batch_id for r in rig.results] == [vip, running]
    assert rig.of(f"r{queued}.0") == [(False, [1.0, 3.0, 1.0])]
    assert rig.handler.left == [2, 1] and rig.table.paused == 0   # the newcomer was 2


def test_a_pause_taken_before_its_preemptor_is_read_keeps_the_slot_for_it() -> None:
    """The PAUSE comes right before the VIP's batch, but a step boundary may fall between
    the two: the paused sequence must not take its slot back meanwhile, or the VIP finds
    every slot held and waits for a sequence to end (tests/bench/bench_vip.py saw 9-26
    steps)."""
    rig = Rig(most=2, handler=Pausing())
    low = rig.join(9, 9, received_ns=1)
    rig.table.step()
    rig.pauses[low] = {f"r{low}.1": 2}   # read at 2; the VIP's batch not yet
    rig.table.step()
    assert rig.table.paused == 1 and rig.table.running == 1
    vip = rig.join(2, received_ns=3)
    rig.table.step()   # the VIP joins at the boundary after it was read, in the kept slot
    assert rig.of(f"r{vip}.0") == [(False, [1.0, 3.0, 2.0])]
    while rig.table.busy:
        rig.table.step()
    assert [v[0] for _, v in rig.of(f"r{low}.1")] == [float(n) for n in range(1, 10)]
    assert rig.handler.calls == [("pause", 2), ("resume", 2)]


def test_a_request_paused_before_it_joined_keeps_the_slot_for_its_preemptor() -> None:
    rig = Rig(most=2)
    first = rig.join(9, received_ns=1)
    rig.table.step()
    queued = rig.join(9, received_ns=2)   # for the free slot, the broker paused it since
    rig.pauses[queued] = {f"r{queued}.0": 3}
    rig.table.step()
    assert rig.table.running == 1 and rig.of(f"r{queued}.0") == []
    vip = rig.join(2, received_ns=4)
    rig.table.step()
    assert rig.of(f"r{vip}.0") == [(False, [1.0, 3.0, 2.0])]
    while rig.table.busy:
        rig.table.step()
    # it joins once the VIP has left: after step 4, the VIP's last
    assert [v[1] for _, v in rig.of(f"r{queued}.0")][0] == 5.0
    assert len(rig.of(f"r{first}.0")) == 9


def test_a_slot_kept_for_a_preemptor_that_never_comes_is_taken_back_in_time() -> None:
    rig = Rig(most=2, handler=Pausing())
    low = rig.join(9, 9, received_ns=1)
    rig.table.step()
    rig.pauses[low] = {f"r{low}.1": 2}
    rig.now = 2 + PREEMPTOR_WAIT_NS - 1
    rig.table.step()
    assert rig.table.paused == 1
    rig.now += 1   # the broker sent none (its request went before it left): resume
    rig.table.step()
    assert rig.table.paused == 0 and rig.table.running == 2
    assert rig.handler.calls == [("pause", 2), ("resume", 2)]


def test_a_zero_count_is_one_empty_final_response() -> None:
    rig = Rig()
    rig.join(0)
    rig.table.step()
    assert rig.parts == [(1, "r1.0", True, [])]
    assert not rig.table.busy


def test_a_failed_step_fails_the_joins_it_ran_and_the_rest_go_on() -> None:
    rig = Rig(most=2)
    rig.handler.fail_step = 2
    running = rig.join(5, 5)
    waiting = rig.join(5)   # waits for a slot: it was not in the failed step
    rig.table.step()
    rig.table.step()
    failed = [r for r in rig.results if r.error]
    assert [r.batch_id for r in failed] == [running]
    assert "step failed on purpose" in (failed[0].error or "")
    assert sorted(rig.handler.left) == [1, 2]
    while rig.table.busy:
        rig.table.step()
    assert [f for f, _ in rig.of(f"r{waiting}.0")] == [False] * 4 + [True]


class Split(Counter):
    """A Counter whose step answers what is ready and whose ``advance`` does the work
    (a decode's stand-in): it records, at each advance, the responses already sent."""

    def __init__(self) -> None:
        super().__init__()
        self.sent: list[Any] = []   # the rig's responses, set once the rig is made
        self.advanced: list[tuple[list[int], int]] = []   # (sequences, responses sent)
        self.fail_advance: int | None = None

    def advance(self, states: dict[int, dict[str, int]]) -> None:
        self.advanced.append((sorted(states), len(self.sent)))
        if len(self.advanced) == self.fail_advance:
            raise RuntimeError("advance failed on purpose")


def test_advance_runs_after_the_steps_responses_are_sent_with_those_going_on() -> None:
    rig = Rig(most=4, handler=Split())
    rig.handler.sent = rig.parts
    rig.join(1, 3)
    rig.table.step()
    # both first responses were out before advance ran; the one that ended is not advanced
    assert rig.handler.advanced == [([2], 2)]
    while rig.table.busy:
        rig.table.step()
    assert rig.handler.advanced == [([2], 2), ([2], 3)]
    assert [v[0] for _, v in rig.of("r1.1")] == [1.0, 2.0, 3.0]


def test_a_failed_advance_fails_the_joins_it_ran_after_their_responses() -> None:
    rig = Rig(most=4, handler=Split())
    rig.handler.sent = rig.parts
    rig.handler.fail_advance = 1
    batch = rig.join(3)
    rig.table.step()
    assert rig.of("r1.0") == [(False, [1.0, 1.0, 1.0])]
    assert [r.batch_id for r in rig.results if r.error] == [batch]
    assert "advance() failed: RuntimeError: advance failed on purpose" in \
        (rig.results[0].error or "")
    assert not rig.table.busy


def test_a_failed_join_fails_its_batch_only() -> None:
    rig = Rig(most=4)
    good = rig.join(2)
    bad = rig.join(3, flag=-2.0)
    rig.table.step()
    assert [(r.batch_id, "refused on purpose" in (r.error or "")) for r in rig.results] == \
        [(bad, True)]
    rig.table.step()
    assert [r.batch_id for r in rig.results][-1] == good


@pytest.mark.parametrize("answer, says", [
    (lambda s: [1], "step() returned list"),
    (lambda s: {99: (None, True)}, "answered sequence 99, which is not running"),
    (lambda s: {k: {"output": torch.ones(1, 3)} for k in s},
     "each response is (outputs, final)"),
    (lambda s: {k: (None, False) for k in s}, "an empty response must be final"),
    (lambda s: {k: ({"output": torch.ones(2, 3)}, True) for k in s},
     "has 2 rows for a request of 1"),
])
def test_a_step_that_breaks_the_contract_fails_with_a_message(answer: Any, says: str) -> None:
    class Bad(Counter):
        def step(self, states: dict[int, Any]) -> Any:
            return answer(states)
    rig = Rig(handler=Bad())
    rig.join(3)
    rig.table.step()
    assert rig.parts == []
    [result] = rig.results
    assert result.error is not None and says in result.error, result.error
    assert not rig.table.busy


@pytest.mark.parametrize("raw, says", [
    ({"sequences": {"max": 0}}, "sequences.max"),
    ({"sequences": 4}, 'must be {"max": N}'),
    ({"sequences": {"max": 4}, "model_transaction_policy": {"decoupled": False}},
     "model_transaction_policy.decoupled"),
    ({"sequences": {"max": 4}, "platform": "pytorch_torchscript"}, "needs platform 'python'"),
    ({"sequences": {"max": 4, "prefill_tokens": 64}}, "platform 'transformers'"),
    ({"sequences": {"max": 4, "prefill_tokens": 0}, "platform": "transformers"},
     "sequences.prefill_tokens"),
    ({"sequences": {"max": 4, "chunk": 8}}, 'must be {"max": N}'),
    ({"sequences": {"max": 4, "step_ratio": 2}}, "platform 'transformers'"),
    ({"sequences": {"max": 4, "step_ratio": 1}, "platform": "transformers"},
     "sequences.step_ratio"),
    ({"sequences": {"max": 4, "step_ratio": "2"}, "platform": "transformers"},
     "sequences.step_ratio"),
])
def test_the_sequences_section_is_checked(raw: dict[str, Any], says: str) -> None:
    with pytest.raises(ConfigError) as err:
        parse_config({**linear_config("c", mbs=8), "platform": "python", **raw}, "test")
    assert says in str(err.value)


def test_an_iterative_model_is_decoupled_and_says_so_in_its_json() -> None:
    cfg = config(16)
    assert cfg.decoupled and cfg.max_sequences == 16
    again = parse_config(cfg.to_json(), "again")
    assert again == cfg and cfg.to_json()["sequences"] == {"max": 16}
    assert "sequences" not in parse_config(linear_config("x"), "x").to_json()
    lm = parse_config(lm_config(), "lm")   # what the broker sends its workers reads back
    assert parse_config(lm.to_json(), "again") == lm and lm.decoupled
    chunked = parse_config({**lm_config(), "sequences": {"max": 4, "prefill_tokens": 32}}, "lm")
    assert chunked.to_json()["sequences"] == {"max": 4, "prefill_tokens": 32}
    assert parse_config(chunked.to_json(), "again") == chunked and not lm.prefill_tokens
    fused = parse_config({**lm_config(), "sequences": {"max": 4, "step_ratio": 1.5}}, "lm")
    assert fused.to_json()["sequences"] == {"max": 4, "step_ratio": 1.5}
    assert parse_config(fused.to_json(), "again") == fused and not lm.step_ratio


class GruLM:
    """A small recurrent LM (a GRU over token embeddings, random weights): the second kind
    of state, a hidden vector a sequence, stepped in one batch. Greedy; answers
    ``output`` [token, 0, 0] a step, the input's first value tokens."""

    def __init__(self) -> None:
        torch.manual_seed(3)
        self.embed = torch.nn.Embedding(32, 16)
        self.cell = torch.nn.GRUCell(16, 24)
        self.head = torch.nn.Linear(24, 32)

    def join(self, seq_id: int, inputs: dict[str, torch.Tensor]) -> dict[str, Any]:
        x = inputs["input"][0]
        h = torch.zeros(1, 24)
        for tok in x[1:].long().tolist():   # the prompt: the other three values
            h = self.cell(self.embed(torch.tensor([tok])), h)
        return {"h": h, "next": int(self.head(h).argmax()), "left": int(x[0]), "sent": 0}

    def step(self, states: dict[int, dict[str, Any]]) -> dict[int, Any]:
        out, going = {}, []
        for seq_id, st in states.items():
            st["sent"] += 1
            final = st["sent"] >= st["left"]
            out[seq_id] = ({"output": torch.tensor([[float(st["next"]), 0.0, 0.0]])}, final)
            if not final:
                going.append(st)
        if going:   # one batched step of every sequence that goes on
            h = self.cell(self.embed(torch.tensor([st["next"] for st in going])),
                          torch.cat([st["h"] for st in going]))
            for row, st in enumerate(going):
                st["h"], st["next"] = h[row:row + 1], int(self.head(h[row]).argmax())
        return out


def test_a_recurrent_lm_batched_and_paused_makes_the_tokens_it_makes_alone() -> None:
    """The GRU's hidden states stepped together, joining at different steps and one
    paused for a while, give each sequence the tokens it gets run alone."""
    prompts = [[12, 3, 7, 1], [9, 5, 5, 2], [15, 8, 1, 4], [6, 2, 9, 9]]

    def tokens(rig: Rig) -> dict[str, list[float]]:
        return {item: [v[0] for _, v in rig.of(item)] for _, item, _, _ in rig.parts}
    alone = Rig(most=3, handler=GruLM())
    for prompt in prompts:
        _join_row(alone, prompt)
        while alone.table.busy:
            alone.table.step()
    rig = Rig(most=3, handler=GruLM())
    first = _join_row(rig, prompts[0])
    rig.table.step()
    _join_row(rig, prompts[1])
    rig.table.step()
    rig.pauses[first] = {f"r{first}.0": 0}
    _join_row(rig, prompts[2])
    _join_row(rig, prompts[3])
    rig.table.step()
    assert rig.table.paused == 1 and rig.table.running == 3
    while rig.table.busy:
        rig.table.step()
    assert tokens(rig) == tokens(alone)
    assert [len(v) for v in tokens(alone).values()] == [12, 9, 15, 6]


def _join_row(rig: Rig, row: list[float]) -> int:
    batch_id = next(rig._ids)
    item = p.BatchItem(f"r{batch_id}.0", [p.from_numpy("input", np.array([row], np.float32))])
    rig.table.join(p.Batch(batch_id, "c", 1, [item]), 0)
    return batch_id
