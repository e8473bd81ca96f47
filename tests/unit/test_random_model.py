"""Random-weight models: the directory they write loads in transformers and in Tessera, with the same logits."""
from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from transformers import AutoModelForCausalLM

from common.cli.main import main
from common.config.base import EngineConfig
from common.engine.model_runner import ModelRunner
from common.storage import random_model
from common.storage.random_model import SHAPES, make_random_model, random_model_dir, shape_label
from common.storage.safetensors_files import INDEX_FILE, weight_totals
from tests.tiny_models import run_steps

TOL = 1e-4  # as tests/unit/test_model_numerics.py: float32 on both sides, only the order of the sums differs
TINY = SHAPES["tiny"]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory, embedded_model_dir):
    return make_random_model(tmp_path_factory.mktemp("random") / "tiny", TINY, "float32", seed=3,
                             tokenizer_from=embedded_model_dir)


def tessera_logits(model_dir, ids):
    runner = ModelRunner(EngineConfig(model=str(model_dir), num_kv_blocks=8), model_dir)
    return run_steps(runner, ids, [len(ids)], [0, 1])


def transformers_logits(model_dir, ids):
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0]


def test_tiny_model_gives_tessera_and_transformers_the_same_logits(tiny_dir, embedded_model_dir):
    ids = list(range(1, 24))
    ours = tessera_logits(tiny_dir, ids)
    assert ours.shape == (len(ids), TINY.vocab_size)
    assert ours.std() > 0  # random weights, not zeros
    assert (ours - transformers_logits(tiny_dir, ids)).abs().max().item() <= TOL
    config = json.loads((tiny_dir / "config.json").read_text())
    assert config["tie_word_embeddings"] and config["torch_dtype"] == "float32"
    assert (tiny_dir / "tokenizer.json").read_bytes() == (embedded_model_dir / "tokenizer.json").read_bytes()
    assert config["eos_token_id"] == json.loads((embedded_model_dir / "config.json").read_text())["eos_token_id"]


def test_small_shards_write_an_index_and_the_same_model(tmp_path, tiny_dir, embedded_model_dir):
    sharded = make_random_model(tmp_path / "sharded", TINY, "float32", seed=3, tokenizer_from=embedded_model_dir,
                                max_shard_bytes=64 << 10)
    weight_map = json.loads((sharded / INDEX_FILE).read_text())["weight_map"]
    assert len(set(weight_map.values())) > 2 and not (sharded / "model.safetensors").exists()
    assert set(weight_map) == {entry.name for entry in TINY.tensors()}
    ids = list(range(5, 17))
    assert torch.equal(tessera_logits(sharded, ids), tessera_logits(tiny_dir, ids))  # same seed, same values
    assert (transformers_logits(sharded, ids) - tessera_logits(sharded, ids)).abs().max().item() <= TOL


def test_the_counts_of_a_shape_match_what_is_written(tiny_dir):
    assert weight_totals(tiny_dir) == (TINY.parameter_count(), TINY.weight_bytes("float32"))
    one_b = SHAPES["1b"]
    assert round(one_b.parameter_count() / 1e6) == 822  # the 1B shape: 822M parameters, tied embeddings
    assert round(one_b.weight_bytes("bfloat16") / 1e9, 2) == 1.64


def test_the_same_arguments_reuse_the_directory(tiny_dir, embedded_model_dir, monkeypatch):
    monkeypatch.setattr(random_model, "write_shards", lambda *args, **kwargs: pytest.fail("wrote again"))
    assert make_random_model(tiny_dir, TINY, "float32", seed=3, tokenizer_from=embedded_model_dir) == tiny_dir


def test_a_seed_gives_the_same_bytes_and_another_seed_others(tmp_path, tiny_dir, embedded_model_dir):
    again = make_random_model(tmp_path / "again", TINY, "float32", seed=3, tokenizer_from=embedded_model_dir)
    other = make_random_model(tmp_path / "other", TINY, "float32", seed=4, tokenizer_from=embedded_model_dir)
    weights = (tiny_dir / "model.safetensors").read_bytes()
    assert (again / "model.safetensors").read_bytes() == weights
    assert (other / "model.safetensors").read_bytes() != weights


def test_another_seed_replaces_a_random_model_but_nothing_else(tmp_path, embedded_model_dir):
    target = make_random_model(tmp_path / "m", TINY, "bfloat16", seed=1, tokenizer_from=embedded_model_dir)
    before = (target / "model.safetensors").read_bytes()
    make_random_model(target, TINY, "bfloat16", seed=2, tokenizer_from=embedded_model_dir)
    assert (target / "model.safetensors").read_bytes() != before
    assert len(before) > TINY.weight_bytes("bfloat16")  # bfloat16: two bytes a weight, plus the header
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".m.")] == [".m.lock"]  # no partial left
    (tmp_path / "mine").mkdir()
    with pytest.raises(ValueError, match="is not a random model"):
        make_random_model(tmp_path / "mine", TINY, "bfloat16", tokenizer_from=embedded_model_dir)


def test_shapes_are_overridden_field_by_field_and_validated():
    smaller = dataclasses.replace(SHAPES["1b"], num_hidden_layers=4, hidden_size=1024)
    assert smaller.head_dim == 32 and smaller.intermediate_size == 5632
    assert shape_label("1b", smaller) == "1b-h1024-l4" and shape_label("1b", SHAPES["1b"]) == "1b"
    assert random_model_dir("1b", "bfloat16", 7, "/c").as_posix() == "/c/models/random-1b-bfloat16-s7"
    with pytest.raises(ValueError, match="num_key_value_heads"):
        dataclasses.replace(TINY, num_key_value_heads=3)
    with pytest.raises(ValueError, match="num_hidden_layers must be an integer >= 1"):
        dataclasses.replace(TINY, num_hidden_layers=0)


def test_the_command_prints_the_directory_and_the_size(tmp_path, capsys, embedded_model_dir):
    out = tmp_path / "cli"
    assert main(["model", "random", "--shape", "tiny", "--layers", "1", "--dtype", "bfloat16", "--seed", "5",
                 "--out", str(out)]) == 0
    captured = capsys.readouterr()
    assert captured.out.strip() == str(out)
    one_layer = dataclasses.replace(TINY, num_hidden_layers=1)
    assert f"{one_layer.parameter_count():,} parameters" in captured.err
    assert json.loads((out / "config.json").read_text())["num_hidden_layers"] == 1
