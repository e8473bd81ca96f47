"""The contracts between a worker's loop (``common.runtime.worker_runtime``), its role handler and its
KV transfer backend: what ``serve`` calls on a role, the load a role reports for the heartbeat, how a role's
handler takes over from another's (``Adopt``), and what a worker needs of a backend."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Protocol

from common.protocol import wire
from common.config.roles import WorkerConfig
from common.runtime.telemetry import WorkerMetrics


@dataclass
class Load:
    """A role's load, sent with each heartbeat (the proxy routes by it)."""
    free_blocks: int = 0
    num_running: int = 0
    num_waiting: int = 0
    outstanding_prefill_tokens: int = 0
    context_tokens: int = 0  # the running sequences' tokens, summed
    step_cost: wire.StepCostModel | None = None  # the engine's fit of its step time (common/engine/model_runner.py)
    decodes_taken: int = 0  # DecodeRequests the compute loop took from the inbox before this load was measured


class RoleHandler(Protocol):
    """A role's behaviour; ``serve`` calls these from the compute loop only."""

    role: str  # prefill, decode or both; changed only by a role switch, which builds a handler of the new role
    draining: bool
    epoch: int  # this process's registration: its start time, renewed when it registers again
    metrics: WorkerMetrics

    def bind(self, send: Callable[[object], None]) -> None: ...  # where outbound messages go
    def registration(self) -> wire.Register: ...
    def handle(self, msg) -> None: ...
    def tick(self) -> None: ...  # one turn of work: poll transfers, step the engine, emit results
    def busy(self) -> bool: ...  # holds requests: draining waits for it to be False
    def wait_s(self, idle_s: float) -> float: ...  # how long the loop may wait for a message: 0 with compute to do
    def load(self) -> Load: ...
    # drain deadline passed or proxy lost: drop everything (``only``: these requests, one of several proxies'), free
    # its KV
    def fail_all(self, reason: str, only: set[str] | None = None) -> None: ...
    def contain(self, request_id: str, reason: str) -> None: ...  # its message made the handler fail: end it
    def publish_metrics(self) -> None: ...  # after each turn: the numbers /metrics and /healthz read
    def new_epoch(self) -> None: ...  # a new identity for the proxies (registering again, a role switch)


# Builds a role's handler around a running one (its model, transfer agent, metrics...), for a role switch
# (role_switch.py): (the handler serving now, the config with the new role) -> the new role's handler.
Adopt = Callable[[RoleHandler, WorkerConfig], RoleHandler]


class KVTransfer(Protocol):
    """What a worker needs of its KV transfer backend here (``kv_transfer.base`` has the full contract)."""
    name: str

    def register_pool(self, kv_cache) -> bytes: ...
    def set_epoch(self, epoch: int) -> bytes: ...  # the epoch its pages are lent under; the metadata to publish
    def counters(self): ...  # TransferCounters: its ``outcomes`` feed tessera_worker_kv_pull_outcomes_total
    def close(self) -> None: ...
