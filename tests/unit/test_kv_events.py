"""A worker's KV event publisher: the numbering of its KVEvents per epoch, and the snapshot it answers from the copy
of what it holds. (The events crossing real sockets to a proxy: tests/e2e/test_kv_index.py.)"""
from __future__ import annotations

import pytest

from common.protocol.wire import KVSnapshot, KVSnapshotRequest
from common.runtime.kv_events import KVEventPublisher


@pytest.fixture
def publisher():
    pub = KVEventPublisher.bind("127.0.0.1", 0)
    yield pub
    pub.close()


def test_the_endpoint_is_the_bound_port_on_the_advertised_host(publisher):
    host, _, port = publisher.endpoint.rpartition(":")
    assert host == "tcp://127.0.0.1" and int(port) > 0


def test_batches_are_numbered_per_epoch_and_a_snapshot_carries_the_last_number(publisher):
    publisher.publish("w", 1, [1, 2, 3], [], fresh=True)
    publisher.publish("w", 1, [], [], fresh=False)  # nothing changed: no number spent
    publisher.publish("w", 1, [4], [2], fresh=False)
    assert publisher.snapshot("w", 1, KVSnapshotRequest("w", 1)) == KVSnapshot("w", 1, 2, [1, 3, 4])
    assert publisher.snapshot("w", 1, KVSnapshotRequest("w", 0)) is None  # an epoch it has left
    assert publisher.snapshot("w", 1, KVSnapshotRequest("other", 1)) is None
    # Registered again (a new epoch), same block manager: what it holds carries over, numbers restart.
    assert publisher.snapshot("w", 2, KVSnapshotRequest("w", 2)) == KVSnapshot("w", 2, 0, [1, 3, 4])
    publisher.publish("w", 2, [5], [], fresh=False)
    assert publisher.snapshot("w", 2, KVSnapshotRequest("w", 2)) == KVSnapshot("w", 2, 1, [1, 3, 4, 5])


def test_a_new_block_manager_starts_from_nothing_held(publisher):
    publisher.publish("w", 1, [1, 2], [], fresh=True)
    publisher.publish("w", 3, [], [], fresh=True)  # a model swap: another pool, under another epoch
    assert publisher.snapshot("w", 3, KVSnapshotRequest("w", 3)) == KVSnapshot("w", 3, 1, [])


def test_a_port_taken_names_the_settings():
    first = KVEventPublisher.bind("127.0.0.1", 0)
    port = int(first.endpoint.rpartition(":")[2])
    try:
        with pytest.raises(RuntimeError, match="kv_events_port"):
            KVEventPublisher.bind("127.0.0.1", port)
    finally:
        first.close()
