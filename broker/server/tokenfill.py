"""A token-budget batch's rows, pure: given the head of the dispatch order and the rows
behind it (of the head's version and shape), which join it. The scheduler gathers the
window and owns the queue; this decides only the fill, so a new rule of it is tested on
plain rows and a fake clock."""

from __future__ import annotations

import math
from typing import Callable, Protocol, Sequence, TypeVar

Predict = Callable[[float], float]   # units (rows x scale) -> seconds


class Row(Protocol):
    @property
    def samples(self) -> int: ...
    @property
    def length(self) -> int: ...          # tokens a row, along the padded dimension
    @property
    def scale(self) -> float: ...         # a row's cost in units of the declared shape's
    @property
    def units(self) -> float: ...
    @property
    def priority(self) -> int: ...
    @property
    def arrival_s(self) -> float: ...
    @property
    def deadline_s(self) -> float: ...
    @property
    def seq(self) -> int: ...


class Budget(Protocol):
    @property
    def max_batch_tokens(self) -> int: ...
    @property
    def packed(self) -> bool: ...
    @property
    def aging_s(self) -> float: ...
    def tokens(self, rows: int, longest: int, total: int) -> int: ...


R = TypeVar("R", bound=Row)


def fill(head: R, rest: Sequence[R], budget: Budget, now: float, start: float, cap: int,
         predict: Predict, limit: float = math.inf) -> list[R]:
    """The head, then rows of a length near its own, so little of the batch is padding.
    Order still comes first: rows that have aged, or whose deadline is near, before the
    rest, and a higher priority before a lower one; by length only within the same rank.
    A row joins only where the batch stays within ``cap`` rows and the budget, and the
    batch, predicted from ``start``, still meets every deadline in it, and is predicted
    to run ``limit`` seconds at most (the head goes whatever its own time)."""
    # a batch runs about its budget's worth: a row whose deadline falls within twice
    # that is urgent, and ranks with the aged ones
    soon = start + 2 * predict(float(budget.max_batch_tokens))

    def rank(e: R) -> tuple[int, int, int]:
        urgent = e.arrival_s + budget.aging_s <= now or e.deadline_s <= soon
        return (0 if urgent else 1 + e.priority, abs(e.length - head.length), e.seq)

    batch = [head]
    rows, longest, total = head.samples, head.length, head.samples * head.length
    tightest = head.deadline_s
    per_token = head.scale / max(head.length, 1)   # the latency model's units a token
    for e in sorted(rest, key=rank):
        if rows + e.samples > cap:
            continue
        wide = max(longest, e.length)
        cost = budget.tokens(rows + e.samples, wide, total + e.samples * e.length)
        if cost > budget.max_batch_tokens:
            continue
        tight = min(tightest, e.deadline_s)
        joined = predict(cost * per_token)
        if start + joined > tight or joined > limit:
            continue
        # as in a padded batch without a budget: a row of another length joins only
        # where running it padded costs no more than running it apart
        if not budget.packed and e.length != longest and joined > \
                predict(rows * longest * per_token) + predict(e.units):
            continue
        batch.append(e)
        rows, longest, total, tightest = rows + e.samples, wide, \
            total + e.samples * e.length, tight
        if rows >= cap:
            break
    return batch
