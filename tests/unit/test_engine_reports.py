"""A step's report: the deltas a server streams, and everything so far as it stood at the report.

The engine reports each touched request once per step. What a server streams are the deltas (token ids, text,
logprobs added since the previous report); the totals (``token_ids``, ``text``, ``logprobs``, ``top_logprobs``)
are read from the sequence when asked, as they stood at that report, so that a report costs the same at the
thousandth token as at the first. Here every report is kept until the requests end, and each one's totals must
equal the deltas streamed up to it, read then.
"""
import pytest

from common.config.base import EngineConfig
from common.engine.llm_engine import LLMEngine
from common.protocol.sampling_params import SamplingParams

PARAMS = {
    "greedy": SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True),
    "logprobs": SamplingParams(temperature=0.8, max_tokens=20, ignore_eos=True, logprobs=2),
    "stop-string": SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True, stop=["e t", "ing"]),
    "n=2": SamplingParams(temperature=0.9, max_tokens=12, ignore_eos=True, n=2, logprobs=1),
}


@pytest.fixture(scope="module")
def engine(tiny_chat_model_dir):
    return LLMEngine(EngineConfig(model=str(tiny_chat_model_dir), num_kv_blocks=128, block_size=16))


def test_every_report_reads_as_it_stood_when_made_after_the_request_went_on(engine):
    for name, params in PARAMS.items():
        engine.add_request(name, f"A prompt for {name}: the rain in Spain", params, seed=7)
    kept = []  # (report, each sequence's deltas up to and including it)
    streamed: dict[tuple[str, int], dict] = {}
    while engine.has_unfinished():
        for out in engine.step():
            for o in out.outputs:
                sofar = streamed.setdefault((out.request_id, o.index), {"ids": [], "text": "", "lp": [], "top": []})
                sofar["ids"] = sofar["ids"] + o.token_ids_delta
                sofar["text"] += o.text_delta
                if o.logprobs_delta is not None:
                    assert len(o.logprobs_delta) == len(o.token_ids_delta) == len(o.top_logprobs_delta)
                    sofar["lp"] = sofar["lp"] + o.logprobs_delta
                    sofar["top"] = sofar["top"] + o.top_logprobs_delta
                kept.append((out.request_id, o, dict(sofar)))
    assert {request_id for request_id, _, _ in kept} == set(PARAMS)
    assert len(kept) > 2 * len(PARAMS)
    for request_id, o, sofar in kept:
        assert o.token_ids == sofar["ids"], request_id
        assert o.text == sofar["text"], request_id
        if PARAMS[request_id].logprobs is None:
            assert o.logprobs is None and o.top_logprobs is None and o.logprobs_delta is None
        else:
            assert o.logprobs == sofar["lp"] and o.top_logprobs == sofar["top"], request_id
    finals = {(request_id, o.index): o for request_id, o, _ in kept if o.finished}
    assert len(finals) == len(PARAMS) + 1  # n=2: two sequences
    stopped = finals[("stop-string", 0)]
    assert stopped.finish_reason == "stop" or len(stopped.token_ids) == 30
