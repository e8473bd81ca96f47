"""The simulated worker's step time: a profile measured on the real engine, stored as a file.

A profile is the real engine's own fit of its step time (``common.protocol.wire.StepCostModel``, what a worker
reports in its heartbeats: milliseconds as a linear function of decode rows, the keys they read, prompt tokens
and prompt attention pairs), plus what it was measured on. ``record`` measures one: it runs the engine of this
process over decode batches of ``FIT_BATCHES`` sizes with their prompts' chunks in between, as a server would,
and keeps the fit the engine's ``StepTimer`` made of those steps.

    tessera sim-worker profile --out my-model.json [--model DIR] [--dtype bfloat16] [--threads 2]

``bench/sim/profiles/smollm2-135m-bf16-2core.json`` ships: the embedded model in bfloat16 on the 2-core machines
this project is developed on. ``bench/sim_accuracy.py`` checks a profile against the engine at batch sizes it was not
fitted on.
"""
from __future__ import annotations

import bisect
import json
import random
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path

import msgspec
import numpy as np

from common.protocol.wire import StepCostModel

FIT_BATCHES = (1, 2, 4, 8, 16, 24, 32, 48, 64)
PROMPT_LENGTHS = (64, 128, 512, 1024, 1536, 2048, 3072)  # single prompts, for the prompt steps' fit
PROFILE_DIR = Path(__file__).resolve().parent / "profiles"  # shipped with the package
DEFAULT_PROFILE = PROFILE_DIR / "smollm2-135m-bf16-2core.json"
ROLE_SWITCH_S = 0.03  # a profile that measured none: about a real switch beyond its drain on this machine


@dataclass
class StepProfile:
    """``cost``: the engine's fit, which a simulated worker's heartbeats report as a real worker's do, and
    which times prompt steps. ``decode``: measured decode-only steps, ``(rows, p50 ms, keys read per row)``
    by batch size, and ``prompt``: a least-squares fit of the steps that ran prompt chunks (the engine's own
    fit of them decays and is shared with decode rows; it missed prompt steps by 20%). A decode step's time is
    interpolated between the two nearest batch sizes of its regime (the
    engine's fused kernel up to ``small_max_rows`` rows, torch beyond: 32 rows can take longer than 48), the
    fit's slope beyond them, and moved by the fit's context term for keys read beyond the measured ones. One
    straight line per regime missed held-out batch sizes by up to 17%."""
    cost: StepCostModel
    about: dict  # what it was measured on: model, dtype, device, threads, machine, when, the batches
    decode: list[tuple[int, float, float]] = field(default_factory=list)
    prompt: list[float] = field(default_factory=list)  # ms = a + b * prompt tokens + c * thousands of pairs
    # a role switch beyond its drain: from the worker's Goodbye to its new Register acknowledged (about.role_switch
    # says how it was measured)
    role_switch_s: float = ROLE_SWITCH_S

    def __post_init__(self) -> None:
        small = self.cost.small_max_rows if len(self.cost.small) == 5 else 0
        # the engine runs up to small_max_rows rows in its fused kernel, more in torch: each regime has its table
        table = sorted(self.decode)
        self._tables = ([e for e in table if e[0] <= small], [e for e in table if e[0] > small])

    def step_ms(self, decode_tokens: int, decode_context: int, prompt_tokens: int = 0, prompt_pairs: int = 0) -> float:
        rows = decode_tokens
        small = rows <= self.cost.small_max_rows and len(self.cost.small) == 5
        table = self._tables[0 if small else 1]
        if prompt_tokens and len(self.prompt) == 3:  # the prompt steps' own fit, plus the decode rows' share
            a, b, c = self.prompt
            large = self.cost.large
            return a + b * prompt_tokens + c * prompt_pairs / 1e3 + large[1] * rows + large[2] * decode_context / 1e3
        if prompt_tokens or not table or not rows:
            return self.cost.step_ms(decode_tokens, decode_context, prompt_tokens, prompt_pairs)
        i = bisect.bisect_left(table, rows, key=lambda entry: entry[0])
        if i < len(table) and table[i][0] == rows:
            _, ms, keys = table[i]
        elif 0 < i < len(table):
            (r0, ms0, k0), (r1, ms1, k1) = table[i - 1], table[i]
            w = (rows - r0) / (r1 - r0)
            ms, keys = ms0 + w * (ms1 - ms0), k0 + w * (k1 - k0)
        else:
            r, ms, keys = table[0] if i == 0 else table[-1]
            ms += self.cost.step_ms(rows, int(rows * keys)) - self.cost.step_ms(r, int(r * keys))
        coef = self.cost.small if small else self.cost.large
        return max(ms + coef[2] * (decode_context - rows * keys) / 1e3, 0.0)

    @classmethod
    def load(cls, path: str | Path | None = None) -> StepProfile:
        path = Path(path) if path else DEFAULT_PROFILE
        try:
            raw = json.loads(path.read_text())
            decode = [tuple(entry) for entry in raw.get("decode", [])]
            return cls(msgspec.convert(raw["cost"], StepCostModel), raw.get("about", {}), sorted(decode),
                       [float(c) for c in raw.get("prompt", [])], float(raw.get("role_switch_s", ROLE_SWITCH_S)))
        except (OSError, ValueError, KeyError, TypeError, msgspec.ValidationError) as exc:
            raise ValueError(f"cannot read the step profile {path}: {exc}") from None

    def save(self, path: str | Path) -> None:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps({"cost": msgspec.to_builtins(self.cost), "decode": self.decode,
                                          "prompt": self.prompt, "role_switch_s": self.role_switch_s,
                                          "about": self.about}, indent=1) + "\n")


