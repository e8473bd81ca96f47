"""NIXL backend: the decode side READs pages one-sidedly from the peer's registered pool.

Each side registers its whole KV pool once, every rank's slice (DRAM, or VRAM
for a GPU pool), and publishes NIXL's agent metadata together with the pool's
base address and memory type; a pull's segments are byte offsets from that
base on each side. A pull is ONE READ request built from the merged segments
(batches of many small descriptors had erratic latency), polled with
``check_xfer_state`` from the caller's loop.

The progress thread. The side whose memory is read must run NIXL's progress
thread: without it the first remote READ fails with
NIXL_ERR_REMOTE_DISCONNECT. The stock ``nixl_agent`` hard-codes its delay to
0, and the thread then spins on the UCX worker. With a delay the thread sleeps
in poll() on the worker's event fd and wakes on traffic, or after the delay at
the latest (NIXL rounds it up to whole milliseconds). Measured on a 2-core
Intel Xeon with AMX (NIXL 1.5.1, UCX, an idle agent with a registered pool;
user + system CPU time over 5 s, ``python -m bench.kv_transfer --idle-cpu``,
2026-12-06):
  progress_delay_us=0      0.99 of a core
  progress_delay_us=1000   0.024 of a core: 1,000 wakes a second (the default)
  progress_delay_us=20000  0.003 of a core
  progress_thread=False    0.001 of a core
Pulls do not wait for the delay: 1 and 16 MiB READs took the same time with
the reader's peer at 1, 10 and 100 ms, over shared memory (0.5 and 2.3 ms)
and over TCP (UCX_TLS=tcp: 1.0-1.5 and 5.8-7.6 ms). The default stays at 1
ms all the same: served P/D on these 2-core virtual machines took 17% longer
a token on one stream with both workers' threads at 20 ms (135M, three
interleaved rounds each, 18.9 against 16.2 ms; saturation and 2 req/s
level). A vCPU left idle longer wakes slower (a cross-core pipe round trip:
60 us busy, 145 us after 2 ms idle, 212 us after 10 ms, 156 us with a thread
waking every 1 ms beside it): the likeliest reason, not proven. NIXL's own
delay of 0 spins a core that a co-located worker's steps need.

Options:
  agent_name         NIXL agent name, unique per process (default: derived from the pid).
  progress_thread    run NIXL's progress thread (default True). A pure puller may turn it
                     off; poll() then drives its transfers. A side whose pool is read must not.
  progress_delay_us  0 = NIXL's busy-polling thread; > 0 = event-driven, waking at least this
                     often (default 1000).

Failure: NIXL reporting ERR, or raising, fails the pull. Abort, deadline and
peer removal release the NIXL request, which cancels it and drains UCX's
in-flight operations (bounded by NIXL_UCX_REQUEST_DRAIN_TIMEOUT, 10 s by
default) before memory may be reused. A dead peer surfaces as an error from
UCX or, at the latest, as the deadline.
"""
from __future__ import annotations

import os
import uuid
from dataclasses import dataclass
from typing import Annotated, Any, Literal

import msgspec

from nixl._api import nixl_agent, nixl_agent_config, nixlBind

from kv_transfer.base import KVTransferBackend, TransferHandle, TransferStatus


class NixlMetadata(msgspec.Struct, forbid_unknown_fields=True):
    """A NIXL pool as published: the agent's metadata and where the pool starts."""

    agent: bytes
    base: Annotated[int, msgspec.Meta(ge=0)]
    mem: Literal["DRAM", "VRAM"] = "DRAM"
    device_id: Annotated[int, msgspec.Meta(ge=0)] = 0

@dataclass(eq=False)
class NixlPull(TransferHandle):
    xfer: Any = None  # nixl_xfer_handle once posted


@dataclass(frozen=True)
class NixlPeer:
    agent_name: str
    base: int  # address of the peer's pool
    mem: str = "DRAM"  # DRAM (host) or VRAM (GPU) pool
    device_id: int = 0


