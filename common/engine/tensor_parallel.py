"""Tensor parallelism inside one worker: the rank group's collectives, and the processes of ranks 1..N-1.

A worker at ``engine.tensor_parallel_size`` = N is N processes, one device each (``engine.ranks.devices``). To the
proxy it is one worker: rank 0 is the worker process (its sockets, scheduler, block manager, sampler and transfer
agent); it starts the other ranks (``RankProcesses``), which only execute. Each step rank 0 sends every rank the
same inputs (the flat batch and its step context, ``send``) over a pipe; then all ranks run the same forward on
their slices of the weights and KV heads, joined by ``Parallel``'s collectives (gloo on the CPU, NCCL on GPUs):
an all-reduce after each attention output and MLP projection (row-parallel; int8's W8A8 adds one of each input
row's range before it, and sums in int32), one after the vocabulary-parallel embedding, and a gather of the
vocabulary-parallel logits to rank 0, which alone samples.

The KV pool is one rank-major buffer in shared memory (common/engine/kv_cache.py) that rank 0 makes and hands to
the others, so rank 0's transfer agent, host tier and block copies reach every rank's slice of a block.

A rank's death is the worker's death: rank 0 watches the others' process sentinels and exits at once when one
ends (the proxy sees one worker gone and resumes its requests elsewhere), and a collective that fails on rank 0 (a
rank silent past engine.ranks.step_timeout_s) ends the worker too (``RankGroupBroken``); a rank whose pipe from
rank 0 closes (rank 0 died) exits, and the kernel kills it too when its parent goes (PR_SET_PDEATHSIG). Ranks
ignore SIGTERM and SIGINT: rank 0 drains on them and then closes the ranks (``close``).
"""
from __future__ import annotations

import ctypes
import logging
import os
import pickle
import shutil
import signal
import tempfile
import threading
import time
from datetime import timedelta
from multiprocessing import util as mp_util
from multiprocessing.connection import Connection, wait

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from common.engine.attention import EncodeContext, PrefillChunk, StepContext

log = logging.getLogger(__name__)


class RankGroupBroken(RuntimeError):
    """A collective failed: a rank is gone, or silent past engine.ranks.step_timeout_s. The ranks can no longer agree
    on which collective is which (a silent rank that wakes would join the next step's), so the worker ends."""


