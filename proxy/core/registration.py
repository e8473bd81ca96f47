"""What a worker's Register must satisfy to join: a known role and id, positive sizes, no stale epoch, and the KV
layout of the workers already serving its model version (``ClusterModel``). ``proxy.core.workers``'
``WorkerRegistry.register`` asks ``refusal`` and returns what it did as a ``Registration``.

A cluster serves several models, and several versions of each, side by side (``proxy.cluster.served_models`` routes a
request to one version, prefill and decode alike). Workers of one version hand each other KV pages, so they must
agree on its layout: the first accepted worker of a version fixes it while any worker of that version is
registered; a worker that differs is refused with a reason naming both values. A Register with the same id and a
newer epoch replaces the old entry (the caller fails its requests); an older epoch is refused as stale; the same
epoch is a retry and is accepted."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Generic, TypeVar

from common.protocol.wire import KVLayoutInfo, Register, RegisterAck, Role

Worker = TypeVar("Worker")  # the registry's entry (proxy.core.workers.WorkerState)


@dataclass(frozen=True)
class ClusterModel:
    """What every worker of one model version must agree on."""
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


def refusal(msg: Register, registered_epoch: int | None, group: ClusterModel | None) -> str:
    """Why ``msg`` cannot join (empty: it can); ``registered_epoch``: the epoch registered under its id, if any;
    ``group``: what the other registered workers of its model version agree on, if any."""
    if msg.role not in {r.value for r in Role}:
        return f"unknown role {msg.role!r}; one of {[r.value for r in Role]}"
    if not msg.worker_id:
        return "empty worker_id"
    if msg.num_blocks < 1 or msg.max_model_len < 2 or msg.kv_layout.block_size < 1:
        return (f"num_blocks={msg.num_blocks}, max_model_len={msg.max_model_len} and "
                f"kv_layout.block_size={msg.kv_layout.block_size} must be positive")
    if registered_epoch is not None and msg.epoch < registered_epoch:
        return f"stale epoch {msg.epoch}: epoch {registered_epoch} of this worker is registered"
    if "@" in msg.model or not msg.model or not msg.model_version:
        return f"model {msg.model!r} version {msg.model_version!r}: both must be non-empty, and the name without '@'"
    if group is not None and msg.kv_layout != group.kv_layout:
        return (f"KV layout {msg.kv_layout} differs from {group.kv_layout}, that of the workers serving "
                f"{msg.model}@{msg.model_version}")
    return ""