def make_agent(name: str, progress_thread: bool, progress_delay_us: int) -> nixl_agent:
    """A NIXL agent with UCX whose progress thread, if any, waits ``progress_delay_us`` between polls."""
    agent = nixl_agent(name, nixl_agent_config(enable_prog_thread=progress_thread, backends=[]))
    if progress_thread and progress_delay_us:
        # nixl_agent offers no way to set the delay, so rebuild its native agent (which has no
        # backend yet, hence no thread) from a config that carries one. Every wrapper method
        # goes through this attribute.
        config = nixlBind.nixlAgentConfig()
        config.useProgThread = True
        config.useListenThread = False
        config.syncMode = nixlBind.NIXL_THREAD_SYNC_NONE
        config.pthrDelay = progress_delay_us
        agent.agent = nixlBind.nixlAgent(name, config)
    agent.create_backend("UCX")
    return agent


class NixlBackend(KVTransferBackend):
    name = "nixl"
    Metadata = NixlMetadata
    handle_type = NixlPull
    # A GPU pool registers as VRAM: UCX reads it with GPUDirect RDMA where the
    # NIC supports it, else through host staging; both sides publish their type.
    device_types = ("cpu", "cuda")

    def __init__(
        self,
        agent_name: str | None = None,
        progress_thread: bool = True,
        progress_delay_us: int = 1000,
    ) -> None:
        if progress_delay_us < 0:
            raise ValueError(f"nixl backend option 'progress_delay_us' = {progress_delay_us!r}: must be >= 0")
        super().__init__()
        self.agent_name = agent_name or f"tessera-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self._agent = make_agent(self.agent_name, progress_thread, progress_delay_us)
        self._registered = None
        self._base = 0
        self._mem, self._device_id = "DRAM", 0

    def _publish(self, kv_cache) -> NixlMetadata:
        self._base, nbytes = kv_cache.pool.data_ptr(), kv_cache.nbytes
        device = kv_cache.pool.device
        self._mem, self._device_id = ("VRAM", device.index or 0) if device.type == "cuda" else ("DRAM", 0)
        self._registered = self._agent.register_memory([(self._base, nbytes, self._device_id, "")], self._mem)
        return NixlMetadata(self._agent.get_agent_metadata(), self._base, self._mem, self._device_id)

    def _connect(self, peer_id: str, fields: NixlMetadata) -> NixlPeer:
        try:
            name = self._agent.add_remote_agent(fields.agent)
        except Exception as exc:
            raise ValueError(f"peer {peer_id!r}: NIXL refused its agent metadata: {exc}") from exc
        return NixlPeer(name.decode() if isinstance(name, bytes) else name, fields.base, fields.mem, fields.device_id)

    def _disconnect(self, peer_id: str, peer: NixlPeer) -> None:
        self._agent.remove_remote_agent(peer.agent_name)

    def _submit(self, handle: NixlPull, peer: NixlPeer) -> None:
        local = [(self._base + s.local_offset, s.nbytes, self._device_id) for s in handle.segments]
        remote = [(peer.base + s.remote_offset, s.nbytes, peer.device_id) for s in handle.segments]
        handle.xfer = self._agent.initialize_xfer(
            "READ",
            self._agent.get_xfer_descs(local, self._mem),
            self._agent.get_xfer_descs(remote, peer.mem),
            peer.agent_name,
        )
        self._apply(handle, self._agent.transfer(handle.xfer))

    def _progress(self, handle: NixlPull) -> None:
        self._apply(handle, self._agent.check_xfer_state(handle.xfer))

    def _apply(self, handle: NixlPull, state: str) -> None:
        if state == "DONE":
            self._advance(handle, TransferStatus.DONE)
        elif state == "PROC":
            self._advance(handle, TransferStatus.TRANSFERRING)
        else:
            raise RuntimeError(f"NIXL reports the READ as {state}")

    def _cancel(self, handle: NixlPull) -> None:
        self._free(handle)

    def _free(self, handle: NixlPull) -> None:
        if handle.xfer is not None:
            handle.xfer.release()  # cancels and drains the request if it is still in flight

    def _shutdown(self) -> None:
        if self._registered is not None:
            self._agent.deregister_memory(self._registered)
            self._registered = None
        # Dropping the last reference destroys the native agent, which joins the progress thread.
        self._agent = None
