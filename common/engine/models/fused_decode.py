"""The whole decoder forward of a small decode step in one C call (``kernels/decode_forward.c``).

A decode step of a few rows reads every weight once and does little else;
on the torch path it also runs about 40 small operators per layer, each with
Python dispatch, an allocation and an OpenMP region of its own, which cost
as much as the weight reads (docs/benchmarks.md, "Where a step's time goes").
``FusedDecode`` hands the kernel a table of each layer's weight addresses,
built once, and the step's paging metadata from the step context, and gets
back the final normed hidden state of every row.

It takes a step only when every row is a single-query decode row (no prompt
chunk), there are at most ``EngineConfig.decode_kernel_max_batch`` of them,
and the model, its weights and the KV pool are on the CPU in float32,
bfloat16 or int8 weights (``common/engine/quantization.py``). Anything else
keeps the torch path.
"""
from __future__ import annotations

import ctypes
import functools

import torch

from common.engine.native import load_kernel

MAX_ROWS = 8  # decode_forward.c's MAX_ROWS
_WEIGHT_TYPES = {torch.float32: 0, torch.bfloat16: 1, torch.int8: 2}
_LINEARS = ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj")


@functools.cache
def decode_forward_kernel():
    """``tessera_decode_forward`` (see its C comment for the arguments), or None without a compiler."""
    lib = load_kernel("decode_forward")
    if lib is None:
        return None
    fn = lib.tessera_decode_forward
    fn.restype = ctypes.c_int
    fn.argtypes = ([ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p, ctypes.c_float, ctypes.c_float]
                   + [ctypes.c_void_p] * 11)
    return fn


def _address(t: torch.Tensor | None) -> int:
    return 0 if t is None else t.data_ptr()


class FusedDecode:
    """Runs ``model``'s forward for up to ``max_rows`` decode rows in one kernel call."""

    def __init__(self, model, max_rows: int) -> None:
        self.model = model
        self.max_rows = min(max_rows, MAX_ROWS)
        self._kernel = decode_forward_kernel() if self.max_rows > 0 else None
        self._layers: torch.Tensor | None = None  # [num_layers, 18] int64 addresses, built on first use
        self._pool_key: tuple | None = None

    def usable(self, ctx, num_rows: int) -> bool:
        return (self._kernel is not None and not ctx.chunks and ctx.decode_rows is not None
                and num_rows <= self.max_rows and ctx.kv_cache.buffer.device.type == "cpu"
                and ctx.kv_cache.buffer.dtype is self.model.norm.weight.dtype)

    def _build(self, ctx) -> None:
        """The layer table: weight, scale and bias addresses per layer, and its K/V offsets in the pool."""
        pool = ctx.kv_cache.buffer
        itemsize = pool.element_size()
        rows = []
        for i, layer in enumerate(self.model.layers):
            attn = layer.self_attn
            row = [_address(layer.input_layernorm.weight), _address(layer.post_attention_layernorm.weight),
                   _address(attn.q_norm.weight if attn.q_norm is not None else None),
                   _address(attn.k_norm.weight if attn.k_norm is not None else None)]
            for name in _LINEARS:
                linear = layer.get_submodule(name)
                row += [_address(linear.weight), _address(getattr(linear, "weight_scale", None)),
                        _address(linear.bias)]
            k_cache, v_cache = ctx.kv_cache.layers[i]
            row += [(k_cache.data_ptr() - pool.data_ptr()) // itemsize,
                    (v_cache.data_ptr() - pool.data_ptr()) // itemsize]
            rows.append(row)
        self._layers = torch.tensor(rows, dtype=torch.int64)
        first = self.model.layers[0]
        weight_dtype = first.self_attn.qkv_proj.weight.dtype
        cfg = self.model.config
        self._static = dict(
            hidden=cfg.hidden_size, heads=first.self_attn.num_heads, kv_heads=first.self_attn.num_kv_heads,
            head_dim=first.self_attn.head_dim, inter=first.mlp.intermediate,
            act_bf16=int(pool.dtype is torch.bfloat16), weight_type=_WEIGHT_TYPES[weight_dtype],
            block_stride=pool.stride(0), block_size=k_cache.shape[1],
        )
        self._eps = float(cfg.rms_norm_eps)
        self._scale = float(first.self_attn.scale)
        self._pool_key = (pool.data_ptr(), pool.shape)

    def __call__(self, x: torch.Tensor, positions: torch.Tensor, ctx) -> torch.Tensor:
        """Normed last hidden states ``[rows, hidden]`` of the step's decode rows (``x``: their embeddings)."""
        if self._layers is None or self._pool_key != (ctx.kv_cache.buffer.data_ptr(), ctx.kv_cache.buffer.shape):
            self._build(ctx)
        s = self._static
        rows = x.shape[0]
        tables = ctx.decode_block_tables
        dims = torch.tensor([rows, s["hidden"], s["heads"], s["kv_heads"], s["head_dim"], s["inter"],
                             s["block_size"], tables.shape[1], s["act_bf16"], s["weight_type"], s["block_stride"]],
                            dtype=torch.int64)
        x = x.contiguous()
        out = torch.empty_like(x)
        rope = self.model.rope
        status = self._kernel(
            self._layers.data_ptr(), self._layers.shape[0], dims.data_ptr(), self._eps, self._scale,
            x.data_ptr(), positions.data_ptr(), rope.cos.data_ptr(), rope.sin.data_ptr(),
            ctx.kv_cache.buffer.data_ptr(), tables.data_ptr(), ctx.decode_context_lens.data_ptr(),
            ctx.slot_blocks.data_ptr(), ctx.slot_offsets.data_ptr(), self.model.norm.weight.data_ptr(),
            out.data_ptr(),
        )
        if status != 0:
            raise RuntimeError("decode_forward kernel refused the model's shapes; "
                               "set engine.decode_kernel_max_batch=0 to use the torch path")
        return out
