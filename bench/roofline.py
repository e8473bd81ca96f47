"""Hardware ceilings for the offline benchmark, measured on this machine.

Two ceilings bound a decoder's throughput on CPU:

- batch 1 is memory-bound: every decode step streams all the weights (plus
  the request's KV cache) from DRAM once, so tokens/s <= copy bandwidth /
  bytes read per token;
- a large batch is compute-bound: tokens/s <= matmul FLOP/s / FLOPs per token.

Definitions used throughout (the report repeats them):

- copy bandwidth = (bytes read + bytes written) / time for ``dst.copy_(src)``
  of a tensor much larger than the last-level cache, best of several; the
  STREAM "copy" convention, so write-allocate traffic is not counted;
- read bandwidth = bytes / time for ``buffer.sum()`` of a float32 buffer many
  times larger than any last-level cache, on one thread per core, best of
  several: reading only, as a decode step reads its weights (the peer
  harness's roofline, bench/peers/compare.py);
- matmul FLOP/s = 2*M*K*N per ``F.linear`` over the model's own GEMM shapes
  (one decoder layer's projections, as the engine fuses them, and the LM
  head), at a given number of rows M, in the model's dtype, with weights
  read from memory rather than the cache, best of several;
- FLOPs per token = 2 x (non-embedding parameters) for every token run
  through the decoder, plus 2 x (vocab x hidden) for every token whose
  logits are computed. Attention score/value FLOPs (4 x layers x context x
  heads x head_dim per token) are not in it; ``attention_flops`` gives them
  separately so their share can be stated.
"""
from __future__ import annotations

import itertools
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from bench.machine import meminfo_bytes

COPY_BYTES = 512 << 20  # far beyond the last-level cache
# Eight times the largest last-level cache of the CPUs measured (an EPYC socket's 384 MiB L3 included).
READ_BYTES = 3 << 30
READ_PASSES = 5
MIN_TIMED_SECONDS = 0.2
REPEATS = 5


@dataclass(frozen=True)
class ModelShape:
    """The parameter counts and GEMM shapes of a Llama-family decoder."""

    num_layers: int
    hidden: int
    intermediate: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab: int
    bytes_per_param: int

    @classmethod
    def from_config(cls, cfg, dtype: str) -> "ModelShape":
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        return cls(
            num_layers=cfg.num_hidden_layers,
            hidden=cfg.hidden_size,
            intermediate=cfg.intermediate_size,
            num_heads=cfg.num_attention_heads,
            num_kv_heads=getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads,
            head_dim=head_dim,
            vocab=cfg.vocab_size,
            bytes_per_param=torch.empty((), dtype=getattr(torch, dtype)).element_size(),
        )

    def layer_gemms(self) -> list[tuple[str, int, int]]:
        """(name, K, N) of one decoder layer's projections, fused as the engine runs them."""
        q, kv = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        return [
            ("qkv_proj", self.hidden, q + 2 * kv),
            ("o_proj", q, self.hidden),
            ("gate_up_proj", self.hidden, 2 * self.intermediate),
            ("down_proj", self.intermediate, self.hidden),
        ]

    @property
    def decoder_params(self) -> int:
        """Non-embedding parameters: projections and norms of every layer, and the final norm."""
        per_layer = sum(k * n for _, k, n in self.layer_gemms()) + 2 * self.hidden
        return self.num_layers * per_layer + self.hidden

    @property
    def head_params(self) -> int:
        return self.vocab * self.hidden

    def weight_bytes_per_step(self) -> int:
        """Weight bytes a decode step streams: the decoder and the LM head (one embedding row is negligible)."""
        return (self.decoder_params + self.head_params) * self.bytes_per_param

    def kv_bytes_per_token(self) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.bytes_per_param

    def flops(self, decoder_tokens: int, logit_tokens: int) -> int:
        return 2 * self.decoder_params * decoder_tokens + 2 * self.head_params * logit_tokens

    def attention_flops(self, context_len: int) -> int:
        """Score and value FLOPs of one query token attending to ``context_len`` keys (all layers)."""
        return 4 * self.num_layers * context_len * self.num_heads * self.head_dim


def _best_seconds(fn) -> float:
    """Best per-call time over ``REPEATS`` rounds, each long enough to time reliably.

    The best, not the mean: other processes on the machine only ever slow a round down.
    """
    fn()
    start = time.perf_counter()
    fn()
    calls = max(1, int(MIN_TIMED_SECONDS / max(time.perf_counter() - start, 1e-6)))
    best = float("inf")
    for _ in range(REPEATS):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - start) / calls)
    return best


