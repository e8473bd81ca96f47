"""The systems the offline benchmark compares, behind one small interface.

Each system is built once per dtype (model load and cache allocation are not
timed), then ``generate(prompts, output_len)`` returns exactly ``output_len``
greedy tokens per prompt. EOS never stops a request: Tessera runs with
``ignore_eos``; transformers gets an EOS id no token can take (-1), which
keeps the EOS logit in play, as Tessera does, instead of masking it the way
``min_new_tokens`` would, so the three systems' greedy outputs stay
comparable token for token.

- ``tessera``: ``LLMEngine.generate`` on the whole prompt list;
- ``hf_generate``: transformers ``model.generate``, one prompt at a time, the
  way a script without a serving engine runs a model;
- ``hf_cb``: transformers' own continuous batching, ``model.generate_batch``
  (paged KV cache, a FIFO scheduler, SDPA over the packed batch on CPU).
"""
from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, GenerationConfig
from transformers.generation.configuration_utils import ContinuousBatchingConfig

from common.config.base import EngineConfig
from common.engine.llm_engine import LLMEngine
from common.protocol.sampling_params import SamplingParams

NO_EOS = -1  # an EOS id no token can take
KV_SLACK_BLOCKS = 16
# Every system's untimed warm-up: this many other prompts, this many output tokens (at most the workload's).
WARMUP_PROMPTS = 4
WARMUP_OUTPUT_LEN = 8


@dataclass(frozen=True)
class Workload:
    num_prompts: int
    input_len: int
    output_len: int
    threads: int

    def blocks_needed(self, block_size: int) -> int:
        """KV blocks that hold every request at full length at once, so nothing is preempted."""
        return self.num_prompts * math.ceil((self.input_len + self.output_len) / block_size) + KV_SLACK_BLOCKS


@dataclass(frozen=True)
class Tuning:
    """Per-system settings the benchmark exposes as flags (defaults live in the CLI)."""

    tessera_batched_tokens: int
    hf_cb_batch_tokens: int
    hf_cb_page_size: int
    hf_cb_max_requests: int


class TesseraSystem:
    name = "tessera"

    def __init__(self, model_dir: Path, dtype: str, workload: Workload, tuning: Tuning) -> None:
        block_size = 16
        self.config = EngineConfig(
            model=str(model_dir),
            dtype=dtype,
            num_threads=workload.threads,
            block_size=block_size,
            max_num_seqs=max(64, workload.num_prompts),
            max_num_batched_tokens=tuning.tessera_batched_tokens,
            num_kv_blocks=workload.blocks_needed(block_size),
        )
        self.engine = LLMEngine(self.config)

    def settings(self) -> dict:
        keys = ("max_num_seqs", "max_num_batched_tokens", "block_size", "num_kv_blocks", "enable_prefix_caching")
        return {k: getattr(self.config, k) for k in keys} | {"attention": self.engine.runner.attention.name}

    def generate(self, prompts: list[list[int]], output_len: int) -> list[list[int]]:
        params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
        return [list(out.outputs[0].token_ids) for out in self.engine.generate(prompts, params)]

    def single_request_decode(self, prompt: list[int], output_len: int) -> dict:
        """Decode speed of one request alone: tokens after the first, over the time after the first."""
        params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
        start = time.perf_counter()
        self.engine.add_request("batch1", prompt, params)
        first_token_at = None
        generated_before = self.engine.stats.num_generated_tokens
        while self.engine.has_unfinished():
            self.engine.step()
            if first_token_at is None and self.engine.stats.num_generated_tokens > generated_before:
                first_token_at = time.perf_counter()
        end = time.perf_counter()
        return {
            "prompt_len": len(prompt),
            "output_len": output_len,
            "time_to_first_token_s": first_token_at - start,
            "decode_s": end - first_token_at,
            "decode_tokens_per_s": (output_len - 1) / (end - first_token_at),
        }

    @property
    def num_preemptions(self) -> int:
        return self.engine.stats.num_preemptions

    def close(self) -> None:
        self.engine = None


def load_hf_model(model_dir: Path, dtype: str):
    # SDPA is transformers' default on CPU, and continuous batching accepts it as its paged implementation.
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype), attn_implementation="sdpa")
    return model.eval()


