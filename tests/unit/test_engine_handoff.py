"""Prefill on one engine, decode on another: the engine side of disaggregation.

The pages are copied between the two pools directly here (the transfer
backends have their own tests); what is checked is that a prefill-only
request keeps its blocks for its lease, that a prefilled request continues
exactly where the one-process engine would, and that no block leaks.
"""
import pytest

from common.config.base import EngineConfig
from common.engine.llm_engine import LLMEngine
from common.protocol.sampling_params import SamplingParams

PROMPTS = ["Hello there, how are you today?", "Count to five:", "x " * 40, "The end."]


@pytest.fixture(scope="module")
def engines(tiny_chat_model_dir):
    cfg = dict(model=str(tiny_chat_model_dir), num_kv_blocks=64, block_size=16)
    return LLMEngine(EngineConfig(**cfg)), LLMEngine(EngineConfig(**cfg)), LLMEngine(EngineConfig(**cfg))


def run_prefill(prefill, request_id, prompt, params, seed):
    (seq,) = prefill.add_request(request_id, prompt, params, seed=seed, prefill_only=True)
    final = None
    while prefill.has_unfinished():
        for out in prefill.step():
            final = out
    return seq, final


def pull_pages(prefill, seq, decode, dseq) -> int:
    """Copy the pages of the blocks the decode pool lacks, as a delta pull does; how many it copied."""
    held = dseq.num_cached_blocks
    src = prefill.runner.kv_cache.buffer
    dst = decode.runner.kv_cache.buffer
    dst[dseq.block_table[held:]] = src[seq.block_table[held:]]
    return len(dseq.block_table) - held


def run_decode(decode, prefill, seq, out, params, seed):
    o = out.outputs[0]
    dseq = decode.add_prefilled_request(
        "d-" + out.request_id, seq.prompt_token_ids, o.token_ids[0], params, seed,
        o.logprobs[0] if o.logprobs else None, o.top_logprobs[0] if o.top_logprobs else None,
    )
    pull_pages(prefill, seq, decode, dseq)
    prefill.release_held(seq)
    decode.kv_ready(dseq)
    text, tokens, final = o.text_delta, list(o.token_ids), None
    while decode.has_unfinished():
        for d in decode.step():
            text += d.outputs[0].text_delta
            tokens += d.outputs[0].token_ids_delta
            final = d
    return text, tokens, final


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True),
    SamplingParams(temperature=0.8, top_p=0.9, max_tokens=20, ignore_eos=True, logprobs=2),
    SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True, stop=["e"]),
], ids=["greedy", "sampled", "stop-string"])
def test_handoff_equals_single_engine(engines, params):
    reference, prefill, decode = engines
    for i, prompt in enumerate(PROMPTS):
        seed = 1000 + i
        reference.add_request(f"ref-{i}-{id(params)}", prompt, params, seed=seed)
        ref = None
        while reference.has_unfinished():
            for o in reference.step():
                ref = o
        seq, out = run_prefill(prefill, f"p-{i}-{id(params)}", prompt, params, seed)
        if out.outputs[0].finish_reason != "handoff":
            assert out.outputs[0].text == ref.outputs[0].text
            prefill.release_held(seq)
            continue
        assert seq.block_table, "the prefill keeps its pages until released"
        text, tokens, final = run_decode(decode, prefill, seq, out, params, seed)
        assert tokens == ref.outputs[0].token_ids
        assert text == ref.outputs[0].text
        assert final.outputs[0].finish_reason == ref.outputs[0].finish_reason, (prompt, ref.outputs[0], final.outputs[0])
        if params.logprobs:
            assert final.outputs[0].logprobs == pytest.approx(ref.outputs[0].logprobs, abs=1e-5)
    for engine in engines:
        assert engine.block_manager.num_used_blocks == 0


