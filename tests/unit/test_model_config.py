"""A model's configuration read from config.json as it is (``loader.load_hf_config``'s fast path, no transformers)
builds the very model transformers' AutoConfig does: the same modules, parameter shapes, norms' epsilon and RoPE
table; a configuration the fast path cannot read plainly (scaled RoPE, an unlisted type, a field left to a
default) goes through AutoConfig."""
from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch
from transformers import AutoConfig

from common.engine.attention import TorchAttention
from common.engine.models.llama import LlamaForCausalLM
from common.engine.models.loader import load_hf_config
from common.engine.tensor_parallel import Parallel
from tests.tiny_models import build_tiny_model


def model_of(cfg) -> LlamaForCausalLM:
    with torch.device("meta"):
        return LlamaForCausalLM(cfg, TorchAttention(), Parallel())


def signature(model: LlamaForCausalLM) -> dict:
    eps = {name: m.eps for name, m in model.named_modules() if hasattr(m, "eps")}
    shapes = {name: tuple(p.shape) for name, p in model.named_parameters()}
    rope = model.rope
    return {"shapes": shapes, "eps": eps, "tied": model.tie_word_embeddings, "inv_freq": rope.inv_freq.tolist(),
            "scaling": rope.scaling, "max_positions": rope.max_positions, "modules": str(model)}


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_a_stated_config_is_read_plainly_and_builds_the_autoconfig_model(kind, tmp_path):
    directory = build_tiny_model(kind, tmp_path)
    plain = load_hf_config(directory)
    assert isinstance(plain, SimpleNamespace)
    assert signature(model_of(plain)) == signature(model_of(AutoConfig.from_pretrained(str(directory))))


def test_the_embedded_model_is_read_plainly_and_builds_the_autoconfig_model(embedded_model_dir):
    plain = load_hf_config(embedded_model_dir)
    assert isinstance(plain, SimpleNamespace)
    assert signature(model_of(plain)) == signature(model_of(AutoConfig.from_pretrained(str(embedded_model_dir))))


@pytest.mark.parametrize("kind", ["llama3-scaled", "mistral", "qwen3"])
def test_scaled_rope_and_other_types_go_through_autoconfig(kind, tmp_path):
    directory = build_tiny_model(kind, tmp_path)
    assert not isinstance(load_hf_config(directory), SimpleNamespace)


def test_a_field_left_to_its_default_goes_through_autoconfig(tmp_path):
    directory = build_tiny_model("llama", tmp_path)
    config = json.loads((directory / "config.json").read_text())
    del config["rms_norm_eps"]
    (directory / "config.json").write_text(json.dumps(config))
    cfg = load_hf_config(directory)
    assert not isinstance(cfg, SimpleNamespace) and cfg.rms_norm_eps == 1e-6  # LlamaConfig's default