def greedy_config(output_len: int, pad_token_id: int | None) -> GenerationConfig:
    return GenerationConfig(
        do_sample=False,
        max_new_tokens=output_len,
        eos_token_id=NO_EOS,
        pad_token_id=pad_token_id if pad_token_id is not None else 0,
    )


class HFGenerateSystem:
    name = "hf_generate"
    num_preemptions = 0  # one request at a time: nothing to preempt

    def __init__(self, model_dir: Path, dtype: str, workload: Workload, tuning: Tuning) -> None:
        self.model = load_hf_model(model_dir, dtype)

    def settings(self) -> dict:
        return {"attn_implementation": self.model.config._attn_implementation, "batch_size": 1, "cache": "dynamic"}

    @torch.inference_mode()
    def generate(self, prompts: list[list[int]], output_len: int) -> list[list[int]]:
        config = greedy_config(output_len, self.model.config.pad_token_id)
        outputs = []
        for prompt in prompts:
            ids = torch.tensor([prompt])
            out = self.model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=config)
            outputs.append(out[0, len(prompt):].tolist())
        return outputs

    def close(self) -> None:
        self.model = None


class HFContinuousBatchingSystem:
    name = "hf_cb"
    num_preemptions = 0  # not reported by transformers; its cache is sized so that every request fits

    def __init__(self, model_dir: Path, dtype: str, workload: Workload, tuning: Tuning) -> None:
        self.model = load_hf_model(model_dir, dtype)
        page = tuning.hf_cb_page_size
        # Sized explicitly: on CPU transformers would otherwise take 60% of free RAM for the cache, and its
        # per-step mask grows with the cache, while the request count hint would come from the warm-up call.
        self.cb_config = ContinuousBatchingConfig(
            page_size=page,
            num_blocks=workload.num_prompts * math.ceil((workload.input_len + workload.output_len) / page) + 4,
            max_batch_tokens=tuning.hf_cb_batch_tokens,
            max_requests_per_batch=tuning.hf_cb_max_requests,
            scheduler_type="fifo",
        )

    def settings(self) -> dict:
        keys = ("page_size", "num_blocks", "max_batch_tokens", "max_requests_per_batch", "scheduler_type",
                "allow_block_sharing")
        cfg = asdict(self.cb_config)
        return {k: cfg[k] for k in keys} | {"attn_implementation": self.model.config._attn_implementation}

    def generate(self, prompts: list[list[int]], output_len: int) -> list[list[int]]:
        # A persistent manager keeps the cache and batch buffers from the warm-up call, as Tessera keeps its pool.
        results = self.model.generate_batch(
            prompts,
            generation_config=greedy_config(output_len, self.model.config.pad_token_id),
            continuous_batching_config=self.cb_config,
            persistent_manager=True,
            max_new_tokens=output_len,
        )
        outputs = [r.generated_tokens for r in results.values()]
        failed = [r.error for r in results.values() if r.error is not None]
        if len(outputs) != len(prompts) or failed:
            raise RuntimeError(
                f"generate_batch returned {len(outputs)} of {len(prompts)} results; errors {failed[:3]}"
            )
        return outputs

    def close(self) -> None:
        self.model.destroy_cached_continuous_batching_manager()
        self.model = None


SYSTEMS = {cls.name: cls for cls in (TesseraSystem, HFGenerateSystem, HFContinuousBatchingSystem)}


@dataclass
class SystemRun:
    """One timed run of one system on one dtype."""

    system: str
    dtype: str
    num_prompts: int
    input_len: int
    output_len: int
    wall_s: float
    settings: dict
    num_preemptions: int = 0
    outputs: list[list[int]] = field(default_factory=list, repr=False)

    @property
    def output_tokens(self) -> int:
        return sum(len(o) for o in self.outputs)

    @property
    def output_tokens_per_s(self) -> float:
        return self.output_tokens / self.wall_s

    @property
    def total_tokens_per_s(self) -> float:
        return (self.num_prompts * self.input_len + self.output_tokens) / self.wall_s

    def summary(self) -> dict:
        data = {k: v for k, v in asdict(self).items() if k != "outputs"}
        return data | {
            "output_tokens": self.output_tokens,
            "output_tokens_per_s": self.output_tokens_per_s,
            "total_tokens_per_s": self.total_tokens_per_s,
        }
