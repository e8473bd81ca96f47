"""Rotary position embedding for the Llama family: the cos/sin table, built once per model, and the rotation.

The inverse frequencies come from transformers' own RoPE initializers, so every scaling type they define for
a static context (default, linear, llama3, yarn, ...) gives exactly the reference numbers. On the CPU the
step's rotation runs in C over this table (``StepRope`` in models/llama.py); ``rotate`` is the torch path.
"""
from __future__ import annotations

import torch
from torch import nn

# Types whose frequencies depend on the current sequence length are refused: one table per batch cannot
# express them.
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
