"""Executes one step plan: builds the flat batch and step context, runs the model, samples (one concept, a step's
execution; long because how a device runs it, chosen at load, belongs to it: the CPU's decode kernel and greedy
head, CUDA graphs).

The runner owns the model, the KV pool and the sampler. It never reaches
into the scheduler: it reads the plan (sequences and how many tokens each
computes) and returns the sampled tokens. Per-step metadata is built with
one pass over the plan's sequences and numpy/torch array ops, never a loop
over tokens.

At tensor parallelism every rank has a runner over its slice of the model and
the KV pool; rank 0's sends each step's inputs to the others before running
its own slice (``run``), and alone gets the logits and samples
(common/engine/tensor_parallel.py).
"""
from __future__ import annotations

import functools
import itertools
import logging
import os
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from common.engine.attention import get_step_context, select_backend
from common.engine.cuda_graphs import CudaGraph, DecodeGraphs
from common.engine.greedy_head import GreedyHead
from common.config.base import EngineConfig
from common.engine.queued_copies import queued_copy
from common.engine.kv_cache import KVCache, KVLayout
from common.engine.huge_pages import thp_policy
from common.engine.int8_ranges import cached_ranges, ranges_key
from common.engine.memory import device_memory_bytes, module_bytes, resident_bytes
from common.engine.malloc import loaded_allocator, release_freed_memory
from common.engine import compact_panels, deterministic
from common.engine.models.llama import (COMPACT_BESIDE_ROWS, FusedDecode, check_divisible, onednn_beside_panels,
                                       onednn_copy_dtype, onednn_rows, prepacks_weights, wide_sums)
from common.engine.models import preloaded
from common.engine.models.loader import load_hf_config, load_model
from common.engine.native import gemv_bf16_kernel, panels_amx_rows
from common.engine.quantization import (calibration_ids, choose_int8_matmul, input_absmax, int8_gemm_amx_rows,
                                        kernel_row_ranges, quantize_model_int8, smooth_for_int8, sums_in_float32)
from common.engine.sampler import Sampler, SamplingRow, argmax_suffices, penalty_prompt_ids
from common.engine.scheduler import StepPlan
from common.engine.sequence import Sequence
from common.engine.spec_verify import verify_drafts
from common.engine.tensor_parallel import (Parallel, RankProcesses, become_rank, join_group, next_step, pack_step,
                                           unpack_step)
from common.protocol.sampling_params import SamplingParams
from common.engine.attention import PrefillChunk, StepContext, step_context

log = logging.getLogger(__name__)

# Tokens per prompt of the int8 calibration text (``ModelRunner._input_ranges``): small enough for any pool a
# worker serves with, so every worker measures the same ranges.
CALIBRATION_WINDOW = 256
CALIBRATION_ROWS = 1024  # at most this many of the calibration's tokens in one forward (its windows side by side)
# Row counts at which the one-call decode kernel is timed against the torch path at load; the last is the most it
# takes by timing (``engine.cpu.decode_kernel_max_batch: -1``). 48 and 64: on an Intel Xeon with AMX the kernel
# was 1.24x the torch path's speed there at 135M and 1.13x and 1.06x at the 1B shape (bench.decode_kernel
# --max-batch 64 --rows 32,48,64; docs/history/benchmarks-rounds.md, "Where a saturated server's cores go, and 64-row
# steps in one call"), where the rungs stopping at 32 left saturation's 64-row
# steps to the torch path's ~40 operators a layer.
DECODE_ROW_RUNGS = (1, 2, 4, 8, 16, 24, 32, 48, 64)
# The kernel keeps a rung unless the torch path is this much faster there: near the crossover either is as fast,
# and a choice that timing noise flips from one start to the next would change which numerics a batch gets.
KERNEL_MARGIN = 1.05
# engine.cpu.compact_panels "auto": a compact copy beside the panels where it takes at most this share of the host's
# memory (the 1B shape's, 1.1 GB, on a 24 GB host; not the 3B shape's 4.5 GB, whose two P/D workers and pools would
# then not fit there), its size estimated from the weights' at COMPACT_RATIO (0.79-0.81x measured:
# kernels/compact_panels.h).
COMPACT_AUTO_SHARE = 1 / 16
COMPACT_RATIO = 0.82


def largest_rung(rungs: list[int], ahead, settled: int = 32) -> int:
    """The largest of ``rungs`` (ascending; the first taken as ahead untimed) below the first at which
    ``ahead(rows)`` fails, asking the last rung first (where the kernel is ahead there, as on a small model, one
    timing settles it). Past ``settled`` (the rungs every CPU kind was measured at) the rungs are asked downwards
    from the last, so a kernel behind at 64 rows but ahead at 32 keeps 32 with a timing or two; below it they are
    scanned upwards rather than bisected: the kernel's lead is not monotone in the rows (1B shape, Zen 4: 14%
    behind at 4 rows, 7% at 8)."""
    if len(rungs) == 1 or ahead(rungs[-1]):
        return rungs[-1]
    for rows in reversed([rows for rows in rungs[1:-1] if rows >= settled]):
        if ahead(rows):
            return rows
    chosen = rungs[0]
    for rows in rungs[1:-1]:
        if rows >= settled or not ahead(rows):
            break
        chosen = rows
    return chosen


@dataclass
class PreparedStep:
    input_ids: torch.Tensor
    positions: torch.Tensor
    context: StepContext
    sample_seqs: list[Sequence]  # sequences that sample this step, in row order
    sample_rows: torch.Tensor  # their rows in the flat batch (1 + drafts rows for a verifying one)
    drafts: list[list[int]]  # per sample sequence, the draft tokens it verifies


@dataclass
class HostStep:
    """One step's flat batch as host arrays, before any copy to the device (``ModelRunner.host_step``)."""

    tokens: np.ndarray
    positions: np.ndarray
    slot_blocks: np.ndarray  # the block each row's K/V goes to (its slot: position % block_size)
    chunks: list[tuple[int, int, int, np.ndarray]]  # (first row, end row, tokens cached before, block table)
    decode_tables: np.ndarray | None  # [decode rows, blocks], zero-padded; None: no decode row
    decode_lens: np.ndarray | None  # [decode rows] context length, the row's own token included
    sample_seqs: list[Sequence]
    sample_rows: np.ndarray
    drafts: list[list[int]]


@dataclass
class StepSample:
    """What one step emitted, per sequence that sampled (in ``seqs`` order)."""

    seqs: list[Sequence]
    token_ids: list[list[int]]  # one token, or accepted drafts plus one
    logprobs: list[list[float]] | None = None
    top_logprobs: list[list[list[tuple[int, float]]]] | None = None
    num_drafts: list[int] = field(default_factory=list)  # proposed, per sequence
    num_accepted: list[int] = field(default_factory=list)
    nonfinite: list[Sequence] = field(default_factory=list)  # logits with a NaN or Inf: sampled nothing


