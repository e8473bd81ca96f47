"""The engine's model of what a step costs: step time as a function of the batch it runs, fitted online from
every step (``StepTimer``), and sent with each heartbeat for the proxy to predict with.

Decode capacity is a latency budget, not a slot count: each extra sequence in a decode batch slows every
other one. The proxy admits a sequence into decode only while the worker's predicted step time (its TPOT)
stays within the target, so each worker measures its steps and fits, online,

    step ms = c0 + c1 * decode tokens + c2 * decode context (thousands of tokens)
              + c3 * prompt tokens + c4 * prompt attention (thousands of query x key pairs)

where decode tokens are the rows that generate (one each, more when they verify drafts), decode context the
keys those rows read, prompt tokens the prompt-chunk tokens of the step and prompt attention their
query x key pairs (each chunk token attends to the context before it). The terms are what the step does:
the matmuls are linear in the rows (at these sizes, past a few rows), attention linear in the keys read.

Three regimes are fitted apart: decode-only steps of at most ``small_max_rows`` rows (the one-call decode
kernel's, ``EngineConfig.cpu.decode_kernel_max_batch``), other decode-only steps (the torch path), and steps
with a prompt chunk. Each fit is a least-squares fit of the relative error (a 2 s prompt step must not
outweigh a 20 ms decode step) whose old samples fade (``half_life`` steps), so the model follows the
machine (a noisy neighbour, a frequency change) and the pool's fragmentation; coefficients are kept
non-negative (a term that fits negative is dropped and the rest refitted), so the prediction never falls
as a batch grows. A regime is reported only once it has seen ``min_samples`` steps (``min_prompt_samples``
for steps with a prompt chunk) at two or more batch sizes; until then the proxy treats that regime as unknown
(the decode-only torch regime must be known for any report).

``StepCostModel`` (common/protocol/wire.py) is what a heartbeat carries, and what the proxy predicts with.
"""
from __future__ import annotations

import math
import time

import numpy as np

from common.protocol.wire import StepCostModel, step_cost_features

NUM_FEATURES = 5
PROMPT_MIN_SAMPLES = 8  # steps with a prompt chunk before that regime is reported (``min_prompt_samples``)
MAX_COEFFICIENT = 1e9  # the wire's bound (common/protocol/wire.py Coefficient)


class _Fit:
    """Exponentially weighted least squares over the step features, refitted on demand."""

    def __init__(self, decay: float) -> None:
        self.decay = decay
        self.xtx = np.zeros((NUM_FEATURES, NUM_FEATURES))
        self.xty = np.zeros(NUM_FEATURES)
        self.count = 0
        self.row_counts: set[int] = set()
        self.coef: tuple[float, ...] | None = None
        self._dirty = False

    def observe(self, x: np.ndarray, ms: float, rows: int) -> None:
        self.xtx *= self.decay
        self.xty *= self.decay
        weight = 1.0 / (ms * ms)  # relative errors: a 2 s prompt step must not drown a 20 ms decode step
        self.xtx += weight * np.outer(x, x)
        self.xty += weight * ms * x
        self.count += 1
        if len(self.row_counts) < 8:
            self.row_counts.add(rows)
        self._dirty = True

    def solve(self) -> tuple[float, ...] | None:
        if not self._dirty:
            return self.coef
        self._dirty = False
        active = [i for i in range(NUM_FEATURES) if self.xtx[i, i] > 1e-12]
        while active:
            a = self.xtx[np.ix_(active, active)] + 1e-9 * np.eye(len(active))
            sol = np.linalg.lstsq(a, self.xty[active], rcond=None)[0]
            negative = [i for i, v in zip(active, sol) if v < 0]
            if not negative:
                coef = [0.0] * NUM_FEATURES
                for i, v in zip(active, sol):
                    coef[i] = float(v)
                if all(math.isfinite(v) and v <= MAX_COEFFICIENT for v in coef):  # else keep the last good fit
                    self.coef = tuple(coef)
                return self.coef
            active.remove(min(negative, key=lambda i: sol[active.index(i)]))
        return self.coef