def test_first_token_that_ends_the_request_is_reported_not_handed_off(engines):
    _, prefill, _ = engines
    seq, out = run_prefill(prefill, "one", "Hi", SamplingParams(max_tokens=1), 5)
    assert out.outputs[0].finish_reason == "length"
    prefill.release_held(seq)
    assert prefill.block_manager.num_used_blocks == 0


def test_failed_pull_recomputes_and_still_matches(engines):
    reference, prefill, decode = engines
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    reference.add_request("ref-fail", PROMPTS[0], params, seed=1)
    ref = None
    while reference.has_unfinished():
        for o in reference.step():
            ref = o
    seq, out = run_prefill(prefill, "p-fail", PROMPTS[0], params, 1)
    prefill.release_held(seq)  # as if the lease expired
    o = out.outputs[0]
    dseq = decode.add_prefilled_request("d-fail", seq.prompt_token_ids, o.token_ids[0], params, 1)
    decode.kv_failed(dseq)
    tokens = list(o.token_ids)
    while decode.has_unfinished():
        for d in decode.step():
            tokens += d.outputs[0].token_ids_delta
    assert tokens == ref.outputs[0].token_ids
    assert decode.block_manager.num_used_blocks == 0 and prefill.block_manager.num_used_blocks == 0


def test_abort_while_waiting_for_pages_frees_them(engines):
    _, _, decode = engines
    dseq = decode.add_prefilled_request("d-abort", [5] * 40, 7, SamplingParams(max_tokens=5), 1)
    assert decode.block_manager.num_used_blocks == 3 and not decode.has_work()
    decode.abort_request("d-abort")
    assert decode.has_work()  # the abort is reported by the next step
    (out,) = decode.step()
    assert out.finished and decode.block_manager.num_used_blocks == 0
    assert not decode.has_unfinished() and dseq.is_finished


def test_a_pull_is_a_request_state_the_scheduler_never_runs(engines):
    _, _, decode = engines
    from common.engine.sequence import SequenceStatus

    dseq = decode.add_prefilled_request("d-wait", [5] * 40, 7, SamplingParams(max_tokens=5), 1)
    assert dseq.status is SequenceStatus.WAITING_FOR_REMOTE_KV and len(dseq.block_table) == 3
    # Nothing runs while the pages travel, and a worker's loop need not turn for it (has_work).
    assert dseq not in decode.scheduler.waiting and decode.has_unfinished() and not decode.has_work()
    assert not decode.step()
    decode.kv_failed(dseq)  # the pull failed: its blocks go back, the prompt is recomputed here
    assert dseq.status is SequenceStatus.WAITING and decode.block_manager.num_used_blocks == 0 and decode.has_work()
    while decode.has_unfinished():
        decode.step()
    assert dseq.is_finished and decode.block_manager.num_used_blocks == 0


def _reference(reference, request_id, prompt_ids, params, seed):
    reference.add_request(request_id, prompt_ids, params, seed=seed)
    tokens = []
    while reference.has_unfinished():
        for o in reference.step():
            tokens += o.outputs[0].token_ids_delta
    return tokens


def _disaggregated(prefill, decode, request_id, prompt_ids, params, seed, reuse_cached=True):
    """One request prefilled on ``prefill`` and decoded on ``decode``: its tokens, the blocks the decode pool
    already held, and the blocks pulled."""
    seq, out = run_prefill(prefill, "p-" + request_id, prompt_ids, params, seed)
    o = out.outputs[0]
    dseq = decode.add_prefilled_request("d-" + request_id, seq.prompt_token_ids, o.token_ids[0], params, seed,
                                        reuse_cached=reuse_cached)
    held = dseq.num_cached_blocks
    pulled = pull_pages(prefill, seq, decode, dseq)
    prefill.release_held(seq)
    decode.kv_ready(dseq)
    tokens = list(o.token_ids)
    while decode.has_unfinished():
        for d in decode.step():
            tokens += d.outputs[0].token_ids_delta
    return tokens, held, pulled


