"""Role switches the proxy ordered: SwitchRole sent, and each order followed until the worker serves in its new role.

``RoleSwitches.order`` is the one way to switch a worker between ``prefill``, ``decode`` and ``both``, for the admin
API (``POST /admin/workers/{worker_id}/role``) and for the planner (its controller loop calls
``Cluster.switch_role``, which is this). It checks the order, sends SwitchRole, routes nothing more to the worker,
and returns a future. The worker drains, says Goodbye (its requests resume elsewhere, as for any worker that leaves)
and registers under a new epoch with its new role, its model still loaded (``common/runtime/role_switch.py``); the
future then resolves to the worker's new ``WorkerState``.

Refused at once, as an ``ApiError`` raised by ``order``: an unknown worker (404); a worker draining, one whose wire
protocol predates SwitchRole, or one with another switch under way (409); a switch that would leave the worker's
model version without a role it needs (409) unless forced: the last decode-capable worker (requests need one), or the
last prefill worker (its prompts would all be prefilled on the decode side). An order for the role the worker has
resolves at once. Failed later, as the future's ApiError: the worker did not register in its new role within
``planner.role_switch_timeout_s`` (504), or it registered with another role or its connection closed (503). Every
order is counted by outcome in ``tessera_proxy_role_switches_total`` and logged; a failure nobody awaits is not
reported again by asyncio.
"""
from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass

from common.protocol.versions import MESSAGE_SINCE, sendable
from common.protocol.wire import Role, SwitchRole
from proxy.core.errors import ApiError
from proxy.core.workers import WorkerRegistry, WorkerState

log = logging.getLogger("tessera.proxy")
OUTCOMES = ("switched", "refused", "timed_out", "failed")


@dataclass
class Order:
    role: Role
    previous: WorkerState  # the worker as it was registered when ordered
    started: float
    deadline: float
    done: asyncio.Future


