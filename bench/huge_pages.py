"""The weights in panels in 2 MB pages against the same weights in 4 KB pages: engine decode steps, alternating.

    .venv/bin/python -m bench.huge_pages --model 1b --rows 1,32 [--steps 200] [--window 5] [--seed 1]

One engine (bfloat16, 2 threads) loads ``--model`` (as bench/peers/compare.py's ``--model``); its weights in panels
live in the huge-page arena the engine makes (common/engine/huge_pages.py). A second copy of every panel goes into
an arena advised ``MADV_NOHUGEPAGE`` (4 KB pages whatever the kernel's policy). For each ``--rows`` count, that many
fresh prompts (128 random tokens each, their own seed) are prefilled, then ``--steps`` decode steps run with the
model reading one copy or the other, switching every ``--window`` steps, so that the host's drift in memory
bandwidth hits both alike. Each row of the table: the median step of each copy, the median over consecutive window
pairs of their ratio, and the streaming read bandwidth (``bench.roofline.read_bandwidth``) measured between windows,
against which one row's step is set as a multiple of the roofline (the bytes of the weights in panels over that
bandwidth). The KV pool holds every point's sequences whole (``--rows`` x (128 + ``--steps`` + 2) tokens).
"""
from __future__ import annotations

import argparse
import random
import statistics
import time

import torch

from bench.roofline import read_bandwidth
from common.config.base import EngineConfig
from common.engine.huge_pages import HugePageArena, thp_policy
from common.engine.llm_engine import LLMEngine
from common.protocol.sampling_params import SamplingParams

PROMPT_TOKENS = 128
PROBE_EVERY = 8  # windows between two bandwidth probes
BLOCK_SIZE = 16


def small_page_copies(panels: list[torch.Tensor]) -> list[torch.Tensor]:
    """Copies of ``panels`` in one arena advised out of huge pages (which lives as long as they do)."""
    arena = HugePageArena(HugePageArena.span([p.nbytes for p in panels]), huge=False)
    return [arena.take(p.shape, p.dtype).copy_(p) for p in panels]


def run_point(engine: LLMEngine, modules, copies: dict[str, list[torch.Tensor]], rows: int, args,
              seed: int) -> dict:
    rng = random.Random(seed)
    params = SamplingParams(temperature=0.0, max_tokens=args.steps + 2, ignore_eos=True)
    for i in range(rows):
        engine.add_request(f"s{seed}-{i}", [rng.randrange(100, 40000) for _ in range(PROMPT_TOKENS)], params)
    while any(s.num_computed_tokens < s.num_prompt_tokens for seqs in engine.requests.values() for s in seqs):
        engine.step()
    kernel = engine.runner.model.fused_decode
    times: dict[str, list[float]] = {name: [] for name in copies}
    windows: dict[str, list[float]] = {name: [] for name in copies}
    bandwidths: list[float] = []
    order = list(copies)
    for window in range(args.steps // args.window):
        if window % PROBE_EVERY == 0:
            bandwidths.append(read_bandwidth(passes=2))
        name = order[window % 2]
        for module, panels in zip(modules, copies[name]):
            module.panels = panels
        if kernel is not None:
            kernel.weights_moved()
        spent = []
        for _ in range(args.window):
            if not engine.has_unfinished():
                break
            started = time.perf_counter()
            engine.step()
            spent.append(time.perf_counter() - started)
        times[name] += spent
        windows[name].append(statistics.median(spent))
    while engine.has_unfinished():
        engine.step()
    pairs = [b / a for a, b in zip(windows["4 KB pages"], windows["2 MB pages"])]
    return {"rows": rows, **{name: 1e3 * statistics.median(t) for name, t in times.items()},
            "ratio": statistics.median(pairs), "bandwidth": (min(bandwidths), max(bandwidths)),
            "median_bandwidth": statistics.median(bandwidths)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="embedded")
    parser.add_argument("--rows", default="1,32", help="comma-separated decode batch sizes")
    parser.add_argument("--steps", type=int, default=200, help="decode steps per batch size")
    parser.add_argument("--window", type=int, default=5, help="steps on one copy before switching to the other")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args(argv)
    from bench.peers.compare import served_model
    model_path = served_model(args.model, "bfloat16").prepare("bfloat16")
    tokens = PROMPT_TOKENS + args.steps + 2
    blocks = max(int(r) for r in args.rows.split(",")) * -(-tokens // BLOCK_SIZE) + 1
    engine = LLMEngine(EngineConfig(model=str(model_path), dtype="bfloat16", num_threads=args.threads,
                                    block_size=BLOCK_SIZE, num_kv_blocks=blocks))
    model = engine.runner.model
    if model.panel_arena is None:
        print("the weights take no panels here (they need bfloat16 and a CPU with AVX512-BF16): nothing to compare")
        return 0
    modules = model.panel_layers()
    huge = [m.panels for m in modules]
    small = small_page_copies(huge)
    copies = {"2 MB pages": huge, "4 KB pages": small}
    weight_bytes = sum(p.nbytes for p in huge)
    in_huge = model.panel_arena.huge_bytes()
    print(f"{model_path.name}: {weight_bytes / 2**20:.0f} MiB in panels, {in_huge / 2**20:.0f} MiB of them in 2 MB "
          f"pages (transparent huge pages: {thp_policy()}); {args.threads} threads, {args.steps} steps per point, "
          f"switching every {args.window}\n")
    print("| rows | step, 2 MB pages | step, 4 KB pages | 2 MB / 4 KB (median of window pairs) | "
          "read bandwidth, GB/s | one row ÷ roofline, 2 MB / 4 KB |")
    print("|---|---|---|---|---|---|")
    for index, rows in enumerate(int(r) for r in args.rows.split(",")):
        point = run_point(engine, modules, copies, rows, args, args.seed * 1000 + index)
        low, high = point["bandwidth"]
        roofline_ms = 1e3 * weight_bytes / point["median_bandwidth"]
        over = (f"{point['2 MB pages'] / roofline_ms:.2f}× / {point['4 KB pages'] / roofline_ms:.2f}×"
                if rows == 1 else "—")
        print(f"| {rows} | {point['2 MB pages']:.2f} ms | {point['4 KB pages']:.2f} ms | {point['ratio']:.3f} | "
              f"{low / 1e9:.1f}-{high / 1e9:.1f} | {over} |", flush=True)
    for module, panels in zip(modules, huge):
        module.panels = panels
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
