"""No request can take a worker down: a failure is contained to the request that caused it.

A real decode handler (tiny model, in-process transfer backend) driven through the loop's own
functions: a message whose handling raises ends that request with a non-retryable error, and an
engine turn that raises gives the running requests back to the proxy (retryable: it resumes them
elsewhere). Either way the worker frees their pages and serves the next request.
"""
import pytest

from common.config.base import EngineConfig
from common.config.roles import WorkerConfig
from common.protocol import wire
from common.protocol.sampling_params import SamplingParams
from common.engine.tensor_parallel import RankGroupBroken
from common.runtime.worker_runtime import _handle, _turn
from decode_worker.worker import DecodeHandler
from tests.fake_transfer import FakeBackend


@pytest.fixture
def decode(tiny_chat_model_dir):
    engine = EngineConfig(model=str(tiny_chat_model_dir), num_kv_blocks=64, block_size=16)
    config = WorkerConfig(role="decode", worker_id="decode-0", engine=engine, observability={"metrics_port": 0})
    handler = DecodeHandler(config, FakeBackend)
    sent = []
    handler.bind(sent.append)
    yield handler, sent
    handler.transfer.close()


def request(request_id: str) -> wire.DecodeRequest:
    return wire.DecodeRequest(request_id, [1, 2, 3, 4, 5], SamplingParams(temperature=0.0, max_tokens=4), seed=1)


def run(handler, sent, request_id: str) -> list:
    _handle(handler, request(request_id))
    while handler.busy():
        _turn(handler)
    messages = [d for m in sent for d in (m.deltas if isinstance(m, wire.TokenDeltas) else [m])]
    return [m for m in messages if getattr(m, "request_id", None) == request_id]


def test_a_message_that_makes_the_handler_fail_ends_only_its_request(decode, monkeypatch):
    handler, sent = decode
    original = handler.engine.add_request

    def explode(*args, **kwargs):
        raise RuntimeError("an input no check foresaw")

    monkeypatch.setattr(handler.engine, "add_request", explode)
    (failed,) = run(handler, sent, "bad")
    assert isinstance(failed, wire.RequestFailed) and not failed.retryable and "no check foresaw" in failed.message
    monkeypatch.setattr(handler.engine, "add_request", original)
    replies = run(handler, sent, "good")
    assert replies[-1].finish_reason == "length" and sum(len(m.token_ids) for m in replies) == 4
    assert handler.metrics.internal_errors._value.get() == 1
    assert handler.engine.block_manager.num_used_blocks == 0


def test_a_failed_engine_turn_gives_its_requests_back_and_the_worker_goes_on(decode, monkeypatch):
    handler, sent = decode
    _handle(handler, request("victim"))
    original = handler.engine.runner.launch

    def explode(*args, **kwargs):
        raise RuntimeError("kernel fault")

    monkeypatch.setattr(handler.engine.runner, "launch", explode)
    _turn(handler)
    (failed,) = [m for m in sent if isinstance(m, wire.RequestFailed)]
    assert failed.request_id == "victim" and failed.retryable and "kernel fault" in failed.message
    assert not handler.busy() and handler.engine.block_manager.num_used_blocks == 0
    monkeypatch.setattr(handler.engine.runner, "launch", original)
    assert run(handler, sent, "next")[-1].finish_reason == "length"


def test_a_broken_rank_group_ends_the_worker_rather_than_serving_on(decode, monkeypatch):
    """A collective that failed (``RankGroupBroken``: a rank silent past engine.ranks.step_timeout_s) ends the worker
    with exit code 70, in a turn and in a message's handling alike: a rank that woke later would pair its collectives
    with the next step's."""
    handler, _ = decode
    _handle(handler, request("victim"))

    def broken(*args, **kwargs):
        raise RankGroupBroken("tensor parallel all-reduce across the worker's 2 ranks failed")

    monkeypatch.setattr(handler.engine.runner, "launch", broken)
    with pytest.raises(SystemExit) as ended:
        _turn(handler)
    assert ended.value.code == 70
    monkeypatch.setattr(handler, "handle", broken)
    with pytest.raises(SystemExit) as ended:
        _handle(handler, request("next"))
    assert ended.value.code == 70


