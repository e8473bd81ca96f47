"""The proxy's exact prefix index under KV events: sequence numbers, gaps, snapshots and epochs."""
from __future__ import annotations

from common.protocol.wire import KVEvents, KVSnapshot, KVSnapshotRequest
from proxy.core.kv_index import MAX_PENDING, KVIndex


def synced(index: KVIndex, worker_id: str = "w", epoch: int = 1, held: list[int] | None = None,
           seq: int = 0) -> KVIndex:
    assert index.track(worker_id, epoch, 0.0) == KVSnapshotRequest(worker_id, epoch)
    assert index.apply_snapshot(KVSnapshot(worker_id, epoch, seq, held or []), 0.0) == ("applied", None)
    return index


def test_events_apply_in_order_and_leading_counts_stop_at_the_first_block_missing():
    index = synced(KVIndex())
    assert index.apply(KVEvents("w", 1, 1, stored=[10, 11, 12]), 1.0) == ("applied", None)
    assert index.leading([10, 11, 12, 13]) == {"w": 3}
    assert index.apply(KVEvents("w", 1, 2, removed=[11]), 1.0) == ("applied", None)
    assert index.leading([10, 11, 12]) == {"w": 1}  # 12 is held, but a cache hits up to its first miss
    assert index.apply(KVEvents("w", 1, 2, stored=[11]), 1.0) == ("duplicate", None)
    assert index.leading([11]) == {} and index.blocks_of("w") == 2


def test_several_workers_share_blocks():
    index = synced(synced(KVIndex(), "a", held=[1, 2, 3]), "b", held=[1, 2])
    assert index.leading([1, 2, 3, 4]) == {"a": 3, "b": 2}
    index.forget("a")
    assert index.leading([1, 2, 3]) == {"b": 2} and index.blocks_of("a") == 0


def test_a_gap_asks_for_a_snapshot_keeps_what_follows_and_applies_it_after_the_snapshot():
    index = synced(KVIndex(), held=[1])
    assert index.apply(KVEvents("w", 1, 1, stored=[2]), 1.0) == ("applied", None)
    # 2 was lost: 3 reveals the gap.
    assert index.apply(KVEvents("w", 1, 3, stored=[4]), 2.0) == ("gap", KVSnapshotRequest("w", 1))
    assert index.apply(KVEvents("w", 1, 4, removed=[1]), 2.0) == ("pending", None)
    assert index.leading([1, 2]) == {"w": 2}  # until the snapshot: what it knew
    # The snapshot as of 3 (the worker published 3 before it answered): 4 remains to apply on top of it.
    assert index.apply_snapshot(KVSnapshot("w", 1, 3, [1, 2, 3, 4]), 3.0) == ("applied", None)
    assert index.leading([1]) == {} and index.leading([2, 3, 4]) == {"w": 3} and index.blocks_of("w") == 3
    assert index.apply(KVEvents("w", 1, 5, stored=[5]), 3.0) == ("applied", None)


def test_a_gap_among_the_kept_events_asks_again():
    index = synced(KVIndex())
    assert index.apply(KVEvents("w", 1, 2, stored=[2]), 1.0)[0] == "gap"
    index.apply(KVEvents("w", 1, 5, stored=[5]), 1.0)  # 3 and 4 lost too
    assert index.apply_snapshot(KVSnapshot("w", 1, 2, [2]), 2.0) == ("applied", KVSnapshotRequest("w", 1))


def test_a_new_epoch_drops_the_old_ones_blocks_at_once_and_late_events_of_it_are_stale():
    index = synced(KVIndex(), held=[1, 2, 3])
    assert index.track("w", 1, 5.0) is None  # a retried Register of the same epoch changes nothing
    assert index.track("w", 2, 5.0) == KVSnapshotRequest("w", 2)
    assert index.leading([1]) == {}
    assert index.apply(KVEvents("w", 1, 1, stored=[7]), 5.0) == ("stale", None)
    assert index.apply_snapshot(KVSnapshot("w", 1, 0, [1, 2, 3]), 5.0) == ("stale", None)
    assert index.apply(KVEvents("w", 2, 1, stored=[9]), 5.0) == ("pending", None)  # the snapshot is awaited
    assert index.apply_snapshot(KVSnapshot("w", 2, 0, [1]), 6.0) == ("applied", None)  # it kept block 1
    assert index.leading([1]) == {"w": 1} and index.leading([9]) == {"w": 1} and index.leading([2]) == {}
    assert index.apply(KVEvents("x", 1, 1, stored=[1]), 6.0) == ("stale", None)  # a worker not registered


def test_an_unanswered_snapshot_request_is_asked_again_after_the_timeout():
    index = KVIndex()
    index.track("w", 1, 0.0)
    assert index.overdue(4.0, 5.0) == []
    assert index.overdue(6.0, 5.0) == [KVSnapshotRequest("w", 1)]
    assert index.overdue(7.0, 5.0) == []  # asked again at 6
    index.apply_snapshot(KVSnapshot("w", 1, 0, []), 8.0)
    assert index.overdue(100.0, 5.0) == []


def test_the_events_kept_while_a_snapshot_is_awaited_are_bounded():
    index = KVIndex()
    index.track("w", 1, 0.0)
    for seq in range(1, MAX_PENDING + 10):
        assert index.apply(KVEvents("w", 1, seq, stored=[seq]), 0.0)[0] == "pending"
    # The early ones went: after the snapshot of 0 the first kept is a gap.
    assert index.apply_snapshot(KVSnapshot("w", 1, 0, []), 1.0) == ("applied", KVSnapshotRequest("w", 1))


def test_the_cluster_asks_a_registering_worker_for_its_snapshot_applies_it_and_forgets_a_leaving_one():
    """The cluster's side, without sockets: a Register naming an endpoint gets a KVSnapshotRequest after its
    RegisterAck; the KVSnapshot fills the index routing reads; a Goodbye empties it."""
    from common.config.roles import ProxyConfig
    from common.protocol.wire import Goodbye, KVLayoutInfo, Register, RegisterAck, encode
    from proxy.cluster.cluster import Cluster
    from proxy.core.metrics import ProxyMetrics
    from proxy.core.routing import PrefixAwareRouting

    policy = PrefixAwareRouting()
    cluster = Cluster(ProxyConfig(), policy, ProxyMetrics())
    sent = []
    cluster.attach(lambda worker_id, msg, version: sent.append((worker_id, msg)))
    register = Register("d0", "decode", 7, "m", "v1", KVLayoutInfo(2, 16, 3, 64, "float32"), 8, 512, "zmq", b"",
                        kv_events_endpoint="tcp://127.0.0.1:9")
    cluster.on_frames(b"d0", encode(register))
    kinds = [type(msg) for _, msg in sent]
    assert kinds.index(RegisterAck) < kinds.index(KVSnapshotRequest)
    assert ("d0", KVSnapshotRequest("d0", 7)) in sent
    cluster.on_frames(b"d0", encode(KVSnapshot("d0", 7, 0, [11, 12])))
    assert policy.index.leading([11, 12]) == {"d0": 2}
    cluster.on_frames(b"d0", encode(Goodbye("d0", 7)))
    assert policy.index.leading([11]) == {}
