"""Role switching, the worker's side: a real decode handler (tiny model, in-process transfer backend) and a WorkerIO
whose thread is not started (what it would send stays queued), driven through the loop's own functions.

The switch waits for what runs, or past the drain time gives it back (retryable); it says Goodbye under the old epoch,
and a prefill handler takes over the same engine (its prefix cache with it) under a new epoch, registered as prefill;
a former prefill worker calibrates its decode steps before it registers as decode.
An order for the role the worker has registers again without a drain; a signal during a switch stops it.
"""
from __future__ import annotations

import copy
import queue

import pytest

from common.config.base import EngineConfig
from common.config.roles import WorkerConfig
from common.protocol import wire
from common.protocol.sampling_params import SamplingParams
from common.runtime.role_switch import RoleSwitch
from common.runtime.worker_io import WorkerIO
from common.runtime.worker_runtime import _handle, _turn
from decode_worker.worker import DecodeHandler
from prefill_worker.worker import PrefillHandler
from tests.fake_transfer import FakeBackend

ADOPTERS = {"prefill": PrefillHandler.adopt, "decode": DecodeHandler.adopt, "both": DecodeHandler.adopt}
PROMPT = list(range(1, 41))  # two full blocks of 16, which the prefix cache keeps


def start(model_dir, role: str):
    """A handler of ``role`` and its RoleSwitch over a WorkerIO of two proxies whose thread is not started, with
    what the handler sends and the signals the loop saw."""
    engine = EngineConfig(model=str(model_dir), num_kv_blocks=64, block_size=16)
    config = WorkerConfig(role=role, worker_id="decode-0", engine=engine, observability={"metrics_port": 0},
                          proxy_address="tcp://127.0.0.1:1,tcp://127.0.0.1:2")
    handler = PrefillHandler(config, FakeBackend) if role == "prefill" else DecodeHandler(config, FakeBackend)
    sent: list = []
    handler.bind(sent.append)
    io = WorkerIO(config, handler.registration(), handler.metrics, handler.engine.model_dir)
    signalled: list[int] = []
    switch = RoleSwitch(config, handler, signalled, ADOPTERS)
    switch.io = io
    return switch, io, sent, signalled


@pytest.fixture
def worker(tiny_chat_model_dir):
    switch, io, sent, signalled = start(tiny_chat_model_dir, "decode")
    handler = switch.handler
    yield switch, io, sent, signalled
    handler.close()  # the handler it handed over to closes what they shared


def decode_locally(handler, request_id: str, max_tokens: int = 4) -> None:
    _handle(handler, wire.DecodeRequest(request_id, PROMPT, SamplingParams(temperature=0.0, max_tokens=max_tokens),
                                        seed=1))


def queued(io: WorkerIO) -> list:
    """What the I/O thread would send, in order."""
    out = []
    while True:
        try:
            out.append(io._outbox.get_nowait())
        except queue.Empty:
            return out


def test_a_decode_worker_drains_then_serves_as_prefill_with_its_model_and_prefix_cache(worker):
    switch, io, sent, _ = worker
    old = switch.handler
    engine, old_epoch = old.engine, old.epoch
    decode_locally(old, "r1")
    _turn(old)
    switch.take(wire.SwitchRole("decode-0", "prefill"), swapping=False)
    assert old.draining and io.draining and switch.check_at == 0.0
    decode_locally(old, "late")  # routed before the proxy knew: refused, retryable
    assert switch.act() is old  # r1 still runs
    while old.busy():
        _turn(old)
    new = switch.act()
    assert isinstance(new, PrefillHandler) and new.role == "prefill" and new.config.role == "prefill"
    assert new.engine is engine and new.epoch > old_epoch and not new.draining and not io.draining
    assert switch.check_at == float("inf") and old.successor is new
    (goodbye,) = [m for m in queued(io) if isinstance(m, wire.Goodbye)]
    assert goodbye.epoch == old_epoch
    assert (io.registration.role, io.registration.epoch) == ("prefill", new.epoch)
    assert io.owners.release_ends  # a prefill worker's requests end with their ReleaseKV
    assert new.metrics.role_switches.labels("prefill")._value.get() == 1
    refused = [m for m in sent if isinstance(m, wire.RequestFailed)]
    assert [(m.request_id, m.retryable) for m in refused] == [("late", True)]
    assert any(d.request_id == "r1" and d.finish_reason for m in sent if isinstance(m, wire.TokenDeltas)
               for d in m.deltas)

    _handle(new, wire.PrefillRequest("p1", PROMPT, SamplingParams(temperature=0.0, max_tokens=4), seed=1,
                                     lease_s=30.0))
    while new.engine.has_work():
        _turn(new)
    (done,) = [m for m in sent if isinstance(m, wire.PrefillDone)]
    assert done.epoch == new.epoch and done.num_cached_tokens == 32  # the blocks it cached while decoding
    _handle(new, wire.ReleaseKV("p1"))
    assert not new.busy() and engine.block_manager.num_used_blocks == 0


