"""KV pull bandwidth between two processes, next to a local memcpy of the same bytes.

    python -m bench.kv_transfer --backend nixl|zmq|both --mib 1,16,64 [--repeats 10] [--idle-cpu]

A spawned "prefill" process serves a pool of 1 MiB blocks; this process,
the "decode" side, pulls N MiB from it. Bandwidth = bytes pulled / time from
start_pull() to poll() reading DONE, busy-polling; the memcpy column is the
same bytes / ``dst.copy_(src)`` time on one thread in this process, in the same run.
Medians and bests over ``--repeats`` pulls after one warm-up; the puller
polls in a loop that yields the GIL (``time.sleep(0)``) each turn. Two patterns:
``contiguous`` (one run, one descriptor) and ``scattered`` (every block lands
on every other local block, so each block is its own descriptor).

``--idle-cpu`` also reports the CPU time an idle backend costs its process
(user + system over 5 s, pool registered, nothing moving), per setting.
The load average is printed because the machine may be shared: read the
numbers with it.
"""
from __future__ import annotations

import argparse
import multiprocessing
import os
import resource
import statistics
import time

import torch

from common.engine.kv_cache import KVCache, KVLayout
from kv_transfer.base import BACKENDS, TransferStatus
from kv_transfer.factory import default_backend_name, make_backend

LAYOUT = KVLayout(num_layers=16, block_size=16, num_kv_heads=4, head_dim=64, dtype="float32")  # 1 MiB a block
PULLER_OPTIONS = {"nixl": {"progress_thread": False}, "zmq": {}}
IDLE_SETTINGS = [
    ("nixl", {"progress_delay_us": 0}, "progress thread, delay 0 (NIXL's own)"),
    ("nixl", {"progress_delay_us": 1000}, "progress thread, delay 1000 us (default)"),
    ("nixl", {"progress_delay_us": 20000}, "progress thread, delay 20000 us"),
    ("nixl", {"progress_thread": False}, "no progress thread"),
    ("zmq", {}, "I/O thread"),
]
IDLE_SECONDS = 5.0
MIN_MEMCPY_SECONDS = 0.2  # small copies are repeated until timing noise averages out
WAIT_S = 120.0  # how long either process waits for the other before giving up


def serve(name: str, num_blocks: int, conn) -> None:
    backend = make_backend(name)
    pool = KVCache(LAYOUT, num_blocks)
    pool.buffer.uniform_()
    conn.send(backend.register_pool(pool))
    conn.poll(WAIT_S)
    backend.close()


def idle_cpu(name: str, options: dict, conn) -> None:
    backend = make_backend(name, **options)
    backend.register_pool(KVCache(LAYOUT, 4))
    before, started = resource.getrusage(resource.RUSAGE_SELF), time.monotonic()
    time.sleep(IDLE_SECONDS)
    after, elapsed = resource.getrusage(resource.RUSAGE_SELF), time.monotonic() - started
    conn.send((after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime) / elapsed)
    backend.close()


def spawn(target, *args):
    ctx = multiprocessing.get_context("spawn")
    parent, child = ctx.Pipe()
    process = ctx.Process(target=target, args=(*args, child), daemon=True)
    process.start()
    if not parent.poll(WAIT_S):
        raise TimeoutError(f"{target.__name__} process sent nothing within {WAIT_S}s")
    return process, parent, parent.recv()


def timed_pull(backend, transfer_id: str, remote: list[int], local: list[int]) -> float:
    started = time.perf_counter()
    handle = backend.start_pull(transfer_id, "prefill", remote, local, WAIT_S)
    while not backend.poll(handle).terminal:
        # Yield the GIL as a worker's loop does between steps; spinning starves the zmq I/O thread.
        time.sleep(0)
    seconds = time.perf_counter() - started
    backend.release(handle)
    if handle.status != TransferStatus.DONE:
        raise RuntimeError(f"pull {transfer_id} failed: {handle.error}")
    return seconds


def memcpy_seconds(mib: int, repeats: int) -> float:
    # One thread, like the kernel's cross-memory copy and the zmq receiver. Two-thread torch copies
    # on a shared 2-core machine wait for a descheduled worker: 1 MiB read 0.1-0.5 GB/s.
    torch.set_num_threads(1)
    src, dst = torch.rand(mib << 18), torch.rand(mib << 18)  # float32: 2**18 per MiB, pages touched
    times: list[float] = []
    while len(times) < repeats or sum(times) < MIN_MEMCPY_SECONDS:
        started = time.perf_counter()
        dst.copy_(src)
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def bench_backend(name: str, sizes: list[int], repeats: int) -> list[tuple]:
    server, conn, metadata = spawn(serve, name, max(sizes))
    backend = make_backend(name, **PULLER_OPTIONS[name])
    backend.register_pool(KVCache(LAYOUT, 2 * max(sizes)))
    rows = []
    try:
        backend.add_peer("prefill", metadata)
        for mib in sizes:
            copy_s = memcpy_seconds(mib, repeats)
            for pattern, local in (("contiguous", list(range(mib))), ("scattered", list(range(0, 2 * mib, 2)))):
                remote = list(range(mib))
                times = [timed_pull(backend, f"{pattern}-{mib}-{i}", remote, local) for i in range(repeats + 1)][1:]
                nbytes = mib << 20
                rows.append((name, pattern, mib, 1 if pattern == "contiguous" else mib, statistics.median(times),
                             nbytes / statistics.median(times), nbytes / min(times), nbytes / copy_s))
    finally:
        backend.close()
        conn.send("stop")
        server.join(WAIT_S)
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", choices=(*BACKENDS, "both"), default="both")
    parser.add_argument("--mib", default="1,16,64", help="comma-separated pull sizes in MiB")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--idle-cpu", action="store_true", help="also measure each backend's idle CPU cost")
    args = parser.parse_args(argv)
    sizes = [int(s) for s in args.mib.split(",")]
    names = list(BACKENDS) if args.backend == "both" else [args.backend]
    if "nixl" in names and default_backend_name() != "nixl":
        raise SystemExit("NIXL does not load here: pip install --no-deps nixl==1.5.1 nixl-cu12==1.5.1")
    print(f"load average at start: {' '.join(f'{x:.2f}' for x in os.getloadavg())} ({os.cpu_count()} CPUs)")
    print(f"{'backend':8} {'pattern':11} {'MiB':>4} {'descs':>5} {'median ms':>10} "
          f"{'GB/s med':>9} {'GB/s best':>9} {'memcpy GB/s':>11} {'pull/memcpy':>11}")
    for name in names:
        for row in bench_backend(name, sizes, args.repeats):
            backend, pattern, mib, descs, median_s, median_bw, best_bw, copy_bw = row
            print(f"{backend:8} {pattern:11} {mib:>4} {descs:>5} {median_s * 1e3:>10.2f} "
                  f"{median_bw / 1e9:>9.2f} {best_bw / 1e9:>9.2f} {copy_bw / 1e9:>11.2f} {median_bw / copy_bw:>11.2f}")
    if args.idle_cpu:
        print(f"\nidle CPU, {IDLE_SECONDS:.0f} s, pool registered, nothing moving (1.00 = one core):")
        for name, options, label in IDLE_SETTINGS:
            if name in names:
                process, _, fraction = spawn(idle_cpu, name, options)
                process.join(WAIT_S)
                print(f"  {name:5} {label:42} {fraction:.3f}")
    print(f"load average at end: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")


if __name__ == "__main__":
    main()
