"""KV pages between real processes: a prefill process serves its pool, a decode process pulls.

Every pull here crosses a process boundary through the backend's real
transport (UCX for NIXL, TCP for ZeroMQ). The NIXL tests skip, saying why,
where ``import nixl`` fails. A NIXL read made to fail for real (a remote
address outside the pool the peer registered: NIXL refuses the read) is read
again over ZeroMQ (``kv_transfer/retry.py``, what workers run where NIXL loads).
"""
from __future__ import annotations

import multiprocessing
import resource
import time

import msgpack
import msgspec
import pytest
import torch
import zmq

from common.engine.kv_cache import KVCache, KVLayout
from kv_transfer.base import PoolMetadata, TransferStatus
from kv_transfer.factory import make_backend
from kv_transfer.retry import RetryingBackend, RetryMetadata
from kv_transfer.zmq_backend import WIRE_VERSION
from tests.transfer_backends import BACKENDS, NIXL_MISSING, PULLER_OPTIONS
from tests.conditions import settle

LAYOUT = KVLayout(num_layers=2, block_size=16, num_kv_heads=2, head_dim=64, dtype="bfloat16")
NUM_BLOCKS = 32
SEED = 1234
REMOTE_IDS = [3, 4, 5, 9, 20, 21, 31]
LOCAL_IDS = [0, 1, 2, 30, 7, 6, 12]  # contiguous, scattered and reversed runs
WAIT_S = 60.0  # generous: the machine is shared; a hang is what these tests catch
DEADLINE_S = 2.0
EPOCH = 7



def source_pool() -> KVCache:
    cache = KVCache(LAYOUT, NUM_BLOCKS)
    noise = torch.randn(cache.buffer.shape, generator=torch.Generator().manual_seed(SEED))
    cache.buffer.copy_(noise.to(cache.buffer.dtype))
    return cache


def serve(backend_name: str, conn) -> None:
    """The prefill process: publish a pool of random KV, serve pulls until told to stop."""
    backend = make_backend(backend_name)
    pool = source_pool()
    conn.send(backend.register_pool(pool))
    conn.poll(WAIT_S)
    backend.close()


def _pull_once(backend, metadata: bytes):
    """Pull REMOTE_IDS from the peer "prefill" into LOCAL_IDS of a fresh pool: the pool, the released handle and
    the bytes that landed."""
    pool = KVCache(LAYOUT, NUM_BLOCKS)
    backend.register_pool(pool)
    backend.add_peer("prefill", metadata)
    handle = backend.start_pull("req-1", "prefill", REMOTE_IDS, LOCAL_IDS, WAIT_S)
    while not backend.poll(handle).terminal:
        time.sleep(0.0005)
    backend.release(handle)
    return pool, handle, pool.buffer[LOCAL_IDS].view(torch.uint8).numpy().tobytes()


def pull(backend_name: str, metadata: bytes, conn) -> None:
    """The decode process: pull REMOTE_IDS into LOCAL_IDS, send back status and those blocks' bytes."""
    backend = make_backend(backend_name, **PULLER_OPTIONS[backend_name])
    pool, handle, landed = _pull_once(backend, metadata)
    untouched = [b for b in range(NUM_BLOCKS) if b not in LOCAL_IDS]
    conn.send((int(handle.status), handle.error, landed, bool(pool.buffer[untouched].any())))
    backend.close()


def serve_retrying(conn) -> None:
    """A prefill process as workers run where NIXL loads: NIXL, and ZeroMQ for retries."""
    backend = RetryingBackend(make_backend("nixl"), make_backend("zmq"))
    backend.register_pool(source_pool())
    conn.send(backend.set_epoch(EPOCH))
    conn.poll(WAIT_S)
    backend.close()


