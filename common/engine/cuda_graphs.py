"""CUDA graphs for decode steps: captured once at start for a ladder of row counts, replayed padded to the next rung.

A decode step of a small batch on a GPU is bound by the host: each of the model's few hundred operations is a
kernel launch from Python. A graph launches them all at once. A graph replays fixed addresses with fixed shapes,
so ``DecodeGraphs`` owns static input buffers (token ids, positions, the slot each row's K/V goes to, context
lengths and block tables padded to ``max_context`` tokens), captures the model's forward and its LM head over the
first ``rows`` of them for each rung of the ladder, and at each step copies the step's host arrays into them (two
host-to-device copies from pinned memory) and replays the smallest rung that holds the step. Padding rows write
no K/V (their block is -1, which the backend's K/V store skips: only backends marked ``graph_safe``) and attend
one token of block 0; their logits are never read.

A step runs eagerly instead when it holds a prompt chunk, has more rows than the largest rung, or a sequence
past ``max_context``. Speculative verification and structured output need nothing of their own: a verifying
sequence's rows are decode rows, and the masks and sampling act on the logits after the replay.

``graph_factory`` is the device interface: ``torch.cuda.CUDAGraph`` on a GPU; the tests pass ``EagerGraph``,
which replays by calling the captured function again over the same buffers, so the ladder, the padding and the
buffers are checked on the CPU.
"""
from __future__ import annotations

import bisect
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from common.engine.attention import StepContext, step_context

log = logging.getLogger(__name__)

FIELDS = ("input_ids", "positions", "slot_blocks", "slot_offsets", "context_lens")


def graph_ladder(max_rows: int) -> list[int]:
    """The row counts graphs are captured for: 1, 2, 4, 8, then every multiple of 16 up to ``max_rows``, and
    ``max_rows`` itself (padding wastes at most 15 rows of a step past 16, under half below)."""
    rungs = [rows for rows in (1, 2, 4, 8) if rows < max_rows] + list(range(16, max_rows, 16))
    return rungs + [max_rows]


def rung_for(ladder: list[int], rows: int) -> int | None:
    """The smallest rung holding ``rows`` rows, or None past the largest."""
    i = bisect.bisect_left(ladder, rows)
    return ladder[i] if i < len(ladder) else None


class EagerGraph:
    """A stand-in for ``torch.cuda.CUDAGraph`` off a GPU: ``capture`` keeps the function without running it, as a
    CUDA graph's capture records kernels without running them (``DecodeGraphs.capture``'s warm-up run has run it);
    ``replay`` calls it over the same buffers."""

    def __init__(self, pool=None) -> None:
        self._function: Callable[[], None] | None = None

    def capture(self, function: Callable[[], None]) -> None:
        self._function = function

    def replay(self) -> None:
        self._function()


class CudaGraph:
    """``torch.cuda.CUDAGraph`` behind ``EagerGraph``'s interface. Every rung's graph captures into one memory
    pool (``pool``): only one replays at a time, and each keeps its output alive, so what one frees after its
    capture the next may take."""

    def __init__(self, pool) -> None:
        self._graph, self._pool = torch.cuda.CUDAGraph(), pool

    def capture(self, function: Callable[[], None]) -> None:
        # thread_local: another thread's CUDA call (a KV transfer's copy) during the capture is not an error
        with torch.cuda.graph(self._graph, pool=self._pool, capture_error_mode="thread_local"):
            function()

    def replay(self) -> None:
        self._graph.replay()


@dataclass
class _Rung:
    graph: EagerGraph | CudaGraph
    context: StepContext  # kept: the graph reads what its warm-up run left in backend_state


