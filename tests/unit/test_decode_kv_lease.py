"""A decode worker never uses pages pulled past their lease or lent under an earlier epoch, and the delayed-pull
fault injection.

The prefill worker frees lent pages ``kv_lease_s`` after PrefillDone and may hand them to the next prompt;
the proxy tells the decode worker how much of the lease is left (``kv_lease_left_s``). A pull that cannot
be done in time is not started, or is cut at the lease, and the prompt is recomputed on the decode worker:
the output is the same. ``fault_kv_pull_delay_s`` holds each pull back; an Abort meanwhile frees its
blocks, and no pull starts. Both handlers run in one process on a tiny model with the in-process backend; the
decode handler's clock stands still unless the test moves it, so a lease or a delay is a number of seconds, not
a race against how fast the machine runs the test.
"""
import time

import pytest

from common.config.base import EngineConfig
from common.config.roles import WorkerConfig
from common.protocol import wire
from common.protocol.sampling_params import SamplingParams
from decode_worker.worker import LEASE_MARGIN_S, DecodeHandler
from prefill_worker.worker import PrefillHandler
from tests.fake_transfer import FakeBackend

PARAMS = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
PROMPT = list(range(1, 41))
PULL_S = 0.3  # how long the fake backend takes to land a pull's bytes (in real time, as are the backend's deadlines)


class StillTime:
    """The decode worker module's ``time``: ``monotonic`` reads a clock the test moves; ``sleep`` is real."""

    def __init__(self) -> None:
        self.now = time.monotonic()
        self.sleep = time.sleep

    def monotonic(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch) -> StillTime:
    still = StillTime()
    monkeypatch.setattr("decode_worker.worker.time", still)
    return still


def handler(cls, model_dir, transfer, **settings):
    engine = EngineConfig(model=str(model_dir), num_kv_blocks=64, block_size=16)
    h = cls(WorkerConfig(role=cls.role, worker_id=f"{cls.role}-0", engine=engine, observability={"metrics_port": 0},
                         **settings),
            lambda: transfer)
    sent = []
    h.bind(sent.append)
    return h, sent


@pytest.fixture(scope="module")
def prefilled(tiny_chat_model_dir):
    """A prefill worker holding PROMPT's pages, and its PrefillDone."""
    prefill, sent = handler(PrefillHandler, tiny_chat_model_dir, FakeBackend())
    prefill.handle(wire.PrefillRequest("r1", PROMPT, PARAMS, seed=1, lease_s=600))
    while not sent:
        prefill.tick()
    yield prefill, sent[0]
    prefill.transfer.close()


def decode_worker(model_dir, prefill, **settings):
    decode, sent = handler(DecodeHandler, model_dir, FakeBackend(delay_s=PULL_S), **settings)
    decode.handle(wire.Peers([wire.PeerInfo("prefill-0", prefill.epoch, "fake", prefill.transfer_metadata)]))
    return decode, sent


def decode_request(done: wire.PrefillDone, request_id: str, lease_left_s: float | None,
                   source_epoch: int = 0) -> wire.DecodeRequest:
    return wire.DecodeRequest(request_id, PROMPT, PARAMS, seed=1, first_token=done.first_token,
                              source_worker_id="prefill-0", source_block_ids=done.block_ids,
                              kv_lease_left_s=lease_left_s, source_epoch=source_epoch)


def pull_outcomes(decode) -> dict[str, float]:
    decode.publish_metrics()
    return {outcome: decode.metrics.registry.get_sample_value("tessera_worker_kv_pull_outcomes_total",
                                                              {"outcome": outcome})
            for outcome in ("ok", "retried_ok", "refused", "recomputed")}


def run_out(decode, sent) -> tuple[list[int], list[wire.KVPulled]]:
    """Turn the loop until every request finished: the tokens generated, and the KVPulled reports."""
    deadline = time.monotonic() + 30
    while decode.engine.has_unfinished():
        assert time.monotonic() < deadline
        decode.tick()
        time.sleep(decode.wait_s(0.01))
    tokens = [t for m in sent if isinstance(m, wire.TokenDeltas) for d in m.deltas for t in d.token_ids]
    return tokens, [m for m in sent if isinstance(m, wire.KVPulled)]


