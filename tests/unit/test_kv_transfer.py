"""The KV transfer contract, run against the in-process fake backend."""
from __future__ import annotations

import sys
import time

import msgpack
import pytest
import torch

from common.engine.kv_cache import KVCache, KVLayout
from kv_transfer.base import BlockRun, TransferStatus, merge_block_runs
from kv_transfer.factory import default_backend_name, make_backend
from tests.fake_transfer import FakeBackend

LAYOUT = KVLayout(num_layers=2, block_size=4, num_kv_heads=2, head_dim=8, dtype="float32")
DEADLINE_S = 5.0


def filled_cache(num_blocks: int, seed: int) -> KVCache:
    cache = KVCache(LAYOUT, num_blocks)
    cache.buffer.copy_(torch.randn(cache.buffer.shape, generator=torch.Generator().manual_seed(seed)))
    return cache


def pair(**decode_options):
    """A prefill pool with random KV and a decode backend that knows it as peer 'p'."""
    prefill, decode = FakeBackend(), FakeBackend(**decode_options)
    source = filled_cache(16, seed=1)
    metadata = prefill.register_pool(source)
    target = KVCache(LAYOUT, 8)
    decode.register_pool(target)
    decode.add_peer("p", metadata)
    return prefill, decode, source, target


def wait(backend, handle, timeout_s: float = DEADLINE_S) -> TransferStatus:
    end = time.monotonic() + timeout_s
    while not backend.poll(handle).terminal:
        assert time.monotonic() < end, "pull never reached a terminal status"
        time.sleep(0.001)
    return handle.status


# ---- the ladder -------------------------------------------------------------------
def test_ladder_is_ordered_and_failed_and_done_are_terminal():
    assert TransferStatus.FAILED < TransferStatus.PENDING < TransferStatus.TRANSFERRING < TransferStatus.DONE
    assert [s for s in TransferStatus if s.terminal] == [TransferStatus.FAILED, TransferStatus.DONE]


def test_status_only_moves_forward_and_failed_is_sticky():
    _, decode, _, _ = pair(delay_s=60)
    handle = decode.start_pull("r", "p", [0], [0], DEADLINE_S)
    assert handle.status == TransferStatus.TRANSFERRING
    assert not decode._advance(handle, TransferStatus.PENDING)
    assert decode._advance(handle, TransferStatus.FAILED, "test")
    for later in TransferStatus:
        assert not decode._advance(handle, later)
    assert handle.status == TransferStatus.FAILED and handle.error == "test"
    decode.release(handle)


def test_done_is_never_turned_into_failed():
    _, decode, _, _ = pair()
    handle = decode.start_pull("r", "p", [0], [0], DEADLINE_S)
    assert wait(decode, handle) == TransferStatus.DONE
    decode.abort(handle)
    assert handle.status == TransferStatus.DONE
    assert decode.counters().pulls_failed == 0
    decode.release(handle)


# ---- merging descriptors ---------------------------------------------------------------
def test_runs_merge_only_where_both_sides_are_contiguous():
    assert merge_block_runs([3, 4, 5], [7, 8, 9]) == [BlockRun(3, 7, 3)]
    assert merge_block_runs([3, 4, 5], [7, 9, 8]) == [BlockRun(3, 7, 1), BlockRun(4, 9, 1), BlockRun(5, 8, 1)]
    assert merge_block_runs([10, 11, 2, 3], [0, 1, 5, 6]) == [BlockRun(2, 5, 2), BlockRun(10, 0, 2)]


def test_runs_are_found_whatever_the_order_of_the_pairs():
    assert merge_block_runs([5, 3, 4, 9], [2, 0, 1, 4]) == [BlockRun(3, 0, 3), BlockRun(9, 4, 1)]


@pytest.mark.parametrize(
    "remote, local, message",
    [
        ([1, 2], [1], "remote block ids for"),
        ([], [], "at least one block"),
        ([1, 1], [2, 3], "remote block ids repeat"),
        ([1, 2], [3, 3], "local block ids repeat"),
        ([-1], [0], "non-negative"),
        ([True], [0], "non-negative ints"),
    ],
)
def test_bad_block_id_lists_are_refused(remote, local, message):
    with pytest.raises(ValueError, match=message):
        merge_block_runs(remote, local)


# ---- published metadata ----------------------------------------------------------------------
@pytest.mark.parametrize("envelope, message", [
    ({"v": 2, "backend": "fake", "bytes_per_block": 0, "num_blocks": 1, "fields": {"pool": "p"}},
     r"\$.bytes_per_block"),
    ({"v": 2, "backend": "fake", "bytes_per_block": 1, "num_blocks": 1}, "missing required field `fields`"),
    ({"v": 1, "backend": "fake", "bytes_per_block": 1, "num_blocks": 1, "fields": {}}, "version 1"),
])
def test_malformed_metadata_is_refused_naming_the_field(envelope, message):
    _, decode, _, _ = pair()
    with pytest.raises(ValueError, match=message):
        decode.add_peer("q", msgpack.packb(envelope))


def test_backend_fields_are_checked_by_the_backend():
    _, decode, _, _ = pair()
    bytes_per_block = LAYOUT.bytes_per_block
    envelope = {"v": 2, "backend": "fake", "bytes_per_block": bytes_per_block, "num_blocks": 4,
                "fields": {"pool": 7}}
    with pytest.raises(ValueError, match=r"fake metadata: Expected `str`, got `int` - at `\$.pool`"):
        decode.add_peer("q", msgpack.packb(envelope))


