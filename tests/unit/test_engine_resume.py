"""A request resumed elsewhere with its output so far continues exactly where it stopped.

This is the engine's half of decode failover: the proxy re-dispatches a request whose decode worker
was lost, carrying the tokens the client already has. Whether the new worker computes them itself or
a prefill worker does and hands the pages over, the tokens after the cut must be the ones the
uninterrupted run produced (greedy, and seeded sampling with penalties, whose RNG is keyed by seed
and position), and the text must join up even when a stop string or a multi-byte character spans
the cut.
"""
import pytest

from common.config.base import EngineConfig
from common.engine.llm_engine import LLMEngine, RequestError
from common.protocol.sampling_params import SamplingParams

PROMPTS = ["Hello there, how are you today?", "x " * 40]
PARAMS = [
    SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True),
    SamplingParams(temperature=0.9, top_p=0.95, frequency_penalty=0.7, presence_penalty=0.3, max_tokens=24,
                   ignore_eos=True, logprobs=2),
    SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, stop=["e t"], repetition_penalty=1.2),
]
IDS = ["greedy", "seeded-penalties", "stop-string"]


@pytest.fixture(scope="module")
def engines(tiny_chat_model_dir):
    cfg = dict(model=str(tiny_chat_model_dir), num_kv_blocks=64, block_size=16)
    return LLMEngine(EngineConfig(**cfg)), LLMEngine(EngineConfig(**cfg))


def drain(engine):
    """Run until idle; (every token delta, every text delta, logprobs, the last output) of the one request."""
    tokens, texts, logprobs, final = [], [], [], None
    while engine.has_unfinished():
        for out in engine.step():
            o = out.outputs[0]
            tokens += o.token_ids_delta
            texts.append((len(o.token_ids), o.text_delta))
            if o.logprobs is not None and o.token_ids_delta:
                logprobs += o.logprobs[len(o.logprobs) - len(o.token_ids_delta):]
            final = out
    return tokens, texts, logprobs, final


def reference(engine, prompt, params, seed):
    engine.add_request(f"ref-{seed}-{id(params)}", prompt, params, seed=seed)
    tokens, texts, logprobs, final = drain(engine)
    sent = {}  # output tokens the client has -> the text it has
    text = ""
    for num_tokens, delta in texts:
        text += delta
        sent[num_tokens] = text
    return tokens, sent, logprobs, final.outputs[0]


def cuts(tokens):
    return sorted({1, 2, len(tokens) // 2, len(tokens) - 1})


@pytest.mark.parametrize("params", PARAMS, ids=IDS)
def test_resumed_locally_continues_the_same_stream(engines, params):
    engine, _ = engines
    for i, prompt in enumerate(PROMPTS):
        seed = 500 + i
        tokens, sent, logprobs, ref = reference(engine, prompt, params, seed)
        for cut in cuts(tokens):
            engine.add_request(f"resume-{seed}-{cut}-{id(params)}", prompt, params, seed=seed,
                               output_token_ids=tokens[:cut])
            rest, texts, rest_logprobs, final = drain(engine)
            assert tokens[:cut] + rest == tokens, (prompt, cut)
            assert sent[cut] + "".join(t for _, t in texts) == ref.text, (prompt, cut)
            assert final.outputs[0].finish_reason == ref.finish_reason
            assert final.outputs[0].token_ids == tokens  # the whole output, as the client counts it
            if params.logprobs is not None:
                assert rest_logprobs == pytest.approx(logprobs[cut:], abs=1e-5)
    assert engine.block_manager.num_used_blocks == 0


@pytest.mark.parametrize("params", PARAMS, ids=IDS)
def test_resumed_through_a_prefill_handoff_continues_the_same_stream(engines, params):
    prefill, decode = engines
    for i, prompt in enumerate(PROMPTS):
        seed = 700 + i
        tokens, sent, _, ref = reference(decode, prompt, params, seed)
        for cut in cuts(tokens)[:-1]:
            request_id = f"handoff-{seed}-{cut}-{id(params)}"
            (seq,) = prefill.add_request(request_id, prompt, params, seed=seed, prefill_only=True,
                                         output_token_ids=tokens[:cut])
            (first,), texts, _, out = drain(prefill)
            assert first == tokens[cut] and out.outputs[0].finish_reason == "handoff"
            assert out.outputs[0].token_ids[-1] == first
            dseq = decode.add_prefilled_request(
                request_id, seq.prompt_token_ids, first, params, seed,
                out.outputs[0].logprobs[-1] if params.logprobs is not None else None,
                output_token_ids=tokens[:cut])
            assert len(dseq.block_table) == len(seq.block_table)
            decode.runner.kv_cache.buffer[dseq.block_table] = prefill.runner.kv_cache.buffer[seq.block_table]
            prefill.release_held(seq)
            decode.kv_ready(dseq)
            rest, more, _, final = drain(decode)
            assert tokens[:cut + 1] + rest == tokens, (prompt, cut)
            text = sent[cut] + "".join(t for _, t in texts) + "".join(t for _, t in more)
            assert text == ref.text, (prompt, cut)
            assert final.outputs[0].finish_reason == ref.finish_reason
    for engine in engines:
        assert engine.block_manager.num_used_blocks == 0


def test_resumed_output_is_bounded_like_a_prompt(engines):
    engine, _ = engines
    params = SamplingParams(temperature=0.0, max_tokens=8)
    with pytest.raises(RequestError, match="already generated"):
        engine.add_request("too-long", [1] * 10, params, output_token_ids=[1] * engine.max_model_len)
    with pytest.raises(RequestError, match="vocabulary"):
        engine.add_request("bad-id", [1] * 10, params, output_token_ids=[engine.runner.vocab_size])
    with pytest.raises(RequestError, match="n=1"):
        engine.add_request("n2", [1] * 10, params.replace(n=2), output_token_ids=[1])
    assert not engine.has_unfinished()