@pytest.mark.parametrize("lease_left_s, why", [
    (0.0, "lease (the proxy's kv_lease_s) ran out before the pull could start"),
    (LEASE_MARGIN_S, "lease (the proxy's kv_lease_s) ran out before the pull could start"),
    (LEASE_MARGIN_S + PULL_S / 3, "(the pages' lease: the proxy's kv_lease_s)"),  # started, and cut at the lease
])
def test_a_pull_that_cannot_end_within_the_lease_is_recomputed(tiny_chat_model_dir, prefilled, clock, lease_left_s,
                                                                why):
    prefill, done = prefilled
    decode, sent = decode_worker(tiny_chat_model_dir, prefill)
    decode.handle(decode_request(done, "in-time", None))
    expected, (pulled,) = run_out(decode, sent)
    assert pulled.ok  # no lease given: the pull's own deadline only

    sent.clear()
    decode.handle(decode_request(done, "late", lease_left_s))
    tokens, (pulled,) = run_out(decode, sent)
    assert not pulled.ok and why in pulled.error, pulled
    assert tokens == expected  # recomputed here, from the prompt
    assert decode.engine.block_manager.num_used_blocks == 0
    decode.transfer.close()


def test_a_delayed_pull_starts_late_and_an_abort_meanwhile_frees_its_blocks(tiny_chat_model_dir, prefilled, clock):
    prefill, done = prefilled
    decode, sent = decode_worker(tiny_chat_model_dir, prefill, testing={"fault_kv_pull_delay_s": 1.0})
    decode.handle(decode_request(done, "aborted", None))
    decode.handle(decode_request(done, "kept", None))
    assert set(decode.delayed) == {"aborted", "kept"} and not decode.pulls
    assert decode.engine.block_manager.num_used_blocks > 0  # blocks reserved for the pages
    assert decode.wait_s(5.0) == pytest.approx(1.0)  # the loop sleeps until the first is due
    clock.now += 0.5
    decode.tick()
    assert not decode.pulls and decode.wait_s(5.0) == pytest.approx(0.5)  # not due yet
    decode.handle(wire.Abort("aborted"))
    clock.now += 0.5
    tokens, pulls = run_out(decode, sent)
    assert [p.request_id for p in pulls] == ["kept"] and pulls[0].ok  # the aborted one never pulled
    assert len(tokens) == PARAMS.max_tokens - 1  # the kept one ran on (its first token came from the prefill)
    assert decode.engine.block_manager.num_used_blocks == 0
    decode.transfer.close()


def test_pages_of_an_earlier_epoch_of_the_prefill_worker_are_refused_and_recomputed(tiny_chat_model_dir, prefilled,
                                                                                    clock):
    prefill, done = prefilled
    assert done.epoch == prefill.epoch
    decode, sent = decode_worker(tiny_chat_model_dir, prefill)
    decode.handle(decode_request(done, "this-epoch", None, source_epoch=done.epoch))
    expected, (pulled,) = run_out(decode, sent)
    assert pulled.ok
    assert pull_outcomes(decode) == {"ok": 1, "retried_ok": 0, "refused": 0, "recomputed": 0}

    sent.clear()
    decode.handle(decode_request(done, "earlier-epoch", None, source_epoch=done.epoch - 1))
    assert not decode.pulls  # refused before a byte was read
    tokens, (pulled,) = run_out(decode, sent)
    assert not pulled.ok and f"epoch {done.epoch - 1}" in pulled.error and "refused" in pulled.error, pulled
    assert tokens == expected  # recomputed here, from the prompt
    assert pull_outcomes(decode) == {"ok": 1, "retried_ok": 0, "refused": 1, "recomputed": 0}
    assert decode.engine.block_manager.num_used_blocks == 0
    decode.transfer.close()