def with_bad_nixl_address(metadata: bytes) -> bytes:
    """The peer's metadata with its NIXL pool's base address moved past the memory it registered."""
    from kv_transfer.nixl_backend import NixlMetadata

    envelope = msgspec.msgpack.decode(metadata, type=PoolMetadata)
    fields = msgspec.msgpack.decode(envelope.fields, type=RetryMetadata)
    primary = msgspec.msgpack.decode(fields.primary, type=PoolMetadata)
    nixl = msgspec.msgpack.decode(primary.fields, type=NixlMetadata)
    nixl = msgspec.structs.replace(nixl, base=nixl.base + (1 << 40))
    primary = msgspec.structs.replace(primary, fields=msgspec.Raw(msgspec.msgpack.encode(nixl)))
    fields = msgspec.structs.replace(fields, primary=msgspec.msgpack.encode(primary))
    return msgspec.msgpack.encode(msgspec.structs.replace(envelope, fields=msgspec.Raw(msgspec.msgpack.encode(fields))))


def pull_retrying(metadata: bytes, conn) -> None:
    """The decode process: pull REMOTE_IDS into LOCAL_IDS; send back status, error, whether it was read again, the
    outcome counts and the landed bytes."""
    backend = RetryingBackend(make_backend("nixl", progress_thread=False), make_backend("zmq"))
    _, handle, landed = _pull_once(backend, metadata)
    conn.send((int(handle.status), handle.error, handle.retried, backend.counters().outcomes, landed))
    backend.close()


def start(target, *args):
    ctx = multiprocessing.get_context("spawn")
    parent, child = ctx.Pipe()
    process = ctx.Process(target=target, args=(*args, child), daemon=True)
    process.start()
    return process, parent


def receive(conn, process):
    assert conn.poll(WAIT_S), f"{process.name} sent nothing within {WAIT_S}s"
    return conn.recv()


@pytest.mark.parametrize("backend_name", BACKENDS)
def test_decode_process_pulls_exact_bytes_from_prefill_process(backend_name):
    prefill, to_prefill = start(serve, backend_name)
    try:
        metadata = receive(to_prefill, prefill)
        decode, from_decode = start(pull, backend_name, metadata)
        status, error, landed, touched_others = receive(from_decode, decode)
        decode.join(WAIT_S)
    finally:
        to_prefill.send("stop")
        prefill.join(WAIT_S)
    assert TransferStatus(status) == TransferStatus.DONE, error
    expected = source_pool().buffer[REMOTE_IDS].view(torch.uint8).numpy().tobytes()
    assert landed == expected
    assert not touched_others
    assert decode.exitcode == 0 and prefill.exitcode == 0


def pull_until_terminal(backend, peer_id: str) -> None:
    """Pull from ``peer_id`` with DEADLINE_S, until it failed (a poll past its deadline fails it), and release."""
    handle = backend.start_pull("req-1", peer_id, REMOTE_IDS, LOCAL_IDS, DEADLINE_S)
    settle(lambda: backend.poll(handle), lambda status: status.terminal, WAIT_S,
           f"the pull from {peer_id} ends (its deadline: {DEADLINE_S}s)")
    backend.release(handle)
    assert handle.status == TransferStatus.FAILED


@pytest.mark.parametrize("backend_name", BACKENDS)
def test_pull_from_a_peer_that_died_fails_within_its_deadline(backend_name):
    prefill, to_prefill = start(serve, backend_name)
    backend = make_backend(backend_name, **PULLER_OPTIONS[backend_name])
    backend.register_pool(KVCache(LAYOUT, NUM_BLOCKS))
    try:
        backend.add_peer("prefill", receive(to_prefill, prefill))
        prefill.kill()
        prefill.join(WAIT_S)
        unknown = backend.start_pull("req-0", "nobody", [0], [0], DEADLINE_S)
        assert unknown.status == TransferStatus.FAILED and "unknown peer" in unknown.error
        backend.release(unknown)
        pull_until_terminal(backend, "prefill")
        assert backend.counters().pulls_failed == 2
    finally:
        backend.close()


