"""The GPU path (torch SDPA on CUDA, the Triton paged kernel, flash-attn when installed) against the CPU path.

Skipped with the reason on machines without a CUDA GPU; run on a GPU host
(`pytest tests/unit/test_gpu_path.py`).
"""
import pytest
import torch

from common.engine.attention import flash_attn_available, triton_available
from common.config.base import EngineConfig
from common.engine.model_runner import ModelRunner
from common.protocol.sampling_params import SamplingParams
from tests.tiny_models import build_tiny_model, run_steps

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU; none is present on this machine"),
]


@pytest.mark.parametrize("kind", ["llama", "qwen2", "qwen3"])
@pytest.mark.parametrize("backend", ["torch", "flash_attn", "triton"])
def test_gpu_logits_match_cpu(tmp_path, kind, backend):
    if backend == "flash_attn" and not flash_attn_available():
        pytest.skip("flash-attn is not installed; the GPU path runs on the Triton kernel or torch SDPA")
    if backend == "triton" and not triton_available():
        pytest.skip("triton is not installed")
    path = build_tiny_model(kind, tmp_path)
    block_size = 256 if backend == "flash_attn" else 16
    ids = torch.randint(0, 320, (300,), generator=torch.Generator().manual_seed(0)).tolist()
    steps = [120, 150] + [1] * 30
    table = list(range(-(-sum(steps) // block_size)))  # the blocks 300 tokens fill (19 of 16, 2 of 256)
    blocks = max(len(table), 16)
    cpu = ModelRunner(EngineConfig(model=str(path), num_kv_blocks=blocks, block_size=block_size), path)
    gpu = ModelRunner(EngineConfig(model=str(path), num_kv_blocks=blocks, block_size=block_size, device="cuda",
                                   attention_backend=backend), path)
    assert gpu.attention.name == backend
    diff = (run_steps(gpu, ids, steps, table) - run_steps(cpu, ids, steps, table)).abs().max().item()
    assert diff <= 2e-3  # TF32/kernel accumulation order differs from the CPU


def test_gpu_engine_greedy_matches_cpu(tiny_chat_model_dir):
    from common.engine.llm_engine import LLMEngine

    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    prompts = ["Hello there", "Count to five:", "x " * 30]
    cpu = LLMEngine(EngineConfig(model=str(tiny_chat_model_dir), num_kv_blocks=64))
    gpu = LLMEngine(EngineConfig(model=str(tiny_chat_model_dir), num_kv_blocks=64, device="cuda"))
    ref = [o.outputs[0].token_ids for o in cpu.generate(prompts, params)]
    assert [o.outputs[0].token_ids for o in gpu.generate(prompts, params)] == ref


def test_gpu_steps_run_ahead_and_end_as_steps_one_at_a_time(tiny_chat_model_dir):
    """On a GPU greedy decode steps are queued before the step before has its tokens on the host, reading them on
    the device (CUDA graphs replayed; a small pool, which preempts where the attention backend keeps blocks of 16):
    every request ends as with steps run one at a time."""
    from common.config.base import StepsConfig
    from common.engine.llm_engine import LLMEngine
    from tests.unit.test_overlap_steps import GREEDY, PROMPTS, run, summary

    def engine(overlap: str) -> LLMEngine:
        return LLMEngine(EngineConfig(model=str(tiny_chat_model_dir), dtype="float32", device="cuda",
                                      num_kv_blocks=12, block_size=16, steps=StepsConfig(overlap=overlap)))
    requests = dict(GREEDY)
    requests.update({f"long{i}": (PROMPTS[i] + [70 + i], SamplingParams(temperature=0.0, max_tokens=48,
                                                                        ignore_eos=True)) for i in range(4)})
    serial, ahead = engine("never"), engine("auto")
    off, _, _ = run(serial, requests)
    on, _, _ = run(ahead, requests)
    assert ahead.overlap and ahead.runner.graphs is not None and ahead.stats.num_steps_ahead > 20
    for request_id in requests:
        assert summary(on[request_id]) == summary(off[request_id]), request_id