class Parallel:
    """This process's place in its worker's rank group, and the collectives the sharded model calls."""

    def __init__(self, rank: int = 0, size: int = 1, timeout_s: float | None = None) -> None:
        self.rank, self.size = rank, size
        # the bound on each collective, and the setting it comes from: the load's (the group's own) until
        # ``serve_steps`` gives the steps a group of their own
        self.timeout_s, self.setting = timeout_s, "engine.ranks.timeout_s"
        self.group = None  # None: the default group
        self.broken: RankGroupBroken | None = None  # once a collective failed, every later one fails at once

    def serve_steps(self, step_timeout_s: float) -> None:
        """From now on the collectives go through a group of every rank whose bound is engine.ranks.step_timeout_s
        (the load's may be long: a rank loads its slice at its own pace). Every rank calls it once loaded: rank 0
        after every other said it is ready (model_runner.py)."""
        self.group = dist.new_group(list(range(self.size)), timeout=timedelta(seconds=step_timeout_s))
        self.timeout_s, self.setting = step_timeout_s, "engine.ranks.step_timeout_s"

    def _failed(self, what: str, exc: Exception) -> RankGroupBroken:
        """A collective that failed (a rank gone, or silent past the group's timeout), with the setting named."""
        self.broken = RankGroupBroken(f"tensor parallel {what} across the worker's {self.size} ranks failed (each "
                                      f"waits at most {self.setting} = {self.timeout_s}s): {exc}")
        return self.broken

    def check(self) -> None:
        """Raises the group's failure, if a collective failed before: no step runs on a broken group."""
        if self.broken is not None:
            raise self.broken

    def vocab_rows(self, vocab_size: int) -> tuple[int, int]:
        """(first row, rows) of this rank's slice of the embedding and LM head: the vocabulary split into equal
        slices of ceil(vocab / size) rows, the last padded with zero rows."""
        rows = -(-vocab_size // self.size)
        return self.rank * rows, rows

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum over ranks of ``x`` (a row-parallel layer's partial output), in float32 for a narrower float
        dtype; float64 and int32 (int8 matmuls' sums) as they are."""
        if self.size == 1:
            return x
        wide = x if x.dtype in (torch.float32, torch.float64, torch.int32) else x.float()
        self.check()
        try:
            dist.all_reduce(wide, group=self.group)
        except RuntimeError as exc:
            raise self._failed("all-reduce", exc) from exc
        return wide if wide is x else wide.to(x.dtype)

    def all_reduce_max(self, x: torch.Tensor) -> torch.Tensor:
        """The element-wise max over ranks of ``x`` (float32): a column-parallel weight's channel ranges, and for
        int8 a row-parallel layer's weight rows' and input rows' ranges (each rank holds a slice of every row)."""
        if self.size == 1:
            return x
        x = x.float().contiguous()
        self.check()
        try:
            dist.all_reduce(x, op=dist.ReduceOp.MAX, group=self.group)
        except RuntimeError as exc:
            raise self._failed("all-reduce", exc) from exc
        return x

    def gather_vocab(self, logits: torch.Tensor, vocab_size: int) -> torch.Tensor | None:
        """Rank 0: the full ``[rows, vocab]`` logits from every rank's vocabulary slice; other ranks: None."""
        if self.size == 1:
            return logits
        logits = logits.contiguous()
        parts = [torch.empty_like(logits) for _ in range(self.size)] if self.rank == 0 else None
        self.check()
        try:
            dist.gather(logits, parts, dst=0, group=self.group)
        except RuntimeError as exc:
            raise self._failed("gather of the logits", exc) from exc
        return None if parts is None else torch.cat(parts, dim=-1)[:, :vocab_size]


def join_group(config, rank: int, rendezvous: str) -> None:
    """Joins this worker's process group as ``rank`` through the ``rendezvous`` file rank 0 named, within
    engine.ranks.timeout_s (a file, not a port: nothing another process binds can take it)."""
    backend = "nccl" if config.device_type == "cuda" else "gloo"
    try:
        dist.init_process_group(backend, init_method=f"file://{rendezvous}", rank=rank,
                                world_size=config.tensor_parallel_size,
                                timeout=timedelta(seconds=config.ranks.timeout_s))
    except Exception as exc:  # a rank that never came up: the worker does not start
        raise RuntimeError(f"rank {rank} could not join the worker's {config.tensor_parallel_size} ranks within "
                           f"engine.ranks.timeout_s ({config.ranks.timeout_s}s): {exc}") from exc


# ---- what rank 0 sends each step ----------------------------------------------------------------
# A step's inputs travel as numpy arrays in one pickle (no shared-memory segment per step); a rank rebuilds the
# step context around its own slice of the KV pool.

def _array(t):
    return None if t is None else t.cpu().numpy()


def pack_step(ctx, input_ids: torch.Tensor, positions: torch.Tensor, logits_rows: torch.Tensor | None) -> bytes:
    if isinstance(ctx, EncodeContext):
        context = ("encode", _array(ctx.index), _array(ctx.mask), ctx.batch, ctx.length)
    else:
        chunks = [(c.token_start, c.token_end, c.num_computed, _array(c.block_table)) for c in ctx.chunks]
        context = ("step", _array(ctx.slot_blocks), _array(ctx.slot_offsets), chunks, _array(ctx.decode_rows),
                   _array(ctx.decode_block_tables), _array(ctx.decode_context_lens))
    return pickle.dumps((context, _array(input_ids), _array(positions), _array(logits_rows)),
                        protocol=pickle.HIGHEST_PROTOCOL)


def unpack_step(data: bytes, kv_cache, device: torch.device):
    """(context, input_ids, positions, logits_rows) of a packed step, on ``device``, over ``kv_cache``."""
    def tensor(a):
        return None if a is None else torch.from_numpy(a).to(device)

    context, ids, positions, rows = pickle.loads(data)
    if context[0] == "encode":
        ctx = EncodeContext(tensor(context[1]), tensor(context[2]), context[3], context[4])
    else:
        _, slot_blocks, slot_offsets, chunks, decode_rows, tables, lens = context
        ctx = StepContext(kv_cache=kv_cache, slot_blocks=tensor(slot_blocks), slot_offsets=tensor(slot_offsets),
                          chunks=[PrefillChunk(a, b, c, tensor(t)) for a, b, c, t in chunks])
        ctx.decode_rows, ctx.decode_block_tables, ctx.decode_context_lens = (tensor(decode_rows), tensor(tables),
                                                                              tensor(lens))
    return ctx, tensor(ids), tensor(positions), tensor(rows)


# ---- ranks 1..N-1 --------------------------------------------------------------------------------

class RankProcesses:
    """Rank 0's handle on the worker's other ranks: started before rank 0 loads its own slice (they load
    theirs meanwhile), handed the shared KV pool, sent each step, watched, closed."""

    def __init__(self, config, model_dir: str, target) -> None:
        """``target(config, model_dir, rank, rendezvous, link)``: a rank process's main (model_runner.serve_rank)."""
        self.config = config
        handle, self.rendezvous = tempfile.mkstemp(prefix="tessera-ranks-")
        os.close(handle)
        os.unlink(self.rendezvous)  # the group's file store makes it
        context = mp.get_context("spawn")
        self.links: list[Connection] = []
        self.procs = []
        for rank in range(1, config.tensor_parallel_size):
            parent, child = context.Pipe()
            proc = context.Process(target=target, args=(config, str(model_dir), rank, self.rendezvous, child),
                                   name=f"tessera-rank{rank}", daemon=True)
            proc.start()
            child.close()
            self.links.append(parent)
            self.procs.append(proc)
        self._closing = False
        log.info("tensor parallel: started ranks 1..%d (pids %s) on %s, rendezvous %s", len(self.procs),
                 [p.pid for p in self.procs], config.devices[1:], self.rendezvous)

    def join(self) -> None:
        """Joins the group as rank 0; a rank that ends before joining fails the worker with its own error."""
        failure: list[BaseException] = []

        def join_rank0() -> None:
            try:
                join_group(self.config, 0, self.rendezvous)
            except BaseException as exc:
                failure.append(exc)

        joining = threading.Thread(target=join_rank0, name="tessera-rank-join", daemon=True)
        joining.start()
        while joining.is_alive():
            joining.join(0.2)
            for rank, (proc, link) in enumerate(zip(self.procs, self.links), start=1):
                if not proc.is_alive():
                    detail = _last_word(link) or f"exit code {proc.exitcode}"
                    self.close()
                    raise RuntimeError(f"rank {rank} failed to start: {detail}")
        if failure:
            self.close()
            raise failure[0]

    def share_pool(self, pool: torch.Tensor) -> None:
        for link in self.links:
            link.send(pool)  # torch's reductions pass the shared-memory handle, not the bytes

    def wait_ready(self) -> None:
        """Every rank loaded its slice, within engine.ranks.timeout_s; else the worker does not start."""
        deadline = time.monotonic() + self.config.ranks.timeout_s
        for rank, link in enumerate(self.links, start=1):
            if not link.poll(max(0.0, deadline - time.monotonic())):
                self.close()
                raise RuntimeError(f"rank {rank} did not load its slice within engine.ranks.timeout_s "
                                   f"({self.config.ranks.timeout_s}s)")
            status, detail = link.recv()
            if status != "ready":
                self.close()
                raise RuntimeError(f"rank {rank} failed to start: {detail}")
        threading.Thread(target=self._watch, name="tessera-rank-watch", daemon=True).start()

    def _watch(self) -> None:
        """A rank that ends while the worker runs takes the worker with it: its slices are gone."""
        ended = wait([p.sentinel for p in self.procs])
        if self._closing:
            return
        dead = [p for p in self.procs if p.sentinel in ended]
        log.critical("tensor parallel rank %s (pid %s) ended with exit code %s: the worker exits",
                     dead[0].name, dead[0].pid, dead[0].exitcode)
        self._remove_files()
        # os._exit skips multiprocessing's exit steps, which remove its temporary directory (the
        # listener the ranks' shared tensors went through): removed here, as they would have.
        shutil.rmtree(mp_util.get_temp_dir(), ignore_errors=True)
        logging.shutdown()
        os._exit(70)

    def send(self, data: bytes) -> None:
        for link in self.links:
            link.send_bytes(data)

    def close(self) -> None:
        """Stops the ranks: each leaves its loop on the closing message; one that does not is killed."""
        if self._closing:
            return
        self._closing = True
        for link in self.links:
            try:
                os.set_blocking(link.fileno(), False)  # a rank that reads nothing (stuck) must not hold the close
                link.send_bytes(b"")
            except OSError:  # BlockingIOError among them: that rank is killed below
                pass
        deadline = time.monotonic() + self.config.ranks.timeout_s
        for proc in self.procs:
            proc.join(max(0.0, deadline - time.monotonic()))
            if proc.is_alive():
                proc.kill()
                proc.join()
        for link in self.links:
            link.close()
        self._remove_files()

    def _remove_files(self) -> None:
        """The group's rendezvous file, which the ranks' file store leaves when a rank dies."""
        try:
            os.unlink(self.rendezvous)
        except OSError:
            pass


def _last_word(link: Connection) -> str:
    """What a rank that ended said of its failure, if it said anything."""
    try:
        return link.recv()[1] if link.poll() else ""
    except (EOFError, OSError):
        return ""


def become_rank(rank: int) -> None:
    """A rank process's set-up: the kernel kills it when its parent (rank 0) dies (Linux PR_SET_PDEATHSIG); it
    ignores SIGTERM and SIGINT (rank 0 drains, then closes it); its log lines name the rank."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG = 1
    except (OSError, AttributeError):
        pass  # elsewhere the closed pipe still ends the rank
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s rank{rank} %(levelname)s %(name)s: %(message)s")


def next_step(link: Connection) -> bytes | None:
    """The next packed step rank 0 sent, or None once rank 0 closes the worker or is gone."""
    try:
        return link.recv_bytes() or None
    except (EOFError, OSError):
        return None