def test_what_still_runs_when_the_drain_time_is_up_goes_back_to_the_proxy(worker):
    switch, io, sent, _ = worker
    old = switch.handler
    decode_locally(old, "r1", max_tokens=64)
    _turn(old)
    switch.take(wire.SwitchRole("decode-0", "both"), swapping=False)
    switch.switch_by = 0.0  # drain_timeout_s is up
    new = switch.act()
    assert isinstance(new, DecodeHandler) and new.role == "both" and new.embeds is not None
    assert [(m.request_id, m.retryable) for m in sent if isinstance(m, wire.RequestFailed)] == [("r1", True)]
    assert not new.busy() and new.engine.block_manager.num_used_blocks == 0


def test_an_order_for_the_role_it_has_registers_again_without_a_drain(worker):
    switch, io, _, _ = worker
    handler, epoch = switch.handler, switch.handler.epoch
    switch.take(wire.SwitchRole("decode-0", "decode"), swapping=False)
    assert not handler.draining and switch.check_at == float("inf")
    assert queued(io) == [io.registration] and io.registration.epoch == epoch


def test_a_signal_during_a_switch_stops_it_and_orders_it_cannot_take_are_dropped(worker):
    switch, io, _, signalled = worker
    handler = switch.handler
    switch.take(wire.SwitchRole("decode-0", "prefill"), swapping=True)  # a model load is pending
    switch.take(wire.SwitchRole("decode-1", "prefill"), swapping=False)  # another worker's
    assert not handler.draining and switch.pending is None
    switch.take(wire.SwitchRole("decode-0", "prefill"), swapping=False)
    signalled.append(15)
    assert switch.act() is handler and switch.check_at == float("inf")
    assert handler.draining and queued(io) == []  # serve's drain goes on; no Goodbye for a switch


def test_a_prefill_worker_lends_its_pages_until_they_are_released_then_serves_as_decode(tiny_chat_model_dir):
    switch, io, sent, _ = start(tiny_chat_model_dir, "prefill")
    old = switch.handler
    try:
        _handle(old, wire.PrefillRequest("p1", PROMPT, SamplingParams(temperature=0.0, max_tokens=4), seed=1,
                                         lease_s=30.0))
        while old.engine.has_work():
            _turn(old)
        assert [type(m) for m in sent] == [wire.PrefillDone]  # its pages are lent now
        switch.take(wire.SwitchRole("decode-0", "decode"), swapping=False)
        _turn(old)
        assert switch.act() is old  # the lent pages wait for their pull
        _handle(old, wire.ReleaseKV("p1"))
        stats, timer = copy.deepcopy(old.engine.stats), old.engine.step_timer
        assert not timer.known(timer.small)  # a prefill worker never timed a decode step
        new = switch.act()
        assert isinstance(new, DecodeHandler) and new.role == "decode" and new.embeds is None
        # it calibrated its decode steps before registering (engine.steps.calibration_s), keeping its traffic's counters
        assert timer.known(timer.small) and new.engine.stats == stats and stats.num_computed_tokens >= len(PROMPT)
        assert not new.engine.has_unfinished() and new.engine.block_manager.num_used_blocks == 0
        assert not io.owners.release_ends and io.registration.role == "decode"
        assert not [m for m in sent if isinstance(m, wire.RequestFailed)]
    finally:
        old.close()
