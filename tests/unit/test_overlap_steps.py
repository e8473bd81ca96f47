"""Overlapped steps (``engine.steps.overlap``, common/engine/llm_engine.py): the same outputs as steps run one at a
time, a call later.

On a GPU the engine queues a step and reports the one before while the device runs it; on the CPU (here) the queued
step has already run when ``launch`` returns, so these tests check what the overlap changes in the engine's
bookkeeping, not its speed: the tokens, text, finish reasons and log-probabilities of every request, stop strings
found a step late, aborts while a step is queued, and that no block is left behind.
"""
from __future__ import annotations

import pytest
import torch

from common.config.base import EngineConfig, StepsConfig
from common.engine.llm_engine import LLMEngine
from common.engine.sequence import SequenceStatus
from common.protocol.sampling_params import SamplingParams

PROMPTS = [[5 + i, 17, 300 + 7 * i, 41, 9] * (1 + i % 3) for i in range(6)]


def make_engine(model_dir, overlap: str) -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(model_dir), dtype="float32", num_kv_blocks=128,
                                  steps=StepsConfig(overlap=overlap)))


@pytest.fixture(scope="module")
def engines(tiny_chat_model_dir):
    return {mode: make_engine(tiny_chat_model_dir, mode) for mode in ("never", "always")}


def run(engine: LLMEngine, requests: dict[str, tuple[list[int], SamplingParams]], abort_at: dict[str, int] = ()):
    """Every request through ``step()`` calls: per request, its final output and the text deltas in order, and the
    call at which its first token arrived; ``abort_at``: request id -> the call after which it is aborted."""
    for request_id, (prompt, params) in requests.items():
        engine.add_request(request_id, prompt, params)
    finals, deltas, first_call, call = {}, {r: [] for r in requests}, {}, 0
    while engine.has_unfinished():
        call += 1
        for out in engine.step():
            for completion in out.outputs:
                deltas[out.request_id].append(completion.text_delta)
                if completion.token_ids:
                    first_call.setdefault(out.request_id, call)
            if out.finished:
                finals[out.request_id] = out
        for request_id, at in dict(abort_at).items():
            if call == at:
                engine.abort_request(request_id)
        assert call < 500, "the requests never finished"
    assert engine.block_manager.num_used_blocks == 0, "a block was left behind"
    return finals, deltas, first_call


def summary(out):
    return [(c.index, c.token_ids, c.text, c.finish_reason, c.logprobs) for c in out.outputs]


