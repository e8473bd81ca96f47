"""Speculative decoding on tiny random models: lossless greedy output, rollback, stops, accounting.

Targets and drafts are tiny random Llama/Qwen2 models sharing the embedded
tokenizer's vocabulary, so every check runs in seconds. A target used as its
own draft must have every draft accepted, which exercises the draft's shadow
KV and its re-sync after each step; a different random draft has almost
every draft rejected, which exercises rollback.
"""
from __future__ import annotations

import random

import numpy as np
import pytest

from common.config.base import ConfigError, CpuConfig, EngineConfig
from common.engine.llm_engine import LLMEngine, RequestError
from common.engine.ngram_proposer import lookup
from common.protocol.sampling_params import SamplingParams
from common.engine.speculator import Acceptance, _positions_worth_verifying
from tests.tiny_models import build_tiny_model

K = 4


@pytest.fixture(scope="module")
def draft_dir(tmp_path_factory, embedded_model_dir):
    return build_tiny_model("qwen2", tmp_path_factory.mktemp("draft"), seed=7, tokenizer_from=embedded_model_dir)


def prompts(count=32, seed=0):
    """Random prompts, half of them repetitive so that n-gram lookups find matches."""
    rng = random.Random(seed)
    out = []
    for i in range(count):
        if i % 2:
            motif = [rng.randrange(3, 2000) for _ in range(rng.randrange(2, 6))]
            out.append((motif * 20)[: rng.randrange(12, 60)])
        else:
            out.append([rng.randrange(3, 2000) for _ in range(rng.randrange(4, 60))])
    return out


def make_engine(model_dir, **engine_kw) -> LLMEngine:
    # 4 KB pages (engine.cpu.huge_pages) for its pool and a draft model's: the same bytes, loaded in a fraction of the
    # CPU where 2 MB pages fault in slowly (common/cli/local_cluster.py TEST_WORKER_OVERRIDES)
    engine_kw.setdefault("cpu", CpuConfig(huge_pages=False))
    return LLMEngine(EngineConfig(model=str(model_dir), num_kv_blocks=256, **engine_kw))


def generate_on(engine: LLMEngine, prompt_ids, params):
    """``engine``'s outputs for the prompts, every KV block (its own and its draft model's) back in the pool after."""
    outs = engine.generate(prompt_ids, params)
    assert engine.block_manager.num_used_blocks == 0, "KV blocks leaked"
    draft = engine.speculator.proposers.get("draft")
    assert draft is None or draft.num_blocks_in_use == 0, "draft KV blocks leaked"
    return [o.outputs[0] for o in outs]


def generate(model_dir, prompt_ids, params, **engine_kw):
    engine = make_engine(model_dir, **engine_kw)
    return generate_on(engine, prompt_ids, params), engine.stats


def check_acceptance_stats(stats, k=K):
    assert stats.num_spec_drafts > 0
    mean_len = 1 + stats.num_spec_accepted_tokens / stats.num_spec_drafts
    assert 1.0 <= mean_len <= k + 1
    per_pos = stats.spec_accepted_per_position
    assert all(a >= b for a, b in zip(per_pos, per_pos[1:])), per_pos
    assert sum(per_pos) == stats.num_spec_accepted_tokens
    return mean_len


GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
SPEC = {"num_tokens": K, "max_batch_size": 64}  # engine.spec settings every speculating test shares


@pytest.mark.parametrize("method", ["ngram", "self-draft", "random-draft"])
def test_greedy_output_is_identical_with_speculation(method, tiny_chat_model_dir, draft_dir):
    ids = prompts()
    plain, _ = generate(tiny_chat_model_dir, ids, GREEDY)
    extra = {
        "ngram": {"method": "ngram", "ngram_min": 1, "adaptive": False},
        "self-draft": {"method": "draft", "draft_model": str(tiny_chat_model_dir)},
        "random-draft": {"method": "draft", "draft_model": str(draft_dir)},
    }[method]
    spec, stats = generate(tiny_chat_model_dir, ids, GREEDY, spec={**SPEC, **extra})
    assert [o.token_ids for o in spec] == [o.token_ids for o in plain]
    assert [o.finish_reason for o in spec] == [o.finish_reason for o in plain]
    mean_len = check_acceptance_stats(stats)
    if method == "self-draft":
        # The target drafting for itself: every draft is the target's own argmax.
        assert stats.num_spec_accepted_tokens >= 0.95 * stats.num_spec_draft_tokens
        assert mean_len > 3.5
    if method == "random-draft":
        assert stats.num_spec_accepted_tokens < 0.2 * stats.num_spec_draft_tokens