class DecodeGraphs:
    """Static buffers and one captured graph per rung, for a model on one device and its KV pool."""

    def __init__(self, model, kv_cache, block_size: int, max_rows: int, max_context: int,
                 graph_factory: Callable[[object], EagerGraph | CudaGraph]) -> None:
        self.model, self.kv_cache, self.block_size = model, kv_cache, block_size
        self.ladder = graph_ladder(max_rows)
        self.max_rows = max_rows
        self.width = -(-max_context // block_size)  # block ids a row's table holds
        self._factory = graph_factory
        device = kv_cache.pool.device
        size = len(FIELDS) * max_rows + max_rows * self.width
        self._host = torch.zeros(size, dtype=torch.int64, pin_memory=device.type == "cuda")
        self._device = torch.zeros(size, dtype=torch.int64, device=device)
        self._host_views = self._views(self._host.numpy())
        self._views_on_device = self._views(self._device)
        self._rows = torch.arange(max_rows, device=device)
        self._logits: torch.Tensor | None = None  # [max_rows, vocab]: every rung writes its rows' logits here
        self._rungs: dict[int, _Rung] = {}
        on_gpu = device.type == "cuda"
        self._pool = torch.cuda.graph_pool_handle() if on_gpu else None
        # Recorded after each copy to the device: the next step stages into the pinned buffer only once it ran.
        self._copied = torch.cuda.Event() if on_gpu else None

    def _views(self, flat):
        n = self.max_rows
        views = {name: flat[i * n:(i + 1) * n] for i, name in enumerate(FIELDS)}
        views["tables"] = flat[len(FIELDS) * n:].reshape(n, self.width)
        return views

    def fits(self, rows: int, has_chunks: bool, table_width: int) -> bool:
        """Whether a step of ``rows`` decode rows (no prompt chunk when ``has_chunks`` is false) and block tables
        ``table_width`` wide replays a graph."""
        return not has_chunks and 0 < rows <= self.max_rows and table_width <= self.width

    @torch.inference_mode()
    def capture(self) -> float:
        """Every rung's graph, largest first (the smaller ones then fit in the memory the largest took); the
        seconds it took."""
        started = time.monotonic()
        self._stage(0, self.max_rows, np.zeros(0, np.int64), np.zeros(0, np.int64), np.zeros(0, np.int64),
                    np.zeros(0, np.int64), np.zeros((0, 0), np.int64))
        self._copy(self.max_rows)
        for rows in reversed(self.ladder):
            v = self._views_on_device
            context = StepContext(self.kv_cache, v["slot_blocks"][:rows], v["slot_offsets"][:rows],
                                  decode_rows=self._rows[:rows], decode_block_tables=v["tables"][:rows],
                                  decode_context_lens=v["context_lens"][:rows])

            def logits(context=context, rows=rows) -> torch.Tensor:
                with step_context(context):
                    return self.model.compute_logits(self.model(v["input_ids"][:rows], v["positions"][:rows]))

            warm = logits()  # compiles what compiles on first use, and fills the context's backend_state
            if self._logits is None:  # the largest rung comes first
                self._logits = torch.empty_like(warm)
            del warm
            graph = self._factory(self._pool)
            graph.capture(lambda logits=logits, rows=rows: self._logits[:rows].copy_(logits()))
            self._rungs[rows] = _Rung(graph, context)
        if self.kv_cache.pool.device.type == "cuda":
            torch.cuda.synchronize(self.kv_cache.pool.device)
        return time.monotonic() - started

    def replay(self, tokens: np.ndarray, positions: np.ndarray, slot_blocks: np.ndarray, context_lens: np.ndarray,
               tables: np.ndarray, feed=None) -> torch.Tensor:
        """The logits ``[rows, vocab]`` of a decode step given as host arrays (``tables``: one row of block ids per
        row, zero-padded); a view of the graphs' output buffer, valid until the next replay. ``feed(input_ids)``:
        writes input tokens the host does not have yet into the device's copy, before the graph reads it."""
        rows = len(tokens)
        rung = rung_for(self.ladder, rows)
        self._stage(rows, rung, tokens, positions, slot_blocks, context_lens, tables)
        self._copy(rung)
        if feed is not None:
            feed(self._views_on_device["input_ids"])
        self._rungs[rung].graph.replay()
        return self._logits[:rows]

    def _stage(self, rows: int, rung: int, tokens, positions, slot_blocks, context_lens, tables) -> None:
        """The step's arrays into the pinned host buffer, rows ``rows..rung`` as padding."""
        if self._copied is not None:
            self._copied.synchronize()  # the last step's copy out of this buffer has run
        h = self._host_views
        h["input_ids"][:rows], h["input_ids"][rows:rung] = tokens, 0
        h["positions"][:rows], h["positions"][rows:rung] = positions, 0
        h["slot_blocks"][:rows], h["slot_blocks"][rows:rung] = slot_blocks, -1  # padding writes no K/V
        h["slot_offsets"][:rows], h["slot_offsets"][rows:rung] = positions % self.block_size, 0
        h["context_lens"][:rows], h["context_lens"][rows:rung] = context_lens, 1  # and reads one key of block 0
        h["tables"][:rows, :tables.shape[1]] = tables
        h["tables"][rows:rung, 0] = 0

    def _copy(self, rung: int) -> None:
        """The staged rows to the device: the per-row fields whole, the first ``rung`` rows of block tables."""
        small = len(FIELDS) * self.max_rows
        end = small + rung * self.width
        self._device[:end].copy_(self._host[:end], non_blocking=True)
        if self._copied is not None:
            self._copied.record()
