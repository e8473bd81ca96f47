"""Tiny random decoder models, built in code and saved as safetensors, for unit tests."""
from __future__ import annotations

import shutil
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

from common.protocol.sampling_params import SamplingParams
from common.engine.scheduler import StepPlan
from common.engine.sequence import Sequence

COMMON = dict(
    vocab_size=320,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    rms_norm_eps=1e-6,
)

CONFIGS = {
    "llama": lambda: LlamaConfig(**COMMON, tie_word_embeddings=False),
    "llama3-scaled": lambda: LlamaConfig(
        **COMMON,
        tie_word_embeddings=True,
        rope_parameters={
            "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 64,
        },
    ),
    "mistral": lambda: MistralConfig(**COMMON, sliding_window=None, tie_word_embeddings=False),
    "qwen2": lambda: Qwen2Config(**COMMON, tie_word_embeddings=True),
    "qwen3": lambda: Qwen3Config(**COMMON, head_dim=32, tie_word_embeddings=True),
}


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")


def build_tiny_model(kind: str, directory: Path, seed: int = 0, tokenizer_from: Path | None = None,
                     vocab_size: int = 49152) -> Path:
    """Save a random model of ``kind`` into ``directory``; returns it.

    With ``tokenizer_from`` (a model directory), the tokenizer files are copied
    in and the vocabulary sized to match (``vocab_size``: a smaller head, whose
    ids the tokenizer still decodes, where a test's cost is the head's), so the
    whole engine (text in, text out) runs on a model that computes in milliseconds.
    """
    torch.manual_seed(seed)
    config = CONFIGS[kind]()
    if tokenizer_from is not None:
        config.vocab_size = vocab_size
        config.eos_token_id = 2
        config.bos_token_id = 1
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    _spread(model)
    return _save(model, directory, tokenizer_from)


def _spread(model) -> None:
    """Random init leaves biases at zero and norms at one; make them matter."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(0, 0.5)
            elif "norm" in name:
                p.uniform_(0.5, 1.5)


def _save(model, directory: Path, tokenizer_from: Path | None) -> Path:
    """``model`` saved into ``directory`` with the tokenizer files of ``tokenizer_from``, if given."""
    directory.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(directory)
    if tokenizer_from is not None:
        for name in TOKENIZER_FILES:
            if (tokenizer_from / name).exists():
                shutil.copy(tokenizer_from / name, directory / name)
    return directory


# The short model: the embedded model's width, heads (9 query, 3 KV: tensor parallelism up to 3), MLP and
# vocabulary, in SHORT_LAYERS layers of random weights. The e2e tests whose checks are about streams, pages and
# processes, not the model's words, serve it: a decode step costs about a third of the embedded model's (its head,
# 28M of its 42M parameters, is most of it) and a prompt step a seventh, through the same kernels at the same
# widths. Its head is scaled so that logits spread (a standard deviation of about 9, against 0.5 unscaled): greedy
# picks its token by a clear margin, never by a tie that rounding in one batch and not another could flip, and each
# prompt's text is its own (random tokens, not the few words of a truncated trained model).
SHORT_LAYERS = 4
SHORT_HEAD_SCALE = 20.0
# SmolLM2-135M-Instruct's config.json (the embedded model), less its 30 layers
EMBEDDED_SHAPE = dict(
    vocab_size=49152, hidden_size=576, intermediate_size=1536, num_attention_heads=9, num_key_value_heads=3,
    head_dim=64, max_position_embeddings=8192, rms_norm_eps=1e-5, rope_theta=100000.0, bos_token_id=1,
    eos_token_id=2, pad_token_id=2,
)


def build_short_model(directory: Path, tokenizer_from: Path, seed: int = 0, layers: int = SHORT_LAYERS) -> Path:
    """Save the short model (``SHORT_LAYERS``) with the tokenizer files of ``tokenizer_from`` (a directory holding
    the embedded model's) into ``directory``; returns it."""
    config = dict(EMBEDDED_SHAPE, num_hidden_layers=layers, tie_word_embeddings=False)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(LlamaConfig(**config), dtype=torch.float32)
    _spread(model)  # a Llama has no biases: its norms only
    with torch.no_grad():
        model.lm_head.weight.mul_(SHORT_HEAD_SCALE)
    return _save(model, directory, tokenizer_from)


def run_steps(runner, ids, steps, block_table):
    """Feed ``ids`` through the runner in the given step sizes; logits of every row."""
    seq = Sequence("r", ids, SamplingParams(), seed=0)
    seq.block_table = block_table
    outs = []
    for n in steps:
        prepared = runner.prepare(StepPlan([seq], [n]))
        outs.append(runner.model.compute_logits(runner.forward(prepared)).float().cpu())
        seq.num_computed_tokens += n
    return torch.cat(outs)


def share_kernels(cache: Path) -> None:
    """A test's own cache root uses the default one's built C kernels (keyed by source, flags and CPU, so any
    cache may share them): its workers load them instead of compiling every kernel again."""
    from common.storage.model_store import default_cache_root

    shared = default_cache_root() / "kernels"
    shared.mkdir(parents=True, exist_ok=True)
    cache.mkdir(parents=True, exist_ok=True)
    if not (cache / "kernels").exists():
        (cache / "kernels").symlink_to(shared, target_is_directory=True)


def registered_versions(root: Path, versions: list[tuple[str, int]], prompts: list[str], max_tokens: int,
                        tokenizer_from: Path) -> tuple[Path, dict[str, dict[str, str]]]:
    """Tiny random Llamas registered as ``name@version`` (seeded as given) in a registry under ``root / "cache"``,
    and each one's greedy chat answer to each prompt: (the cache directory, {name@version: {prompt: text}})."""
    from common.config.base import EngineConfig
    from common.engine.llm_engine import LLMEngine
    from common.storage.registry import ModelRegistry

    registry = ModelRegistry(root / "cache" / "registry")
    share_kernels(root / "cache")
    answers = {}
    for model, seed in versions:
        name, _, version = model.partition("@")
        path = build_tiny_model("llama", root / model.replace("@", "-"), seed=seed, tokenizer_from=tokenizer_from)
        registry.register(path, name, version)
        engine = LLMEngine(EngineConfig(model=str(path), num_kv_blocks=64))
        chats = [engine.tokenizer.apply_chat_template([{"role": "user", "content": p}]) for p in prompts]
        outs = engine.generate(chats, SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True))
        answers[model] = {p: o.outputs[0].text for p, o in zip(prompts, outs)}
    return root / "cache", answers