# ---- factory -------------------------------------------------------------------------------
def test_factory_names_the_known_backends():
    with pytest.raises(ValueError, match="one of"):
        make_backend("rdma")


def test_default_backend_falls_back_to_zmq_without_nixl(monkeypatch):
    monkeypatch.setitem(sys.modules, "nixl._api", None)
    assert default_backend_name() == "zmq"


# ---- the fake backend ---------------------------------------------------------------------
def test_pull_moves_exact_bytes_into_other_block_ids():
    _, decode, source, target = pair()
    remote, local = [9, 3, 4, 12], [0, 5, 6, 2]
    handle = decode.start_pull("r", "p", remote, local, DEADLINE_S)
    assert handle.status == TransferStatus.TRANSFERRING
    assert wait(decode, handle) == TransferStatus.DONE
    assert torch.equal(target.buffer[local], source.buffer[remote])
    untouched = [b for b in range(8) if b not in local]
    assert not target.buffer[untouched].any()
    decode.release(handle)
    counters = decode.counters()
    assert (counters.pulls_done, counters.pulls_failed) == (1, 0)
    assert counters.bytes_pulled == 4 * LAYOUT.bytes_per_block


def test_fail_every_nth_pull_is_injected():
    _, decode, _, _ = pair(fail_every=2)
    statuses = []
    for i in range(4):
        handle = decode.start_pull(f"r{i}", "p", [i], [i], DEADLINE_S)
        statuses.append(wait(decode, handle))
        decode.release(handle)
    assert statuses == [TransferStatus.DONE, TransferStatus.FAILED] * 2
    assert decode.counters().pulls_failed == 2


def test_pull_past_its_deadline_fails_and_writes_nothing():
    _, decode, _, target = pair(delay_s=0.3)
    handle = decode.start_pull("r", "p", [1, 2], [1, 2], 0.05)
    assert wait(decode, handle) == TransferStatus.FAILED
    assert "deadline" in handle.error
    time.sleep(0.3)
    assert decode.poll(handle) == TransferStatus.FAILED
    assert not target.buffer.any()
    decode.release(handle)


def test_peer_problems_fail_the_handle_instead_of_raising():
    _, decode, _, _ = pair()
    unknown = decode.start_pull("a", "nobody", [0], [0], DEADLINE_S)
    beyond = decode.start_pull("b", "p", [16], [0], DEADLINE_S)
    assert unknown.status == beyond.status == TransferStatus.FAILED
    assert "unknown peer" in unknown.error and "outside" in beyond.error
    decode.release(unknown)
    decode.release(beyond)


def test_caller_mistakes_raise():
    _, decode, _, _ = pair(delay_s=60)
    with pytest.raises(ValueError, match="outside the pool"):
        decode.start_pull("r", "p", [0], [8], DEADLINE_S)
    with pytest.raises(ValueError, match="deadline_s"):
        decode.start_pull("r", "p", [0], [0], 0)
    handle = decode.start_pull("r", "p", [0], [0], DEADLINE_S)
    with pytest.raises(ValueError, match="already in flight"):
        decode.start_pull("r", "p", [1], [1], DEADLINE_S)
    decode.release(handle)
    with pytest.raises(RuntimeError, match="register_pool"):
        FakeBackend().start_pull("r", "p", [0], [0], DEADLINE_S)


def test_incompatible_metadata_is_refused():
    _, decode, _, _ = pair()
    other_layout = FakeBackend()
    metadata = other_layout.register_pool(KVCache(KVLayout(2, 8, 2, 8, "float32"), 4))
    with pytest.raises(ValueError, match="layouts differ"):
        decode.add_peer("q", metadata)
    with pytest.raises(ValueError, match="not msgpack"):
        decode.add_peer("q", b"\xc1")
    zmq_like = msgpack.packb({"v": 2, "backend": "zmq", "bytes_per_block": 1, "num_blocks": 1, "fields": {}})
    with pytest.raises(ValueError, match="runs 'fake'"):
        decode.add_peer("q", zmq_like)


def test_removing_a_peer_fails_its_pulls():
    _, decode, _, _ = pair(delay_s=60)
    handle = decode.start_pull("r", "p", [0], [0], DEADLINE_S)
    decode.remove_peer("p")
    assert handle.status == TransferStatus.FAILED and "removed" in handle.error
    decode.release(handle)
    decode.remove_peer("p")


def test_a_dead_peer_fails_the_pull():
    prefill, decode, _, _ = pair()
    prefill.close()
    handle = decode.start_pull("r", "p", [0], [0], DEADLINE_S)
    assert wait(decode, handle) == TransferStatus.FAILED
    assert "gone" in handle.error
    decode.release(handle)


def test_abort_then_release_and_release_is_idempotent():
    _, decode, _, target = pair(delay_s=60)
    handle = decode.start_pull("r", "p", [0], [0], DEADLINE_S)
    decode.abort(handle)
    assert decode.poll(handle) == TransferStatus.FAILED
    decode.release(handle)
    decode.release(handle)
    assert handle.released and not target.buffer.any()
    assert decode.counters().pulls_failed == 1


def test_release_in_flight_aborts_and_close_releases_everything():
    _, decode, _, _ = pair(delay_s=60)
    first = decode.start_pull("a", "p", [0], [0], DEADLINE_S)
    second = decode.start_pull("b", "p", [1], [1], DEADLINE_S)
    decode.release(first)
    assert first.status == TransferStatus.FAILED
    decode.close()
    assert second.released and second.status == TransferStatus.FAILED