class RoleSwitches:
    def __init__(self, config, registry: WorkerRegistry, send: Callable[[str, object], None], metrics,
                 peer_versions: dict[str, int], clock) -> None:
        """``peer_versions``: each worker's protocol version (one before SwitchRole's is refused)."""
        self.timeout_s = config.planner.role_switch_timeout_s
        self.registry = registry
        self.send = send
        self.metrics = metrics
        self.peer_versions = peer_versions
        self.clock = clock
        self.pending: dict[str, Order] = {}  # worker id -> the switch it was ordered to make
        for outcome in OUTCOMES:
            metrics.role_switches.labels(outcome)

    def order(self, worker_id: str, role: str, force: bool = False) -> asyncio.Future:
        """Order worker ``worker_id`` to serve as ``role`` (``force``: even the last of a role its model version
        needs). Returns a future of its ``WorkerState`` once it registered in that role; raises ``ApiError`` when
        refused. Call it from the event loop."""
        try:
            new = Role(role)
        except ValueError:
            raise self._refused(400, f"unknown role {role!r}: one of prefill, decode, both", "invalid_value",
                                param="role") from None
        worker = self.registry.workers.get(worker_id)
        if worker is None:
            raise self._refused(404, f"no worker {worker_id!r} is registered", "worker_not_found")
        ordered = self.pending.get(worker_id)
        if ordered is not None:
            if ordered.role is new:
                return ordered.done
            raise self._refused(409, f"worker {worker_id!r} is switching to {ordered.role.value} already",
                                "role_switch_under_way")
        done = asyncio.get_running_loop().create_future()
        done.add_done_callback(_retrieved)
        if worker.role is new:
            done.set_result(worker)
            return done
        if worker.draining:
            raise self._refused(409, f"worker {worker_id!r} is draining (it is shutting down or loading another "
                                "model): it switches no role now", "worker_draining")
        version = self.peer_versions.get(worker_id, 0)
        if not sendable(SwitchRole, version):
            raise self._refused(409, f"worker {worker_id!r} speaks wire protocol {version}; switching roles needs "
                                f"{MESSAGE_SINCE['SwitchRole']} or later (upgrade the worker)", "protocol_too_old")
        if (why := self._needed(worker, new)) and not force:
            raise self._refused(409, f"worker {worker_id!r} stays {worker.role.value}: {why} (force: true switches "
                                "it anyway)", "last_worker_of_role")
        now = self.clock()
        self.pending[worker_id] = Order(new, worker, now, now + self.timeout_s, done)
        worker.draining = True  # nothing more is routed to it; its heartbeats say so too once it took the order
        self.send(worker_id, SwitchRole(worker_id, new.value))
        log.info("asked worker %r to switch from %s to %s%s", worker_id, worker.role.value, new.value,
                 f" ({why}; forced)" if why else "")
        return done

    def switching(self, worker_id: str) -> bool:
        """Whether ``worker_id`` was ordered to switch and has not registered in its new role yet."""
        return worker_id in self.pending

    def registered(self, worker: WorkerState) -> None:
        """An accepted Register: the end of a switch ``worker`` was ordered to make, under a new epoch."""
        ordered = self.pending.get(worker.worker_id)
        if ordered is None or worker.epoch == ordered.previous.epoch:
            return
        del self.pending[worker.worker_id]
        if worker.role is not ordered.role:
            self._fail(worker.worker_id, ordered, ApiError(
                503, f"worker {worker.worker_id!r} registered again as {worker.role.value}, not as "
                f"{ordered.role.value}", code="role_switch_failed"))
            return
        self.metrics.role_switches.labels("switched").inc()
        log.info("worker %r switched from %s to %s in %.2fs (epoch %d)", worker.worker_id,
                 ordered.previous.role.value, worker.role.value, self.clock() - ordered.started, worker.epoch)
        if not ordered.done.done():
            ordered.done.set_result(worker)

    def lost(self, worker_id: str) -> None:
        """The worker's connection closed: a switch it was ordered to make is over."""
        ordered = self.pending.pop(worker_id, None)
        if ordered is not None:
            self._fail(worker_id, ordered, ApiError(503, f"worker {worker_id!r} was lost while switching to "
                                                    f"{ordered.role.value} (its connection closed)",
                                                    code="role_switch_failed"))

    def expire(self, now: float) -> None:
        """Orders past ``planner.role_switch_timeout_s`` fail (the cluster calls this with its heartbeat check)."""
        for worker_id, ordered in list(self.pending.items()):
            if now > ordered.deadline:
                del self.pending[worker_id]
                self._fail(worker_id, ordered, ApiError(
                    504, f"worker {worker_id!r} did not register as {ordered.role.value} within "
                    f"planner.role_switch_timeout_s={self.timeout_s}s", code="role_switch_timeout"), "timed_out")

    def _needed(self, worker: WorkerState, new: Role) -> str:
        """Why ``worker`` serving as ``new`` would leave its model version without a role it needs; "" if not."""
        others = [w for w in self.registry.workers.values() if w is not worker and not w.draining
                  and (w.model, w.model_version) == (worker.model, worker.model_version)]
        model = f"{worker.model}@{worker.model_version}"
        if worker.decode_capable and new is Role.PREFILL and not any(w.decode_capable for w in others):
            return f"it is the last decode-capable worker (role decode or both) of {model}, which requests need"
        if worker.serves_prefill and new is not Role.PREFILL and not any(w.serves_prefill for w in others):
            return f"it is the last prefill worker of {model} (its prompts would all be prefilled on the decode side)"
        return ""

    def _refused(self, status: int, message: str, code: str, param: str | None = None) -> ApiError:
        self.metrics.role_switches.labels("refused").inc()
        log.warning("role switch refused: %s", message)
        return ApiError(status, message, code=code, param=param)

    def _fail(self, worker_id: str, ordered: Order, error: ApiError, outcome: str = "failed") -> None:
        self.metrics.role_switches.labels(outcome).inc()
        log.warning("role switch of worker %r to %s failed: %s", worker_id, ordered.role.value, error.message)
        if not ordered.done.done():
            ordered.done.set_exception(error)


def _retrieved(done: asyncio.Future) -> None:
    """Marks a failed order's error as seen: it was logged and counted here, whoever awaits the future or not."""
    if not done.cancelled():
        done.exception()
