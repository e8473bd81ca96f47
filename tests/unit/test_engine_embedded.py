"""The engine on the embedded SmolLM2 model against transformers' own model (fp32)."""
import pytest
import torch
from transformers import AutoModelForCausalLM

from common.config.base import EngineConfig
from common.engine.llm_engine import LLMEngine, RequestError
from common.protocol.sampling_params import SamplingParams
from common.protocol.wire import cache_salt_of

PROMPTS = [
    "The capital of France is",
    "Write a haiku about the sea.",
    "def fibonacci(n):",
    "Explain what a hash table is in one sentence.",
    "Once upon a time, in a small village,",
    "List three primary colors.",
    "Translate 'good morning' into Spanish.",
    "What is 12 times 7?",
    "Give me a name for a pet turtle.",
    "Summarize the plot of Romeo and Juliet.",
    "Why is the sky blue?",
    "Write a SQL query that counts rows in a table named users.",
]
GREEDY = SamplingParams(temperature=0.0, max_tokens=24)


@pytest.fixture(scope="module")
def engine(embedded_model_dir):
    return LLMEngine(EngineConfig(model=str(embedded_model_dir), dtype="float32", num_kv_blocks=512))


@pytest.fixture(scope="module")
def hf_model(embedded_model_dir):
    return AutoModelForCausalLM.from_pretrained(embedded_model_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def chat_prompts(engine):
    return [engine.tokenizer.apply_chat_template([{"role": "user", "content": p}]) for p in PROMPTS]


@pytest.fixture(scope="module")
def proposals(engine, chat_prompts):
    """The engine's greedy tokens for the prompts in one batch, its cache cold (nothing computed before)."""
    return [out.outputs[0].token_ids for out in engine.generate(chat_prompts, GREEDY)]


@pytest.fixture(scope="module")
def reference(proposals, hf_model, chat_prompts):
    """transformers' greedy tokens for each prompt, up to GREEDY's max_tokens or an EOS (included), as its
    ``generate`` gives them, found by teacher forcing: one forward of transformers' model over the prompt and the
    engine's ``proposals`` gives, at each position, transformers' argmax after the tokens before it. The
    reference takes those argmaxes while they agree with the proposal and ends at the first that does not (or at
    an EOS, or at max_tokens, or one past a proposal that stopped short): it equals the proposal exactly when each
    of its tokens is transformers' greedy choice. One forward a prompt instead of ``generate``'s one a token (4
    CPU-s of transformers for the 12 prompts rather than 30)."""
    eos = hf_model.generation_config.eos_token_id
    eos = set(eos if isinstance(eos, list) else [eos])
    outs = []
    with torch.no_grad():
        for ids, proposal in zip(chat_prompts, proposals):
            greedy = hf_model(torch.tensor([ids + proposal])).logits[0, len(ids) - 1:].argmax(-1).tolist()
            ref: list[int] = []
            for position, token in enumerate(greedy):
                ref.append(token)
                if (token in eos or len(ref) == GREEDY.max_tokens or position == len(proposal)
                        or token != proposal[position]):
                    break
            outs.append(ref)
    return outs


def _matches(ours: list[int], ref: list[int]) -> bool:
    # transformers stops at EOS and includes it; so do we.
    return ours == ref[: len(ours)] and len(ours) == len(ref)


def test_prompt_logits_match_transformers(engine, hf_model, chat_prompts):
    from common.engine.scheduler import StepPlan
    from common.engine.sequence import Sequence

    runner = engine.runner
    for ids in chat_prompts[:3]:
        seq = Sequence("logits", ids, GREEDY, seed=0)
        seq.block_table = engine.block_manager.allocate(-(-len(ids) // engine.config.block_size))
        try:
            ours = runner.model.compute_logits(runner.forward(runner.prepare(StepPlan([seq], [len(ids)]))))
        finally:
            engine.block_manager.free(seq.block_table)
        with torch.no_grad():
            ref = hf_model(torch.tensor([ids])).logits[0]
        # within 1e-5 of the logits' range (about 30): float32 sums in another order than torch's (an AVX2 host's
        # linears take kernels/gemm_invariant.c) round differently, a few ulps a layer over 30 layers
        assert (ours - ref).abs().max().item() <= 1e-5 * ref.abs().max().item()


def test_greedy_batch_equals_transformers_generate(engine, chat_prompts, proposals, reference):
    """Cold (the proposals: nothing cached) and again with every prompt's blocks cached."""
    for proposal, ref in zip(proposals, reference):
        assert _matches(proposal, ref)
    outs = engine.generate(chat_prompts, GREEDY)
    for out, ref in zip(outs, reference):
        assert _matches(out.outputs[0].token_ids, ref)
    assert engine.block_manager.num_used_blocks == 0


def test_chunked_prefill_equals_one_shot(embedded_model_dir, chat_prompts, reference):
    chunked = LLMEngine(EngineConfig(
        model=str(embedded_model_dir), dtype="float32", num_kv_blocks=256,
        max_num_batched_tokens=16, enable_prefix_caching=False,
    ))
    outs = chunked.generate(chat_prompts[:4], GREEDY)
    for out, ref in zip(outs, reference):
        assert _matches(out.outputs[0].token_ids, ref)


def test_preemption_and_recompute_give_identical_output(embedded_model_dir, chat_prompts, reference):
    # 12 blocks of 16 tokens cannot hold 6 sequences of ~60 tokens at once.
    small = LLMEngine(EngineConfig(model=str(embedded_model_dir), dtype="float32", num_kv_blocks=12))
    outs = small.generate(chat_prompts[:6], GREEDY)
    for out, ref in zip(outs, reference):
        assert _matches(out.outputs[0].token_ids, ref)
    assert small.block_manager.num_used_blocks == 0
    assert small.stats.num_preemptions > 0


def test_prefix_cache_hit_is_identical_and_skips_compute(engine, chat_prompts, reference):
    engine.generate(chat_prompts[:1], GREEDY)  # warm the cache
    computed_before = engine.stats.num_computed_tokens
    (out,) = engine.generate(chat_prompts[:1], GREEDY)
    assert _matches(out.outputs[0].token_ids, reference[0])
    prompt_len = len(chat_prompts[0])
    assert out.num_cached_tokens == (prompt_len - 1) // 16 * 16 > 0
    computed = engine.stats.num_computed_tokens - computed_before
    assert computed == prompt_len - out.num_cached_tokens + len(out.outputs[0].token_ids) - 1


def test_a_cache_salt_keeps_equal_prompts_apart_and_changes_no_output(engine, chat_prompts, reference):
    (first,) = engine.generate(chat_prompts[2:3], GREEDY, cache_salt=cache_salt_of("tenant:alpha"))
    (other,) = engine.generate(chat_prompts[2:3], GREEDY, cache_salt=cache_salt_of("tenant:beta"))
    (again,) = engine.generate(chat_prompts[2:3], GREEDY, cache_salt=cache_salt_of("tenant:alpha"))
    assert (first.num_cached_tokens, other.num_cached_tokens) == (0, 0)
    assert again.num_cached_tokens == (len(chat_prompts[2]) - 1) // 16 * 16 > 0
    for out in (first, other, again):
        assert _matches(out.outputs[0].token_ids, reference[2])


def test_seeded_sampling_is_reproducible_regardless_of_batch(engine, chat_prompts):
    params = SamplingParams(temperature=0.9, top_p=0.95, seed=1234, max_tokens=16)
    (alone,) = engine.generate(chat_prompts[:1], params)
    crowd = engine.generate(chat_prompts[3:6] + chat_prompts[:1], [GREEDY] * 3 + [params])
    assert crowd[-1].outputs[0].token_ids == alone.outputs[0].token_ids


def test_parallel_samples_share_the_prompt_and_differ(engine, chat_prompts):
    params = SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=12)
    (out,) = engine.generate(chat_prompts[:1], params)
    assert [o.index for o in out.outputs] == [0, 1, 2]
    texts = {tuple(o.token_ids) for o in out.outputs}
    assert len(texts) > 1
    assert engine.block_manager.num_used_blocks == 0


def test_stop_string_is_excluded_and_logprobs_are_returned(engine, chat_prompts, reference):
    ref_text = engine.tokenizer.decode(reference[1])
    stop = ref_text[10:14]
    params = SamplingParams(temperature=0.0, max_tokens=24, stop=[stop], logprobs=2)
    (out,) = engine.generate(chat_prompts[1:2], params)
    o = out.outputs[0]
    assert o.finish_reason == "stop" and o.stop_reason == stop
    assert o.text == ref_text[: ref_text.index(stop)]
    assert len(o.logprobs) == len(o.token_ids) and all(lp <= 0 for lp in o.logprobs)
    assert all(len(top) == 2 for top in o.top_logprobs)


def test_streaming_deltas_concatenate_to_the_final_text(engine, chat_prompts):
    engine.add_request("stream", chat_prompts[2], GREEDY)
    deltas, final = [], None
    while engine.has_unfinished():
        for out in engine.step():
            deltas.append(out.outputs[0].text_delta)
            final = out
    assert "".join(deltas) == final.outputs[0].text


def test_abort_frees_blocks(engine, chat_prompts):
    engine.add_request("abort-me", chat_prompts[0], SamplingParams(max_tokens=100))
    engine.step()
    assert engine.block_manager.num_used_blocks > 0
    engine.abort_request("abort-me")
    (out,) = engine.step()
    assert out.finished and out.outputs[0].finish_reason == "abort"
    assert engine.block_manager.num_used_blocks == 0 and not engine.has_unfinished()


def test_bad_requests_are_refused_clearly(engine):
    with pytest.raises(RequestError, match="context limit"):
        engine.add_request("long", [1] * (engine.max_model_len + 1), GREEDY)
    with pytest.raises(RequestError, match="empty"):
        engine.add_request("empty", [], GREEDY)
    with pytest.raises(RequestError, match="vocabulary"):
        engine.add_request("vocab", [10**9], GREEDY)
    assert not engine.has_unfinished()
