"""A worker's step-cost calibration at load: real engine steps on dummy sequences, run before the worker takes
its first request, so that its first heartbeat already carries a fit of its step time (``StepTimer``) that covers
one row and many.

Without it the first fit comes from whatever the first traffic happens to run (a cold cluster's first batches
are 4-8 rows), which predicts the one-sequence step badly; the proxy's TPOT target and decode capacity are read
off that prediction (proxy/core/capacity.py), so a cold cluster's capacity swung from twice the right value to a
fraction of it within its first seconds (docs/benchmarks.md, "Cold start").

What runs, within ``engine.steps.calibration_s`` of steps (0: none):

- decode steps (a role that decodes): groups of 1, 2, 4, ... rows (capped by ``max_num_seqs`` and the KV pool)
  at two context lengths, the regime that holds one row first (``StepTimer.small``), then the larger rows'. The
  sequences enter as a decode worker's do, with pages "pulled" (``add_prefilled_request``, then ``kv_ready``):
  a decode step's cost does not depend on what its keys hold, so no prompt is computed for them;
- prompt steps (a role that prefills): one-row prompts of three lengths, each a real prompt step.

Each regime's calibration stops once the ``StepTimer`` would report it (``min_samples``, for prompt steps
``min_prompt_samples``, at two or more batch sizes). The steps are ordinary ``LLMEngine.step`` calls, so
``StepTimer.observe`` sees them like any other; their weight fades with real steps (``half_life``). The prompt
fit comes from short prompts (up to four blocks) and overestimates long ones (measured on the embedded model at
one thread: 2x at 512 tokens) until real prompt steps refine it.

Everything is freed afterwards: prefix caching is off while it runs (``BlockManager.uncached``: no block of a
dummy prompt is cached or announced in KV events), every page is free again, and the engine's counters are as they
were before it (its steps are not traffic).
"""
from __future__ import annotations

import copy
import itertools
import logging
import time
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass

from common.engine.step_timer import StepTimer
from common.protocol.sampling_params import SamplingParams

log = logging.getLogger(__name__)

ROW_COUNTS = (1, 2, 4, 8, 16, 32)
DECODE_STEPS_PER_GROUP = 2  # steps of one batch size in a row before the next size
PROMPT_BLOCKS = (1, 2, 4)  # prompt lengths of the prompt steps, in KV blocks: three, for the fit's three prompt terms
CONTEXT_BLOCKS = (2, 16)  # context lengths of the decode rows, in KV blocks
FIRST_TOKEN = 100  # dummy token ids count up from here (clear of the special tokens at the vocabulary's start)
SUMMARY_CONTEXT = 256  # the context per row of the predictions logged
# On CPU the budget counts the calibrating thread's CPU time, so that a worker started on a busy host (a step
# taking three times as long, the cores shared) runs the steps an idle one would; their wall time stops it at
# this many times the budget.
WALL_CAP = 4.0


@dataclass
class Calibration:
    """What a calibration ran and how long it took: ``step_s`` in its steps (what ``calibration_s`` bounds: on CPU
    the calibrating thread's CPU time, on a GPU wall time), ``step_wall_s`` their wall time (at most
    ``WALL_CAP`` times the budget), ``seconds`` in all (waits for the core share too)."""

    decode_steps: int = 0
    prompt_steps: int = 0
    step_s: float = 0.0
    step_wall_s: float = 0.0
    seconds: float = 0.0

    def spent(self, budget_s: float) -> bool:
        return self.step_s >= budget_s or self.step_wall_s >= WALL_CAP * budget_s

    def summary(self, timer: StepTimer) -> str:
        report = timer.report()
        ran = (f"{self.decode_steps} decode and {self.prompt_steps} prompt steps in {self.step_s:.2f}s "
               f"({self.step_wall_s:.2f}s of wall time, {self.seconds:.2f}s with waits for the cores)")
        if report is None:
            return f"{ran}: too few for a fit (raise engine.steps.calibration_s)"
        many = ROW_COUNTS[-1]
        one, most = report.step_ms(1, SUMMARY_CONTEXT), report.step_ms(many, many * SUMMARY_CONTEXT)
        return (f"{ran}: "
                f"a step predicted {one:.1f} ms at 1 row, {most:.1f} ms at {many} rows of {SUMMARY_CONTEXT} tokens "
                f"(fused-kernel fit {'known' if report.small else 'unknown'}, prompt fit "
                f"{'known' if report.mixed else 'unknown'})")


