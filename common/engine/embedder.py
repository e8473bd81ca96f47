"""Embeddings: each input's last hidden state, pooled, in batches that keep no KV.

An input is computed whole, with no cache: the model runs under an ``EncodeContext``
(``common/engine/attention.py``), which pads the batch's inputs to its longest and attends them in one
call. Inputs are grouped by length (``plan_batches``) so that a batch stays within a token budget and its
padding within a share of it; the model's final norm output is then pooled per input:
- ``mean`` over the input's tokens (the default), ``cls`` (its first token) or ``last`` (its last token),
  as a sentence-transformers ``modules.json`` with a Pooling module declares (``pooling_of``);
- normalized to unit length, unless such a ``modules.json`` lists no Normalize module.
Pooling runs in float32 whatever the model's dtype.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from common.engine.attention import EncodeContext, step_context

_ST_MODES = {"pooling_mode_mean_tokens": "mean", "pooling_mode_cls_token": "cls", "pooling_mode_lasttoken": "last"}


@dataclass(frozen=True)
class Pooling:
    mode: str = "mean"
    normalize: bool = True


def pooling_of(model_dir: str | Path) -> Pooling:
    """The pooling a model directory declares (sentence-transformers' modules.json), else mean and normalized."""
    modules_file = Path(model_dir) / "modules.json"
    if not modules_file.is_file():
        return Pooling()
    modules = json.loads(modules_file.read_text())
    normalize = any(str(m.get("type", "")).endswith("Normalize") for m in modules)
    for module in modules:
        if str(module.get("type", "")).endswith("Pooling"):
            config_file = Path(model_dir) / module.get("path", "") / "config.json"
            config = json.loads(config_file.read_text()) if config_file.is_file() else {}
            modes = [mode for key, mode in _ST_MODES.items() if config.get(key)]
            if len(modes) > 1 or any(config.get(k) for k in ("pooling_mode_max_tokens",
                                                               "pooling_mode_mean_sqrt_len_tokens")):
                raise ValueError(f"{config_file}: pooling {config} is not supported (one of {', '.join(_ST_MODES)})")
            return Pooling(modes[0] if modes else "mean", normalize)
    return Pooling("mean", normalize)


def plan_batches(lengths: list[int], max_tokens: int, padding_budget: float) -> list[list[int]]:
    """Indices of ``lengths`` grouped into batches, longest first: a batch's padded size (its count times its
    longest) stays within ``max_tokens`` and its padding within ``padding_budget`` of that size. An input
    longer than ``max_tokens`` is a batch of its own."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    batches: list[list[int]] = []
    batch: list[int] = []
    longest = tokens = 0
    for i in order:
        size = (len(batch) + 1) * longest
        if batch and (size > max_tokens or size - tokens - lengths[i] > padding_budget * size):
            batches.append(batch)
            batch = []
        if not batch:
            longest, tokens = lengths[i], 0
        batch.append(i)
        tokens += lengths[i]
    if batch:
        batches.append(batch)
    return batches


class Embedder:
    def __init__(self, model, device: torch.device, pooling: Pooling, max_batch_tokens: int,
                 padding_budget: float) -> None:
        self.model = model
        self.device = device
        self.pooling = pooling
        self.max_batch_tokens = max_batch_tokens
        self.padding_budget = padding_budget
        self.dim = model.config.hidden_size

    @torch.inference_mode()
    def embed(self, inputs: list[list[int]]) -> np.ndarray:
        """``[len(inputs), dim]`` float32, in the inputs' order."""
        out = np.empty((len(inputs), self.dim), dtype=np.float32)
        for batch in plan_batches([len(ids) for ids in inputs], self.max_batch_tokens, self.padding_budget):
            out[batch] = self._batch([inputs[i] for i in batch]).cpu().numpy()
        return out

    def _batch(self, inputs: list[list[int]]) -> torch.Tensor:
        lens = np.array([len(ids) for ids in inputs], dtype=np.int64)
        if (lens < 1).any():
            raise ValueError("an input to embed has no tokens")
        batch, length, total = len(inputs), int(lens.max()), int(lens.sum())
        starts = np.cumsum(lens) - lens
        positions = np.arange(total) - np.repeat(starts, lens)
        index = np.repeat(np.arange(batch) * length, lens) + positions
        key = torch.arange(length, device=self.device)
        lens_t = torch.from_numpy(lens).to(self.device)
        mask = (key[None, None, :] <= key[None, :, None]) & (key[None, None, :] < lens_t[:, None, None])
        ctx = EncodeContext(torch.from_numpy(index).to(self.device), mask[:, None], batch, length)
        ids = torch.from_numpy(np.concatenate([np.asarray(i, dtype=np.int64) for i in inputs])).to(self.device)
        with step_context(ctx):
            hidden = self.model(ids, torch.from_numpy(positions).to(self.device)).float()
        if self.pooling.mode == "mean":
            segment = torch.from_numpy(np.repeat(np.arange(batch), lens)).to(self.device)
            pooled = torch.zeros((batch, hidden.shape[1]), device=self.device).index_add_(0, segment, hidden)
            pooled /= lens_t[:, None].float()
        else:
            rows = starts if self.pooling.mode == "cls" else starts + lens - 1
            pooled = hidden[torch.from_numpy(rows).to(self.device)]
        return F.normalize(pooled, dim=-1) if self.pooling.normalize else pooled
