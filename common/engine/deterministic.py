"""engine.deterministic's ``auto``, settled for this host, model and config before a runner loads the model.

``auto`` is on where batch-invariant numerics cost about nothing: bfloat16 weights in the panel layout that the one-call
decode kernel reads (the CPU with AVX512-BF16 and a C compiler, one rank, no quantization), the kernel's share left to
the engine (``cpu.decode_kernel_max_batch`` -1) and the CPU's own attention. There every row of every step, a prompt's
too, goes through that kernel (common/engine/models/llama.py, ``FusedDecode``), and on AMD Zen 4 the engine served 0.98x
and 1.00x the throughput of the mode off at 135M and at the 1B shape, for 1.03x and 0.98x the one-stream TPOT
(docs/benchmarks.md, "Deterministic numerics: what they cost"). A stream recomputed after a failover, a preemption or a
migration then continues exactly in bfloat16, as float32 always did.

Off everywhere else: float32 and int8 weights (the mode keeps them layer by layer: 1.7-2.8x the one-stream TPOT, int8
0.91x the throughput too), a GPU (no batch-invariant kernels there), tensor parallelism (the kernel takes one rank), and
CPUs with AMX tiles, where the panel kernels multiply steps of 4 rows or more with the tiles (kernels/panels_bf16.h),
whose sums round otherwise than vdpbf16ps': the mode's build, without them, took 6x as long per prompt token at the 1B
shape on an AMX Xeon (8.2 ms against 1.4). ``true`` and ``false`` set it as they say.

Each worker settles it for itself: a cluster whose prefill and decode hosts settle it differently (one with AMX, one
without) keeps streams exact across a failover only with ``true`` on every worker (``tessera up --deterministic``).
"""
from __future__ import annotations

import dataclasses
import logging
from pathlib import Path

from common.config.base import EngineConfig
from common.engine.models.llama import (W_BF16_PANELS, decode_forward_dims, decode_forward_takes,
                                       decode_forward_takes_panels)
from common.engine.models.loader import load_hf_config
from common.engine.native import cpu_has, linear_panels_kernel, load_kernel

log = logging.getLogger(__name__)


def settle(config: EngineConfig, model_dir: str | Path) -> EngineConfig:
    """``config`` with engine.deterministic a bool: ``auto`` settled as the module says, with a line saying why."""
    if config.deterministic != "auto":
        return config
    why = _why_not(config, model_dir)
    if why:
        log.info("engine.deterministic auto: off (%s)", why)
    else:
        log.info("engine.deterministic auto: on (bfloat16 weights in panels, every row through the one-call "
                 "decode kernel: a stream resumed after a failover continues exactly)")
    return dataclasses.replace(config, deterministic=not why)


def _why_not(config: EngineConfig, model_dir: str | Path) -> str:
    """What keeps ``auto`` off here, or "" where it is on."""
    if config.device_type != "cpu":
        return "a GPU: batch-invariant kernels run on the CPU only"
    if config.dtype != "bfloat16" or config.quantization != "none":
        weights = "int8" if config.quantization == "int8" else config.dtype
        return f"{weights} weights: the mode costs little with bfloat16 weights in panels only"
    if config.tensor_parallel_size != 1:
        return "tensor parallelism: the one-call decode kernel takes one rank"
    if config.cpu.decode_kernel_max_batch != -1:
        return (f"engine.cpu.decode_kernel_max_batch {config.cpu.decode_kernel_max_batch}: the split between the "
                "kernel and the layer path it sets")
    if config.attention_backend not in ("auto", "cpu_paged"):
        return f"attention_backend {config.attention_backend}"
    if (not cpu_has("avx512_bf16") or not decode_forward_takes_panels() or linear_panels_kernel() is None
            or load_kernel("paged_attention") is None):
        return "this CPU has no AVX512-BF16 or no C compiler built the kernels: no panel layout"
    if cpu_has("amx_bf16"):
        return ("this CPU has AMX tiles, which the panel kernels (or oneDNN's copy) multiply steps of several rows "
                "with outside the mode")
    hf = load_hf_config(model_dir)  # past the kernel's limits the mode would run layer by layer, at half the speed
    head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
    if not decode_forward_takes(decode_forward_dims(hf.hidden_size, hf.num_attention_heads, hf.num_key_value_heads,
                                                    head_dim, hf.intermediate_size, config.block_size, True,
                                                    W_BF16_PANELS)):
        return "the model's shapes do not fit the panel layout or the one-call kernel"
    return ""
