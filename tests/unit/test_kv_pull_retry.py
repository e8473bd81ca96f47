"""A pull whose first read fails is read once more by the retry backend; a pull of pages lent under an earlier epoch
is refused by a server that sees it; each pull's outcome is counted once.

The retry's state machine runs over the in-process fake backend (``tests/fake_transfer.py``: its ``fail_every``
makes the first read fail when posted, its ``delay_s`` keeps a read in flight); the epoch check runs over the real
ZeroMQ backend, two in one process talking over TCP. The NIXL read failing for real, and ZeroMQ reading the pages
again, between two processes: tests/e2e/test_kv_transfer_processes.py.
"""
from __future__ import annotations

import time

import pytest
import torch

from common.config.roles import WorkerConfig
from common.engine.kv_cache import KVCache, KVLayout
from common.runtime.telemetry import WorkerMetrics
from kv_transfer.base import OUTCOMES, TransferStatus
from kv_transfer.factory import make_backend
from kv_transfer.retry import RetryingBackend
from tests.fake_transfer import FakeBackend

LAYOUT = KVLayout(num_layers=2, block_size=4, num_kv_heads=2, head_dim=8, dtype="float32")
WAIT_S = 30.0  # bounds a wait for a pull's end, so that a hang fails rather than stalls; never a timing
REMOTE, LOCAL = [3, 4, 9], [0, 5, 6]
EPOCH = 1_000


def filled(num_blocks: int, seed: int) -> KVCache:
    cache = KVCache(LAYOUT, num_blocks)
    cache.buffer.copy_(torch.randn(cache.buffer.shape, generator=torch.Generator().manual_seed(seed)))
    return cache


def wait(backend, handle) -> TransferStatus:
    end = time.monotonic() + WAIT_S
    while not backend.poll(handle).terminal:
        assert time.monotonic() < end, "the pull never ended"
        time.sleep(0.001)
    return handle.status


def outcomes(backend, **counts) -> dict[str, int]:
    return {**dict.fromkeys(OUTCOMES, 0), **counts}


@pytest.fixture
def pair():
    """``make(decode_primary, decode_retry, lender_retry=True)``: a lender of random KV and a puller that knows it
    as peer 'p', both retrying backends; closed after the test."""
    made = []

    def make(primary, retry, lender_retry: bool = True):
        lender = RetryingBackend(FakeBackend(), FakeBackend() if lender_retry else None)
        puller = RetryingBackend(primary, retry)
        made.extend([lender, puller])
        source, target = filled(16, seed=1), KVCache(LAYOUT, 8)
        lender.register_pool(source)
        metadata = lender.set_epoch(EPOCH)
        puller.register_pool(target)
        puller.add_peer("p", metadata)
        return puller, source, target

    yield make
    for backend in made:
        backend.close()


def landed(source: KVCache, target: KVCache) -> bool:
    return torch.equal(source.buffer[REMOTE], target.buffer[LOCAL])


def test_a_first_read_that_works_is_not_read_again(pair):
    puller, source, target = pair(FakeBackend(), FakeBackend(fail_every=1))
    handle = puller.start_pull("r", "p", REMOTE, LOCAL, WAIT_S)
    assert wait(puller, handle) is TransferStatus.DONE and not handle.retried
    assert landed(source, target)
    puller.release(handle)
    assert puller.counters().outcomes == outcomes(puller, ok=1)


def test_a_failed_first_read_is_read_again_by_the_retry_backend(pair):
    puller, source, target = pair(FakeBackend(fail_every=1), FakeBackend(delay_s=0.05))
    handle = puller.start_pull("r", "p", REMOTE, LOCAL, WAIT_S)
    assert handle.retried and handle.via is puller.retry  # the primary refused the post: read again at once
    assert wait(puller, handle) is TransferStatus.DONE
    assert landed(source, target)
    puller.release(handle)
    counters = puller.counters()
    assert counters.outcomes == outcomes(puller, retried_ok=1)
    assert (counters.pulls_done, counters.pulls_failed) == (1, 0)  # one pull, however many reads


def test_a_read_failing_in_flight_is_read_again_too(pair):
    puller, source, target = pair(FakeBackend(delay_s=0.05), FakeBackend())
    handle = puller.start_pull("r", "p", REMOTE, LOCAL, WAIT_S)
    assert handle.status is TransferStatus.TRANSFERRING and not handle.retried
    handle.inner.pool_id = "gone"  # the fake's dead peer: the read in flight fails at its next progress
    assert wait(puller, handle) is TransferStatus.DONE and handle.retried
    assert landed(source, target)
    puller.release(handle)
    assert puller.counters().outcomes == outcomes(puller, retried_ok=1)


def test_when_both_reads_fail_the_pull_fails_once(pair):
    puller, _, target = pair(FakeBackend(fail_every=1), FakeBackend(fail_every=1))
    handle = puller.start_pull("r", "p", REMOTE, LOCAL, WAIT_S)
    assert wait(puller, handle) is TransferStatus.FAILED
    assert handle.retried and "read before it failed too" in handle.error, handle.error
    assert not target.buffer.any()
    puller.release(handle)
    assert puller.counters().outcomes == outcomes(puller, failed=1)