def test_every_request_ends_the_same_and_its_first_token_one_call_later(engines):
    reference, _, _ = run(engines["never"], {"probe": (PROMPTS[0], SamplingParams(temperature=0.0, max_tokens=12))})
    probe = reference["probe"].outputs[0]
    stop_text = probe.text[len(probe.text) // 2:][:3].strip() or probe.text[-2:]
    requests = {
        "greedy": (PROMPTS[0], SamplingParams(temperature=0.0, max_tokens=16)),
        "sampled": (PROMPTS[1], SamplingParams(temperature=0.9, top_p=0.9, seed=7, max_tokens=16)),
        "two": (PROMPTS[2], SamplingParams(temperature=0.8, n=2, seed=3, max_tokens=10)),
        "logprobs": (PROMPTS[3], SamplingParams(temperature=0.0, max_tokens=8, logprobs=2)),
        "stop-string": (PROMPTS[0], SamplingParams(temperature=0.0, max_tokens=12, stop=[stop_text])),
        "stop-token": (PROMPTS[0], SamplingParams(temperature=0.0, max_tokens=12,
                                                  stop_token_ids=[probe.token_ids[4]])),
        "penalised": (PROMPTS[4], SamplingParams(temperature=0.0, max_tokens=12, repetition_penalty=1.3)),
    }
    off, off_deltas, off_first = run(engines["never"], requests)
    on, on_deltas, on_first = run(engines["always"], requests)
    assert on.keys() == off.keys() == requests.keys()
    for request_id in requests:
        assert summary(on[request_id]) == summary(off[request_id]), request_id
        assert "".join(on_deltas[request_id]) == "".join(off_deltas[request_id]), request_id
        assert on_first[request_id] == off_first[request_id] + 1, request_id
    assert on["stop-string"].outputs[0].finish_reason == "stop"
    assert len(on["stop-string"].outputs[0].token_ids) < 12, "the stop string was not hit: pick another"


def test_an_abort_while_a_step_is_queued_takes_nothing_from_it(engines):
    requests = {"kept": (PROMPTS[5], SamplingParams(temperature=0.0, max_tokens=14)),
                "aborted": (PROMPTS[4], SamplingParams(temperature=0.0, max_tokens=14))}
    off, _, _ = run(engines["never"], requests)
    on, _, _ = run(engines["always"], {r: (p, s) for r, (p, s) in requests.items()}, abort_at={"aborted": 5})
    assert summary(on["kept"]) == summary(off["kept"])
    aborted = on["aborted"].outputs[0]
    assert aborted.finish_reason == "abort"
    full = off["aborted"].outputs[0].token_ids
    assert 0 < len(aborted.token_ids) < len(full) and aborted.token_ids == full[:len(aborted.token_ids)]


def test_a_queued_step_counts_as_work(engines):
    engine = engines["always"]
    engine.add_request("w", PROMPTS[0], SamplingParams(temperature=0.0, max_tokens=1))
    engine.step()  # the prompt step, queued
    assert engine.has_work()
    outputs = engine.step()  # applied: its one token, and the request is done
    assert [o.request_id for o in outputs] == ["w"] and outputs[0].finished
    assert not engine.has_work() and not engine.has_unfinished()


def test_a_queued_step_whose_sampling_raises_is_dropped_not_applied_again(engines, monkeypatch):
    """A kernel fault shows when the queued step is sampled: that call raises (the worker fails its requests,
    common/runtime/worker_runtime.py), and the next call does not meet the same step again."""
    engine = engines["always"]
    engine.add_request("fault", PROMPTS[1], SamplingParams(temperature=0.0, max_tokens=4))
    engine.step()  # queued
    finish = engine.runner.finish

    def fault(launched):
        raise RuntimeError("kernel fault")
    monkeypatch.setattr(engine.runner, "finish", fault)
    with pytest.raises(RuntimeError, match="kernel fault"):
        engine.step()
    monkeypatch.setattr(engine.runner, "finish", finish)
    engine.abort_request("fault")
    outputs = engine.step()
    assert [o.outputs[0].finish_reason for o in outputs] == ["abort"]
    assert not engine.has_unfinished() and engine.block_manager.num_used_blocks == 0


# ---- running ahead: the next step queued before the step before has its tokens on the host ----
GREEDY = {f"g{i}": (PROMPTS[i % len(PROMPTS)] + [60 + i], SamplingParams(temperature=0.0, max_tokens=m))
          for i, m in enumerate([1, 2, 3, 5, 9, 17, 24, 30])}


def test_greedy_decode_runs_ahead_and_every_request_ends_the_same(engines):
    """Every greedy decode step after the first is planned before the step before it has its tokens: the same
    tokens, text and finish reasons, stop strings and stop ids a step late, max_tokens met exactly."""
    reference, _, _ = run(engines["never"], {"probe": (PROMPTS[2], SamplingParams(temperature=0.0, max_tokens=20))})
    probe = reference["probe"].outputs[0]
    requests = dict(GREEDY)
    requests["stop-string"] = (PROMPTS[2], SamplingParams(temperature=0.0, max_tokens=20,
                                                          stop=[probe.text[len(probe.text) // 2:][:3].strip()]))
    requests["stop-id"] = (PROMPTS[2], SamplingParams(temperature=0.0, max_tokens=20,
                                                      stop_token_ids=[probe.token_ids[6]]))
    requests["sampled"] = (PROMPTS[3], SamplingParams(temperature=0.8, seed=5, max_tokens=12))  # not ahead
    off, off_deltas, _ = run(engines["never"], requests)
    engine = engines["always"]
    before = engine.stats.num_steps_ahead
    on, on_deltas, _ = run(engine, requests)
    for request_id in requests:
        assert summary(on[request_id]) == summary(off[request_id]), request_id
        assert "".join(on_deltas[request_id]) == "".join(off_deltas[request_id]), request_id
    assert len(on["stop-string"].outputs[0].token_ids) < 20 and len(on["stop-id"].outputs[0].token_ids) < 20
    assert engine.stats.num_steps_ahead - before > 10


def test_running_ahead_under_preemption_and_aborts(tiny_chat_model_dir):
    """A pool too small for every sequence: the plan that runs ahead preempts sequences whose tokens are still on
    the device (they take them, and recompute later); an abort lands while a step is queued ahead."""
    small = {mode: LLMEngine(EngineConfig(model=str(tiny_chat_model_dir), dtype="float32", num_kv_blocks=10,
                                          block_size=16, steps=StepsConfig(overlap=mode))) for mode in ("never", "always")}
    requests = {f"p{i}": (PROMPTS[i % len(PROMPTS)] + [90 + i], SamplingParams(temperature=0.0, max_tokens=40,
                                                                                ignore_eos=True)) for i in range(6)}
    scheduler, preempted_ahead = small["always"].scheduler, []
    settle = scheduler.settle

    def settle_counting(ahead, sampled):  # the sequences the plan run ahead preempted before their token came
        preempted_ahead.extend(seq for seq in ahead if seq.status is SequenceStatus.WAITING)
        return settle(ahead, sampled)
    scheduler.settle = settle_counting
    off, _, _ = run(small["never"], requests)
    on, _, _ = run(small["always"], requests)
    assert preempted_ahead and small["always"].stats.num_steps_ahead > 0
    for request_id in requests:
        assert summary(on[request_id]) == summary(off[request_id]), request_id
    aborted, _, _ = run(small["always"], requests, abort_at={"p3": 12})
    assert aborted["p3"].outputs[0].finish_reason == "abort"
    for request_id in set(requests) - {"p3"}:
        assert summary(aborted[request_id]) == summary(off[request_id]), request_id


def test_a_step_that_raises_while_running_ahead_leaves_no_placeholder(engines, monkeypatch):
    """Planning ahead raised: the queued step's tokens are not taken, the placeholders go, and the requests, once
    the fault is gone, end as if it had never happened."""
    engine = engines["always"]
    reference, _, _ = run(engines["never"], {"r": (PROMPTS[5], SamplingParams(temperature=0.0, max_tokens=10))})
    engine.add_request("r", PROMPTS[5], SamplingParams(temperature=0.0, max_tokens=10))
    for _ in range(3):
        engine.step()
    seq, = engine.requests["r"]
    tokens = list(seq.token_ids)
    launch = engine.runner.launch

    def fault(*args):
        raise RuntimeError("launch fault")
    monkeypatch.setattr(engine.runner, "launch", fault)
    with pytest.raises(RuntimeError, match="launch fault"):
        engine.step()
    assert seq.token_ids == tokens and seq.num_computed_tokens == seq.num_tokens - 1
    monkeypatch.setattr(engine.runner, "launch", launch)
    final = None
    while engine.has_unfinished():
        final = next((out for out in engine.step() if out.finished), final)
    assert summary(final) == summary(reference["r"]) and engine.block_manager.num_used_blocks == 0


def test_a_row_whose_logits_are_not_finite_samples_nothing():
    """The device's argmax step marks a row whose logits hold a NaN or Inf; ``finish`` gives it no token (and the
    step's tokens, which a step run ahead reads, stay valid ids)."""
    from common.engine.model_runner import ModelRunner, _argmax_step
    from common.engine.sequence import Sequence
    seqs = [Sequence(f"s{i}", [1, 2, 3], SamplingParams(temperature=0.0), seed=0) for i in range(3)]
    logits = torch.tensor([[0.0, 2.0, 1.0], [float("nan"), 0.0, 1.0], [3.0, 0.0, float("inf")]])
    launched = _argmax_step(seqs, logits)
    sample = ModelRunner.finish(None, launched)
    assert sample.token_ids == [[1], [], []] and sample.nonfinite == seqs[1:]
    assert 0 <= int(launched.tokens.min()) and int(launched.tokens.max()) < logits.shape[1]
