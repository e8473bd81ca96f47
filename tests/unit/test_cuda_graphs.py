"""Decode-step graphs (common/engine/cuda_graphs.py): the ladder, and a whole engine replaying its decode steps.

Off a GPU the graphs are ``EagerGraph``s (each replay calls the captured forward again over the same static
buffers) and the attention is the Triton backend through Triton's interpreter, whose K/V store skips padding
rows as on a GPU: what is checked here is the buffers, the padding and the engine's use of them. On a CUDA
machine the same engine test captures real CUDA graphs.
"""
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # read when the kernel is decorated, at import
triton = pytest.importorskip("triton", reason="Triton is not installed (pip install triton)")

from common.config.base import CudaGraphsConfig, EngineConfig, SpecConfig, StepsConfig  # noqa: E402
from common.engine.attention import get_step_context  # noqa: E402
from common.engine.cuda_graphs import CudaGraph, DecodeGraphs, EagerGraph, graph_ladder, rung_for  # noqa: E402
from common.engine.llm_engine import LLMEngine  # noqa: E402
from common.engine.triton_attention import TritonAttention  # noqa: E402
from common.protocol.sampling_params import SamplingParams, StructuredOutput  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def test_the_ladder_pads_little_and_ends_at_its_largest_rung():
    assert graph_ladder(1) == [1]
    assert graph_ladder(6) == [1, 2, 4, 6]
    assert graph_ladder(40) == [1, 2, 4, 8, 16, 32, 40]
    ladder = graph_ladder(256)
    assert ladder[:5] == [1, 2, 4, 8, 16] and ladder[-1] == 256 and len(ladder) == 20
    assert [rung_for(ladder, rows) for rows in (1, 3, 9, 17, 255, 256, 257)] == [1, 4, 16, 32, 256, 256, None]


def _engine(model_dir, graphs: bool, spec: bool, overlap: str = "auto") -> tuple[LLMEngine, list[int]]:
    """An engine whose attention is the Triton backend; with ``graphs``, its decode steps replay graphs of up to
    16 rows (``EagerGraph`` off a GPU). Returns it and a list that counts the rows of each replay."""
    config = EngineConfig(model=str(model_dir), device=DEVICE, num_kv_blocks=64, max_num_seqs=4,
                          steps=StepsConfig(calibration_s=0.0, overlap=overlap),
                          attention_backend="torch", cuda_graphs=CudaGraphsConfig(enabled=False),
                          spec=SpecConfig(method="draft", draft_model=str(model_dir), num_tokens=3, adaptive=False)
                          if spec else SpecConfig())
    eng = LLMEngine(config)
    runner = eng.runner
    runner.attention = TritonAttention(get_step_context)
    for layer in runner.model.layers:
        layer.self_attn.backend = runner.attention
    replays: list[int] = []
    if graphs:
        factory = CudaGraph if DEVICE == "cuda" else EagerGraph
        runner.graphs = DecodeGraphs(runner.model, runner.kv_cache, config.block_size, 16, 256, factory)
        runner.graphs.capture()
        replay = runner.graphs.replay
        runner.graphs.replay = lambda tokens, *rest: replays.append(len(tokens)) or replay(tokens, *rest)
    return eng, replays


@pytest.mark.parametrize("spec", [False, True], ids=["plain", "speculative"])
def test_decode_steps_through_graphs_match_eager_steps_and_padding_writes_no_kv(tiny_chat_model_dir, spec):
    """Three greedy sequences (speculative: the model drafting for itself, so drafts are verified): the tokens,
    log-probabilities and the whole KV pool match the eager engine's, and steps of 3 rows (or verifying rows)
    replayed padded to a larger rung."""
    prompts = [[5 + i for i in range(12)], [40, 41, 42, 43] * 5, list(range(100, 107))]
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, logprobs=0)
    results = []
    for graphs in (False, True):
        eng, replays = _engine(tiny_chat_model_dir, graphs, spec)
        outs = [o.outputs[0] for o in eng.generate(prompts, params)]
        results.append(([o.token_ids for o in outs], [o.logprobs for o in outs], eng.runner.kv_cache.pool.clone(),
                        replays))
    (eager_tokens, eager_logprobs, eager_pool, _), (tokens, logprobs, pool, replays) = results
    assert tokens == eager_tokens
    assert torch.allclose(torch.tensor(logprobs), torch.tensor(eager_logprobs), atol=1e-5)
    # Padding rows wrote nothing: the same slots hold K/V, and the same K/V up to the rounding of a matmul of
    # the padded row count (not bitwise: a GEMM's result for a row may depend on how many rows it has).
    assert torch.equal(pool != 0, eager_pool != 0)
    assert torch.allclose(pool, eager_pool, atol=1e-5)
    assert replays and any(rows not in graph_ladder(16) for rows in replays), replays
    if spec:  # some replay held a verifying sequence's rows: more rows than sequences
        assert max(replays) > len(prompts), replays


def test_structured_output_masks_the_replayed_logits(tiny_chat_model_dir):
    """A regex-constrained greedy sequence beside two free ones: the masks act on the logits a replay gave, and the
    text is the eager engine's."""
    pytest.importorskip("xgrammar", reason="structured output needs xgrammar (the Makefile installs it)")
    prompts = [[5 + i for i in range(12)], [40, 41, 42, 43] * 5, list(range(100, 107))]
    free = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    constrained = SamplingParams(temperature=0.0, max_tokens=12, structured=StructuredOutput(
        kind="regex", spec="(yes|no)( [a-z]+){1,4}"))
    texts = []
    for graphs in (False, True):
        eng, replays = _engine(tiny_chat_model_dir, graphs, spec=False)
        outs = eng.generate(prompts, [constrained, free, free])
        texts.append([o.outputs[0].text for o in outs])
    assert texts[0] == texts[1] and texts[1][0].split(" ")[0] in ("yes", "no"), texts
    assert replays


def test_a_step_past_the_graphs_runs_eagerly(tiny_chat_model_dir):
    """Rows past the largest rung, or a context past max_context, do not fit; a prompt chunk never does."""
    eng, _ = _engine(tiny_chat_model_dir, graphs=True, spec=False)
    graphs = eng.runner.graphs
    assert graphs.fits(16, False, graphs.width) and graphs.fits(1, False, 1)
    assert not graphs.fits(17, False, 1) and not graphs.fits(4, False, graphs.width + 1) and not graphs.fits(
        4, True, 1)


def test_steps_run_ahead_feed_the_replayed_graphs_their_input_tokens(tiny_chat_model_dir):
    """Overlapped greedy decode through the graphs: each step is staged before the step before has its tokens on
    the host, and its input ids are written into the graphs' buffer from that step's tokens (``replay(feed=...)``):
    the same tokens as the eager engine one step at a time, sequences ending at different steps."""
    prompts = [[5 + i for i in range(12)], [40, 41, 42, 43] * 5, list(range(100, 107))]
    params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for m in (10, 4, 7)]
    eager, _ = _engine(tiny_chat_model_dir, graphs=False, spec=False, overlap="never")
    expected = [o.outputs[0].token_ids for o in eager.generate(prompts, params)]
    eng, replays = _engine(tiny_chat_model_dir, graphs=True, spec=False, overlap="always")
    assert [o.outputs[0].token_ids for o in eng.generate(prompts, params)] == expected
    assert eng.stats.num_steps_ahead >= 5 and replays