@pytest.mark.parametrize("backend_name", BACKENDS)
def test_a_peer_dead_before_it_is_added_is_refused_or_fails_its_pulls(backend_name):
    prefill, to_prefill = start(serve, backend_name)
    metadata = receive(to_prefill, prefill)
    prefill.kill()
    prefill.join(WAIT_S)
    backend = make_backend(backend_name, **PULLER_OPTIONS[backend_name])
    backend.register_pool(KVCache(LAYOUT, NUM_BLOCKS))
    try:
        try:
            backend.add_peer("prefill", metadata)
        except ValueError:  # NIXL connects at once and says so; ZeroMQ connects lazily
            return
        pull_until_terminal(backend, "prefill")
    finally:
        backend.close()


@pytest.mark.skipif(bool(NIXL_MISSING), reason=NIXL_MISSING or "-")
@pytest.mark.parametrize("nixl_read", ["works", "fails"])
def test_a_failed_nixl_read_is_read_again_over_zmq(nixl_read):
    prefill, to_prefill = start(serve_retrying)
    try:
        metadata = receive(to_prefill, prefill)
        if nixl_read == "fails":
            metadata = with_bad_nixl_address(metadata)
        decode, from_decode = start(pull_retrying, metadata)
        status, error, retried, outcomes, landed = receive(from_decode, decode)
        decode.join(WAIT_S)
    finally:
        to_prefill.send("stop")
        prefill.join(WAIT_S)
    assert TransferStatus(status) == TransferStatus.DONE, error
    assert landed == source_pool().buffer[REMOTE_IDS].view(torch.uint8).numpy().tobytes()
    assert retried == (nixl_read == "fails")
    assert outcomes == {**dict.fromkeys(outcomes, 0), "retried_ok" if retried else "ok": 1}
    assert decode.exitcode == 0 and prefill.exitcode == 0


@pytest.mark.skipif(bool(NIXL_MISSING), reason=NIXL_MISSING or "-")
def test_idle_nixl_progress_thread_does_not_spin():
    # Guards the progress-delay setting: NIXL's stock thread burns a whole core while idle.
    backend = make_backend("nixl")
    backend.register_pool(KVCache(LAYOUT, NUM_BLOCKS))
    try:
        before, started = resource.getrusage(resource.RUSAGE_SELF), time.monotonic()
        time.sleep(1.0)
        after, elapsed = resource.getrusage(resource.RUSAGE_SELF), time.monotonic() - started
    finally:
        backend.close()
    busy = (after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime) / elapsed
    assert busy < 0.3, f"an idle NIXL agent used {busy:.2f} of a core"


def test_zmq_server_drops_malformed_requests_and_keeps_serving():
    server = make_backend("zmq")
    pool = source_pool()
    metadata = server.register_pool(pool)
    address = msgpack.unpackb(metadata)["fields"]["address"]
    context = zmq.Context()
    raw = context.socket(zmq.DEALER)
    raw.connect(address)
    puller = make_backend("zmq")
    local = KVCache(LAYOUT, NUM_BLOCKS)
    puller.register_pool(local)
    try:
        raw.send_multipart([b"\x01", b"not msgpack"])
        raw.send_multipart([b"\x01", msgpack.packb({"v": WIRE_VERSION, "id": "x", "segments": [[0, "1"]]})])
        raw.send_multipart([b"\x01", msgpack.packb({"v": 2, "id": "w", "runs": [[0, 1]]})])
        raw.send(b"one frame")
        raw.send_multipart([b"\x01", msgpack.packb({"v": WIRE_VERSION, "id": "y",
                                                    "segments": [[pool.nbytes - 1, 2]]})])
        assert raw.poll(WAIT_S * 1000), "a well-formed request outside the pool got no answer"
        kind, header = raw.recv_multipart()
        assert kind == b"\x03" and msgpack.unpackb(header)["id"] == "y"
        puller.add_peer("prefill", metadata)
        handle = puller.start_pull("req-1", "prefill", REMOTE_IDS, LOCAL_IDS, WAIT_S)
        while not puller.poll(handle).terminal:
            time.sleep(0.001)
        assert handle.status == TransferStatus.DONE, handle.error
        assert torch.equal(local.buffer[LOCAL_IDS], pool.buffer[REMOTE_IDS])
        puller.release(handle)
    finally:
        raw.close(linger=0)
        context.term()
        puller.close()
        server.close()


