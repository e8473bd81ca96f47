"""Which pulls take CUDA IPC (kv_transfer/cuda_ipc.py): the choice and the published export, on any machine.

The copies themselves need two processes on a GPU: tests/e2e/test_kv_transfer_processes.py, which skip without one.
"""
from __future__ import annotations

import os
import time

import msgspec
import pytest
import torch

from common.engine.kv_cache import KVCache, KVLayout
from kv_transfer.base import PoolMetadata, TransferStatus
from kv_transfer.cuda_ipc import IpcExport, boot_id, export_pool, why_not
from tests.fake_transfer import FakeBackend

LAYOUT = KVLayout(num_layers=2, block_size=4, num_kv_heads=2, head_dim=8, dtype="float32")


def an_export(**changes) -> IpcExport:
    fields = dict(boot_id=boot_id(), pid=os.getpid() + 1, gpu_uuid="GPU-0", handle=b"h" * 64, storage_bytes=4096,
                  storage_offset=0, ref_counter_handle=b"r", ref_counter_offset=0, event_handle=b"",
                  event_sync_required=False, pool_offset=0, pool_bytes=4096)
    fields.update(changes)
    return IpcExport(**fields)


def test_a_host_memory_pool_exports_nothing():
    assert export_pool(torch.zeros(16)) is None
    backend = FakeBackend()
    backend.cuda_ipc = True
    metadata = msgspec.msgpack.decode(backend.register_pool(KVCache(LAYOUT, 4)), type=PoolMetadata)
    assert metadata.ipc is None


def test_the_reason_a_peer_is_not_mapped_is_named():
    host_pool = torch.zeros(16)
    assert why_not(an_export(), host_pool) == "this worker's pool is in host memory"
    assert boot_id(), "a Linux host has a boot id"


def test_a_peer_exporting_its_pool_is_pulled_from_by_the_backend_where_it_cannot_be_mapped():
    """A peer whose metadata carries an export (here one this host's CPU pool cannot map) is still a peer: its pulls
    take the backend's own path, with the same results."""
    lender, puller = FakeBackend(), FakeBackend()
    puller.cuda_ipc = True
    source = KVCache(LAYOUT, 8)
    source.buffer.copy_(torch.randn(source.buffer.shape, generator=torch.Generator().manual_seed(5)))
    envelope = msgspec.msgpack.decode(lender.register_pool(source), type=PoolMetadata)
    target = KVCache(LAYOUT, 8)
    puller.register_pool(target)
    puller.add_peer("p", msgspec.msgpack.encode(msgspec.structs.replace(envelope, ipc=an_export())))
    handle = puller.start_pull("r", "p", [3, 1], [0, 6], 5.0)
    end = time.monotonic() + 5.0
    while not puller.poll(handle).terminal and time.monotonic() < end:
        time.sleep(0.001)
    assert handle.status == TransferStatus.DONE and handle.ipc is None
    assert torch.equal(target.buffer[[0, 6]], source.buffer[[3, 1]])
    puller.release(handle)


def test_an_export_that_does_not_fit_is_refused_naming_the_field():
    lender = FakeBackend()
    envelope = msgspec.msgpack.decode(lender.register_pool(KVCache(LAYOUT, 4)), type=PoolMetadata)
    bad = msgspec.msgpack.encode(msgspec.structs.replace(envelope, ipc=an_export()))
    bad = bad.replace(b"pool_bytes", b"pool_bytez")
    puller = FakeBackend()
    puller.register_pool(KVCache(LAYOUT, 4))
    with pytest.raises(ValueError, match=r"unknown field `pool_bytez` - at `\$.ipc`"):
        puller.add_peer("p", bad)