def test_stops_inside_an_accepted_run_end_the_output_there(tiny_chat_model_dir):
    """Self-drafting accepts whole runs, so EOS-like stop ids, max_tokens and stop strings land inside them."""
    ids = prompts(16, seed=3)
    # Each engine serves every request below, one at a time; no prefix cache, so that each prompt is computed alone
    # on both sides (the plain engine's first batch would otherwise have cached its prompts' KV from a batch of 16).
    plain_engine = make_engine(tiny_chat_model_dir, enable_prefix_caching=False)
    spec_engine = make_engine(tiny_chat_model_dir, enable_prefix_caching=False,
                              spec={**SPEC, "method": "draft", "draft_model": str(tiny_chat_model_dir)})
    plain_out = generate_on(plain_engine, ids, GREEDY)
    # Stop on a token each output really produces, somewhere in its middle.
    for i, (prompt, ref) in enumerate(zip(ids, plain_out)):
        stop_id = ref.token_ids[7 + i % 9]
        params = SamplingParams(temperature=0.0, max_tokens=10 + i % 7, stop_token_ids=[stop_id], ignore_eos=True)
        (plain,) = generate_on(plain_engine, [prompt], params)
        drafts = spec_engine.stats.num_spec_drafts
        (spec,) = generate_on(spec_engine, [prompt], params)
        assert spec.token_ids == plain.token_ids and spec.finish_reason == plain.finish_reason
        assert len(spec.token_ids) <= params.max_tokens
        if spec_engine.stats.num_spec_drafts > drafts:
            check_acceptance_stats(spec_engine.stats)
    for prompt, ref in zip(ids, plain_out):
        stop_text = ref.text[len(ref.text) // 2:][:3]
        if not stop_text.strip():
            continue
        params = SamplingParams(temperature=0.0, max_tokens=24, stop=[stop_text], ignore_eos=True)
        (plain,) = generate_on(plain_engine, [prompt], params)
        (spec,) = generate_on(spec_engine, [prompt], params)
        assert (spec.text, spec.token_ids, spec.finish_reason) == (plain.text, plain.token_ids, plain.finish_reason)


def test_preemption_and_logprobs_with_speculation(tiny_chat_model_dir):
    """A pool too small for the batch forces preemption mid-speculation; logprobs ride along."""
    ids = prompts(12, seed=5)
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True, logprobs=2)
    plain, _ = generate(tiny_chat_model_dir, ids, params)
    engine = LLMEngine(EngineConfig(model=str(tiny_chat_model_dir), num_kv_blocks=14,
                                    spec={**SPEC, "method": "draft", "draft_model": str(tiny_chat_model_dir)}))
    spec = [o.outputs[0] for o in engine.generate(ids, params)]
    assert engine.stats.num_preemptions > 0 and engine.stats.num_spec_drafts > 0
    assert engine.block_manager.num_used_blocks == 0
    for a, b in zip(spec, plain):
        assert a.token_ids == b.token_ids
        assert np.allclose(a.logprobs, b.logprobs, atol=1e-4)
        assert [t for t, _ in a.top_logprobs[-1]] == [t for t, _ in b.top_logprobs[-1]]


def test_requests_choose_their_method_or_opt_out(tiny_chat_model_dir):
    engine = LLMEngine(EngineConfig(model=str(tiny_chat_model_dir), num_kv_blocks=64,
                                    spec={"max_batch_size": 64, "ngram_min": 1}))
    with pytest.raises(RequestError, match="'draft' is not available"):
        engine.add_request("x", [5, 6, 7], SamplingParams(speculative="draft"))
    rep = [9, 10, 11] * 10
    (out,) = engine.generate([rep], SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True,
                                                   speculative="off"))
    assert engine.stats.num_spec_drafts == 0
    # The model's own continuation, repeated in the prompt, gives the lookup matches.
    echo = rep + out.outputs[0].token_ids + rep
    engine.generate([echo], SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, speculative="ngram",
                                           num_speculative_tokens=2))
    assert engine.stats.num_spec_drafts > 0
    assert len(engine.stats.spec_accepted_per_position) == 2