@pytest.mark.parametrize("lender_retry, puller_retry", [(False, True), (True, False)])
def test_without_a_retry_path_on_either_side_a_failed_read_fails_the_pull(pair, lender_retry, puller_retry):
    puller, _, _ = pair(FakeBackend(fail_every=1), FakeBackend() if puller_retry else None, lender_retry)
    handle = puller.start_pull("r", "p", REMOTE, LOCAL, WAIT_S)
    assert wait(puller, handle) is TransferStatus.FAILED and not handle.retried
    puller.release(handle)
    assert puller.counters().outcomes == outcomes(puller, failed=1)


def test_an_abort_during_the_retry_stops_it_and_nothing_lands(pair):
    puller, _, target = pair(FakeBackend(fail_every=1), FakeBackend(delay_s=60))
    handle = puller.start_pull("r", "p", REMOTE, LOCAL, WAIT_S)
    assert handle.retried and handle.status is TransferStatus.TRANSFERRING
    inner = handle.inner
    puller.abort(handle)
    assert handle.status is TransferStatus.FAILED and inner.status is TransferStatus.FAILED
    puller.release(handle)
    assert inner.released and not target.buffer.any()
    assert puller.counters().outcomes == outcomes(puller, failed=1)


def test_removing_the_peer_fails_its_pull_and_frees_the_read(pair):
    puller, _, _ = pair(FakeBackend(delay_s=60), FakeBackend())
    handle = puller.start_pull("r", "p", REMOTE, LOCAL, WAIT_S)
    puller.remove_peer("p")
    assert handle.status is TransferStatus.FAILED and handle.inner.status is TransferStatus.FAILED
    puller.release(handle)
    assert handle.inner.released


# ---- the epoch, seen by the ZeroMQ server ------------------------------------------------------------------------
@pytest.fixture
def zmq_pair():
    lender, puller = make_backend("zmq"), make_backend("zmq")
    source, target = filled(16, seed=2), KVCache(LAYOUT, 8)
    lender.register_pool(source)
    puller.register_pool(target)
    yield lender, puller, source, target
    puller.close()
    lender.close()


def test_the_zmq_server_serves_pages_of_its_epoch_and_refuses_those_of_an_earlier_one(zmq_pair):
    lender, puller, source, target = zmq_pair
    puller.add_peer("p", lender.set_epoch(EPOCH))
    handle = puller.start_pull("now", "p", REMOTE, LOCAL, WAIT_S)
    assert handle.epoch == EPOCH and wait(puller, handle) is TransferStatus.DONE and landed(source, target)
    puller.release(handle)

    target.buffer.zero_()
    lender.set_epoch(EPOCH + 1)  # it registered again: what it lent before is freed; the puller does not know yet
    handle = puller.start_pull("stale", "p", REMOTE, LOCAL, WAIT_S)
    assert wait(puller, handle) is TransferStatus.FAILED and handle.refused
    assert f"epoch {EPOCH}" in handle.error and f"epoch {EPOCH + 1}" in handle.error, handle.error
    assert not target.buffer.any()
    puller.release(handle)
    assert puller.counters().outcomes == outcomes(puller, ok=1, refused=1)


def test_a_refused_pull_is_not_read_again():
    lender = RetryingBackend(FakeBackend(), make_backend("zmq"))
    puller = RetryingBackend(FakeBackend(fail_every=1), make_backend("zmq"))
    try:
        lender.register_pool(filled(16, seed=3))
        puller.register_pool(KVCache(LAYOUT, 8))
        puller.add_peer("p", lender.set_epoch(EPOCH))
        lender.set_epoch(EPOCH + 1)
        handle = puller.start_pull("stale", "p", REMOTE, LOCAL, WAIT_S)
        assert wait(puller, handle) is TransferStatus.FAILED and handle.retried and handle.refused
        puller.release(handle)
        assert puller.counters().outcomes == outcomes(puller, refused=1)
    finally:
        puller.close()
        lender.close()


# ---- the metric ------------------------------------------------------------------------------------------------------
def test_each_pull_counts_once_in_one_outcome():
    metrics = WorkerMetrics(WorkerConfig(role="decode", worker_id="d", observability={"metrics_port": 0}))

    def sample(outcome: str) -> float:
        return metrics.registry.get_sample_value("tessera_worker_kv_pull_outcomes_total", {"outcome": outcome})

    backend = object()
    metrics.kv_pulled(True, 10, 0.1)
    metrics.kv_pulled(True, 10, 0.1)
    metrics.kv_pulled(False, 0, 0.1)  # refused by the lender
    metrics.kv_pulled(False, 0, 0.1)  # timed out
    metrics.count_pulls(backend, {"ok": 1, "retried_ok": 1, "refused": 1, "failed": 1})
    metrics.kv_pull_refused()  # refused here, before the backend saw it
    metrics.kv_pulled(False, 0, 0.0)
    metrics.kv_pulled(False, 0, 0.0)  # no free block to receive the pages: never reached the backend
    metrics.count_pulls(backend, {"ok": 1, "retried_ok": 1, "refused": 1, "failed": 1})
    assert {o: sample(o) for o in ("ok", "retried_ok", "refused", "recomputed")} == {
        "ok": 1, "retried_ok": 1, "refused": 2, "recomputed": 2}
    metrics.kv_pulled(True, 10, 0.1)
    metrics.count_pulls(object(), {"ok": 1, "retried_ok": 0, "refused": 0, "failed": 0})  # a new model's backend
    assert sample("ok") == 2
