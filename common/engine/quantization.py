"""int8 weights (``engine.quantization: int8``): half the bytes of bfloat16 for every step to read.

At load, every linear layer and the embedding (the LM head, when tied) is
stored as int8 with one float32 scale per output row, symmetric: ``w ≈ q *
scale`` with ``scale = max|w_row| / 127``. Nothing is ever dequantized into a
weight-sized copy; each path computes on the int8 values:

- decode steps of up to 8 rows: the one-call decode kernel, and for the LM
  head ``tessera_linear_int8`` (both ``kernels/decode_forward.c``), widen the
  int8 weights in registers against float32 activations (weight-only);
- larger batches and prompt chunks: the activations are quantized per row
  (``scale_x = max|x_row| / 127``) and multiplied by the int8 weights in
  int8 with int32 sums (``torch._int_mm``, which runs on the CPU's VNNI
  instructions), then scaled back: W8A8 with dynamic per-token scales.

The embedding lookup widens only the looked-up rows. Activations, norms, the
residual stream and the KV pool keep ``engine.dtype``. The accuracy cost
(greedy agreement with bfloat16, perplexity) is in docs/benchmarks.md.
"""
from __future__ import annotations

import ctypes

import torch
from torch import nn

from common.engine.native import kernel_function

SMALL_BATCH_ROWS = 8  # decode_forward.c's MAX_ROWS


def quantize_rows(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 per output row: ``(q [N, K] int8, scale [N] float32)``."""
    w = weight.float()
    scale = w.abs().amax(dim=1).clamp(min=1e-8) / 127.0
    q = torch.round(w / scale[:, None]).clamp_(-127, 127).to(torch.int8)
    return q.contiguous(), scale.contiguous()


def linear_int8_kernel():
    """``tessera_linear_int8(x, w, scale, bias, y, m, n, k, act_bf16)`` (``kernels/decode_forward.c``)."""
    return kernel_function("decode_forward", "tessera_linear_int8", (ctypes.c_void_p,) * 5 + (ctypes.c_int,) * 4)


def linear_int8(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``x @ (q * scale)^T + bias`` without materializing the dequantized weight."""
    rows = x.shape[0]
    if rows <= SMALL_BATCH_ROWS and x.dim() == 2:
        kernel = linear_int8_kernel()
        if kernel is not None:
            x = x.contiguous()
            out = torch.empty((rows, q.shape[0]), dtype=x.dtype)
            bias_ptr = None if bias is None else bias.contiguous().data_ptr()
            if kernel(x.data_ptr(), q.data_ptr(), scale.data_ptr(), bias_ptr, out.data_ptr(), rows, q.shape[0],
                      q.shape[1], int(x.dtype is torch.bfloat16)) == 0:
                return out
    xf = x.reshape(-1, x.shape[-1]).float()
    x_scale = xf.abs().amax(dim=1, keepdim=True).clamp_(min=1e-8) / 127.0
    xq = torch.round(xf / x_scale).to(torch.int8)
    acc = torch._int_mm(xq, q.t())
    out = (acc.float() * x_scale * scale).to(x.dtype)
    if bias is not None:
        out += bias
    return out.reshape(*x.shape[:-1], q.shape[0])


class Int8Embedding(nn.Module):
    """An embedding (and tied LM head) held as int8 rows with per-row scales."""

    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__()
        q, scale = quantize_rows(weight)
        self.register_buffer("weight", q)
        self.register_buffer("weight_scale", scale)
        self.dtype = weight.dtype

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return (self.weight[input_ids].float() * self.weight_scale[input_ids, None]).to(self.dtype)


def quantize_model_int8(model: nn.Module) -> None:
    """Replace every ``Linear``'s weight, and the embedding, by int8 rows with scales (in place)."""
    for module in model.modules():
        if isinstance(module, nn.Linear):
            q, scale = quantize_rows(module.weight.data)
            del module.weight
            module.register_buffer("weight", q)
            module.register_buffer("weight_scale", scale)
    model.embed_tokens = Int8Embedding(model.embed_tokens.weight.data)