def test_abort_frees_the_draft_kv_at_once(tiny_chat_model_dir):
    engine = LLMEngine(EngineConfig(model=str(tiny_chat_model_dir), num_kv_blocks=64,
                                    spec={"method": "draft", "draft_model": str(tiny_chat_model_dir), "max_batch_size": 64}))
    engine.add_request("a", prompts(2)[1], GREEDY)
    for _ in range(3):
        engine.step()
    draft = engine.speculator.proposers["draft"]
    assert draft.num_blocks_in_use > 0
    engine.abort_request("a")
    assert draft.num_blocks_in_use == 0 and engine.block_manager.num_used_blocks == 0


def test_no_speculation_above_the_batch_switch(tiny_chat_model_dir):
    ids = prompts(8)
    # All 8 decode side by side until they finish together: above a switch of 4, none speculates.
    _, stats = generate(tiny_chat_model_dir, ids, GREEDY,
                        spec={"method": "ngram", "ngram_min": 1, "max_batch_size": 4})
    _, everywhere = generate(tiny_chat_model_dir, ids, GREEDY,
                             spec={"method": "ngram", "ngram_min": 1, "max_batch_size": 8})
    assert stats.num_spec_drafts == 0 < everywhere.num_spec_drafts


def test_ngram_lookup_prefers_the_longest_latest_match():
    tokens = np.array([1, 2, 3, 9, 1, 2, 4, 8, 5, 1, 2, 3])
    # Suffix [1, 2, 3] matched at 0 -> continues 9, 1, 2.
    assert lookup(tokens, 1, 3, 3) == [9, 1, 2]
    # Only [2, 3]... and [3] available with max_n 2: the latest [2, 3] is at 1.
    assert lookup(tokens, 2, 2, 2) == [9, 1]
    assert lookup(np.array([4, 5, 6]), 1, 3, 4) == []
    assert lookup(np.array([7, 7, 7, 7]), 1, 2, 5) == [7]


def test_adaptive_k_shrinks_with_low_acceptance_and_recovers():
    assert _positions_worth_verifying(0.7, 0.1) == 6
    assert _positions_worth_verifying(0.3, 0.1) == 1
    assert _positions_worth_verifying(0.05, 0.1) == 0
    est = Acceptance()
    for _ in range(20):
        est.record(drafted=4, accepted=0)
    assert _positions_worth_verifying(est.rate, 0.1) == 0
    for _ in range(20):
        est.record(drafted=4, accepted=4)
    assert _positions_worth_verifying(est.rate, 0.1) >= 4


def test_config_names_bad_speculative_fields():
    with pytest.raises(ConfigError, match="spec.method"):
        EngineConfig(model="m", spec={"method": "medusa"})
    with pytest.raises(ConfigError, match="in spec: config field 'draft_model'"):
        EngineConfig(model="m", spec={"method": "draft"})
    with pytest.raises(ConfigError, match="in spec: config field 'ngram_min'"):
        EngineConfig(model="m", spec={"ngram_min": 5, "ngram_max": 3})
    with pytest.raises(ValueError, match="speculative"):
        SamplingParams(speculative="eagle")


def test_the_adaptive_controller_only_restricts_the_configured_speculation():
    from common.engine.speculator import make_speculator

    config = EngineConfig(model="unused", spec={"method": "ngram", "num_tokens": 4, "max_batch_size": 4})
    speculator = make_speculator(config, runner=None)
    assert speculator.tune(2, 0) == (2, 0)
    assert speculator.tune(8, 16) == (4, 4)  # never above the configured values
    assert speculator.tune(1, None) == (1, 4)
    assert speculator.tune(None, None) == (4, 4)