class StepTimer:
    """Observes every step the engine runs and keeps the fit of each regime."""

    def __init__(self, small_max_rows: int, half_life: float = 500.0, min_samples: int = 20,
                 refit_s: float = 0.5) -> None:
        # a regime is reported once seen at two row counts: the kernel's steps of one row alone (a large model
        # keeps it for one) could never be, so they fit with the torch path's
        self.small_max_rows = small_max_rows if small_max_rows >= 2 else 0
        self.min_samples = min_samples
        # the regime of steps with a prompt chunk: each such step is long against the noise a decode step sees (a
        # scheduler tick, a neighbour's burst) and costs as much as tens of decode steps, so fewer samples fit it
        # as well, and a calibration at load affords them
        self.min_prompt_samples = min(min_samples, PROMPT_MIN_SAMPLES)
        self.refit_s = refit_s  # ``report`` refits at most this often
        decay = 0.5 ** (1.0 / half_life)
        self.small, self.large, self.mixed = _Fit(decay), _Fit(decay), _Fit(decay)
        self._report: StepCostModel | None = None
        self._refit_at = 0.0
        # Decode steps, predicted by the reported fit before they ran, against what they took (moving averages
        # over about 20 steps; None until a fit was reported): what /metrics shows of the model's accuracy
        self.predicted_ms: float | None = None
        self.measured_ms: float | None = None
        self.relative_error: float | None = None

    def regime(self, decode_tokens: int, prompt_tokens: int) -> _Fit:
        if prompt_tokens:
            return self.mixed
        return self.small if decode_tokens <= self.small_max_rows else self.large

    def observe(self, decode_tokens: int, decode_context: int, prompt_tokens: int, prompt_pairs: int,
                seconds: float) -> None:
        """One step: what it ran and how long it took."""
        if decode_tokens + prompt_tokens <= 0 or not math.isfinite(seconds) or seconds <= 0:
            return
        ms = 1000.0 * seconds
        if self._report is not None and not prompt_tokens:
            self._track(self._report.step_ms(decode_tokens, decode_context), ms)
        x = np.asarray(step_cost_features(decode_tokens, decode_context, prompt_tokens, prompt_pairs))
        self.regime(decode_tokens, prompt_tokens).observe(x, ms, decode_tokens + prompt_tokens)

    def _track(self, predicted: float, measured: float, rate: float = 0.05) -> None:
        error = abs(predicted - measured) / measured
        if self.predicted_ms is None:
            self.predicted_ms, self.measured_ms, self.relative_error = predicted, measured, error
            return
        self.predicted_ms += rate * (predicted - self.predicted_ms)
        self.measured_ms += rate * (measured - self.measured_ms)
        self.relative_error += rate * (error - self.relative_error)

    def _ready(self, fit: _Fit) -> tuple[float, ...] | None:
        least = self.min_prompt_samples if fit is self.mixed else self.min_samples
        if fit.count < least or len(fit.row_counts) < 2:
            return None
        return fit.solve()

    def known(self, fit: _Fit) -> bool:
        """Whether ``fit`` (one of this timer's regimes) has the samples to be reported."""
        return self._ready(fit) is not None

    def report(self) -> StepCostModel | None:
        """The current fit for the heartbeat (refitted at most every ``refit_s``); None until a regime is known."""
        now = time.monotonic()
        if now >= self._refit_at:
            self._refit_at = now + self.refit_s
            self._report = self._fit()
        return self._report

    def _fit(self) -> StepCostModel | None:
        """The regimes known so far. The wire needs ``large``: until it is known the fused kernel's fit stands in
        for it (a worker that never runs more than ``small_max_rows`` sequences), or else the prompt steps'
        (a prefill worker, which runs nothing else: what the proxy's TTFT gate reads)."""
        small, mixed = self._ready(self.small), self._ready(self.mixed)
        large = self._ready(self.large)
        if large is None:
            large = small if small is not None else mixed
        if large is None:
            return None
        return StepCostModel(small_max_rows=self.small_max_rows if small is not None else 0,
                             small=list(small) if small is not None else [], large=list(large),
                             mixed=list(mixed) if mixed is not None else [],
                             samples=self.small.count + self.large.count + self.mixed.count)
