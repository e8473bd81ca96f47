"""Embeddings computed by the engine's model equal transformers' on the same weights."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from transformers import AutoModel

from common.engine.attention import select_backend
from common.engine.embedder import Embedder, Pooling, plan_batches, pooling_of
from common.engine.models.loader import load_model
from tests.tiny_models import build_tiny_model

INPUT_LENGTHS = (5, 17, 1, 40, 33, 8, 64, 2)


def inputs(vocab: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in INPUT_LENGTHS]


def reference(model_dir, batch: list[list[int]]) -> np.ndarray:
    """transformers' last hidden state, each input alone, mean-pooled and normalized, in float32."""
    model = AutoModel.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        pooled = [model(torch.tensor([ids])).last_hidden_state[0].mean(0) for ids in batch]
    return torch.nn.functional.normalize(torch.stack(pooled), dim=-1).numpy()


def embedder(model_dir, dtype: str, max_tokens: int = 96, padding_budget: float = 0.25) -> Embedder:
    model = load_model(model_dir, getattr(torch, dtype), "cpu", select_backend("auto", "cpu", 16))
    return Embedder(model, torch.device("cpu"), pooling_of(model_dir), max_tokens, padding_budget)


@pytest.mark.parametrize("kind", ["llama", "qwen2", "qwen3"])
def test_float32_embeddings_equal_transformers(kind, tmp_path):
    model_dir = build_tiny_model(kind, tmp_path)
    batch = inputs(300)
    got = embedder(model_dir, "float32").embed(batch)
    assert np.abs(got - reference(model_dir, batch)).max() <= 1e-4


def test_the_embedded_model_in_float32_and_bfloat16(embedded_model_dir, embedded_model_dir_bf16):
    batch = inputs(49152, seed=1)
    want = reference(embedded_model_dir, batch)
    assert np.abs(embedder(embedded_model_dir, "float32").embed(batch) - want).max() <= 1e-4
    cosine = (embedder(embedded_model_dir_bf16, "bfloat16").embed(batch) * want).sum(axis=1)
    assert cosine.min() >= 0.999


def test_batching_does_not_change_a_vector(tmp_path):
    """Padded into one batch, or each alone: the same vectors (padding never leaks into an input)."""
    model_dir = build_tiny_model("llama", tmp_path)
    batch = inputs(300)
    together = embedder(model_dir, "float32", max_tokens=4096, padding_budget=1.0).embed(batch)
    alone = embedder(model_dir, "float32", max_tokens=1).embed(batch)
    assert np.abs(together - alone).max() <= 1e-5


def test_batches_keep_within_the_token_and_padding_budgets():
    lengths = [100, 3, 50, 49, 48, 7, 7, 6, 300, 1]
    batches = plan_batches(lengths, max_tokens=128, padding_budget=0.25)
    assert sorted(i for b in batches for i in b) == list(range(len(lengths)))
    for batch in batches:
        longest = max(lengths[i] for i in batch)
        size = len(batch) * longest
        if len(batch) > 1:
            assert size <= 128
            assert size - sum(lengths[i] for i in batch) <= 0.25 * size
    assert [8] in batches  # longer than the budget: alone
    assert [2, 3] in batches  # 50 and 49 share one (with 48 too, 3 x 50 would pass 128 tokens)
    assert [5, 6, 7, 1] in batches  # 7, 7, 6 and 3: 5 padding tokens of 28


def test_pooling_follows_a_sentence_transformers_declaration(tmp_path):
    assert pooling_of(tmp_path) == Pooling("mean", True)
    (tmp_path / "1_Pooling").mkdir()
    (tmp_path / "1_Pooling" / "config.json").write_text(json.dumps({"pooling_mode_lasttoken": True}))
    (tmp_path / "modules.json").write_text(json.dumps([
        {"idx": 0, "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]))
    assert pooling_of(tmp_path) == Pooling("last", False)
    (tmp_path / "1_Pooling" / "config.json").write_text(json.dumps({"pooling_mode_max_tokens": True}))
    with pytest.raises(ValueError, match="not supported"):
        pooling_of(tmp_path)


def test_cls_and_last_token_pooling(tmp_path):
    model_dir = build_tiny_model("llama", tmp_path)
    model = load_model(model_dir, torch.float32, "cpu", select_backend("auto", "cpu", 16))
    batch = inputs(300)
    hf = AutoModel.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        states = [hf(torch.tensor([ids])).last_hidden_state[0] for ids in batch]
    for mode, row in (("cls", 0), ("last", -1)):
        got = Embedder(model, torch.device("cpu"), Pooling(mode, False), 96, 0.25).embed(batch)
        want = torch.stack([s[row] for s in states]).numpy()
        assert np.abs(got - want).max() <= 1e-4
