"""The greedy LM head: the argmax of a row's logits, exactly as the bfloat16 head computes it, from far fewer bytes.

A decode step at one stream reads every weight once; the LM head is 6-20% of them (a 49,152-token vocabulary in
bfloat16: 201 MB of the 1B shape's 1.64 GB, 56 MB of the 135M model's 270 MB). A greedy row needs only the
argmax, so the head is read twice, cheaply:

1. An int8 copy of the head (a byte per weight, a float32 scale per token: half the bytes) gives every token's
   approximate logit, through the int8 one-row kernel (kernels/decode_forward.c: the row rounded to int16 steps,
   exact integer sums, scaled in double). For token i its distance from the logit the bfloat16 head would compute
   before rounding is at most
       ``|x| |w_i - w8_i| + (step / 2) |w8_i|_1 + 2k 2^-24 |x| |w_i|`` (+ 2^-22 of the approximation itself),
   the int8 weight's error (Cauchy-Schwarz), the row's int16 rounding, and the bfloat16 kernel's float32 sums
   of k products (at most k 2^-24 of the sum of their sizes, which Cauchy-Schwarz bounds by |x| |w_i|; taken
   twice); the per-token norms are kept beside the copy, and the whole bound is taken 1% wider.
2. The token whose lower bound is highest beats every token whose upper bound is below that one by more than two
   bfloat16 steps at the logits' size (so their rounded logits cannot tie it either); the others, typically a few
   dozen, are candidates (kernels/greedy_bound.c). The 64-token tiles that hold them get their exact logits through
   the panel kernel (``tessera_linear_panels_tiles``), whose every sum has the order the whole head's call gives it:
   the argmax over those tiles, first index on a tie, is the whole head's argmax, bit for bit.

When the candidates' tiles would be more than ``MAX_TILE_SHARE`` of the head, or a row, a bound or a candidate's
logit is not finite, ``argmax`` returns None and the caller computes the whole head. The copy costs a byte per head
weight of memory (reported at load). The int8 sums cost per row where the bytes do not, and a short row (a small
hidden size) spreads the int8 kernel's cost per token over few inputs: on Zen 4, timed with the caches flushed, it
was ahead of the whole head up to 1-4 rows at the 1B shape (hidden 2048; 3 in most timings) and at 135M (576) level
at one row in one timing, ahead up to 2 in another. So by default (``default_rows``) it takes up to ``DEFAULT_ROWS``
rows from ``MIN_HIDDEN`` and none below; ``engine.cpu.greedy_head_max_rows`` sets another count. ``timed_max_rows``
times both ways now (``bench.greedy_head``): not at load, where a worker's timing runs beside the other workers'
loads on shared cores and came out either way.
"""
from __future__ import annotations

import time
from collections.abc import Callable

import torch

from common.engine.models.llama import PANEL_COLS, PANEL_GROUP, weight_of_panels
from common.engine.native import greedy_tiles_kernel, linear_panels_tiles_kernel
from common.engine.quantization import linear_int8_kernel, quantize_rows

TILE = PANEL_COLS * PANEL_GROUP  # outputs per tile of the panel layout
XQ_MAX = 16383  # kernels/decode_forward.c's int16 step count (to_int16_rows)
SUM_ERROR = 2 * 2.0**-24  # per input: the float32 sums of the panel kernel's k products, against |x| |w_i|
APPROX_ROUNDING = 2.0**-22  # the approximation's own float32 rounding (from a double), relative, with room
WIDER = 1.01  # every bound taken this much wider
TIE_STEPS = 2.0**-6  # two bfloat16 steps, relative to the logits' size (bfloat16 keeps 8 significant bits)
FLUSHED = 1e-30  # products under float32's normal range that the kernels flush to zero: k of them, at most
MAX_TILE_SHARE = 0.25  # past this share of the head's tiles, the whole head costs less
MAX_ROWS = 4  # the most rows ``timed_max_rows`` tries: 1B shape, Zen 4: ahead at 4 rows, behind at 8
DEFAULT_ROWS = 3  # rows it takes by default (``default_rows``): 1B shape, Zen 4, timed ahead up to 1-4 rows, 3 mostly
# The smallest hidden size it takes by default (measured at 576 and 2048: docs/history/benchmarks-rounds.md,
# "At 1B parameters (moved 2026-12-07)").
MIN_HIDDEN = 2048
FLUSH_BYTES = 256 << 20  # read between timed calls, as a decode step's weights pass through the caches
BUILD_BYTES = 16 << 20  # each float64 temporary of the copy's build at load (no second whole copy of the head)
MAX_K = 16384  # kernels/decode_forward.c's widest row