@pytest.mark.parametrize("shared", [40, 48, 60], ids=["mid-block", "block-edge", "late-mid-block"])
def test_a_delta_pull_moves_only_the_blocks_the_decode_pool_lacks(tiny_chat_model_dir, shared):
    """Turn 2 of a conversation shares ``shared`` tokens with turn 1, whose KV the decode pool cached: only the
    blocks from the first one not wholly inside that prefix are pulled, and the output is the one-engine one."""
    cfg = dict(model=str(tiny_chat_model_dir), num_kv_blocks=64, block_size=16)
    reference, prefill, decode = (LLMEngine(EngineConfig(**cfg)) for _ in range(3))
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    history = [(7 * i) % 300 + 3 for i in range(shared)]
    turn1 = history
    turn2 = history + [(11 * i) % 250 + 5 for i in range(37)]
    tokens, held, pulled = _disaggregated(prefill, decode, "t1", turn1, params, 1)
    assert held == 0 and pulled == -(-len(turn1) // 16)  # the pages hold every prompt token
    assert tokens == _reference(reference, "r1", turn1, params, 1)
    tokens, held, pulled = _disaggregated(prefill, decode, "t2", turn2, params, 2)
    assert held == shared // 16  # decoding turn 1 computed its last prompt token too: every full shared block
    assert pulled == -(-len(turn2) // 16) - held
    assert tokens == _reference(reference, "r2", turn2, params, 2)
    for engine in (reference, prefill, decode):
        assert engine.block_manager.num_used_blocks == 0


def test_a_prompt_the_decode_pool_holds_whole_needs_no_pull(tiny_chat_model_dir):
    cfg = dict(model=str(tiny_chat_model_dir), num_kv_blocks=64, block_size=16)
    reference, prefill, decode = (LLMEngine(EngineConfig(**cfg)) for _ in range(3))
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    prompt = [(5 * i) % 200 + 3 for i in range(32)]  # its pages: two full blocks
    _disaggregated(prefill, decode, "a", prompt, params, 1)
    tokens, held, pulled = _disaggregated(prefill, decode, "b", prompt, params, 1)
    assert (held, pulled) == (2, 0)
    assert tokens == _reference(reference, "r", prompt, params, 1)
    assert decode.block_manager.num_used_blocks == 0


def test_without_delta_pull_every_block_is_pulled(tiny_chat_model_dir):
    cfg = dict(model=str(tiny_chat_model_dir), num_kv_blocks=64, block_size=16)
    prefill, decode = (LLMEngine(EngineConfig(**cfg)) for _ in range(2))
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    prompt = [(5 * i) % 200 + 3 for i in range(50)]
    _disaggregated(prefill, decode, "a", prompt, params, 1, reuse_cached=False)
    _, held, pulled = _disaggregated(prefill, decode, "b", prompt, params, 1, reuse_cached=False)
    assert (held, pulled) == (0, 4)


def test_a_pool_too_full_for_the_missing_blocks_gives_back_the_held_ones(tiny_chat_model_dir):
    cfg = dict(model=str(tiny_chat_model_dir), num_kv_blocks=6, block_size=16)
    prefill, decode = LLMEngine(EngineConfig(**cfg)), LLMEngine(EngineConfig(**cfg))
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    prompt = [(5 * i) % 200 + 3 for i in range(40)]
    _disaggregated(prefill, decode, "a", prompt, params, 1)
    hog = decode.scheduler.reserve(4)  # leaves 2 free: the 2 cached blocks, which the pull would reuse
    longer = prompt + [9] * 40
    dseq = decode.add_prefilled_request("d-b", longer, 5, params, 1)
    assert not dseq.block_table and dseq.num_cached_blocks == 0
    assert decode.block_manager.num_used_blocks == 4
    decode.kv_failed(dseq)
    decode.abort_request("d-b")
    decode.step()
    decode.scheduler.unreserve(hog)
    assert decode.block_manager.num_used_blocks == 0