def run_batch(engine, rng: random.Random, batch: int, prompt_len: int, steps: int, name: str,
              learn: bool = True) -> list[tuple]:
    """Prefill ``batch`` fresh random prompts, then ``steps`` decode steps; every step's shape and seconds
    (``StepTimer.observe``'s arguments). With ``learn`` false the engine's step model does not see them."""
    from common.protocol.sampling_params import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=10_000, ignore_eos=True)
    vocab = engine.runner.vocab_size
    ids = [f"{name}-{i}" for i in range(batch)]
    for rid in ids:
        engine.add_request(rid, [rng.randrange(100, vocab - 1) for _ in range(prompt_len)], params)
    timed = []
    observe = engine.step_timer.observe
    engine.step_timer.observe = lambda *a: (timed.append(a), observe(*a) if learn else None)
    try:
        while any(s.num_computed_tokens < s.num_prompt_tokens for rid in ids for s in engine.requests[rid]):
            engine.step()
        for _ in range(steps):
            engine.step()
        return timed
    finally:
        engine.step_timer.observe = observe
        for rid in ids:
            engine.abort_request(rid)
        engine.step()


def make_engine(model: str, dtype: str, threads: int, device: str):
    import torch

    from common.config.base import EngineConfig
    from common.engine.llm_engine import LLMEngine

    torch.set_flush_denormal(True)
    return LLMEngine(EngineConfig(model=model, dtype=dtype, num_threads=threads, device=device,
                                  kv_cache_memory_bytes=2 << 30))


def record(model: str = "embedded", dtype: str = "bfloat16", threads: int = 2, device: str = "cpu",
           steps: int = 24, prompt_len: int = 256, seed: int = 7) -> StepProfile:
    """Measure the engine of this process and return its step-time fit."""
    from bench.machine import describe_machine

    engine = make_engine(model, dtype, threads, device)
    rng = random.Random(seed)
    run_batch(engine, rng, 2, 32, 3, "warm-up")
    decode, prompt_steps = [], []
    for batch in FIT_BATCHES:
        steps_run = run_batch(engine, rng, batch, prompt_len, steps, f"fit-{batch}")
        decoding = [t for t in steps_run if t[2] == 0]
        decode.append((batch, round(1e3 * statistics.median(t[4] for t in decoding), 3),
                       round(statistics.mean(t[1] / t[0] for t in decoding), 1)))
        prompt_steps += [t for t in steps_run if t[2] > 0 and t[0] == 0]
    for length in PROMPT_LENGTHS:  # prompt steps of other sizes and depths than the batches'
        prompt_steps += [t for t in run_batch(engine, rng, 1, length, 0, f"prompt-{length}") if t[2] > 0 and t[0] == 0]
    x = np.array([[1.0, t[2], t[3] / 1e3] for t in prompt_steps])
    y = np.array([1e3 * t[4] for t in prompt_steps])
    prompt = [round(float(c), 6) for c in np.linalg.lstsq(x, y, rcond=None)[0]]
    engine.step_timer._refit_at = 0.0
    cost = engine.step_timer.report()
    if cost is None:
        raise RuntimeError("the engine fitted no step-time model from the profiling steps")
    about = {"model": model, "dtype": dtype, "device": device, "threads": threads, "fit_batches": list(FIT_BATCHES),
             "prompt_len": prompt_len, "decode_steps_per_batch": steps,
             "recorded": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "machine": describe_machine()}
    return StepProfile(cost, about, decode, prompt)
