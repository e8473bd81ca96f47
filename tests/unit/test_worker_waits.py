"""How long a worker's loop may wait for a message: never spinning on work that is somewhere else.

A prefill worker whose only requests are pages lent to a decode worker, and a decode worker whose only
requests are pulls in flight, have nothing to compute. Their loops turned without a pause there, keeping a
core busy that the other co-located worker needed. Both handlers run here in one process with real engines on
a tiny model and the in-process transfer backend.
"""
import time

import pytest

from common.config.base import EngineConfig
from common.config.roles import WorkerConfig
from common.protocol import wire
from common.protocol.sampling_params import SamplingParams
from decode_worker.worker import PULL_POLL_S, DecodeHandler
from prefill_worker.worker import PrefillHandler
from tests.fake_transfer import FakeBackend

IDLE_S = 0.05
LEASE_S = 30.0


def handler(cls, role: str, model_dir, transfer):
    engine = EngineConfig(model=str(model_dir), num_kv_blocks=64, block_size=16)
    config = WorkerConfig(role=role, worker_id=f"{role}-0", engine=engine, observability={"metrics_port": 0},
                          idle_poll_s=IDLE_S)
    h = cls(config, lambda: transfer)
    sent = []
    h.bind(sent.append)
    return h, sent


@pytest.fixture(scope="module")
def workers(tiny_chat_model_dir):
    prefill, prefill_sent = handler(PrefillHandler, "prefill", tiny_chat_model_dir, FakeBackend())
    decode, decode_sent = handler(DecodeHandler, "decode", tiny_chat_model_dir, FakeBackend(delay_s=0.3))
    decode.handle(wire.Peers([wire.PeerInfo("prefill-0", prefill.epoch, "fake", prefill.transfer_metadata)]))
    yield prefill, prefill_sent, decode, decode_sent
    prefill.transfer.close()
    decode.transfer.close()


def test_lent_pages_and_pulls_in_flight_do_not_spin_the_loops(workers):
    prefill, prefill_sent, decode, decode_sent = workers
    assert prefill.wait_s(IDLE_S) == IDLE_S and decode.wait_s(IDLE_S) == IDLE_S  # idle: the full poll

    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    prompt = list(range(1, 41))
    prefill.handle(wire.PrefillRequest("r1", prompt, params, seed=1, lease_s=LEASE_S))
    assert prefill.wait_s(IDLE_S) == 0.0  # a prompt to compute: no waiting
    while not prefill_sent:
        prefill.tick()
    (done,) = prefill_sent
    assert prefill.busy() and prefill.leases  # the pages are lent until the decode worker releases them
    assert 0 < prefill.wait_s(IDLE_S) <= IDLE_S
    assert prefill.wait_s(LEASE_S * 2) == pytest.approx(LEASE_S, abs=1.0)  # it wakes for the lease's expiry

    decode.handle(wire.DecodeRequest("r1", prompt, params, seed=1, first_token=done.first_token,
                                     source_worker_id="prefill-0", source_block_ids=done.block_ids))
    assert decode.pulls and decode.engine.has_unfinished()
    assert decode.wait_s(IDLE_S) == PULL_POLL_S  # polls its pull, but does not spin on it
    deadline = time.monotonic() + 10
    while decode.pulls and time.monotonic() < deadline:
        decode.tick()
        time.sleep(decode.wait_s(IDLE_S))
    assert not decode.pulls and decode.wait_s(IDLE_S) == 0.0  # the pages landed: decode steps at once
    prefill.handle(wire.ReleaseKV("r1"))
    assert not prefill.busy() and prefill.wait_s(IDLE_S) == IDLE_S
    while decode.engine.has_unfinished():
        decode.tick()
    deltas = [d for m in decode_sent if isinstance(m, wire.TokenDeltas) for d in m.deltas]
    assert deltas[-1].finish_reason == "length" and sum(len(d.token_ids) for d in deltas) == 3
    assert decode.wait_s(IDLE_S) == IDLE_S
    assert decode.engine.block_manager.num_used_blocks == prefill.engine.block_manager.num_used_blocks == 0
