"""What 2 MB pages cost a start: memory faulted in at load in 2 MB pages against 4 KB pages, and an engine's load
with engine.cpu.huge_pages on and off, taking turns.

    .venv/bin/python -m bench.page_faults [--mib 1024] [--rounds 3] [--model embedded] [--kv-mib 2048] \
        [--settle-s 5]

Memory: each round maps ``--mib`` afresh in an arena advised into huge pages and in one advised out of them
(common/engine/huge_pages.py), in turns, and zeroes it on one thread as a KV pool is at load (the kernel populates
it, ``take_zeroed``), then once more in 4 KB pages zeroed by writes (``zero_``: each page faulted in by its first
write), the populate's baseline: wall time and the process's CPU time (user and system) per GiB. A kernel
faults a 2 MB page in by zeroing it; on bare metal that runs at memory speed, but in a VM whose host takes back
its guests' free memory (free page reporting, as Firecracker does), each page the guest reuses costs the host its
own faults first. Before each, the benchmark waits ``--settle-s`` so that the memory the last one freed is handed
back as it would be long before a new worker starts (the guest reports free memory 2 s after it is freed); 0
measures memory freed a moment ago. Engine: each round loads ``--model`` in bfloat16 with a ``--kv-mib`` pool
once each way (2 threads, the decode rungs' timing left out), and gives the load's wall and CPU time and the
pool's fault-in time (``KVCache.fault_s``). The medians over rounds and their ratios.
"""
from __future__ import annotations

import argparse
import gc
import resource
import statistics
import time

import torch

from common.engine.huge_pages import HugePageArena, thp_policy

WAYS = {"2 MB pages": True, "4 KB pages": False}


def cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def fault_in(nbytes: int, huge: bool, written: bool = False) -> tuple[float, float, int]:
    """A fresh arena of ``nbytes`` zeroed on one thread as a KV pool is (``take_zeroed``: the kernel populates it),
    or ``written`` by ``zero_`` (each page faulted in by its first write): (wall s, CPU s, bytes the kernel put in
    2 MB pages)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        wall, cpu = time.perf_counter(), cpu_s()
        arena = HugePageArena(nbytes, huge=huge)
        if written:
            arena.take((nbytes,), torch.uint8).zero_()
        else:
            arena.take_zeroed((nbytes,), torch.uint8)
        wall, cpu = time.perf_counter() - wall, cpu_s() - cpu
        return wall, cpu, arena.huge_bytes()
    finally:
        torch.set_num_threads(threads)


def load_engine(model: str, kv_bytes: int, huge: bool) -> tuple[float, float, float]:
    """``model`` loaded in bfloat16 with a ``kv_bytes`` pool: (wall s, CPU s, the pool's fault-in s)."""
    from bench.peers.compare import served_model
    from common.config.base import CpuConfig, EngineConfig
    from common.engine.llm_engine import LLMEngine

    path = served_model(model, "bfloat16").prepare("bfloat16")
    wall, cpu = time.perf_counter(), cpu_s()
    engine = LLMEngine(EngineConfig(model=str(path), dtype="bfloat16", num_threads=2, kv_cache_memory_bytes=kv_bytes,
                                    cpu=CpuConfig(huge_pages=huge, decode_kernel_max_batch=8)))
    wall, cpu = time.perf_counter() - wall, cpu_s() - cpu
    fault_s = engine.runner.kv_cache.fault_s
    del engine
    gc.collect()
    return wall, cpu, fault_s


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mib", type=int, default=1024, help="memory faulted in per way and round (default: 1024)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--model", default="embedded", help="as bench/peers/compare.py's --model; none: no engine")
    parser.add_argument("--kv-mib", type=int, default=2048, help="the engine's KV pool (default: 2048, the default)")
    parser.add_argument("--settle-s", type=float, default=5.0, help="wait before each fault-in and load (default: 5)")
    args = parser.parse_args(argv)
    print(f"transparent huge pages: {thp_policy()}; {args.rounds} rounds, the ways in turns", flush=True)
    memory: dict[str, list[tuple[float, float, int]]] = {way: [] for way in WAYS}
    written: list[tuple[float, float, int]] = []  # 4 KB pages zeroed by writes: the populate's baseline
    engines: dict[str, list[tuple[float, float, float]]] = {way: [] for way in WAYS}
    for r in range(args.rounds):
        order = list(WAYS) if r % 2 == 0 else list(WAYS)[::-1]
        for way in order:
            time.sleep(args.settle_s)
            memory[way].append(fault_in(args.mib << 20, WAYS[way]))
        time.sleep(args.settle_s)
        written.append(fault_in(args.mib << 20, False, written=True))
        if args.model != "none":
            for way in order:
                time.sleep(args.settle_s)
                engines[way].append(load_engine(args.model, args.kv_mib << 20, WAYS[way]))
    gib = args.mib / 1024
    print(f"\n| {args.mib} MiB zeroed on one thread | wall s per GiB | CPU s per GiB | in 2 MB pages |\n"
          "|---|---|---|---|")
    for way, runs in [*memory.items(), ("4 KB pages, zeroed by writes", written)]:
        print(f"| {way} | {statistics.median(w for w, _, _ in runs) / gib:.2f} | "
              f"{statistics.median(c for _, c, _ in runs) / gib:.2f} | "
              f"{statistics.median(h for _, _, h in runs) / 2**20:.0f} MiB |")
    ratio = statistics.median(a[1] / b[1] for a, b in zip(*memory.values()))
    print(f"\nCPU time, 2 MB / 4 KB pages: {ratio:.1f}x (median over rounds)")
    ratio = statistics.median(a[1] / b[1] for a, b in zip(memory["4 KB pages"], written))
    print(f"CPU time in 4 KB pages, populated / zeroed by writes: {ratio:.2f}x (median over rounds)")
    if args.model != "none":
        print(f"\n| {args.model}, bfloat16, {args.kv_mib} MiB pool | load wall s | load CPU s | pool fault-in s |"
              "\n|---|---|---|---|")
        for way, runs in engines.items():
            print(f"| {way} | " + " | ".join(f"{statistics.median(run[i] for run in runs):.1f}" for i in range(3))
                  + " |")
        ratio = statistics.median(a[1] / b[1] for a, b in zip(*engines.values()))
        print(f"\nload CPU time, 2 MB / 4 KB pages: {ratio:.1f}x (median over rounds)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
