"""CUDA IPC between two workers' GPU pools on one host: the pages copied device to device, whatever the backend.

UCX gives NIXL no ``cuda_ipc`` lane for a one-sided READ where the host has no RDMA NIC (its protocol layer asks for
capabilities that transport does not offer, so GPU pages go through host memory over TCP: 0.4 GB/s measured on an
H200, docs/gpu.md), and ZeroMQ moves GPU pages through host memory by design. Two workers on one host need neither:
the lender exports its pool's allocation as a CUDA IPC handle in its published metadata (``IpcExport``), the
puller opens it once per peer (``open_peer``) and copies a pull's segments from the mapped pool into its own on a
stream of its own, then polls an event (``IpcCopy``). The base backend (kv_transfer/base.py) takes this path for
every peer that exports one on the same host (same boot id) and GPU this side can map, and its own backend's path
for the rest; ``transfer.cuda_ipc: false`` turns it off.

Ordering. The lender announces pages only once its device has written them (a prompt step ends in a synchronising
sample; a layer group waits for its layers' kernels), so the pages are in device memory when the copy starts. The
copy waits for work already queued on this side's compute stream (a reserved block may have just been freed by a
step still reading it), and the pull reads DONE only once the copy's event has passed, before any step reads it.

Lifetime. The lender's pool lives as long as its process; the puller drops its mapping when the peer is removed.
A copy can not be cancelled once queued: an abort waits for it (milliseconds) so that no byte lands afterwards.
"""
from __future__ import annotations

import logging
import os
from typing import Annotated

import msgspec
import torch

from kv_transfer.segments import Segment

log = logging.getLogger(__name__)

NonNegative = Annotated[int, msgspec.Meta(ge=0)]


class IpcExport(msgspec.Struct, forbid_unknown_fields=True):
    """A GPU pool as another process on the host opens it: its allocation's IPC handle and where the pool lies."""

    boot_id: str  # the host's boot: a handle means nothing on another host
    pid: NonNegative  # the lender's process: a process cannot open its own handle
    gpu_uuid: str  # the GPU holding the pool, named the same in every process whatever their device numbering
    handle: bytes  # the allocation's cudaIpcMemHandle (torch's storage share)
    storage_bytes: NonNegative  # the shared storage's size
    storage_offset: NonNegative  # the storage's offset in its allocation
    ref_counter_handle: bytes  # torch's counter of the lender's storage, held while a peer maps it
    ref_counter_offset: NonNegative
    event_handle: bytes  # the lender's stream at export, waited for at open
    event_sync_required: bool
    pool_offset: NonNegative  # the pool's first byte in the storage
    pool_bytes: NonNegative


def boot_id() -> str:
    """This host's boot: equal in two processes only when they run on the same host (and boot)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return ""


def _gpu_uuid(index: int) -> str:
    return str(torch.cuda.get_device_properties(index).uuid)


def export_pool(pool: torch.Tensor) -> IpcExport | None:
    """The IPC export of a contiguous GPU pool, or None (a CPU pool, no host identity, or CUDA refuses to share
    its allocation: logged, and pulls from this worker take its backend's own path)."""
    if pool.device.type != "cuda" or not pool.is_contiguous():
        return None
    host = boot_id()
    if not host:
        log.info("KV pages get no CUDA IPC export: this host has no /proc/sys/kernel/random/boot_id")
        return None
    try:
        (_, handle, storage_bytes, storage_offset, ref_handle, ref_offset, event_handle,
         event_sync) = pool.untyped_storage()._share_cuda_()
    except (RuntimeError, AttributeError) as exc:
        log.warning("KV pages get no CUDA IPC export: %s", exc)
        return None
    return IpcExport(host, os.getpid(), _gpu_uuid(pool.device.index or 0), bytes(handle), storage_bytes,
                     storage_offset, bytes(ref_handle), ref_offset, bytes(event_handle or b""), bool(event_sync),
                     pool.storage_offset() * pool.element_size(), pool.numel() * pool.element_size())


def why_not(export: IpcExport, local: torch.Tensor) -> str | None:
    """Why this side cannot map ``export`` into ``local``'s process (None: it may try)."""
    if local.device.type != "cuda":
        return "this worker's pool is in host memory"
    if export.boot_id != boot_id():
        return "the peer runs on another host"
    if export.pid == os.getpid():
        return "the peer is this process"
    if _device_of(export.gpu_uuid) is None:
        return f"GPU {export.gpu_uuid} is not visible to this process"
    return None


def _device_of(uuid: str) -> int | None:
    return next((i for i in range(torch.cuda.device_count()) if _gpu_uuid(i) == uuid), None)


class IpcPeer:
    """A peer's pool mapped into this process (uint8, its bytes) and the stream this side copies from it on."""

    def __init__(self, export: IpcExport, local: torch.Tensor) -> None:
        device = _device_of(export.gpu_uuid)
        self.storage = torch.UntypedStorage._new_shared_cuda(
            device, export.handle, export.storage_bytes, export.storage_offset, export.ref_counter_handle,
            export.ref_counter_offset, export.event_handle or None, export.event_sync_required)
        self.remote = torch.empty(0, dtype=torch.uint8, device=f"cuda:{device}").set_(
            self.storage, export.pool_offset, (export.pool_bytes,), (1,))
        self.local = local.view(-1).view(torch.uint8)
        self.stream = torch.cuda.Stream(device=local.device)

    def copy(self, segments: list[Segment]) -> IpcCopy:
        """Queue the segments' copies (after the compute stream's queued work); their event, to poll."""
        compute = torch.cuda.current_stream(self.local.device)
        self.stream.wait_stream(compute)
        with torch.cuda.stream(self.stream):
            for s in segments:
                self.local[s.local_offset:s.local_offset + s.nbytes].copy_(
                    self.remote[s.remote_offset:s.remote_offset + s.nbytes], non_blocking=True)
            event = torch.cuda.Event()
            event.record(self.stream)
        return IpcCopy(event)


class IpcCopy:
    """One pull's queued copies."""

    def __init__(self, event: torch.cuda.Event) -> None:
        self.event = event

    def done(self) -> bool:
        return self.event.query()

    def wait(self) -> None:
        self.event.synchronize()


def open_peer(peer_id: str, export: IpcExport, local: torch.Tensor) -> IpcPeer | None:
    """The peer's pool mapped here, or None with the reason logged (its pulls then take the backend's path)."""
    reason = why_not(export, local)
    if reason is None:
        try:
            peer = IpcPeer(export, local)
        except Exception as exc:  # a handle CUDA refuses, or an export that does not describe one
            reason = f"CUDA could not open its IPC handle: {type(exc).__name__}: {exc}"
        else:
            log.info("KV pulls from %s: CUDA IPC, GPU to GPU on this host", peer_id)
            return peer
    log.info("KV pulls from %s do not take CUDA IPC: %s", peer_id, reason)
    return None
