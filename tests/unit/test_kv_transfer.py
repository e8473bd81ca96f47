"""The KV transfer contract, run against the in-process fake backend (and the ZeroMQ backend on each device)."""
from __future__ import annotations

import sys
import time

import msgpack
import pytest
import torch

from common.engine.kv_cache import KVCache, KVLayout
from kv_transfer.base import METADATA_VERSION, TransferStatus, check_block_ids
from kv_transfer.factory import default_backend_name, make_backend
from kv_transfer.segments import PoolGeometry, Segment, merge_segments, pull_segments
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
def blocks(remote: list[int], local: list[int], tp_size: int = 1) -> list[Segment]:
    """Segments of a pull between two pools of 10-byte blocks (remote: 4 blocks a rank, local: 3)."""
    return pull_segments(PoolGeometry(tp_size, 4, 10), PoolGeometry(tp_size, 3, 10), remote, local)


def test_segments_merge_only_where_both_sides_are_contiguous():
    assert blocks([0, 1, 2], [0, 1, 2]) == [Segment(0, 0, 30)]
    assert blocks([0, 1, 2], [0, 2, 1]) == [Segment(0, 0, 10), Segment(10, 20, 10), Segment(20, 10, 10)]
    assert blocks([3, 0, 1], [1, 2, 0]) == [Segment(0, 20, 10), Segment(10, 0, 10), Segment(30, 10, 10)]
    assert merge_segments([Segment(0, 0, 4), Segment(4, 8, 4), Segment(8, 12, 4)]) == [
        Segment(0, 0, 4), Segment(4, 8, 8)]


def test_segments_are_found_whatever_the_order_of_the_pairs():
    assert blocks([3, 1, 2], [2, 0, 1]) == [Segment(10, 0, 30)]


def test_each_rank_slice_goes_to_the_same_rank_and_merges_across_ranks():
    # Rank 0's slice of remote block 3 ends where rank 1's slice of block 0 starts, and so do their targets.
    assert blocks([3, 0], [2, 0], tp_size=2) == [Segment(0, 0, 5), Segment(15, 10, 10), Segment(35, 25, 5)]


def test_across_tp_sizes_the_remote_stream_fills_the_staging_stream():
    # One rank's whole blocks 1 and 2 split into two ranks' halves of staging blocks 0 and 2.
    segments = pull_segments(PoolGeometry(1, 4, 10), PoolGeometry(2, 3, 10), [1, 2], [0, 2])
    assert segments == [Segment(10, 0, 5), Segment(15, 10, 10), Segment(25, 25, 5)]


@pytest.mark.parametrize(
    "remote, local, staging, message",
    [
        ([1, 2], [1], None, "remote block ids for"),
        ([], [], None, "at least one block"),
        ([1, 1], [2, 3], None, "remote block ids repeat"),
        ([1, 2], [3, 3], None, "local block ids repeat"),
        ([-1], [0], None, "non-negative"),
        ([True], [0], None, "non-negative ints"),
        ([0], [8], None, "local block id 8 is outside the pool of 8"),
        ([0, 1], [0, 1], [2], "1 staging block ids for 2"),
        ([0, 1], [0, 1], [1, 2], r"staging block ids \[1\] are also local ones"),
        ([0, 1], [0, 1], [2, 2], "staging block ids repeat"),
        ([0, 1], [0, 1], [2, 8], "staging block id 8 is outside the pool of 8"),
    ],
)
def test_bad_block_id_lists_are_refused(remote, local, staging, message):
    with pytest.raises(ValueError, match=message):
        check_block_ids(remote, local, staging, 8)


# ---- published metadata ----------------------------------------------------------------------
def envelope(**changes) -> bytes:
    fields = {"v": METADATA_VERSION, "backend": "fake", "num_layers": 2, "block_size": 4, "num_kv_heads": 2,
              "head_dim": 8, "dtype": "float32", "tp_size": 1, "bytes_per_block": LAYOUT.bytes_per_block,
              "num_blocks": 4, "fields": {"pool": "p"}}
    fields.update(changes)
    return msgpack.packb({k: v for k, v in fields.items() if v is not None})


@pytest.mark.parametrize("changes, message", [
    ({"bytes_per_block": 0}, r"\$.bytes_per_block"),
    ({"tp_size": 0}, r"\$.tp_size"),
    ({"fields": None}, "missing required field `fields`"),
    ({"num_layers": None}, "missing required field `num_layers`"),
    ({"v": 2, "tp_size": None}, r"version 2, not one of \(4, 5\)"),
])
def test_malformed_metadata_is_refused_naming_the_field(changes, message):
    _, decode, _, _ = pair()
    with pytest.raises(ValueError, match=message):
        decode.add_peer("q", envelope(**changes))


def test_backend_fields_are_checked_by_the_backend():
    _, decode, _, _ = pair()
    with pytest.raises(ValueError, match=r"fake metadata: Expected `str`, got `int` - at `\$.pool`"):
        decode.add_peer("q", envelope(fields={"pool": 7}))


# ---- factory -------------------------------------------------------------------------------
def test_factory_names_the_known_backends():
    with pytest.raises(ValueError, match="one of"):
        make_backend("rdma")


def test_default_backend_falls_back_to_zmq_without_nixl(monkeypatch):
    monkeypatch.setitem(sys.modules, "nixl._api", None)
    assert default_backend_name() == "zmq"


# ---- the ZeroMQ backend, from a pool on each device --------------------------------------------------------------
CUDA = pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(),
                                                     reason="needs a CUDA GPU; none is present on this machine"))


@pytest.mark.parametrize("device", ["cpu", CUDA])
def test_zmq_moves_exact_bytes_between_pools_on_the_device(device):
    """Over TCP from a pool on ``device`` into another there: a GPU pool goes through host copies."""
    lender, puller = make_backend("zmq"), make_backend("zmq")
    source, target = KVCache(LAYOUT, 16, device=device), KVCache(LAYOUT, 8, device=device)
    source.buffer.copy_(torch.randn(source.buffer.shape, generator=torch.Generator().manual_seed(3)))
    try:
        puller.register_pool(target)
        puller.add_peer("p", lender.register_pool(source))
        remote, local = [9, 3, 4, 12], [0, 5, 6, 2]
        handle = puller.start_pull("r", "p", remote, local, DEADLINE_S)
        assert wait(puller, handle) == TransferStatus.DONE, handle.error
        assert torch.equal(target.buffer[local].cpu(), source.buffer[remote].cpu())
        assert not target.buffer[[b for b in range(8) if b not in local]].any()
        puller.release(handle)
    finally:
        puller.close()
        lender.close()


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
    with pytest.raises(ValueError, match="block_size 8, this pool 4: the KV layouts differ"):
        decode.add_peer("q", metadata)
    with pytest.raises(ValueError, match="dtype 'bfloat16', this pool 'float32'"):
        decode.add_peer("q", envelope(dtype="bfloat16"))
    with pytest.raises(ValueError, match="bytes_per_block 7"):
        decode.add_peer("q", envelope(bytes_per_block=7))
    with pytest.raises(ValueError, match="2 KV heads do not split across tp_size 3"):
        decode.add_peer("q", envelope(tp_size=3))
    with pytest.raises(ValueError, match="not msgpack"):
        decode.add_peer("q", b"\xc1")
    with pytest.raises(ValueError, match="runs 'fake'"):
        decode.add_peer("q", envelope(backend="zmq", fields={}))


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
