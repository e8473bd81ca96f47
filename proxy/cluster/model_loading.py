"""Cold models: which workers can load which model versions, the loads under way, and how long loads took.

A worker started with ``standby_models`` serves one model and lists the others in its Register (``standby``); one
that unloaded its model after ``model_idle_unload_s`` holds none and sends Standby instead of heartbeats
(``common/runtime/model_swap.py``). When a request names a version no live worker serves, ``ServedModels`` asks
``want``: the first request for it starts a load and every request gets 503 with Retry-After until a worker
registers with it. A load goes to one decode-capable worker (role decode or both) that lists the version, and to one
prefill worker that lists it, if any (asked again by each request while the decode side loads; without one the
decode worker prefills): a worker standing by first, else an idle one (nothing running, nothing routed to it, and
no request chose its model for ``model_swap_min_idle_s``, so two models wanted in turn do not swap one worker back
and forth), whose current model it then gives up. The proxy routes nothing more to a worker it asked to load.

Retry-After is the version's last load time left to run (``retry_after_s`` before one is known). A load that does
not end within ``model_load_timeout_s`` is given up (logged, counted), so the next request may ask another worker.
Loads are counted by model and outcome, and their seconds (the worker's own measure: weights, KV pool and transfer
agent) observed, in ``tessera_proxy_model_loads_total`` and ``tessera_proxy_model_load_seconds``.
"""
from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from common.protocol.versions import sendable
from common.protocol.wire import LoadModel, Register, Role, Standby
from proxy.core.requests import SubRequest
from proxy.core.workers import WorkerRegistry

log = logging.getLogger("tessera.proxy")


@dataclass
class Loading:
    model: str  # name@version
    decode: bool  # on a decode-capable worker (else a prefill worker)
    epoch: int  # the worker's when asked: a Standby of a newer one says the load ended without the model
    started: float
    deadline: float