class GreedyHead:
    """The greedy argmax of a bfloat16 LM head held in panels (``LlamaForCausalLM.pack_panels``)."""

    def __init__(self, panels: torch.Tensor, n: int, k: int) -> None:
        if n % TILE:
            raise ValueError(f"the greedy head takes whole tiles of {TILE} tokens (vocabulary {n})")
        self.panels, self.n, self.k = panels, n, k
        self.max_rows = MAX_ROWS
        self.q = torch.empty((n, k), dtype=torch.int8)
        self.scale = torch.empty(n, dtype=torch.float32)
        # per token: |w_i - w8_i| + SUM_ERROR k |w_i| (times |x|) and |w8_i|_1 / 2 (times the row's int16 step), both
        # WIDER (float64, then rounded up)
        self.weight_error = torch.empty(n, dtype=torch.float32)
        self.step_error = torch.empty(n, dtype=torch.float32)
        build_rows = max(TILE, BUILD_BYTES // (8 * k) // TILE * TILE)
        for start in range(0, n, build_rows):
            rows = slice(start, min(n, start + build_rows))
            tiles = panels[start * k:rows.stop * k]  # whole tiles: build_rows is a multiple of TILE
            w = weight_of_panels(tiles, rows.stop - start, k)
            self.q[rows], self.scale[rows] = quantize_rows(w)
            exact = w.double()
            approx = self.q[rows].double() * self.scale[rows].double()[:, None]
            self.weight_error[rows] = _rounded_up(((exact - approx).norm(dim=1) + SUM_ERROR * k * exact.norm(dim=1))
                                                  * WIDER)
            self.step_error[rows] = _rounded_up(approx.abs().sum(1) / 2 * WIDER)
        self.approximate = linear_int8_kernel()
        self.bound = greedy_tiles_kernel()
        self.exact = linear_panels_tiles_kernel()

    @classmethod
    def of(cls, head: torch.nn.Module) -> GreedyHead | None:
        """The greedy head of ``head`` (an LM head module): None unless it is in panels, of whole tiles and rows the
        int8 kernel takes, with the kernels built."""
        panels = getattr(head, "panels", None)
        n, k = head.weight.shape
        return cls(panels, n, k) if panels is not None and cls.takes(n, k) else None

    @staticmethod
    def takes(n: int, k: int) -> bool:
        """Whether an [n, k] head in panels can have the copy: whole tiles, rows the int8 kernel takes, the kernels
        built (what the load checks before it sizes the KV pool with ``copy_bytes`` reserved)."""
        return n % TILE == 0 and k <= MAX_K and None not in (linear_int8_kernel(), greedy_tiles_kernel(),
                                                                linear_panels_tiles_kernel())

    @staticmethod
    def default_rows(hidden_size: int) -> int:
        """The rows a head of ``hidden_size`` inputs takes by default (``MIN_HIDDEN``, ``DEFAULT_ROWS``)."""
        return DEFAULT_ROWS if hidden_size >= MIN_HIDDEN else 0

    def timed_max_rows(self, whole: Callable[[torch.Tensor], torch.Tensor], limit: int = MAX_ROWS,
                       repeat: int = 5) -> int:
        """The most rows, up to ``limit``, for which this head was ahead of ``whole`` (the whole head and its argmax)
        at every count up to them, both timed now on random rows (best of ``repeat``), each call after reading
        ``FLUSH_BYTES`` so that neither finds its weights in the caches, as in a decode step; 0 where it was behind
        at one row. Sets ``max_rows`` to it."""
        flush = torch.ones(FLUSH_BYTES // 4)
        gen = torch.Generator().manual_seed(0)
        chosen = 0
        for rows in range(1, limit + 1):
            self.max_rows = rows
            x = torch.randn(rows, self.k, generator=gen).to(torch.bfloat16)
            ours = theirs = float("inf")
            for _ in range(repeat):
                flush.sum()
                start = time.perf_counter()
                settled = self.argmax(x) is not None
                ours = min(ours, time.perf_counter() - start if settled else float("inf"))
                flush.sum()
                start = time.perf_counter()
                whole(x)
                theirs = min(theirs, time.perf_counter() - start)
            if ours >= theirs:
                break
            chosen = rows
        self.max_rows = chosen
        return chosen

    @staticmethod
    def copy_bytes(n: int, k: int) -> int:
        """The memory the copy of an [n, k] head adds: a byte per weight, three float32 per token."""
        return n * k + 12 * n

    @property
    def nbytes(self) -> int:
        """The memory it adds to the head's."""
        return self.copy_bytes(self.n, self.k)

    def margins(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Each token's approximate logit for each row of ``x`` (float32) [rows, n], and the row's two
        factors of its bound, each taken wider: its norm (times ``weight_error``) and its int16 step (times
        ``step_error``) [rows]; a token's margin is these plus APPROX_ROUNDING of its approximation and FLUSHED."""
        approx = torch.empty((x.shape[0], self.n), dtype=torch.float32)
        if self.approximate(x.data_ptr(), self.q.data_ptr(), self.scale.data_ptr(), None, approx.data_ptr(),
                            x.shape[0], self.n, self.k, 0) != 0:
            raise RuntimeError(f"the int8 head kernel refused {tuple(x.shape)} x {self.n} outputs")
        norm = x.double().norm(dim=1).float() * WIDER
        step = x.abs().amax(dim=1) / XQ_MAX * WIDER  # to_int16_rows's step (its own rounding is within WIDER)
        return approx, norm, step

    def candidate_tiles(self, x: torch.Tensor) -> torch.Tensor | None:
        """The tiles (ascending) that hold every token the bound cannot rule out for any row of ``x`` (float32);
        None where a bound is not finite (a row not finite, whose int8 sums are NaN, or too large for float32)."""
        approx, norm, step = self.margins(x)
        tiles = torch.empty(self.n // TILE, dtype=torch.int32)
        count = self.bound(approx.data_ptr(), self.weight_error.data_ptr(), self.step_error.data_ptr(),
                           norm.data_ptr(), step.data_ptr(), x.shape[0], self.n, TILE, APPROX_ROUNDING, FLUSHED,
                           TIE_STEPS, tiles.data_ptr())
        if count == -1:
            raise RuntimeError(f"kernels/greedy_bound.c refused {tuple(approx.shape)} in tiles of {TILE}")
        return tiles[:count] if count > 0 else None  # -2: an approximation or a bound not finite

    def argmax(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """Each row's greedy token (int64), as ``logits(hidden).argmax(-1)`` of the bfloat16 head; None where the
        whole head is the cheaper or the only sound way (too many candidates, a row or a logit not finite, too many
        rows)."""
        rows = hidden.shape[0]
        if not 0 < rows <= self.max_rows or hidden.dtype is not torch.bfloat16:
            return None
        hidden = hidden.contiguous()
        tiles = self.candidate_tiles(hidden.float())
        if tiles is None or len(tiles) > MAX_TILE_SHARE * self.n / TILE:
            return None
        logits = torch.empty((len(tiles), rows, TILE), dtype=torch.bfloat16)
        if self.exact(hidden.data_ptr(), self.panels.data_ptr(), tiles.data_ptr(), len(tiles), logits.data_ptr(),
                      rows, self.n, self.k) != 0:
            raise RuntimeError(f"kernels/linear_panels.c refused {len(tiles)} tiles of {tuple(hidden.shape)}")
        logits = logits.permute(1, 0, 2).reshape(rows, -1).float()
        if not torch.isfinite(logits).all():  # overflowed: the whole head's rows go to the non-finite check
            return None
        best = logits.argmax(dim=1)
        return tiles.long()[best // TILE] * TILE + best % TILE


def _rounded_up(values: torch.Tensor) -> torch.Tensor:
    """float64 values as the float32 at or above each."""
    rounded = values.float()
    return torch.where(rounded.double() < values, torch.nextafter(rounded, torch.tensor(float("inf"))), rounded)