def calibrate(engine, budget_s: float, decode: bool, prompts: bool,
              cores: AbstractContextManager = nullcontext()) -> Calibration:
    """Run ``engine`` (an idle ``LLMEngine``) through up to ``budget_s`` of calibration steps: decode steps when
    ``decode``, prompt steps when ``prompts``, each holding ``cores`` (a worker's core share); leaves the engine as
    idle and empty as it found it."""
    if engine.has_unfinished() or engine.block_manager.num_used_blocks:
        raise RuntimeError("calibration needs an idle engine: it holds requests or KV pages")
    result = Calibration()
    if budget_s <= 0:
        return result
    started = time.perf_counter()
    ids = itertools.count()
    traffic = copy.deepcopy(engine.stats)  # what ran before (none, at load) stays what the counters hold
    try:
        with engine.block_manager.uncached():
            if decode:
                timer = engine.step_timer
                for fit, rows in _decode_regimes(engine):
                    for n, context in _cycle(rows, CONTEXT_BLOCKS):
                        if result.spent(budget_s) or timer.known(fit):
                            break
                        result.decode_steps += _decode_group(engine, n, context * engine.config.block_size, ids,
                                                             _Steps(engine, cores, result))
            if prompts:
                for _, blocks in _cycle((1,), PROMPT_BLOCKS):
                    if result.spent(budget_s) or engine.step_timer.known(engine.step_timer.mixed):
                        break
                    result.prompt_steps += _prompt_step(engine, blocks * engine.config.block_size, ids,
                                                        _Steps(engine, cores, result))
        if engine.has_unfinished() or engine.block_manager.num_used_blocks:  # a bug here must not reach traffic
            raise RuntimeError(f"calibration left {len(engine.requests)} requests and "
                               f"{engine.block_manager.num_used_blocks} KV pages behind")
    finally:
        engine.stats = traffic
    result.seconds = time.perf_counter() - started
    return result


def _decode_regimes(engine):
    """(fit, the row counts it covers) for each decode regime, the one that holds one row first."""
    timer, config = engine.step_timer, engine.config
    per_seq = -(-(DECODE_STEPS_PER_GROUP + 2) // config.block_size)  # a row's least: one token of context
    most = min(config.max_num_seqs, engine.block_manager.num_blocks // per_seq)
    rows = [n for n in ROW_COUNTS if n <= most]
    small = [n for n in rows if n <= timer.small_max_rows]
    large = [n for n in rows if n > timer.small_max_rows]
    return [(fit, counts) for fit, counts in ((timer.small, small), (timer.large, large)) if len(counts) >= 2]


def _cycle(rows, contexts):
    """Every (rows, context) pair over and over, contexts alternating from one pass to the next."""
    for turn in itertools.count():
        for n in rows:
            yield n, contexts[turn % len(contexts)]


def _dummy_prompt(engine, length: int) -> list[int]:
    span = max(1, min(1000, engine.runner.vocab_size - FIRST_TOKEN))
    return [FIRST_TOKEN + i % span for i in range(length)]


def _decode_group(engine, rows: int, context: int, ids, steps: _Steps) -> int:
    """``rows`` sequences of (at most) ``context`` tokens of uninitialised KV, each decoding
    ``DECODE_STEPS_PER_GROUP`` tokens; returns the steps run."""
    params = SamplingParams(temperature=0.0, max_tokens=DECODE_STEPS_PER_GROUP + 1, ignore_eos=True)
    # a short context where the pool cannot hold this many rows of the long one
    room = engine.block_manager.num_blocks // rows * engine.config.block_size - DECODE_STEPS_PER_GROUP - 1
    context = max(1, min(context, room))
    for _ in range(rows):
        request_id = f"calibration-{next(ids)}"
        seq = engine.add_prefilled_request(request_id, _dummy_prompt(engine, context), FIRST_TOKEN, params, seed=0,
                                           reuse_cached=False)
        if not seq.block_table:  # the pool could not take it (sized from the pool, so not expected)
            engine.abort_request(request_id)
            continue
        engine.kv_ready(seq)
    return steps.run()


def _prompt_step(engine, length: int, ids, steps: _Steps) -> int:
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    engine.add_request(f"calibration-{next(ids)}", _dummy_prompt(engine, length), params, seed=0)
    return steps.run()


class _Steps:
    """Steps the engine until its requests finish, each step holding the core share; its time goes to ``result``."""

    def __init__(self, engine, cores: AbstractContextManager, result: Calibration) -> None:
        self.engine, self.cores, self.result = engine, cores, result
        self.on_cpu = engine.config.device_type == "cpu"

    def run(self) -> int:
        steps = 0
        while self.engine.has_unfinished():
            with self.cores:
                started, cpu = time.perf_counter(), time.thread_time()
                self.engine.step()
                wall = time.perf_counter() - started
                self.result.step_wall_s += wall
                self.result.step_s += time.thread_time() - cpu if self.on_cpu else wall
            steps += 1
        return steps
