"""The workers: which are alive, what they serve, how loaded they are, and what a Register must satisfy to join.

``WorkerRegistry`` is pure bookkeeping: the cluster feeds it the messages and sends whatever the outcome says.

- ``register`` validates a Register (``refusal``) and applies it; it returns what it did as a ``Registration``.
  A Register must name a known role and an id, give positive sizes, carry no stale epoch, and agree with the KV
  layout of the workers already serving its model version (``ClusterModel``). A cluster serves several models,
  and several versions of each, side by side (``proxy.cluster.served_models`` routes a request to one version,
  prefill and decode alike); workers of one version hand each other KV pages, so the first accepted worker of a
  version fixes its layout while any worker of that version is registered, and one that differs is refused with
  a reason naming both values. A Register with the same id and a newer epoch replaces the old entry (the caller
  fails its requests); an older epoch is refused as stale; the same epoch is a retry and is accepted.
- ``heartbeat`` updates load and the TPOT capacity (proxy/core/capacity.py); ``observe_step`` times each decode
  step's tokens for its lag. A heartbeat from an unknown worker or a wrong epoch is not applied; ``ask_to_rejoin``
  answers it with Reregister at most once per worker id every ``heartbeat_timeout_s / 4`` (the watchdog's
  period): a flood gets few replies, and the worker rejoins well before it could count as dead. ``expire``
  removes workers silent for ``heartbeat_timeout_s``; ``goodbye`` handles Goodbye.

Roles: ``prefill`` serves PrefillRequests; ``decode`` serves DecodeRequests (with pages to pull, or without:
it prefills locally); ``both`` is an aggregated worker, decode-capable and counted as prefill-capable for
readiness, but never sent a PrefillRequest.

The ROUTER socket the messages come in on is ``proxy.cluster.worker_link.WorkerLink``'s.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from common.config.base import EngineConfig
from common.protocol.wire import (Goodbye, Heartbeat, KVLayoutInfo, PeerInfo, Peers, Register, RegisterAck, Role,
                                  StepCostModel)
from proxy.core.capacity import (ASSUMED_CONTEXT, LAG_MIN_SAMPLES, START_CAPACITY, StepLag, latency_capacity,
                                 mean_context)

log = logging.getLogger("tessera.proxy")


# Bumped whenever what decode_slots counts changes (a worker's role, slots, capacity or draining, or the set of
# workers): the registry keeps its sum until then, as the cluster asks for it at every step's message.
_SLOT_FIELDS = frozenset({"role", "max_num_seqs", "latency_capacity", "draining"})
_slot_changes = [0]


@dataclass
class WorkerState:
    worker_id: str
    role: Role
    epoch: int
    model: str
    model_version: str
    kv_layout: KVLayoutInfo
    num_blocks: int
    max_model_len: int
    transfer_backend: str
    transfer_metadata: bytes
    last_seen: float
    free_blocks: int = 0
    num_running: int = 0
    num_waiting: int = 0  # requests it holds that wait for a slot or for blocks (heartbeat)
    outstanding_prefill_tokens: int = 0
    draining: bool = False
    max_num_seqs: int = EngineConfig.max_num_seqs  # decode slots; the engine's default when not reported
    speculation: tuple[int, int] = (0, 0)  # k and spec_max_batch_size as configured; (0, 0): none (Register)
    mean_context: int = ASSUMED_CONTEXT  # of one running sequence (heartbeat; capacity.mean_context)
    step_cost: StepCostModel | None = None  # its fit of its step time (heartbeat); None: not known yet
    latency_capacity: int = 0  # sequences it may run within the TPOT target (proxy/core/capacity.py); 0: unknown
    tpot_target_ms: float = 0.0  # that target (capacity.tpot_target_ms); 0: no step model yet
    core_group: str = ""  # the cores it time-shares with other workers (Register); "": its own
    tokenizer_sha256: str = ""  # the hash of the tokenizer files it sends when asked (Register); "": it cannot
    tensor_parallel_size: int = 1  # its ranks (Register); pages move between workers of one layout at any size
    host: str = ""  # the host it runs on (Register); "": not reported, paired with no one by host
    interconnect_domain: str = ""  # its GPU's NVLink fabric (Register); "": none, paired with no one by fabric
    lag: StepLag = field(default_factory=StepLag)  # its steps as they come, against its model
    prompt_done_at: float | None = None  # when it last finished a prompt (a first token); None: not yet
    # The last of this proxy's DecodeRequests that its heartbeat's load counts (Heartbeat.last_decode_taken); None: the
    # worker does not say, so the load counts all this proxy sent.
    last_decode_taken: str | None = None

    def __setattr__(self, name: str, value) -> None:
        if name in _SLOT_FIELDS:
            _slot_changes[0] += 1
        object.__setattr__(self, name, value)

    @property
    def tpot_capacity(self) -> int:
        """``latency_capacity``, or ``START_CAPACITY`` of its slots while that is unknown."""
        return self.latency_capacity or min(self.max_num_seqs, START_CAPACITY)

    @property
    def serves_prefill(self) -> bool:
        """Takes PrefillRequests (the prefill side of a disaggregated request)."""
        return self.role is Role.PREFILL

    @property
    def decode_capable(self) -> bool:
        return self.role in (Role.DECODE, Role.BOTH)

    @property
    def block_size(self) -> int:
        return self.kv_layout.block_size

    def peer_info(self) -> PeerInfo:
        return PeerInfo(self.worker_id, self.epoch, self.transfer_backend, self.transfer_metadata)


@dataclass(frozen=True)
class ClusterModel:
    """What every worker of one model version must agree on."""
    model: str
    model_version: str
    kv_layout: KVLayoutInfo


@dataclass
class Registration:
    """What a Register led to; the cluster acts on it."""
    ack: RegisterAck
    worker: WorkerState | None = None  # the accepted entry
    replaced: WorkerState | None = None  # an older epoch of the same worker, now gone
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


@dataclass
class WorkerRegistry:
    heartbeat_timeout_s: float
    tpot_slo_ms: float = 0.0  # the decode step-time target (ProxyConfig); 0: tpot_slo_factor x one sequence's
    tpot_slo_factor: float = 2.0
    workers: dict[str, WorkerState] = field(default_factory=dict)
    _rejoin_asked: dict[str, float] = field(default_factory=dict)  # worker id -> when last asked
    _slots: tuple = ((), 0)  # decode_slots' last answer, and what it depended on
    _learning: tuple = ((), False)  # learning's, likewise

    def register(self, msg: Register, now: float) -> Registration:
        old = self.workers.get(msg.worker_id)
        reason = refusal(msg, old.epoch if old is not None else None,
                         self._identity(msg.model, msg.model_version, exclude=msg.worker_id))
        if reason:
            log.warning("refused worker %r: %s", msg.worker_id, reason)
            return Registration(RegisterAck(msg.worker_id, False, reason))
        role = Role(msg.role)
        worker = WorkerState(
            msg.worker_id, role, msg.epoch, msg.model, msg.model_version, msg.kv_layout, msg.num_blocks,
            msg.max_model_len, msg.transfer_backend, msg.transfer_metadata, last_seen=now,
            free_blocks=msg.num_blocks, max_num_seqs=msg.max_num_seqs or EngineConfig.max_num_seqs,
            speculation=(msg.spec_num_tokens, msg.spec_max_batch_size), core_group=msg.core_group,
            tokenizer_sha256=msg.tokenizer_sha256, tensor_parallel_size=msg.tensor_parallel_size,
            host=msg.host, interconnect_domain=msg.interconnect_domain)
        replaced = old if old is not None and old.epoch != msg.epoch else None
        if old is not None and replaced is None:  # a retried Register: keep the load we know
            for name in ("free_blocks", "num_running", "outstanding_prefill_tokens", "draining", "mean_context",
                         "step_cost", "latency_capacity", "tpot_target_ms", "lag"):
                setattr(worker, name, getattr(old, name))
        self.workers[msg.worker_id] = worker
        _slot_changes[0] += 1  # a new entry under the same id changes no count of workers
        self._rejoin_asked.pop(msg.worker_id, None)
        prefill_changed = worker.serves_prefill or (old is not None and old.serves_prefill)
        log.info("registered %s worker %r epoch %d (%s %s, %d blocks, max_model_len %d)%s",
                 role.value, msg.worker_id, msg.epoch, msg.model, msg.model_version, msg.num_blocks,
                 msg.max_model_len, f", replacing epoch {replaced.epoch}" if replaced else "")
        return Registration(RegisterAck(msg.worker_id, True), worker, replaced, prefill_changed)

    def heartbeat(self, msg: Heartbeat, now: float) -> WorkerState | None:
        worker = self.workers.get(msg.worker_id)
        if worker is None or worker.epoch != msg.epoch:
            return None
        worker.last_seen = now
        worker.free_blocks = msg.free_blocks
        worker.num_running = msg.num_running
        worker.num_waiting = msg.num_waiting
        worker.last_decode_taken = msg.last_decode_taken
        worker.outstanding_prefill_tokens = msg.outstanding_prefill_tokens
        worker.step_cost = msg.step_cost
        if not msg.num_running:
            worker.lag.last_at = None  # it runs nothing: the next step's tokens end no step the proxy timed
        worker.mean_context = mean_context(msg.context_tokens, msg.num_running)
        worker.latency_capacity, worker.tpot_target_ms = latency_capacity(
            msg.step_cost, worker.max_num_seqs, worker.mean_context, self.tpot_slo_ms, self.tpot_slo_factor, worker.lag)
        if msg.draining and not worker.draining:
            log.info("worker %r is draining: no new requests go to it", msg.worker_id)
        worker.draining = msg.draining
        return worker

    def observe_step(self, worker_id: str, rows: int, running_after: bool, now: float, step: int = 0) -> None:
        """A decode step's tokens (``rows`` sequences) came from ``worker_id``; ``running_after``: some go on;
        ``step``: the worker's step number, where it serves several proxies (wire.TokenDeltas)."""
        worker = self.workers.get(worker_id)
        if worker is not None and worker.step_cost is not None:
            worker.lag.step_came(rows, now, worker.step_cost.step_ms(rows, rows * worker.mean_context), running_after,
                                 step)

    def observe_handoff(self, worker_id: str, gap_s: float, tokens: int, slot_wait_s: float) -> None:
        """A disaggregated request's second token came from ``worker_id`` ``gap_s`` after its first, ``slot_wait_s``
        of it waiting for its decode slot; it asks for ``tokens`` tokens. The wait beyond a step is lag."""
        worker = self.workers.get(worker_id)
        if worker is not None and worker.step_cost is not None:
            rows = max(worker.num_running, 1)
            step_ms = worker.step_cost.step_ms(rows, rows * worker.mean_context)
            worker.lag.add_handoff(gap_s * 1e3, step_ms, rows, tokens, slot_wait_s * 1e3)

    def observe_tpot(self, worker_id: str, since: float, until: float, tokens: int, slot_wait_s: float) -> None:
        """A choice decoded on ``worker_id`` alone ended: its ``tokens`` came from ``since`` to ``until``."""
        worker = self.workers.get(worker_id)
        if worker is not None and worker.step_cost is not None and worker.lag.samples >= LAG_MIN_SAMPLES:
            cost, context = worker.step_cost, worker.mean_context
            worker.lag.add_tpot((until - since) * 1e3 / (tokens - 1), since, until,
                                lambda rows: cost.step_ms(rows, rows * context), slot_wait_s * 1e3)

    def ask_to_rejoin(self, worker_id: str, now: float) -> bool:
        """Whether to answer a heartbeat that ``heartbeat`` did not apply with Reregister now; counts as asked."""
        last = self._rejoin_asked.get(worker_id)
        if last is not None and now - last < self.heartbeat_timeout_s / 4:
            return False
        self._rejoin_asked[worker_id] = now
        return True

    def goodbye(self, msg: Goodbye) -> WorkerState | None:
        worker = self.workers.get(msg.worker_id)
        if worker is None or worker.epoch != msg.epoch:
            return None
        return self.workers.pop(msg.worker_id)

    def disconnected(self, worker_id: str) -> WorkerState | None:
        """The worker's connection closed: it is gone (a live one that reconnects is asked to register again)."""
        return self.workers.pop(worker_id, None)

    def expire(self, now: float) -> list[WorkerState]:
        dead = [w for w in self.workers.values() if now - w.last_seen > self.heartbeat_timeout_s]
        for worker in dead:
            del self.workers[worker.worker_id]
        # A sender that never rejoined is forgotten like a dead worker, so the map stays small.
        for worker_id in [w for w, t in self._rejoin_asked.items() if now - t > self.heartbeat_timeout_s]:
            del self._rejoin_asked[worker_id]
        return dead

    def touch(self, worker_id: str, now: float) -> None:
        """Any message is a sign of life, not only heartbeats."""
        worker = self.workers.get(worker_id)
        if worker is not None:
            worker.last_seen = now

    def prefill_side(self) -> list[WorkerState]:
        return [w for w in self.workers.values() if w.serves_prefill]

    def decode_side(self) -> list[WorkerState]:
        return [w for w in self.workers.values() if w.decode_capable]

    def decode_slots(self, within_tpot: bool = False, scale: float = 1.0) -> int:
        """Sequences the decode-capable workers that take new work can run at once; ``within_tpot``: only as many
        as keep each one's predicted step time within the TPOT target (``WorkerState.tpot_capacity``), times
        ``scale`` (the adaptive controller's correction; at least one each)."""
        key = (_slot_changes[0], len(self.workers), within_tpot, scale)
        if self._slots[0] != key:
            self._slots = (key, sum(min(max(int(w.tpot_capacity * scale), 1), w.max_num_seqs) if within_tpot
                                    else w.max_num_seqs for w in self.decode_side() if not w.draining))
        return self._slots[1]

    def learning(self) -> bool:
        """Whether a decode-capable worker that takes new work has no TPOT capacity from its own step model yet
        (a new cluster's first seconds, or a worker that just joined): its ``tpot_capacity`` is a guess. A worker of
        one slot (``max_num_seqs`` 1) is not: its capacity is that slot, and it never fits a step model (its
        calibration and its traffic see one row count only), so it would hold the cluster learning for good."""
        key = (_slot_changes[0], len(self.workers))
        if self._learning[0] != key:
            self._learning = (key, any(not w.latency_capacity and w.max_num_seqs > 1
                                       for w in self.decode_side() if not w.draining))
        return self._learning[1]

    def peers(self) -> Peers:
        return Peers([w.peer_info() for w in self.prefill_side()])

    @property
    def max_model_len(self) -> int | None:
        """The longest context every worker accepts; None with no workers."""
        return min((w.max_model_len for w in self.workers.values()), default=None)

    def readiness(self) -> tuple[bool, str]:
        """Ready when a request can be served: a decode-capable worker that is not draining, as ``route`` needs.
        Without a prefill worker every prompt is prefilled on the decode side (slower, but served)."""
        active = [w for w in self.workers.values() if not w.draining]
        if not any(w.decode_capable for w in active):
            return False, "no decode-capable worker (role decode or both) is registered and not draining"
        if not any(w.serves_prefill for w in active):
            return True, f"{len(active)} worker(s) ready; no prefill worker, so prompts are prefilled on the decode side"
        return True, f"{len(active)} worker(s) ready"

    def count_by_role(self) -> dict[str, int]:
        counts = {role.value: 0 for role in Role}
        for worker in self.workers.values():
            counts[worker.role.value] += 1
        return counts

    def _identity(self, model: str, version: str, exclude: str) -> ClusterModel | None:
        for worker in self.workers.values():
            if worker.worker_id != exclude and (worker.model, worker.model_version) == (model, version):
                return ClusterModel(worker.model, worker.model_version, worker.kv_layout)
        return None