# ---- GPU pools on one host: CUDA IPC ------------------------------------------------------------------------------
NO_GPU = "" if torch.cuda.is_available() else "needs a CUDA GPU; none is present on this machine"


def serve_gpu(backend_name: str, conn) -> None:
    """A prefill process with its pool on the GPU, exported over CUDA IPC: serve until told to stop, or die."""
    backend = make_backend(backend_name)
    backend.cuda_ipc = True
    pool = KVCache(LAYOUT, NUM_BLOCKS, device="cuda")
    pool.buffer.copy_(source_pool().buffer)
    torch.cuda.synchronize()
    conn.send(backend.register_pool(pool))
    conn.poll(WAIT_S)
    backend.close()


def pull_gpu(backend_name: str, metadata: bytes, conn) -> None:
    """The decode process, its pool on the GPU: one pull; status, error, whether it took CUDA IPC, the landed bytes,
    whether other blocks were touched. Then, told the lender is gone, a second pull's status, and whether this
    process's CUDA still computes."""
    backend = make_backend(backend_name, **PULLER_OPTIONS[backend_name])
    backend.cuda_ipc = True
    pool = KVCache(LAYOUT, NUM_BLOCKS, device="cuda")
    backend.register_pool(pool)
    backend.add_peer("prefill", metadata)
    handle = backend.start_pull("req-1", "prefill", REMOTE_IDS, LOCAL_IDS, WAIT_S)
    settle(lambda: backend.poll(handle), lambda status: status.terminal, WAIT_S, "the pull ends")
    backend.release(handle)
    untouched = [b for b in range(NUM_BLOCKS) if b not in LOCAL_IDS]
    conn.send((int(handle.status), handle.error, handle.ipc is not None,
               pool.buffer[LOCAL_IDS].cpu().view(torch.uint8).numpy().tobytes(), bool(pool.buffer[untouched].any())))
    conn.poll(WAIT_S)
    conn.recv()
    late = backend.start_pull("req-2", "prefill", REMOTE_IDS, LOCAL_IDS, DEADLINE_S)
    settle(lambda: backend.poll(late), lambda status: status.terminal, WAIT_S, "the pull from a dead lender ends")
    backend.release(late)
    backend.remove_peer("prefill")
    computes = bool((torch.ones(4, device="cuda") * 2).sum().item() == 8)
    conn.send((int(late.status), computes))
    backend.close()


@pytest.mark.gpu
@pytest.mark.skipif(bool(NO_GPU), reason=NO_GPU or "-")
@pytest.mark.parametrize("backend_name", BACKENDS)
def test_gpu_pools_on_one_host_copy_over_cuda_ipc(backend_name):
    """Two processes, two GPU pools: the pull copies device to device (CUDA IPC), the exact bytes, into the named
    blocks only; once the lender is killed, a pull from its mapping ends (either way) and the puller's CUDA works."""
    prefill, to_prefill = start(serve_gpu, backend_name)
    try:
        metadata = receive(to_prefill, prefill)
        decode, from_decode = start(pull_gpu, backend_name, metadata)
        status, error, via_ipc, landed, touched_others = receive(from_decode, decode)
        prefill.kill()
        prefill.join(WAIT_S)
        from_decode.send("lender gone")
        late_status, computes = receive(from_decode, decode)
        decode.join(WAIT_S)
    finally:
        prefill.kill()
    assert TransferStatus(status) == TransferStatus.DONE, error
    assert via_ipc
    assert landed == source_pool().buffer[REMOTE_IDS].view(torch.uint8).numpy().tobytes()
    assert not touched_others
    assert TransferStatus(late_status).terminal and computes
    assert decode.exitcode == 0