class ModelLoader:
    def __init__(self, config, registry: WorkerRegistry, send: Callable[[str, object], None], metrics,
                 inflight: Iterable[SubRequest], peer_versions: dict[str, int], clock=time.monotonic) -> None:
        """``inflight``: the requests in flight (a live view; a worker one of them involves is busy);
        ``peer_versions``: each worker's protocol version (one before LoadModel's is never asked)."""
        self.config = config
        self.registry = registry
        self.send = send
        self.metrics = metrics
        self.inflight = inflight
        self.peer_versions = peer_versions
        self.clock = clock
        self.standing_by: dict[str, tuple[Standby, float]] = {}  # worker id -> its last Standby, when received
        self.offers: dict[str, tuple[int, tuple[str, ...]]] = {}  # registered worker id -> (epoch, standby models)
        self.loading: dict[str, Loading] = {}  # worker id -> the load it was asked for
        self.load_s: dict[str, float] = {}  # name@version -> how long its last load took
        # (name, version) -> when a request last chose it (``ServedModels._choice`` writes it): a worker gives its
        # model up for another only once its model had no request for ``model_swap_min_idle_s``
        self.chosen: dict[tuple[str, str], float] = {}

    # -- what workers say ---------------------------------------------------------------------

    def on_standby(self, msg: Standby, now: float) -> None:
        loading = self.loading.get(msg.worker_id)
        if loading is not None and msg.epoch > loading.epoch:  # it stood by again since it was asked
            self.loading.pop(msg.worker_id)
            self._failed(msg.worker_id, loading, msg.error or "it stands by without it")
        if msg.worker_id not in self.standing_by:
            log.info("worker %r (%s) holds no model; it may load %s", msg.worker_id, msg.role,
                     ", ".join(msg.models) or "none")
        self.standing_by[msg.worker_id] = (msg, now)
        self.offers.pop(msg.worker_id, None)

    def registered(self, msg: Register) -> None:
        """An accepted Register: what the worker may load next, and the end of a load it was asked for."""
        self.standing_by.pop(msg.worker_id, None)
        self.offers[msg.worker_id] = (msg.epoch, tuple(msg.standby))
        loading = self.loading.pop(msg.worker_id, None)
        if loading is None:
            return
        model = f"{msg.model}@{msg.model_version}"
        if model != loading.model:
            self._failed(msg.worker_id, loading, f"it registered with {model} instead")
            return
        self.load_s[model] = msg.load_s
        self.metrics.model_loads.labels(model, "loaded").inc()
        self.metrics.model_load_seconds.observe(msg.load_s)
        log.info("worker %r loaded %s in %.2fs (%.2fs after it was asked)", msg.worker_id, model, msg.load_s,
                 self.clock() - loading.started)

    def forget(self, worker_id: str, lost: bool = False) -> None:
        """The worker left (Goodbye) or is gone (``lost``: its connection closed, a load it was asked for with it)."""
        self.standing_by.pop(worker_id, None)
        loading = self.loading.pop(worker_id, None) if lost else None
        if loading is not None:
            self._failed(worker_id, loading, "its connection closed")

    # -- what requests want -----------------------------------------------------------------------

    def cold(self) -> dict[str, dict[str, int]]:
        """name -> version -> how many workers may load it (standing by, or offering it beside their model)."""
        out: dict[str, dict[str, int]] = {}
        for _, models in self._offering(self.clock()):
            for model in models:
                name, _, version = model.partition("@")
                versions = out.setdefault(name, {})
                versions[version] = versions.get(version, 0) + 1
        return out

    def want(self, model: str) -> int | None:
        """Seconds a request for ``model`` (name@version) should wait while it loads (Retry-After), starting the
        load when none is under way; None when no worker can load it now."""
        now = self.clock()
        self._expire(now)
        under_way = [load for load in self.loading.values() if load.model == model]
        if not any(load.decode for load in under_way) and not self._ask(model, True, now):
            return None
        if not any(not load.decode for load in under_way):  # asked again while the decode side loads: one busy
            self._ask(model, False, now)  # then may be idle now (without one the decode worker prefills)
        under_way = [load for load in self.loading.values() if load.model == model]
        started = min(load.started for load in under_way)
        expected = self.load_s.get(model)
        if expected is None:
            return self.config.requests.retry_after_s
        return max(1, math.ceil(expected - (now - started)))

    def loading_versions(self, name: str) -> set[str]:
        """The versions of model ``name`` a worker is loading now."""
        return {version for model_name, _, version in (load.model.partition("@") for load in self.loading.values())
                if model_name == name}

    def _ask(self, model: str, decode: bool, now: float) -> bool:
        """Ask one worker of the side (decode-capable, else prefill) that offers ``model`` to load it."""
        def side(role: str) -> bool:
            return (Role(role) is not Role.PREFILL) == decode

        idle = []
        for worker_id, models in self._offering(now):
            if model not in models or worker_id in self.loading:
                continue
            if not sendable(LoadModel, self.peer_versions.get(worker_id, 0)):
                continue
            state = self.registry.workers.get(worker_id)
            if state is None:
                standby = self.standing_by[worker_id][0]
                if side(standby.role):
                    idle.append((0, worker_id))
            elif side(state.role.value) and not state.draining and not state.num_running \
                    and not state.outstanding_prefill_tokens and not self._busy(worker_id) \
                    and now - self.chosen.get((state.model, state.model_version), -math.inf) \
                    >= self.config.model_swap_min_idle_s:
                # a worker whose model others serve too gives it up first
                alone = not any(w is not state and not w.draining and (w.model, w.model_version)
                                == (state.model, state.model_version) for w in self.registry.workers.values())
                idle.append((1 + alone, worker_id))
        if not idle:
            return False
        _, worker_id = min(idle)
        state = self.registry.workers.get(worker_id)
        if state is not None:
            state.draining = True  # nothing more is routed to it; its heartbeats say so too from now on
        epoch = state.epoch if state is not None else self.standing_by[worker_id][0].epoch
        self.loading[worker_id] = Loading(model, decode, epoch, now, now + self.config.model_load_timeout_s)
        self.send(worker_id, LoadModel(worker_id, model))
        log.info("asked worker %r to load %s%s", worker_id, model,
                 f" instead of {state.model}@{state.model_version}" if state is not None else "")
        return True

    def _busy(self, worker_id: str) -> bool:
        return any(sub.involves(worker_id) for sub in self.inflight)

    def _offering(self, now: float):
        """(worker id, the models it may load) of each live worker that may load one."""
        for worker_id, (epoch, models) in list(self.offers.items()):
            state = self.registry.workers.get(worker_id)
            if state is None or state.epoch != epoch:
                self.offers.pop(worker_id)
            elif models:
                yield worker_id, models
        for worker_id, (msg, seen) in list(self.standing_by.items()):
            if now - seen > self.config.heartbeat_timeout_s or worker_id in self.registry.workers:
                self.standing_by.pop(worker_id)
            else:
                yield worker_id, tuple(msg.models)

    def _expire(self, now: float) -> None:
        for worker_id, loading in list(self.loading.items()):
            if now > loading.deadline:
                self.loading.pop(worker_id)
                self._failed(worker_id, loading, f"it did not register within model_load_timeout_s="
                                                 f"{self.config.model_load_timeout_s}s")

    def _failed(self, worker_id: str, loading: Loading, why: str) -> None:
        log.warning("worker %r did not load %s: %s", worker_id, loading.model, why)
        self.metrics.model_loads.labels(loading.model, "failed").inc()