def copy_bandwidth() -> float:
    """Bytes/s of a large tensor copy, counting the read and the write."""
    nbytes = COPY_BYTES
    src = torch.ones(nbytes // 4, dtype=torch.float32)
    dst = torch.empty_like(src)
    seconds = _best_seconds(lambda: dst.copy_(src))
    return 2 * nbytes / seconds


def _l3_bytes() -> int:
    try:
        size = Path("/sys/devices/system/cpu/cpu0/cache/index3/size").read_text().strip()
    except OSError:
        return 32 << 20
    return int(size[:-1]) << {"K": 10, "M": 20, "G": 30}[size[-1]] if size[-1] in "KMG" else int(size)


def read_probe_bytes() -> int:
    """The read probe's buffer: ``READ_BYTES``, or a quarter of the memory available now where that is less (a
    server under test can hold most of the host, and a probe must not push it out of memory: a vLLM worker serving
    the 8B shape on a 24 GB host was killed so), but at least eight times this CPU's last-level cache, unless that
    is more than the quarter: a virtual machine may report its host's whole cache (480 MB on an AMX Xeon of 2 cores,
    whose 3.8 GB probe had vLLM beside Tessera's two workers at the 1B shape killed)."""
    available = meminfo_bytes("MemAvailable")
    quarter = (available if available is not None else READ_BYTES * 4) // 4
    return min(max(min(READ_BYTES, quarter), 8 * _l3_bytes()), max(quarter, 2 * _l3_bytes()))


def read_bandwidth(nbytes: int | None = None, passes: int = READ_PASSES) -> float:
    """Bytes/s of reading ``nbytes`` (``read_probe_bytes()`` by default) once with ``sum()``, on as many torch
    threads as this process has cores.

    The best pass: other processes only ever slow one down. The threads are set back as they were after.
    """
    nbytes = read_probe_bytes() if nbytes is None else nbytes
    previous = torch.get_num_threads()
    torch.set_num_threads(len(os.sched_getaffinity(0)))
    try:
        buffer = torch.ones(max(1, nbytes // 4), dtype=torch.float32)  # written once: every page is mapped
        buffer.sum()
        best = float("inf")
        for _ in range(passes):
            start = time.perf_counter()
            buffer.sum()
            best = min(best, time.perf_counter() - start)
    finally:
        torch.set_num_threads(previous)
    return buffer.numel() * 4 / best


def _streamed_weights(n: int, k: int, dtype: torch.dtype) -> list[torch.Tensor]:
    """Distinct copies of an ``[n, k]`` weight, together far larger than the last-level cache.

    Cycling through them makes every call read its weight from memory, as a
    forward pass does (the model's weights do not fit in the cache either);
    timing one hot weight would overstate small-M rates several times over.
    """
    count = max(1, COPY_BYTES // (n * k * torch.empty((), dtype=dtype).element_size()))
    return list(torch.full((count, n, k), 0.01, dtype=dtype).unbind())


@torch.inference_mode()
def matmul_flops(shape: ModelShape, dtype: str, rows: list[int]) -> list[dict]:
    """Per row count: FLOP/s of each layer GEMM and the LM head, and of one layer's GEMMs together."""
    torch_dtype = getattr(torch, dtype)
    gemms = shape.layer_gemms() + [("lm_head", shape.hidden, shape.vocab)]
    rates: dict[int, dict[str, float]] = {m: {} for m in rows}
    for name, k, n in gemms:
        weights = itertools.cycle(_streamed_weights(n, k, torch_dtype))
        for m in rows:
            x = torch.randn(m, k, dtype=torch_dtype)
            rates[m][name] = 2 * m * k * n / _best_seconds(lambda: F.linear(x, next(weights)))
    results = []
    for m in rows:
        layer = [(2 * m * k * n, rates[m][name]) for name, k, n in shape.layer_gemms()]
        mix = sum(f for f, _ in layer) / sum(f / r for f, r in layer)
        results.append({"rows": m, "layer_mix": mix, "per_gemm": rates[m]})
    return results


def forward_matmul_seconds(shape: ModelShape, entry: dict) -> float:
    """Time one forward's projections and LM head take at ``entry``'s row count and measured rates."""
    m, rate = entry["rows"], entry["per_gemm"]
    layer = sum(2 * m * k * n / rate[name] for name, k, n in shape.layer_gemms())
    return shape.num_layers * layer + 2 * m * shape.hidden * shape.vocab / rate["lm_head"]


@dataclass
class Roofline:
    dtype: str
    copy_bandwidth: float  # bytes/s, read + write
    matmul: list[dict]  # matmul_flops(): one entry per row count
    weight_bytes: int
    decoder_params: int
    head_params: int

    @property
    def peak_matmul_flops(self) -> float:
        """The best layer-mix rate over the measured row counts: the compute ceiling."""
        return max(m["layer_mix"] for m in self.matmul)

    def to_dict(self) -> dict:
        return asdict(self) | {"peak_matmul_flops": self.peak_matmul_flops}


def measure(shape: ModelShape, dtype: str, rows: list[int], bandwidth: float | None = None) -> Roofline:
    """The ceilings for one dtype; pass ``bandwidth`` to reuse a copy measurement (it is dtype-free)."""
    return Roofline(
        dtype=dtype,
        copy_bandwidth=bandwidth if bandwidth is not None else copy_bandwidth(),
        matmul=matmul_flops(shape, dtype, rows),
        weight_bytes=shape.weight_bytes_per_step(),
        decoder_params=shape.decoder_params,
        head_params=shape.head_params,
    )
