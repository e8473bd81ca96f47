"""A step's report: the deltas a server streams, and everything so far as it stood at the report.

The engine reports each touched request once per step. What a server streams are the deltas (token ids, text,
logprobs added since the previous report); the totals (``token_ids``, ``text``, ``logprobs``, ``top_logprobs``)
are read from the sequence's lists when asked, as they stood at that report, so that a report costs the same at
the thousandth token as at the first. Here every report is kept until the requests end, and each one's totals must
equal the deltas streamed up to it, read then; the streamed totals must equal the whole run's (steps one at a
time, steps run ahead, speculation); and a request without stop strings (the text state's fast path) streams what
one with a stop string that never matches does.
"""
import pytest

from common.config.base import EngineConfig, StepsConfig
from common.engine.llm_engine import LLMEngine
from common.protocol.sampling_params import SamplingParams

PROMPT = "A prompt for the reports: the rain in Spain"
NEVER = "\uffff\ufffe"  # two noncharacters: a stop string no output holds


def params(stop_at: str) -> dict[str, SamplingParams]:
    return {
        "greedy": SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True),  # on alone after the others
        "logprobs": SamplingParams(temperature=0.8, max_tokens=20, ignore_eos=True, logprobs=2),
        "stop-string": SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True, stop=[stop_at]),
        "n=2": SamplingParams(temperature=0.9, max_tokens=12, ignore_eos=True, n=2, logprobs=1),
        "never-stops": SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, stop=[NEVER]),
    }


CONFIGS = {
    "one-at-a-time": {},
    "run-ahead": {"steps": StepsConfig(overlap="always")},
    "ngram": {"spec": {"method": "ngram", "ngram_min": 1, "adaptive": False, "num_tokens": 4}},
}


@pytest.fixture(scope="module")
def stop_at(tiny_chat_model_dir) -> str:
    """Three characters from the middle of the greedy run's text: a stop string the greedy request meets."""
    engine = LLMEngine(EngineConfig(model=str(tiny_chat_model_dir), num_kv_blocks=128, block_size=16))
    (out,) = engine.generate([PROMPT], SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True))
    text = out.outputs[0].text
    assert len(text) > 20, text
    return text[len(text) // 2:len(text) // 2 + 3]


def stream(engine, requests: dict[str, SamplingParams]) -> tuple[list, dict]:
    """Every report kept with each sequence's deltas up to it; and the last report of each sequence."""
    for name, p in requests.items():
        engine.add_request(name, PROMPT, p, seed=7)
    kept, streamed, last = [], {}, {}
    while engine.has_unfinished():
        for out in engine.step():
            for o in out.outputs:
                key = (out.request_id, o.index)
                sofar = streamed.setdefault(key, {"ids": [], "text": "", "lp": [], "top": [], "steps": []})
                sofar["ids"] = sofar["ids"] + o.token_ids_delta
                sofar["text"] += o.text_delta
                sofar["steps"] = sofar["steps"] + [(tuple(o.token_ids_delta), o.text_delta)]
                if o.logprobs_delta is not None:
                    assert len(o.logprobs_delta) == len(o.token_ids_delta) == len(o.top_logprobs_delta)
                    sofar["lp"] = sofar["lp"] + o.logprobs_delta
                    sofar["top"] = sofar["top"] + o.top_logprobs_delta
                kept.append((out.request_id, o, dict(sofar)))
                last[key] = o
    return kept, last


@pytest.mark.parametrize("config", list(CONFIGS))
def test_every_report_reads_as_it_stood_when_made_after_the_request_went_on(config, tiny_chat_model_dir, stop_at):
    requests = params(stop_at)
    engine = LLMEngine(EngineConfig(model=str(tiny_chat_model_dir), num_kv_blocks=128, block_size=16,
                                    **CONFIGS[config]))
    kept, last = stream(engine, requests)
    if config == "run-ahead":  # once the sampled and logprobs rows end, the greedy ones run ahead
        assert engine.stats.num_steps_ahead > 0
    if config == "ngram":
        assert engine.stats.num_spec_drafts > 0
    assert {request_id for request_id, _, _ in kept} == set(requests)
    assert len(kept) > 2 * len(requests)
    for request_id, o, sofar in kept:
        assert o.token_ids == sofar["ids"], request_id
        assert o.text == sofar["text"], request_id
        if requests[request_id].logprobs is None:
            assert o.logprobs is None and o.top_logprobs is None and o.logprobs_delta is None
        else:
            assert o.logprobs == sofar["lp"] and o.top_logprobs == sofar["top"], request_id
    assert all(o.finished for o in last.values()) and len(last) == len(requests) + 1  # n=2: two sequences
    stopped = last[("stop-string", 0)]
    assert stopped.finish_reason == "stop" and stopped.stop_reason == stop_at, stopped
    assert stop_at not in stopped.text and len(stopped.token_ids) < 30
    # the same requests run whole: what was streamed adds up to each one's final output
    whole = LLMEngine(EngineConfig(model=str(tiny_chat_model_dir), num_kv_blocks=128, block_size=16))
    for name in ("greedy", "stop-string", "never-stops"):
        (out,) = whole.generate([PROMPT], requests[name])
        assert (last[(name, 0)].token_ids, last[(name, 0)].text) == (out.outputs[0].token_ids, out.outputs[0].text)


def test_a_request_without_stop_strings_streams_what_one_with_an_unmet_stop_string_does(tiny_chat_model_dir):
    engine = LLMEngine(EngineConfig(model=str(tiny_chat_model_dir), num_kv_blocks=128, block_size=16))

    def steps_of(name: str, stop: list[str]):
        kept, last = stream(engine, {name: SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True,
                                                          stop=stop)})
        return kept[-1][2]["steps"], last[(name, 0)]
    fast_steps, fast = steps_of("fast", [])
    slow_steps, slow = steps_of("slow", [NEVER])
    assert len(fast.token_ids) == 40 and fast.finish_reason == "length"
    assert fast_steps == slow_steps  # each step's token ids and text delta
    assert (fast.token_ids, fast.text) == (slow.token_ids, slow.text)
