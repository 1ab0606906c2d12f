"""Online latency model: latency(u) = a + c*u, least squares over a sliding window.

``u`` is a batch's units: its rows times their scale (models/shapes.py), which for a model
of fixed shapes is its rows, and for a variable-length one grows with the padded length,
so one fit prices a 16-token batch and a 512-token batch apart."""

from __future__ import annotations

import math
from collections import deque
from typing import Callable

MAX_S = 24 * 3600.0   # no batch takes a day


class LatencyModel:
    """Predicts a batch's run time from its units, fitted on recent measured batches.

    Until it has seen two distinct batch sizes it scales the mean per-sample time of
    what it has seen; with no data it predicts 0 (admit, then learn).
    """

    def __init__(self, window: int = 64) -> None:
        self._samples: deque[tuple[float, float]] = deque(maxlen=window)
        # running sums over the window, so a fit costs O(1) per batch
        self._n = 0
        self._sx = self._sy = self._sxx = self._sxy = 0.0
        self._fit: tuple[float, float] | None = None

    def observe(self, batch_size: float, seconds: float) -> None:
        # what cannot be a batch's time is ignored: one NaN in the running sums once
        # stopped admission from ever refusing on a deadline again
        if not (batch_size > 0 and math.isfinite(seconds) and 0.0 <= seconds <= MAX_S):
            return
        # the sums updated in line: observed for every batch, where two calls to a helper
        # with a sign cost more than the arithmetic
        if len(self._samples) == self._samples.maxlen:
            b, t = self._samples[0]
            self._n -= 1
            self._sx -= b
            self._sy -= t
            self._sxx -= b * b
            self._sxy -= b * t
        self._samples.append((batch_size, seconds))
        self._n += 1
        self._sx += batch_size
        self._sy += seconds
        self._sxx += batch_size * batch_size
        self._sxy += batch_size * seconds
        self._fit = None

    def _solve(self) -> tuple[float, float]:
        n, sx, sy, sxx, sxy = self._n, self._sx, self._sy, self._sxx, self._sxy
        den = n * sxx - sx * sx
        if den <= 1e-9 * max(1.0, n * sxx):
            # one batch size seen: assume the time is mostly fixed cost
            mean_b, mean_t = sx / n, sy / n
            return mean_t * 0.5, mean_t * 0.5 / mean_b
        slope = (n * sxy - sx * sy) / den
        intercept = (sy - slope * sx) / n
        # a negative term would predict free work; clamp to a sane shape
        slope = max(slope, 0.0)
        intercept = max(intercept, 0.0)
        if slope == 0.0 and intercept == 0.0:
            intercept = sy / n
        return intercept, slope

    def predict(self, batch_size: float) -> float:
        if not self._samples:
            return 0.0
        if self._fit is None:
            self._fit = self._solve()
        a, c = self._fit
        return a + c * batch_size

    @property
    def known(self) -> bool:
        return bool(self._samples)


def _zero(_: float) -> float:
    return 0.0


class LatencyBook:
    """Latency models per (model, worker), and per model across workers for admission.

    Disabled, every prediction is 0: batches are bounded by size alone and admission
    never refuses for a deadline (a plain fixed-delay batcher, for comparison).
    """

    def __init__(self, enabled: bool = True, window: int = 64) -> None:
        self.enabled = enabled
        self.window = window
        self._models: dict[tuple[str, str], LatencyModel] = {}

    def forget_worker(self, worker: str) -> None:
        """A worker left for good: ids churn on hosts that name workers by pod, so a
        model per worker ever seen would grow for ever (the model's own stays)."""
        for key in [k for k in self._models if k[1] == worker]:
            del self._models[key]

    def size(self) -> int:
        return len(self._models)

    def _get(self, model: str, worker: str) -> LatencyModel:
        lm = self._models.get((model, worker))
        if lm is None:
            lm = self._models[(model, worker)] = LatencyModel(self.window)
        return lm

    def observe(self, model: str, worker: str, batch_size: float, seconds: float) -> None:
        self._get(model, worker).observe(batch_size, seconds)
        self._get(model, "").observe(batch_size, seconds)

    def predictor(self, model: str, worker: str = "") -> Callable[[float], float]:
        if not self.enabled:
            return _zero
        lm = self._models.get((model, worker))
        if lm is None or not lm.known:
            lm = self._models.get((model, ""))
        return lm.predict if lm is not None else _zero
