"""KV pulls between pools at different tensor parallelism, through the real backends (NIXL where it loads).

Every head of every pulled block must equal the source's, compared in the logical full view of each pool (a
block's heads in global order, whatever ranks hold them).
"""
from __future__ import annotations

import time

import msgpack
import pytest
import torch

from common.engine.kv_cache import KVCache, KVLayout
from kv_transfer.base import METADATA_VERSION, TransferStatus
from kv_transfer.factory import make_backend
from tests.transfer_backends import BACKENDS, PULLER_OPTIONS
from tests.fake_transfer import FakeBackend

HEADS = 12  # split across 1, 2, 3 and 4 ranks
WAIT_S = 30.0

TP_PAIRS = [(1, 3), (3, 1), (1, 2), (2, 4), (4, 2), (2, 2), (3, 3), (1, 1)]
REMOTE_IDS = [7, 2, 3, 9, 0]
LOCAL_IDS = [0, 5, 6, 1, 11]  # contiguous, scattered and reversed pairs
STAGING_IDS = [8, 9, 10, 3, 2]


def layout(tp_size: int, heads: int = HEADS) -> KVLayout:
    return KVLayout(num_layers=2, block_size=4, num_kv_heads=heads, head_dim=8, dtype="float32", tp_size=tp_size)


def full_view(cache: KVCache, block_ids: list[int]) -> torch.Tensor:
    """Blocks as ``[n, layers, 2, block_size, heads, head_dim]``, heads in global order."""
    lay = cache.layout
    return cache.pool[:, block_ids].permute(1, 2, 3, 4, 0, 5, 6).reshape(
        len(block_ids), lay.num_layers, 2, lay.block_size, lay.num_kv_heads, lay.head_dim)


@pytest.fixture
def backends():
    """``make(name, **options)``: a backend closed at the end of the test."""
    made = []

    def make(name: str, **options):
        made.append(FakeBackend(**options) if name == "fake" else make_backend(name, **options))
        return made[-1]

    yield make
    for backend in reversed(made):
        backend.close()


def pair(make, name: str, remote_tp: int, local_tp: int):
    """A source pool of random KV at ``remote_tp`` served by one backend, an empty pool at ``local_tp``
    whose backend knows it as peer 'p'."""
    source = KVCache(layout(remote_tp), 10)
    source.pool.copy_(torch.randn(source.pool.shape, generator=torch.Generator().manual_seed(remote_tp)))
    target = KVCache(layout(local_tp), 12)
    metadata = make(name).register_pool(source)
    puller = make(name, **PULLER_OPTIONS.get(name, {}))
    puller.register_pool(target)
    puller.add_peer("p", metadata)
    return puller, source, target


def wait(backend, handle) -> TransferStatus:
    end = time.monotonic() + WAIT_S
    while not backend.poll(handle).terminal:
        assert time.monotonic() < end, "pull never reached a terminal status"
        time.sleep(0.001)
    return handle.status


@pytest.mark.parametrize("remote_tp, local_tp", TP_PAIRS)
@pytest.mark.parametrize("name", BACKENDS)
def test_every_head_of_every_pulled_block_matches_the_source(backends, name, remote_tp, local_tp):
    puller, source, target = pair(backends, name, remote_tp, local_tp)
    staged = puller.needs_staging("p")
    assert staged == (remote_tp != local_tp)
    handle = puller.start_pull("t", "p", REMOTE_IDS, LOCAL_IDS, WAIT_S, STAGING_IDS if staged else None)
    assert wait(puller, handle) == TransferStatus.DONE, handle.error
    assert torch.equal(full_view(target, LOCAL_IDS), full_view(source, REMOTE_IDS))
    untouched = [b for b in range(target.num_blocks) if b not in LOCAL_IDS + (STAGING_IDS if staged else [])]
    assert not target.pool[:, untouched].any()
    puller.release(handle)
    assert puller.counters().bytes_pulled == len(LOCAL_IDS) * layout(1).bytes_per_block


def test_equal_tp_moves_one_segment_per_rank_for_contiguous_blocks(backends):
    puller, source, target = pair(backends, "zmq", 2, 2)
    handle = puller.start_pull("t", "p", [4, 5, 6], [1, 2, 3], WAIT_S)
    assert len(handle.segments) == 2
    assert wait(puller, handle) == TransferStatus.DONE, handle.error
    assert torch.equal(target.pool[:, 1:4], source.pool[:, 4:7])
    puller.release(handle)


def test_staging_is_required_and_checked_across_tp_sizes(backends):
    puller, _, target = pair(backends, "fake", 1, 2)
    with pytest.raises(ValueError, match="tp_size 1, this worker at 2: the pull needs staging_block_ids"):
        puller.start_pull("t", "p", [0, 1], [0, 1], WAIT_S)
    with pytest.raises(ValueError, match="1 staging block ids for 2"):
        puller.start_pull("t", "p", [0, 1], [0, 1], WAIT_S, [2])
    with pytest.raises(ValueError, match=r"staging block ids \[1\] are also local ones"):
        puller.start_pull("t", "p", [0, 1], [0, 1], WAIT_S, [1, 2])
    with pytest.raises(ValueError, match="staging block id 12 is outside the pool of 12"):
        puller.start_pull("t", "p", [0, 1], [0, 1], WAIT_S, [2, 12])
    assert not puller.needs_staging("nobody")
    unknown = puller.start_pull("t", "nobody", [0], [0], WAIT_S)
    assert unknown.status == TransferStatus.FAILED and "unknown peer" in unknown.error
    puller.release(unknown)
    assert not target.pool.any()


def test_an_aborted_pull_across_tp_sizes_writes_nothing(backends):
    puller, _, target = pair(backends, "fake", 3, 1)
    handle = puller.start_pull("t", "p", [0, 1], [0, 1], WAIT_S, [2, 3])
    puller.abort(handle)  # the fake would copy and re-lay on this poll
    assert puller.poll(handle) == TransferStatus.FAILED
    puller.release(handle)
    assert not target.pool.any()


def test_metadata_carries_the_layout_and_tp_size(backends):
    metadata = msgpack.unpackb(backends("fake").register_pool(KVCache(layout(4), 3)))
    assert {k: v for k, v in metadata.items() if k != "fields"} == {
        "v": METADATA_VERSION - 1, "backend": "fake", "num_layers": 2, "block_size": 4, "num_kv_heads": HEADS,
        "head_dim": 8, "dtype": "float32", "tp_size": 4, "bytes_per_block": layout(1).bytes_per_block,
        "num_blocks": 3}  # a host pool exports nothing: version 4, which the release before reads too
    assert METADATA_VERSION == 5


def test_a_peer_of_another_model_is_refused_at_any_tp_size(backends):
    other = backends("zmq").register_pool(KVCache(layout(2, heads=6), 4))
    puller = backends("zmq")
    puller.register_pool(KVCache(layout(3), 4))
    with pytest.raises(ValueError, match="num_kv_heads 6, this pool 12: the KV layouts differ"):
        puller.add_peer("q", other)
    assert not puller.needs_staging("q")