@dataclass
class LaunchedStep:
    """A step queued on the device (``ModelRunner.launch``): the sampling sequences, their drafts, the mask to apply,
    and the float32 logits of their rows, or the greedy head's tokens, or neither (a step that samples nothing)."""

    seqs: list[Sequence]
    drafts: list[list[int]]
    constrain: object = None
    logits: torch.Tensor | None = None
    tokens: torch.Tensor | None = None  # on the device: a step that runs ahead reads its input tokens here
    # With ``tokens`` from the logits (``_argmax_step``): each row's token on the host, -1 where its logits were not
    # finite, once ``ready`` (None: at once) has passed
    reported: torch.Tensor | None = None
    ready: object = None


def _argmax_step(seqs: list[Sequence], logits: torch.Tensor) -> LaunchedStep:
    """A step whose rows all take their logits' argmax, queued on the device: the tokens, and for the host each
    row's token or -1 where its logits were not finite (a row's float32 sum is not finite exactly when one of its
    logits is not: finite logits would have to pass 1e33 to overflow it). On a GPU the host's copy is queued now,
    so that ``finish`` waits for this step alone, not for a step queued after it."""
    if logits.device.type == "cpu":  # numpy's argmax: 0.2-0.4x of torch's on this CPU (python -m bench.argmax_check)
        logits = logits.float()
        tokens = torch.from_numpy(np.argmax(logits.numpy(), axis=1))
        reported = torch.where(torch.isfinite(logits.sum(-1)), tokens, -1)
        return LaunchedStep(seqs, [[] for _ in seqs], None, tokens=tokens, reported=reported)
    tokens = logits.argmax(-1)
    reported = torch.where(torch.isfinite(logits.sum(-1, dtype=torch.float32)), tokens, -1)
    ready = torch.cuda.Event()
    reported = reported.to("cpu", non_blocking=True)  # into pinned memory, ordered on the stream
    ready.record()
    return LaunchedStep(seqs, [[] for _ in seqs], None, tokens=tokens, reported=reported, ready=ready)


def nonfinite_rows(logits: torch.Tensor) -> list[int]:
    """The rows that hold a NaN or Inf. A row's sum is not finite when one of its logits is not, or when finite
    logits overflow it, which the exact check on those rows then clears: one pass over the logits, 0.03-0.25x of
    isfinite over every logit (``python -m bench.nonfinite_check``; docs/history/benchmarks-rounds.md, "Where an engine
    step's time goes")."""
    suspect = (~torch.isfinite(logits.sum(-1))).nonzero().flatten()
    if not len(suspect):
        return []
    return suspect[~torch.isfinite(logits[suspect]).all(-1)].tolist()


