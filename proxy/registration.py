"""What a worker's Register must satisfy to join: a known role and id, positive sizes, no stale epoch, and
the model and KV layout every registered worker agrees on (``ClusterModel``). ``proxy.workers``'
``WorkerRegistry.register`` asks ``refusal`` and returns what it did as a ``Registration``.

The first accepted worker fixes the cluster's model (name + version) and KV layout; a worker that differs is
refused with a reason naming both values. The identity is kept while at least one worker is registered, so
replacing the whole fleet with a new model version needs no proxy restart. A Register with the same id and a
newer epoch replaces the old entry (the caller fails its requests); an older epoch is refused as stale; the same
epoch is a retry and is accepted."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Generic, TypeVar

from common.protocol.wire import KVLayoutInfo, Register, RegisterAck, Role

Worker = TypeVar("Worker")  # the registry's entry (proxy.workers.WorkerState)


@dataclass(frozen=True)
class ClusterModel:
    """What every worker must agree on."""
    model: str
    model_version: str
    kv_layout: KVLayoutInfo


@dataclass
class Registration(Generic[Worker]):
    """What a Register led to; the cluster acts on it."""
    ack: RegisterAck
    worker: Worker | None = None  # the accepted entry
    replaced: Worker | None = None  # an older epoch of the same worker, now gone
    prefill_set_changed: bool = False


def refusal(msg: Register, registered_epoch: int | None, cluster: ClusterModel | None) -> str:
    """Why ``msg`` cannot join (empty: it can); ``registered_epoch``: the epoch registered under its id, if any;
    ``cluster``: what the other registered workers agree on, if any."""
    if msg.role not in {r.value for r in Role}:
        return f"unknown role {msg.role!r}; one of {[r.value for r in Role]}"
    if not msg.worker_id:
        return "empty worker_id"
    if msg.num_blocks < 1 or msg.max_model_len < 2 or msg.kv_layout.block_size < 1:
        return (f"num_blocks={msg.num_blocks}, max_model_len={msg.max_model_len} and "
                f"kv_layout.block_size={msg.kv_layout.block_size} must be positive")
    if registered_epoch is not None and msg.epoch < registered_epoch:
        return f"stale epoch {msg.epoch}: epoch {registered_epoch} of this worker is registered"
    if cluster is None:
        return ""
    if (msg.model, msg.model_version) != (cluster.model, cluster.model_version):
        return (f"model {msg.model!r} version {msg.model_version!r} differs from the cluster's "
                f"model {cluster.model!r} version {cluster.model_version!r}")
    if msg.kv_layout != cluster.kv_layout:
        return f"KV layout {msg.kv_layout} differs from the cluster's {cluster.kv_layout}"
    return ""
