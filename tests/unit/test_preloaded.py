"""A model loaded before a fork, adopted by the engine that would load the same weights
(common/engine/models/preloaded.py); what cannot be kept loads as ever."""
from __future__ import annotations

import dataclasses
import os

import pytest
from torch import nn

from common.config.base import EngineConfig
from common.engine.llm_engine import LLMEngine
from common.engine.models import preloaded
from common.engine.models.preloaded import preload
from common.protocol.sampling_params import SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
PROMPTS = [[5, 6, 7, 8, 9], [40, 41, 42] * 4]


@pytest.fixture(autouse=True)
def nothing_kept():
    preloaded._models.clear()
    yield
    preloaded._models.clear()


def config_of(model_dir, **changes) -> EngineConfig:
    return dataclasses.replace(EngineConfig(model=str(model_dir), dtype="float32", num_kv_blocks=32), **changes)


def test_a_preloaded_model_is_adopted_once_and_answers_as_a_loaded_one(tiny_chat_model_dir):
    config = config_of(tiny_chat_model_dir)
    assert preload(config) and not preload(config), "kept once"
    adopted = LLMEngine(config)
    assert adopted.runner.adopted and not preloaded.held(), "taken: the process owns it alone"
    loaded = LLMEngine(config)
    assert not loaded.runner.adopted
    assert adopted.runner.model is not loaded.runner.model
    assert all(layer.self_attn.backend is adopted.runner.attention for layer in adopted.runner.model.layers)
    outs = [[o.outputs[0].token_ids for o in engine.generate(PROMPTS, GREEDY)] for engine in (adopted, loaded)]
    assert outs[0] == outs[1]


@pytest.mark.parametrize("changes", [{"dtype": "bfloat16"}, {"quantization": "int8"}, {"deterministic": True}],
                         ids=["bfloat16", "int8", "deterministic"])
def test_weights_changed_after_the_load_are_never_kept(tiny_chat_model_dir, changes):
    assert not preload(config_of(tiny_chat_model_dir, **changes)) and not preloaded.held()


def test_a_model_directory_written_again_is_loaded_from_its_files(tiny_chat_model_dir):
    config = config_of(tiny_chat_model_dir)
    assert preload(config)
    config_json = tiny_chat_model_dir / "config.json"
    stat = config_json.stat()
    os.utime(config_json, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000_000))
    try:
        assert not LLMEngine(config).runner.adopted
    finally:
        os.utime(config_json, ns=(stat.st_atime_ns, stat.st_mtime_ns))


def test_the_newest_models_are_kept_and_a_load_drops_them_all():
    for n in range(preloaded.MAX_MODELS + 1):
        preloaded.keep(("model", n), nn.Linear(1, 1))
    assert not preloaded.kept(("model", 0))
    assert preloaded.kept(("model", 1)), "found again: the newest now"
    preloaded.keep(("model", 9), nn.Linear(1, 1))
    assert preloaded.kept(("model", 1)) and not preloaded.kept(("model", 2))
    assert preloaded.take(("model", 3)) is not None and not preloaded.held(), "the others dropped"
    preloaded.keep(("model", 1), nn.Linear(1, 1))
    assert preloaded.take(("model", 5)) is None and not preloaded.held(), "dropped by a load that takes none too"
    assert preloaded.take(None) is None