class ModelRunner:
    def __init__(self, config: EngineConfig, model_dir: str | Path, rank: int = 0, rank_link=None,
                 rendezvous: str = "", kv_tokens: list[int] | None = None) -> None:
        """Rank 0 (the worker's own runner) starts the other ranks at tensor_parallel_size > 1; a rank process
        (``serve_rank``) passes its ``rank``, its pipe from rank 0 and the group's ``rendezvous`` file.
        ``kv_tokens``: the sequences whose tokens (each at most the context) are all the pool need hold at once,
        where that is fewer blocks than its budget (``tessera generate``, whose prompts are known)."""
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        config = self.config = deterministic.settle(config, model_dir)
        # Fault injection for tests (a worker's testing.fault_nonfinite_logits_token): NaN logits for a sequence
        # whose prompt holds this token id.
        self.fault_nonfinite_token: int | None = None
        self.fault_hang_token: int | None = None  # testing.fault_hang_token: a step holding it never returns
        self.tp = Parallel(rank, config.tensor_parallel_size, config.ranks.timeout_s)
        self.ranks: RankProcesses | None = None
        self._serving = False  # rank 0 sends steps to the other ranks once all of them are up
        if self.tp.size > 1:
            if config.device_type == "cuda":
                raise ValueError("engine.tensor_parallel_size > 1 runs on the CPU only for now: the ranks share "
                                 "one KV pool in host memory (docs/deploy.md, tensor parallelism)")
            if rank == 0:
                check_divisible(load_hf_config(model_dir), self.tp.size)  # before any rank starts
                self.ranks = RankProcesses(config, str(model_dir), serve_rank)
                self.ranks.join()
            else:
                join_group(config, rank, rendezvous)
        self.device = torch.device(config.devices[rank])
        self.dtype = getattr(torch, config.dtype)
        self.attention = select_backend(config.attention_backend, str(self.device), config.block_size,
                                        config.deterministic)
        started = time.monotonic()
        kept = preloaded.take(preloaded.key(config, model_dir, str(self.device),
                                            prepacks_weights(config, self.device, self.dtype))
                              if self.tp.size == 1 and preloaded.held() else None)
        self.adopted = kept is not None  # the weights a parent process loaded and prepacked (``preload``)
        if kept is not None:
            self.model = kept
            for layer in self.model.layers:
                layer.self_attn.backend = self.attention
        else:
            self.model = load_model(model_dir, self.dtype, str(self.device), self.attention, self.tp)
        if config.deterministic:  # before int8 calibration too, so its ranges do not depend on the thread count
            self.model.make_deterministic()
        self.load_s = time.monotonic() - started
        self.weight_bytes = module_bytes(self.model)
        hf = self.model.config
        attn = self.model.layers[0].self_attn
        self.layout = KVLayout(hf.num_hidden_layers, config.block_size, attn.num_kv_heads * self.tp.size,
                               attn.head_dim, "int8" if config.cpu.kv_cache_dtype == "int8" else config.dtype,
                               self.tp.size)
        limit = self.model.rope.max_positions
        self.max_model_len = min(config.max_model_len or limit, limit)
        if rank == 0:
            num_blocks = config.num_kv_blocks or self.layout.blocks_for_budget(self._kv_budget())
            if kv_tokens is not None:  # each sequence's blocks whole, and one more
                num_blocks = min(num_blocks, sum(-(-min(tokens, self.max_model_len) // config.block_size) + 1
                                                 for tokens in kv_tokens))
            self.kv_cache = KVCache(self.layout, num_blocks, self.device, huge_pages=config.cpu.huge_pages)
            if self.ranks is not None:
                self.ranks.share_pool(self.kv_cache.share())
        else:
            if not rank_link.poll(config.ranks.timeout_s):
                raise RuntimeError(f"rank 0 sent no KV pool within engine.ranks.timeout_s ({config.ranks.timeout_s}s)")
            pool = rank_link.recv()
            self.kv_cache = KVCache(self.layout, pool.shape[1], self.device, rank, pool)
        self.vocab_size = hf.vocab_size
        if config.quantization == "int8":
            if config.int8.smoothing:
                smooth_for_int8(self.model, functools.partial(self._input_ranges, model_dir), config.int8.smoothing)
            quantize_model_int8(self.model)  # in place: the layers keep make_deterministic's paths
            started = time.monotonic()
            chosen = choose_int8_matmul(tuple(m.weight.shape) for m in self.model.modules()
                                        if isinstance(getattr(m, "weight", None), torch.Tensor)
                                        and m.weight.dtype is torch.int8)
            log.info("int8 matmul: kernels/int8_gemm.c (%s) at %s rows, %s at the others (timed in %.1fs)",
                     f"AMX tiles from {int8_gemm_amx_rows()} rows" if int8_gemm_amx_rows() else "VNNI",
                     "; ".join(f"{kernel_row_ranges(shape)} for {shape[0]}x{shape[1]}" for shape in chosen),
                     "exact float32 sums (no int8 dot product on this CPU)" if sums_in_float32() else "torch._int_mm",
                     time.monotonic() - started)
        bf16_cpu = self.dtype is torch.bfloat16 and self.device.type == "cpu" and not config.deterministic
        if bf16_cpu:
            gemv_bf16_kernel()  # built now, not on the first batch-1 decode step (models/llama.py ``linear``)
        # only bfloat16 weights take panels: not int8 or float32; one rank (engine.deterministic too: a panel's
        # every sum runs over k in one order at any rows, kernels/panels_bf16.h)
        if self._panels_planned() and self.model.pack_panels(self._compact_mode(), config.cpu.huge_pages):
            self._log_panels()
        # The one-call kernel has no all-reduce between its layers, and keeps float32 activations between them
        # where the layer-by-layer path rounds: engine.deterministic takes it for every row of every step (its
        # rows are batch-invariant, and a prompt's rows then write the K/V its decode steps would have) or for
        # none (``_fused_decode_kernel``).
        left = config.cpu.decode_kernel_max_batch < 0 and not config.deterministic
        if self._fused_decode_kernel():
            # -1 with float32 weights keeps the kernel's fixed limit (``FusedDecode``: 8 rows, 16 on an AVX2 CPU
            # without AVX-512): it is ahead there (1.4x at 8 rows, 135M, Zen 4; on Zen 3 1.08x at 16, 1.02x at 1B),
            # and the exactness tests compare float32 outputs across processes, which timing could split
            self.model.fused_decode = FusedDecode(self.model, DECODE_ROW_RUNGS[-1] if left
                                                  else config.cpu.decode_kernel_max_batch, config.deterministic)
            if self.model.fused_decode.available and not self.model.fused_decode.takes_shapes(config.block_size):
                log.warning("the one-call decode kernel (kernels/decode_forward.c) does not take this model's shapes "
                            "at block_size %d: every step takes the torch path", config.block_size)
                self.model.fused_decode = None
        if config.deterministic:
            log.info("engine.deterministic: every row of every step %s (engine.cpu.decode_kernel_max_batch)",
                     "through kernels/decode_forward.c" if self.model.fused_decode is not None
                     else "layer by layer, through the batch-invariant matmuls")
        # greedy rows' tokens from an int8 copy of a head in panels, and the few tokens it cannot rule out
        greedy_rows = self._greedy_head_rows()
        self.greedy_head = GreedyHead.of(self.model.head()) if greedy_rows else None
        if self.greedy_head is not None:
            self.greedy_head.max_rows = greedy_rows
            log.info("greedy LM head for steps of up to %d row(s): an int8 copy of the head (+%.1f MiB) rules out all "
                     "but a few tokens, whose exact logits come from the panels (common/engine/greedy_head.py; "
                     "engine.cpu.greedy_head_max_rows)", greedy_rows, self.greedy_head.nbytes / 2**20)
        if self._prepacks() and not self.adopted and (added := self.model.prepack_weights()):
            log.info("%s linear weights prepacked for oneDNN%s (+%.1f MiB; engine.cpu.prepack_weights)",
                     str(self.dtype).removeprefix("torch."),
                     " in float32" if onednn_copy_dtype(self.dtype) is not self.dtype else "", added / 2**20)
        if self.model.fused_decode is not None and left and (self.dtype is torch.bfloat16
                                                              or config.quantization == "int8"):
            self._choose_decode_rows()
        self.sampler = Sampler()
        self.graphs: DecodeGraphs | None = None  # decode steps replayed as CUDA graphs (``_capture_graphs``)
        if self.device.type == "cuda" and rank == 0:
            self._capture_graphs()
        if self.ranks is not None:
            self.ranks.wait_ready()
            self.tp.serve_steps(config.ranks.step_timeout_s)  # with every rank, once each said it is ready
            self._serving = True
        release_freed_memory()  # the load's temporaries: jemalloc keeps freed pages for the steps (engine.cpu.malloc)
        self._log_load(rank)

    def _log_load(self, rank: int) -> None:
        """The load's summary line (where INFO is logged: the pool's page count reads /proc/self/smaps,
        common/engine/huge_pages.py)."""
        if not log.isEnabledFor(logging.INFO):
            return
        config, hf = self.config, self.model.config
        log.info(
            "model loaded in %.1fs%s: %s layers, dtype %s, weights %s (%.2f GiB%s), attention %s; KV pool %d blocks "
            "x %d tokens of %s (%.1f MiB%s); resident %.2f GiB; malloc %s (engine.cpu.malloc)",
            self.load_s, " (its weights the parent process's, loaded before it forked this one)" if self.adopted
            else "", hf.num_hidden_layers, config.dtype,
            "int8" if config.quantization == "int8" else config.dtype,
            module_bytes(self.model) / 2**30, f", rank {rank} of {self.tp.size}" if self.tp.size > 1 else "",
            self.attention.name, self.kv_cache.num_blocks, config.block_size,
            "int8 rows (engine.cpu.kv_cache_dtype)" if self.layout.quantized else self.layout.dtype,
            self.kv_cache.nbytes / 2**20,
            self.kv_cache.pages_note(),
            resident_bytes() / 2**30, loaded_allocator(),
        )

    def _log_panels(self) -> None:
        """The load's line on the weights in panels (where INFO is logged: the arena's page count reads
        /proc/self/smaps, common/engine/huge_pages.py)."""
        if not log.isEnabledFor(logging.INFO):
            return
        config = self.config
        arena = self.model.panel_arena
        pages = ("in 4 KB pages" if arena is None else
                 "%.0f of their %.0f MiB in 2 MB pages" % (arena.huge_bytes() / 2**20, arena.nbytes / 2**20))
        compact = ""
        if self.model.layers[0].self_attn.qkv_proj.panels.dtype is torch.uint8:
            compact = "; the decoder's in compact panels, kernels/compact_panels.h"
        elif self.model.compact_bytes():
            compact = ("; the decoder's also in compact panels (%.0f MiB, kernels/compact_panels.h) for steps of "
                       "up to %d rows" % (self.model.compact_bytes() / 2**20, COMPACT_BESIDE_ROWS))
        copies = ("with oneDNN's copy for steps of %d rows or more (AMX)" % onednn_rows()
                  if onednn_beside_panels() and config.cpu.prepack_weights else "their only copy")
        if (amx := panels_amx_rows()) and not config.deterministic:
            copies += f", AMX tiles from {amx} rows"
        log.info("linear weights in the panel layout (kernels/panels_bf16.h%s), which the decode kernel and "
                 "kernels/linear_panels.c read: %s; %s (transparent huge pages: %s)", compact,
                 copies, pages, thp_policy() if config.cpu.huge_pages else "off, engine.cpu.huge_pages")

    def _choose_decode_rows(self) -> None:
        """The most rows the one-call kernel keeps, where ``decode_kernel_max_batch`` leaves it to timing (-1):
        a decode step's forward timed through the kernel and through the torch path now, on pages nothing owns
        yet, at rung counts of ``DECODE_ROW_RUNGS`` up to the kernel's limit (``largest_rung``). The kernel
        reads each weight once for all its rows, so it wins while a step is bound by reading the weights; past
        some rows a step is bound by its products, where the torch path's layer-by-layer matmuls can win
        (bfloat16, Zen 4, against oneDNN's: with the weights in panels, kernels/panels_bf16.h, the kernel ahead up
        to 32 rows at 135M and at the 1B shape, the rungs' end then; Intel with AMX: ahead at 64 too; in rows, up
        to 2 at 1B; int8, in integer sums against W8A8: ahead
        1.1-1.5x at 1-4 rows at 1B, even at 8; ``bench.decode_kernel --model 1b``). Either way is exact to its own
        numerics; only which one a step of some rows takes changes."""
        fused, bs = self.model.fused_decode, self.config.block_size
        rungs = [rows for rows in DECODE_ROW_RUNGS if rows <= min(fused.max_rows, self.num_blocks)]
        if not fused.available or not rungs:
            return  # no kernel built (no compiler): every step takes the torch path
        started = time.monotonic()

        def kernel_ahead(rows: int) -> bool:
            seqs = []
            for i in range(rows):
                seq = Sequence(f"timing-{i}", [1 + i] * bs, SamplingParams(), seed=0)
                seq.block_table, seq.num_computed_tokens = [i], bs - 1  # a decode row at the block's last slot
                seqs.append(seq)
            prepared = self.prepare(StepPlan(seqs, [1] * rows))
            kernel = torch_path = float("inf")
            for _ in range(3):
                fused.max_rows, self.model.fused_decode = rows, fused
                start = time.perf_counter()
                self.forward(prepared)
                middle = time.perf_counter()
                self.model.fused_decode = None
                self.forward(prepared)
                kernel, torch_path = min(kernel, middle - start), min(torch_path, time.perf_counter() - middle)
            return kernel <= torch_path * KERNEL_MARGIN

        chosen = largest_rung(rungs, kernel_ahead)
        fused.max_rows, self.model.fused_decode = chosen, fused
        log.info("decode steps: kernels/decode_forward.c up to %d row(s), the torch path past them (timed in "
                 "%.1fs; engine.cpu.decode_kernel_max_batch)", chosen, time.monotonic() - started)

    def _capture_graphs(self) -> None:
        """CUDA graphs of decode steps up to ``engine.cuda_graphs.max_rows`` rows, or as many as a step can hold
        (``max_num_seqs`` sequences, each with its drafts; ``max_num_batched_tokens``), where the attention
        backend's K/V write skips padding rows."""
        c = self.config
        settings = c.cuda_graphs
        if not settings.enabled:
            log.info("CUDA graphs: off (engine.cuda_graphs.enabled); decode steps run eagerly")
            return
        if not getattr(self.attention, "graph_safe", False) or self.tp.size > 1:
            log.warning("CUDA graphs: not with attention backend %s%s; decode steps run eagerly", self.attention.name,
                        " at tensor parallelism" if self.tp.size > 1 else " (its K/V write takes no padding row)")
            return
        drafts = c.spec.num_tokens if c.spec.method != "off" else 0
        max_rows = min(settings.max_rows, c.max_num_seqs * (1 + drafts), c.max_num_batched_tokens)
        max_context = min(settings.max_context, self.max_model_len)
        graphs = DecodeGraphs(self.model, self.kv_cache, c.block_size, max_rows, max_context, CudaGraph)
        try:
            seconds = graphs.capture()
        except Exception as exc:  # a model or kernel that cannot be captured still serves, eagerly
            log.warning("CUDA graphs: capture failed (%s: %s); decode steps run eagerly", type(exc).__name__, exc,
                        exc_info=True)
            del graphs
            torch.cuda.synchronize(self.device)
            torch.cuda.empty_cache()
            return
        self.graphs = graphs
        log.info("CUDA graphs: decode steps of 1 to %d rows captured in %d rungs (%s) for contexts up to %d tokens, "
                 "in %.1fs (engine.cuda_graphs)", max_rows, len(self.graphs.ladder),
                 ", ".join(map(str, self.graphs.ladder)), max_context, seconds)

    def _kv_budget(self) -> int:
        """The KV pool's bytes: ``kv_cache_memory_fraction`` of the device memory the weights leave, else
        ``kv_cache_memory_bytes``."""
        fraction = self.config.kv_cache_memory_fraction
        if fraction is None:
            return self.config.kv_cache_memory_bytes
        weights = self._serving_weight_bytes() * self.tp.size  # the ranks share the host's memory
        left = device_memory_bytes(self.device) - weights
        if left <= 0:
            raise ValueError(f"the model's weights as served ({weights / 2**30:.2f} GiB) leave no memory on "
                             f"{self.device} for a KV pool (kv_cache_memory_fraction)")
        return int(left * fraction)

    def _panels_planned(self) -> bool:
        """Whether the load moves the linear weights into panels (``LlamaForCausalLM.pack_panels``): bfloat16 on
        the CPU, one rank, and shapes and kernels that take them."""
        return (self.dtype is torch.bfloat16 and self.device.type == "cpu" and self.tp.size == 1
                and self.model.panels_fit())

    def _compact_mode(self) -> str:
        """engine.cpu.compact_panels for ``pack_panels``, "auto" settled: "beside" where compact panels are built
        here and the copy (about 0.8x the decoder's linear weights) is at most COMPACT_AUTO_SHARE of the host's
        memory, else "off". The copy serves the steps of a few rows (a host's one or two streams), where its bytes
        save 13-18% of a step at the 1B shape; bigger models keep the memory for the KV pool
        (docs/history/benchmarks-rounds.md, "At 1B parameters (moved 2026-12-07)")."""
        mode = self.config.cpu.compact_panels
        if mode != "auto":
            return mode
        if not compact_panels.available():
            return "off"
        fits = self._compact_copy_bytes() <= COMPACT_AUTO_SHARE * device_memory_bytes(self.device)
        return "beside" if fits else "off"

    def _compact_copy_bytes(self) -> int:
        """The compact copy's bytes before it is built: the decoder's linear weights' at COMPACT_RATIO."""
        return int(COMPACT_RATIO * sum(m.weight.nbytes for m in self.model.decoder_linears()))

    def _greedy_head_rows(self) -> int:
        """The most rows of a step the head's greedy copy (``GreedyHead``) takes: engine.cpu.greedy_head_max_rows,
        or for -1 ``GreedyHead.default_rows`` of the hidden size; 0 (no copy) but with the weights in panels, not
        int8, one rank, and a head ``GreedyHead.takes``. On a CPU with AMX, fewer rows than the whole head's call
        takes its tiles or oneDNN's copy from, so that the copy's exact logits have that call's bits."""
        setting = self.config.cpu.greedy_head_max_rows
        rows = setting if setting >= 0 else GreedyHead.default_rows(self.model.config.hidden_size)
        if not rows or self.config.quantization != "none" or not self._panels_planned():
            return 0
        if onednn_beside_panels():  # AMX: the whole head's calls of more rows take its tiles, or oneDNN's copy
            rows = min(rows, (panels_amx_rows() or onednn_rows()) - 1)
        return rows if GreedyHead.takes(*self.model.head().weight.shape) else 0

    def _fused_decode_kernel(self) -> bool:
        """Whether this runner gets the one-call decode kernel (``FusedDecode``): the CPU, its paged attention,
        ``decode_kernel_max_batch`` not 0, one rank. Under engine.deterministic, where the kernel takes every row
        of every step, -1 gives it to bfloat16 weights in panels only. There it is ahead of the layer path at
        any rows (135M, Zen 4: 0.95x the mode-off throughput against 0.49x, 1.09x its one-stream TPOT against
        1.97x); with int8 or float32 weights its prompt rows are behind the layer path's matmuls (int8: 0.54x
        against 0.91x at saturation, for 0.85x against 2.79x at one stream; ``bench.deterministic``)."""
        setting = self.config.cpu.decode_kernel_max_batch
        if self.config.deterministic and setting < 0 and self.model.layers[0].self_attn.qkv_proj.panels is None:
            return False
        return (self.device.type == "cpu" and self.attention.name in ("cpu_paged", "cpu_paged_deterministic")
                and setting != 0 and self.tp.size == 1)

    def _serving_weight_bytes(self) -> int:
        """The weights' bytes once the load has quantized or prepacked them (the pool is sized before either),
        the greedy head's copy (``GreedyHead.copy_bytes``: a byte per head weight, three float32 per token) and
        the compact copy beside the panels (``_compact_mode``, estimated at COMPACT_RATIO)."""
        copy = GreedyHead.copy_bytes(*self.model.head().weight.shape) if self._greedy_head_rows() else 0
        if self._panels_planned() and self._compact_mode() == "beside":
            copy += self._compact_copy_bytes()
        return self._stored_weight_bytes() + copy

    def _prepacks(self) -> bool:
        return prepacks_weights(self.config, self.device, self.dtype)

    def _stored_weight_bytes(self) -> int:
        """The weights' own bytes as served: int8 holds a linear weight (and the embedding) in a byte per value
        plus a float32 scale per row; the oneDNN prepack (``_prepacks``) keeps a second copy of every linear weight, and
        of a tied LM head, not in panels (``pack_panels``: the only copy of the layers it takes, but where oneDNN
        has AMX); a bf16 weight's copy in float32 (``onednn_widens_bf16``) twice its bytes. Not counted: the load's
        float32 temporary of one weight at a time while its copy is made."""
        linears = [m.weight for m in self.model.modules() if isinstance(m, torch.nn.Linear)]
        embedding = self.model.embed_tokens.weight
        if self.config.quantization == "int8":
            shrunk = sum(w.nbytes - w.numel() - 4 * w.shape[0] for w in [*linears, embedding])
            return self.weight_bytes - shrunk
        if self._prepacks():
            panels = set(self.model.panel_layers()) if self._panels_planned() and not onednn_beside_panels() else ()
            copied = [m for m in self.model.modules() if isinstance(m, torch.nn.Linear) and m not in panels]
            if self.model.tie_word_embeddings and self.model.embed_tokens not in panels:
                copied.append(self.model.embed_tokens)
            return self.weight_bytes + onednn_copy_dtype(self.dtype).itemsize * sum(m.weight.numel() for m in copied)
        return self.weight_bytes

    @property
    def num_blocks(self) -> int:
        return self.kv_cache.num_blocks

    # ---- batch preparation -------------------------------------------------
    def host_tier(self):
        """The KV tiers below the pool the config asks for (``engine.kv_tiers``):
        a ``HostTier`` for the block manager, or None."""
        c = self.config
        return self.kv_cache.host_tier(c.kv_tiers.host_memory_bytes, c.kv_tiers.disk_dir, c.kv_tiers.disk_bytes)

    def prepare(self, plan: StepPlan) -> PreparedStep:
        """The step's flat batch on the device (``host_step``'s arrays copied there)."""
        return self.to_device(self.host_step(plan))

    def to_device(self, host: HostStep) -> PreparedStep:
        """On a GPU the copies are queued behind the steps before (from pinned memory): a step run eagerly (a prompt
        chunk in it, or past the graphs' rows) is prepared while the one before runs, as a replayed one is."""
        ctx = StepContext(
            kv_cache=self.kv_cache,
            slot_blocks=self._queued_tensor(host.slot_blocks),
            slot_offsets=self._queued_tensor(host.positions % self.config.block_size),
            chunks=[PrefillChunk(start, end, done, self._queued_tensor(table))
                    for start, end, done, table in host.chunks],
        )
        if host.decode_tables is not None:
            ctx.decode_rows = self._queued_tensor(np.arange(len(host.decode_lens)))
            ctx.decode_block_tables = self._queued_tensor(host.decode_tables)
            ctx.decode_context_lens = self._queued_tensor(host.decode_lens)
        return PreparedStep(
            input_ids=self._queued_tensor(host.tokens),
            positions=self._queued_tensor(host.positions),
            context=ctx,
            sample_seqs=host.sample_seqs,
            sample_rows=self._queued_tensor(host.sample_rows),
            drafts=host.drafts,
        )

    def host_step(self, plan: StepPlan) -> HostStep:
        """Flat batch as host arrays: single-query rows first (decodes, and each draft being verified), then chunks.

        A verifying sequence's rows are decode rows too: row i attends to the
        context up to its own position, which the step writes before any
        attention runs, so drafts need no chunk path.
        """
        if plan.seqs and min(plan.num_new_tokens) == max(plan.num_new_tokens) == 1 and not any(plan.spec_token_ids):
            return self._decode_host_step(plan.seqs)
        return self._mixed_host_step(plan)

    def _mixed_host_step(self, plan: StepPlan) -> HostStep:
        """``host_step`` of any step, a sequence at a time."""
        bs = self.config.block_size
        entries = list(zip(plan.seqs, plan.num_new_tokens, plan.spec_token_ids))
        decode = [e for e in entries if e[1] == 1 or e[2]]
        chunked = [e for e in entries if e[1] > 1 and not e[2]]

        tokens: list[int] = []
        positions: list[np.ndarray] = []
        slot_blocks: list[np.ndarray] = []
        sample_seqs: list[Sequence] = []
        sample_rows: list[np.ndarray] = []
        drafts: list[list[int]] = []
        chunks: list[tuple[int, int, int, np.ndarray]] = []
        row = 0
        for seq, n, spec in decode + chunked:
            start = seq.num_computed_tokens
            pos = np.arange(start, start + n)
            table = np.asarray(seq.block_table, dtype=np.int64)
            tokens.extend(seq.token_ids[start:start + n - len(spec)])
            tokens.extend(spec)
            positions.append(pos)
            slot_blocks.append(table[pos // bs])
            if n > 1 and not spec:
                chunks.append((row, row + n, start, table[: -(-(start + n) // bs)]))
            row += n
            if start + n == seq.num_tokens + len(spec):
                sample_seqs.append(seq)
                sample_rows.append(np.arange(row - 1 - len(spec), row))
                drafts.append(spec)
        tables, lens = self._decode_tables(decode) if decode else (None, None)
        return HostStep(np.asarray(tokens, dtype=np.int64), np.concatenate(positions), np.concatenate(slot_blocks),
                        chunks, tables, lens, sample_seqs,
                        np.concatenate(sample_rows) if sample_rows else np.zeros(0, np.int64), drafts)

    def _decode_host_step(self, seqs: list[Sequence]) -> HostStep:
        """``host_step`` of a step of one row per sequence and no drafts (a decode step), in whole arrays: the
        general path's per-sequence work, at 256 rows, was most of a GPU decode step's host time."""
        bs, n = self.config.block_size, len(seqs)
        pos = np.fromiter((s.num_computed_tokens for s in seqs), dtype=np.int64, count=n)
        tokens = np.fromiter((s.token_ids[s.num_computed_tokens] for s in seqs), dtype=np.int64, count=n)
        samples = np.fromiter((s.num_tokens for s in seqs), dtype=np.int64, count=n) == pos + 1
        counts = np.fromiter((len(s.block_table) for s in seqs), dtype=np.int64, count=n)
        flat = np.fromiter(itertools.chain.from_iterable(s.block_table for s in seqs), dtype=np.int64,
                           count=int(counts.sum()))
        used = (pos + bs) // bs  # blocks up to and including the row's own position
        row = np.repeat(np.arange(n), counts)
        col = np.arange(len(flat)) - np.repeat(np.cumsum(counts) - counts, counts)
        keep = col < used[row]
        tables = np.zeros((n, int(used.max())), dtype=np.int64)
        tables[row[keep], col[keep]] = flat[keep]
        sample_rows = np.arange(n) if samples.all() else np.flatnonzero(samples)
        sample_seqs = list(seqs) if len(sample_rows) == n else [seqs[i] for i in sample_rows.tolist()]
        return HostStep(tokens, pos, tables[np.arange(n), pos // bs], [], tables, pos + 1, sample_seqs, sample_rows,
                        [[] for _ in sample_seqs])

    def _decode_tables(self, decode: list[tuple[Sequence, int, list[int]]]) -> tuple[np.ndarray, np.ndarray]:
        """Per decode row: its sequence's block table (zero-padded to the longest) and its context length."""
        bs = self.config.block_size
        rows_per_seq = np.fromiter((n for _, n, _ in decode), dtype=np.int64, count=len(decode))
        first_len = np.fromiter((s.num_computed_tokens + 1 for s, _, _ in decode), dtype=np.int64, count=len(decode))
        seq_of_row = np.repeat(np.arange(len(decode)), rows_per_seq)
        row_in_seq = np.arange(len(seq_of_row)) - np.repeat(np.cumsum(rows_per_seq) - rows_per_seq, rows_per_seq)
        lens = first_len[seq_of_row] + row_in_seq
        last_len = first_len + rows_per_seq - 1
        max_blocks = int(-(-last_len.max() // bs))
        tables = np.zeros((len(decode), max_blocks), dtype=np.int64)
        for i, (seq, _, _) in enumerate(decode):
            used = -(-int(last_len[i]) // bs)
            tables[i, :used] = seq.block_table[:used]
        return (tables[seq_of_row] if len(seq_of_row) > len(decode) else tables), lens

    def _queued_tensor(self, array: np.ndarray) -> torch.Tensor:
        """``array`` on the device, without waiting for the steps queued there (common/engine/queued_copies.py)."""
        return queued_copy(torch.from_numpy(np.ascontiguousarray(array)), self.device)

    # ---- execution ----------------------------------------------------------
    @torch.inference_mode()
    def run(self, ctx, input_ids: torch.Tensor, positions: torch.Tensor,
            logits_rows: torch.Tensor | None = None) -> torch.Tensor | None:
        """The model over one flat batch in step context ``ctx``: the hidden states of every row, or with
        ``logits_rows`` the logits of those rows (None on ranks other than 0). Rank 0 first sends the other
        ranks the same inputs, so every rank runs the same forward on its slice."""
        if self._serving:
            self.tp.check()  # a broken group's ranks may not read what is sent
            self.ranks.send(pack_step(ctx, input_ids, positions, logits_rows))
        with step_context(ctx):
            hidden = self.model(input_ids, positions)
        return hidden if logits_rows is None else self.model.compute_logits(hidden[logits_rows])

    def forward(self, prepared: PreparedStep) -> torch.Tensor:
        """Hidden states of every row of the flat batch."""
        return self.run(prepared.context, prepared.input_ids, prepared.positions)

    @property
    def embedding_model(self):
        """The model as the embedder calls it: at tensor parallelism, run on every rank."""
        return self.model if self.tp.size == 1 else _AllRanks(self)

    def wait_device(self) -> None:
        """Until the device has run what was queued on it (nothing to wait for on the CPU)."""
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()

    def close(self) -> None:
        """Stops the other ranks and leaves their group (tensor parallelism); nothing to do otherwise."""
        if self.ranks is not None:
            self._serving = False
            self.ranks.close()
            self.ranks = None
        if self.tp.size > 1 and dist.is_initialized():
            dist.destroy_process_group()

    def _input_ranges(self, model_dir: str | Path, modules: list[nn.Module]) -> list[torch.Tensor]:
        """Per module, the largest ``|x|`` of each input channel over the int8 calibration text's forward, in
        windows of CALIBRATION_WINDOW tokens, each its own prompt: what the smoothing measures then does not depend
        on the pool's size or max_model_len (two workers with different pools would otherwise quantize different
        models), unless either is below one window. Read from the cache where this layout measured them before."""
        token_ids = calibration_ids(model_dir)
        window = min(CALIBRATION_WINDOW, self.max_model_len, self.num_blocks * self.config.block_size)
        if window < CALIBRATION_WINDOW:
            log.warning("int8 calibration in windows of %d tokens (KV pool or max_model_len below %d): this worker's "
                        "smoothing differs from one with a larger pool", window, CALIBRATION_WINDOW)

        windows = [token_ids[start:start + window] for start in range(0, len(token_ids), window)]
        per_forward = max(1, min(self.num_blocks // -(-window // self.config.block_size), CALIBRATION_ROWS // window))

        def forward() -> None:
            with wide_sums():  # the same ranges at any tensor parallelism
                for first in range(0, len(windows), per_forward):  # each weight widened once per forward
                    self._forward_prompts(windows[first:first + per_forward])
        key = ranges_key(model_dir, dtype=self.config.dtype, device_type=self.device.type,
                         attention=self.attention.name, block_size=self.config.block_size,
                         kv_dtype=self.layout.dtype, token_ids=token_ids, window=window, tp_size=self.tp.size,
                         rank=self.tp.rank, deterministic=self.config.deterministic)
        return cached_ranges(key, modules, lambda: input_absmax(modules, forward), self.tp,
                             self.config.int8.calibration_wait_s)

    def _forward_prompts(self, prompts: list[list[int]]) -> torch.Tensor:
        """Prompts' forward outside any schedule (calibration), in one step, each its own sequence, their blocks
        one after another from the pool's first (which must hold them all): only at load, before the pool has an
        owner."""
        room = min(self.max_model_len, self.num_blocks * self.config.block_size)
        plan, next_block = StepPlan(), 0
        for i, token_ids in enumerate(prompts):
            ids = [t % self.vocab_size for t in token_ids][:room]
            seq = Sequence(f"calibration-{i}", ids, SamplingParams(), seed=0)
            blocks = -(-len(ids) // self.config.block_size)
            seq.block_table = list(range(next_block, next_block + blocks))
            next_block += blocks
            plan.add(seq, len(ids))
        if next_block > self.num_blocks:
            raise ValueError(f"{len(prompts)} prompts need {next_block} KV blocks; the pool has {self.num_blocks}")
        return self.forward(self.prepare(plan))

    def execute(self, plan: StepPlan, constrain=None, on_layers=None) -> StepSample:
        """Run one step; returns what each sampling sequence emitted. ``constrain(logits, seqs, drafts)``: masks
        the logits in place before sampling (structured output). ``on_layers``: ``(counts, call)``, ``call(n)`` as
        the step's first n layers are done, for each n in ``counts``, their KV in the pool (on a GPU, once the device
        has written it: only those layers wait for it)."""
        return self.finish(self.launch(plan, constrain, on_layers))

    @torch.inference_mode()
    def launch(self, plan: StepPlan, constrain=None, on_layers=None, after: LaunchedStep | None = None
               ) -> LaunchedStep:
        """``execute``'s first half: the step queued on the device (on a GPU it runs on while this returns); what
        ``finish`` samples from. ``constrain`` runs in ``finish``, on the state the caller has then.

        ``after``: the step queued before, not yet finished, whose sequences this plan continues (the engine's
        ``Scheduler.run_ahead``): their input tokens are its sampled ``tokens``, read on the device."""
        if self.fault_hang_token is not None and any(self.fault_hang_token in seq.prompt_token_ids
                                                     for seq in plan.seqs):
            log.warning("fault injection: this step hangs (testing.fault_hang_token)")
            while True:
                time.sleep(3600)
        host = self.host_step(plan)
        feed = self._feed(plan, after) if after is not None else None
        argmax = self._argmax_only(host.sample_seqs, host.drafts, constrain)
        if self._replays(host) and on_layers is None:
            logits = self.graphs.replay(host.tokens, host.positions, host.slot_blocks, host.decode_lens,
                                        host.decode_tables, feed)
            rows = len(host.tokens)  # what is read below leaves the graphs' buffer to the next replay
            logits = logits if len(host.sample_rows) == rows else logits[self._queued_tensor(host.sample_rows)]
            if argmax:
                return _argmax_step(host.sample_seqs, logits)
            return LaunchedStep(host.sample_seqs, host.drafts, constrain, logits=logits.to(torch.float32, copy=True))
        prepared = self.to_device(host)
        if feed is not None:
            feed(prepared.input_ids)
        if on_layers is not None:
            counts, call = on_layers
            prepared.context.on_layers = call if self.device.type != "cuda" else _after_device(call, self.device)
            prepared.context.on_layers_at = counts
        if not prepared.sample_seqs:
            self.forward(prepared)
            return LaunchedStep([], [], None)
        if argmax and self.greedy_head is not None and len(prepared.sample_seqs) <= self.greedy_head.max_rows:
            hidden = self.forward(prepared)[prepared.sample_rows]
            tokens = self.greedy_head.argmax(hidden)
            if tokens is not None:
                return LaunchedStep(prepared.sample_seqs, prepared.drafts, None, tokens=tokens)
            logits = self.model.compute_logits(hidden)
        else:
            logits = self.run(prepared.context, prepared.input_ids, prepared.positions, prepared.sample_rows)
        if argmax:
            return _argmax_step(prepared.sample_seqs, logits)
        return LaunchedStep(prepared.sample_seqs, prepared.drafts, constrain, logits=logits.float())

    def _feed(self, plan: StepPlan, after: LaunchedStep):
        """For a plan that runs ahead of ``after``: what writes the input token of each of its rows that continue
        ``after``'s sequences from ``after.tokens`` into the step's input ids (on the device, queued), or None.
        Those rows are decode rows, which come first in the flat batch in plan order (``host_step``)."""
        index = {seq.seq_id: i for i, seq in enumerate(after.seqs)}
        n = len(plan.seqs)
        src = np.fromiter((index.get(seq.seq_id, -1) for seq in plan.seqs), dtype=np.int64, count=n)
        new = np.asarray(plan.num_new_tokens, dtype=np.int64)
        decode = (new == 1) | np.fromiter(map(bool, plan.spec_token_ids), dtype=bool, count=n)
        decode_rows = np.where(decode, new, 0)
        dst = (np.cumsum(decode_rows) - decode_rows)[decode & (src >= 0)]
        src = src[decode & (src >= 0)]
        tokens, k = after.tokens, len(dst)
        if not k:
            return None
        if dst[-1] == k - 1 and src[-1] == k - 1 and (src == np.arange(k)).all():  # the same rows, in order
            return lambda ids: ids[:k].copy_(tokens[:k])
        dst_rows, src_rows = self._queued_tensor(dst), self._queued_tensor(src)
        return lambda ids: ids.index_copy_(0, dst_rows, tokens[src_rows])

    @torch.inference_mode()
    def finish(self, launched: LaunchedStep) -> StepSample:
        """``execute``'s second half: waits for the device's logits (or tokens) and samples them."""
        seqs = launched.seqs
        if launched.tokens is not None:
            sample = StepSample(seqs, [], num_drafts=[0] * len(seqs), num_accepted=[0] * len(seqs))
            if launched.reported is None:
                sample.token_ids = [[t] for t in launched.tokens.tolist()]
                return sample
            if launched.ready is not None:
                launched.ready.synchronize()
            tokens = launched.reported.tolist()  # a row whose logits were not finite reads -1 and samples nothing
            sample.token_ids = [[t] if t >= 0 else [] for t in tokens]
            if min(tokens, default=0) < 0:
                sample.nonfinite = [seq for seq, t in zip(seqs, tokens) if t < 0]
            return sample
        if launched.logits is None:
            return StepSample([], [])
        return self._sample_logits(launched.logits, seqs, launched.drafts, launched.constrain)

    def _argmax_only(self, seqs: list[Sequence], drafts: list[list[int]], constrain) -> bool:
        """Whether a step's sampled rows take their logits' argmax on the device: every one greedy with nothing that
        reads its logits (penalties, logprobs, a mask, drafts to verify, fault injection)."""
        return (bool(seqs) and constrain is None and self.fault_nonfinite_token is None and not any(drafts)
                and all(argmax_suffices(seq.params) for seq in seqs))

    def _replays(self, host: HostStep) -> bool:
        """Whether the step replays a CUDA graph: decode rows only, as many as the largest rung, some sampling."""
        return (self.graphs is not None and bool(host.sample_seqs) and host.decode_tables is not None
                and self.graphs.fits(len(host.tokens), bool(host.chunks), host.decode_tables.shape[1]))

    def _sample_logits(self, logits: torch.Tensor, seqs: list[Sequence], drafts: list[list[int]],
                       constrain) -> StepSample:
        """The sampled rows' float32 logits (their own copy) checked, masked and sampled."""
        if self.fault_nonfinite_token is not None:
            self._poison(logits, seqs, drafts)
        bad_rows = nonfinite_rows(logits)  # before the masks, whose -inf are meant
        nonfinite = []
        if bad_rows:
            logits[bad_rows] = 0.0  # sampled, then dropped: the other rows are untouched
            # A verifying sequence has a row per draft and one more: the sequence of each bad row.
            owner = np.repeat(np.arange(len(drafts)), [len(d) + 1 for d in drafts])
            nonfinite = sorted(set(owner[bad_rows].tolist()))
        if constrain is not None:
            constrain(logits, seqs, drafts)
        sample = self.sample(logits, seqs, drafts)
        for i in nonfinite:
            sample.token_ids[i], sample.num_drafts[i], sample.num_accepted[i] = [], 0, 0
            if sample.logprobs is not None:
                sample.logprobs[i], sample.top_logprobs[i] = [], []
        sample.nonfinite = [seqs[i] for i in nonfinite]
        return sample

    def _poison(self, logits: torch.Tensor, seqs: list[Sequence], drafts: list[list[int]]) -> None:
        """Fault injection for tests: NaN in every row of a sequence whose prompt holds ``fault_nonfinite_token``."""
        row = 0
        for seq, d in zip(seqs, drafts):
            if self.fault_nonfinite_token in seq.prompt_token_ids:
                logits[row:row + len(d) + 1, 0] = float("nan")
            row += len(d) + 1

    def sample(self, logits: torch.Tensor, seqs: list[Sequence], drafts: list[list[int]]) -> StepSample:
        """Plain sequences through the sampler, verifying ones through ``verify_drafts``."""
        if not any(drafts) and all(argmax_suffices(s.params) for s in seqs):  # no row's sampling reads more
            tokens = logits.argmax(-1).tolist()
            return StepSample(seqs, [[t] for t in tokens], num_drafts=[0] * len(seqs), num_accepted=[0] * len(seqs))
        plain = [i for i, d in enumerate(drafts) if not d]
        verifying = [i for i, d in enumerate(drafts) if d]
        out = StepSample(seqs, [[] for _ in seqs], num_drafts=[len(d) for d in drafts], num_accepted=[0] * len(seqs))
        wants_logprobs = any(s.params.logprobs is not None for s in seqs)
        if wants_logprobs:
            out.logprobs, out.top_logprobs = [[] for _ in seqs], [[] for _ in seqs]
        if not verifying:
            rows_of = list(range(len(seqs)))
        else:
            counts = np.asarray([len(d) + 1 for d in drafts])
            starts = np.cumsum(counts) - counts
            rows_of = starts[plain].tolist()
        if plain:
            picked = [seqs[i] for i in plain]
            # the output's copy only where the penalties read it, the prompt's distinct ids only where the
            # repetition penalty does (made once a sequence): not a copy of every sequence each step
            rows = [SamplingRow(s.params, penalty_prompt_ids(s), s.output_token_ids if s.params.needs_penalties
                                else (), s.seed, s.num_output_tokens) for s in picked]
            sampled = self.sampler(logits[rows_of] if verifying else logits, rows)
            for j, i in enumerate(plain):
                out.token_ids[i] = [sampled.token_ids[j]]
                if sampled.logprobs is not None and seqs[i].params.logprobs is not None:
                    out.logprobs[i] = [sampled.logprobs[j]]
                    out.top_logprobs[i] = [sampled.top_logprobs[j]]
        if verifying:
            row_index = np.concatenate([np.arange(starts[i], starts[i] + counts[i]) for i in verifying])
            verified = verify_drafts(
                logits[torch.from_numpy(row_index).to(logits.device)],
                [seqs[i] for i in verifying],
                [drafts[i] for i in verifying],
                [seqs[i].spec_draft_probs for i in verifying],
            )
            for j, i in enumerate(verifying):
                out.token_ids[i] = verified.token_ids[j]
                out.num_accepted[i] = verified.num_accepted[j]
                if verified.logprobs is not None and seqs[i].params.logprobs is not None:
                    out.logprobs[i] = verified.logprobs[j]
                    out.top_logprobs[i] = verified.top_logprobs[j]
        return out


def serve_rank(config: EngineConfig, model_dir: str, rank: int, rendezvous: str, link) -> None:
    """A tensor-parallel rank process (ranks 1..N-1): joins the group, loads its slice, takes the shared pool, then
    runs each step rank 0 sends until rank 0 closes the worker or is gone."""
    become_rank(rank)
    try:
        runner = ModelRunner(config, model_dir, rank=rank, rank_link=link, rendezvous=rendezvous)
    except BaseException as exc:
        try:
            link.send(("error", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))
        finally:
            os._exit(1)
    link.send(("ready", ""))
    try:
        runner.tp.serve_steps(config.ranks.step_timeout_s)  # with rank 0, once every rank said it is ready
        while (data := next_step(link)) is not None:
            runner.run(*unpack_step(data, runner.kv_cache, runner.device))
    except BaseException:
        log.exception("rank %d failed", rank)
        logging.shutdown()
        os._exit(1)
    if dist.is_initialized():
        dist.destroy_process_group()
    os._exit(0)


def _after_device(on_layers, device: torch.device):
    """``on_layers`` once the device has run what was queued: a page is announced only once it is written."""
    def synchronized(n: int) -> None:
        torch.cuda.current_stream(device).synchronize()
        on_layers(n)
    return synchronized


class _AllRanks:
    """The model as the embedder calls it, ``(input_ids, positions)`` in a step context, run on every rank."""

    def __init__(self, runner: ModelRunner) -> None:
        self.runner, self.config = runner, runner.model.config

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.runner.run(get_step_context(), input_ids, positions)