def test_a_broken_rank_group_steps_no_more_and_its_requests_are_still_given_back(decode):
    """Once a collective failed, every later one fails at once (no second wait of engine.ranks.step_timeout_s), and the
    cleanup gives each request back to the proxy without stepping the engine."""
    handler, sent = decode
    _handle(handler, request("victim"))
    tp = handler.engine.runner.tp
    tp.broken = RankGroupBroken("tensor parallel all-reduce across the worker's 2 ranks failed")
    with pytest.raises(RankGroupBroken):
        tp.check()
    handler.fail_all("worker is shutting down")
    (failed,) = [m for m in sent if isinstance(m, wire.RequestFailed)]
    assert failed.request_id == "victim" and failed.retryable


def test_a_request_whose_step_cannot_be_reported_ends_alone(decode, monkeypatch):
    """A step's tokens travel in one TokenDeltas: failing to build one request's delta ends that request and
    still sends the others theirs."""
    handler, sent = decode
    original = handler._delta

    def fail_for_bad(out):
        if out.request_id == "bad" and out.outputs[0].finish_reason != "abort":
            raise RuntimeError("a delta no check foresaw")
        return original(out)

    monkeypatch.setattr(handler, "_delta", fail_for_bad)
    _handle(handler, request("bad"))
    good = run(handler, sent, "good")
    (failed,) = [m for m in sent if isinstance(m, wire.RequestFailed)]
    assert failed.request_id == "bad" and not failed.retryable and "no check foresaw" in failed.message
    assert good[-1].finish_reason == "length" and sum(len(m.token_ids) for m in good) == 4
    assert all(d.request_id == "good" for m in sent if isinstance(m, wire.TokenDeltas) for d in m.deltas)
    assert not handler.busy() and handler.engine.block_manager.num_used_blocks == 0


def test_a_tune_from_the_proxy_sets_the_engines_token_budget_and_speculation_and_their_gauges():
    import queue
    from types import SimpleNamespace

    from common.engine.speculator import make_speculator
    from common.protocol import wire
    from common.runtime.worker_runtime import _take_messages
    budgets = []
    gauges = {name: SimpleNamespace(value=None) for name in ("token_budget", "spec_num_tokens", "spec_max_batch_size")}
    config = EngineConfig(model="unused", spec={"method": "ngram", "num_tokens": 4, "max_batch_size": 8})
    handler = SimpleNamespace(engine=SimpleNamespace(scheduler=SimpleNamespace(
                                  set_token_budget=lambda t: budgets.append(t) or (t or 2048)),
                                  speculator=make_speculator(config, runner=None)),
                              metrics=SimpleNamespace(tuned=lambda *values: [
                                  setattr(g, "value", v) for g, v in zip(gauges.values(), values)]))
    inbox = queue.Queue()
    io = SimpleNamespace(inbox=inbox, take=lambda wait_s=0.0: inbox.get_nowait())
    io.inbox.put(wire.Tune(512, spec_num_tokens=2, spec_max_batch_size=0))
    assert _take_messages(io, handler, None, None, 0)
    assert budgets == [512] and {n: g.value for n, g in gauges.items()} == {
        "token_budget": 512, "spec_num_tokens": 2, "spec_max_batch_size": 0}
    io.inbox.put(wire.Tune(0))  # back to the configured values
    assert _take_messages(io, handler, None, None, 0)
    assert budgets == [512, 0] and {n: g.value for n, g in gauges.items()} == {
        "token_budget": 2048, "spec_num_tokens": 4, "spec_max_batch_size": 8}
