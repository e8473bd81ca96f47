"""Llama-family decoder: Llama (incl. llama3 RoPE scaling), Mistral, Qwen2, Qwen3.

One implementation with switches read from the Hugging Face config:
- Qwen2: bias on the q/k/v projections;
- Qwen3: RMSNorm on each head of q and k before RoPE;
- Llama: optional ``attention_bias`` / ``mlp_bias``;
- grouped-query attention and tied embeddings everywhere.

The forward takes a flat ragged batch ``(input_ids, positions)``; paging and
batching live in the step context and the attention backend. q/k/v and
gate/up projections are fused into one matmul each; the loader slices the
checkpoint's separate tensors into them.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from common.engine.attention import get_step_context
from common.engine.native import gemv_bf16_kernel
from common.engine.quantization import linear_int8

GEMV_MAX_K = 16384  # kernels/gemv_bf16.c's limit on the input width

SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
}


# ---- rotary position embedding: a precomputed cos/sin table ----------------------------------
# The inverse frequencies come from transformers' own RoPE initializers, so
# every scaling type they define for a static context (default, linear,
# llama3, yarn, ...) gives exactly the reference numbers. Types whose
# frequencies depend on the current sequence length (dynamic, longrope) are
# refused: a shared table per batch cannot express them.
_LENGTH_DEPENDENT = {"dynamic", "longrope"}


def _rope_parameters(cfg) -> dict:
    params = getattr(cfg, "rope_parameters", None)
    if params is None:  # older configs
        params = dict(getattr(cfg, "rope_scaling", None) or {})
        params.setdefault("rope_theta", getattr(cfg, "rope_theta", 10000.0))
    return dict(params)


class RotaryEmbedding(nn.Module):
    def __init__(self, cfg, head_dim: int) -> None:
        super().__init__()
        params = _rope_parameters(cfg)
        rope_type = params.get("rope_type", params.get("type", "default"))
        if rope_type in _LENGTH_DEPENDENT:
            raise NotImplementedError(f"RoPE type {rope_type!r} depends on sequence length; not supported")
        if params.get("partial_rotary_factor", 1.0) != 1.0:
            raise NotImplementedError("partial rotary embeddings are not supported")
        if rope_type == "default":
            base = params["rope_theta"]
            inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float, device="cpu") / head_dim))
            scaling = 1.0
        else:
            from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

            with torch.device("cpu"):  # the loader builds modules under the meta device
                inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](cfg, "cpu")
        self.inv_freq = inv_freq.float().cpu()
        self.scaling = float(scaling)
        self.max_positions = int(getattr(cfg, "max_position_embeddings", 4096))
        self.register_buffer("cos", torch.empty(0, device="cpu"), persistent=False)
        self.register_buffer("sin", torch.empty(0, device="cpu"), persistent=False)
        self.build_table("cpu")

    def build_table(self, device: str | torch.device) -> None:
        """(Re)compute the cos/sin table on ``device`` (the loader calls it after materializing)."""
        positions = torch.arange(self.max_positions, dtype=torch.float, device="cpu")
        freqs = positions[:, None] * self.inv_freq[None, :]
        self.cos = (freqs.cos() * self.scaling).to(device)
        self.sin = (freqs.sin() * self.scaling).to(device)

    def table(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin ``[T, 1, D/2]`` of ``positions`` in ``dtype``: gathered once per step, used by every layer."""
        return self.cos[positions].unsqueeze(1).to(dtype), self.sin[positions].unsqueeze(1).to(dtype)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` ``[T, heads, D]`` (q and k heads together) by the positions of ``cos``/``sin``."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           scale: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear``, except that int8 weights (with their per-row ``scale``) take the int8 paths
    (common/engine/quantization.py), and one bfloat16 row on the CPU (a batch-1 decode step) takes the GEMV
    kernel, which streams the weights at memory speed where torch's bf16 matmul does not (docs/benchmarks.md)."""
    if weight.dtype is torch.int8:
        return linear_int8(x, weight, scale, bias)
    if (x.dtype is torch.bfloat16 and x.shape[0] == 1 and x.dim() == 2 and x.device.type == "cpu"
            and weight.dtype is torch.bfloat16 and x.shape[1] <= GEMV_MAX_K and weight.is_contiguous()
            and (bias is None or bias.dtype is torch.bfloat16)):
        kernel = gemv_bf16_kernel()
        if kernel is not None:
            x = x.contiguous()
            out = torch.empty((1, weight.shape[0]), dtype=torch.bfloat16)
            bias_ptr = None if bias is None else bias.contiguous().data_ptr()
            if kernel(x.data_ptr(), weight.data_ptr(), bias_ptr, out.data_ptr(), 1, weight.shape[0], x.shape[1]) == 0:
                return out
    return F.linear(x, weight, bias)


class Linear(nn.Linear):
    """``nn.Linear`` whose single-row bfloat16 calls (batch-1 decode) take the GEMV kernel (``linear``)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias, getattr(self, "weight_scale", None))


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """Normalize ``x`` (+ ``residual`` when given, returning the sum as the new residual)."""
        if residual is not None:
            x = x + residual
            residual = x
        dtype = x.dtype
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        out = self.weight * xf.to(dtype)
        return out if residual is None else (out, residual)


class Attention(nn.Module):
    def __init__(self, cfg, layer_idx: int, arch: str, backend) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = getattr(cfg, "num_key_value_heads", None) or self.num_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // self.num_heads
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        qkv_bias = arch == "qwen2" or bool(getattr(cfg, "attention_bias", False))
        o_bias = arch != "qwen2" and bool(getattr(cfg, "attention_bias", False))
        self.qkv_proj = Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=qkv_bias)
        self.o_proj = Linear(self.q_size, cfg.hidden_size, bias=o_bias)
        if arch == "qwen3":
            self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
        else:
            self.q_norm = self.k_norm = None
        self.scale = self.head_dim ** -0.5
        self.backend = backend

    def forward(self, rope: tuple[torch.Tensor, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        n = x.shape[0]
        qk, v = self.qkv_proj(x).split([self.q_size + self.kv_size, self.kv_size], dim=-1)
        qk = qk.reshape(n, self.num_heads + self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = qk.split([self.num_heads, self.num_kv_heads], dim=1)
            qk = torch.cat((self.q_norm(q), self.k_norm(k)), dim=1)
        q, k = rotate(qk, *rope).split([self.num_heads, self.num_kv_heads], dim=1)
        v = v.reshape(n, self.num_kv_heads, self.head_dim)
        out = self.backend(q, k, v, self.layer_idx, self.scale)
        return self.o_proj(out.reshape(n, self.q_size))


class MLP(nn.Module):
    def __init__(self, cfg) -> None:
        super().__init__()
        bias = bool(getattr(cfg, "mlp_bias", False))
        self.intermediate = cfg.intermediate_size
        self.gate_up_proj = Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=bias)
        self.down_proj = Linear(cfg.intermediate_size, cfg.hidden_size, bias=bias)
        if getattr(cfg, "hidden_act", "silu") != "silu":
            raise NotImplementedError(f"hidden_act {cfg.hidden_act!r} (only silu is supported)")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split(self.intermediate, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, cfg, layer_idx: int, arch: str, backend) -> None:
        super().__init__()
        self.self_attn = Attention(cfg, layer_idx, arch, backend)
        self.mlp = MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, rope, x, residual):
        if residual is None:
            residual = x
            x = self.input_layernorm(x)
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.self_attn(rope, x)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual


class LlamaForCausalLM(nn.Module):
    def __init__(self, cfg, backend) -> None:
        super().__init__()
        arch = architecture_of(cfg)
        self.config = cfg
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.rope = RotaryEmbedding(cfg, head_dim)
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(
            DecoderLayer(cfg, i, arch, backend) for i in range(cfg.num_hidden_layers)
        )
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.tie_word_embeddings = bool(getattr(cfg, "tie_word_embeddings", False))
        if not self.tie_word_embeddings:
            self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.requires_grad_(False)
        # Set by the model runner where the one-call decode kernel applies (models/fused_decode.py).
        self.fused_decode = None

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        if self.fused_decode is not None:
            ctx = get_step_context()
            if self.fused_decode.usable(ctx, x.shape[0]):
                return self.fused_decode(x, positions, ctx)
        rope = self.rope.table(positions, x.dtype)
        residual = None
        for layer in self.layers:
            x, residual = layer(rope, x, residual)
        x, _ = self.norm(x, residual)
        return x

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        head = self.embed_tokens if self.tie_word_embeddings else self.lm_head
        return linear(hidden, head.weight, None, getattr(head, "weight_scale", None))


def architecture_of(cfg) -> str:
    names = list(getattr(cfg, "architectures", None) or [])
    for name in names:
        if name in SUPPORTED_ARCHITECTURES:
            return SUPPORTED_ARCHITECTURES[name]
    model_type = getattr(cfg, "model_type", None)
    if model_type in SUPPORTED_ARCHITECTURES.values():
        return model_type
    raise NotImplementedError(
        f"unsupported model architecture {names or model_type!r}; "
        f"supported: {sorted(SUPPORTED_ARCHITECTURES)}"
    )
