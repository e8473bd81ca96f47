"""Routing policies: which worker gets a request.

A policy is an object; the cluster calls its hooks and never decides itself.

Hooks (all called by the cluster, in the event loop; ``cache_salt`` is the
request's tenant's, the root of its block hashes on the workers):
- ``route(prompt, workers, cache_salt, session)`` at admission: a ``Route`` that is either
  disaggregated (the prefill worker; the decode worker is picked later) or
  local (a decode-capable worker that prefills itself), or None when no
  worker can take the request.
- ``pick_decode(prompt, workers)`` when a prefilled request gets its
  decode slot: the decode worker that pulls the pages, or None.
- ``prefill_sent(worker, prompt, cache_salt)`` / ``prefill_ended(worker_id, num_tokens)``
  bracket a PrefillRequest, on every path out (PrefillDone, failure, abort,
  worker loss); the cluster says which worker and how many tokens, so the
  policy keeps no per-request state.
- ``decode_sent`` when a DecodeRequest goes out (with the request's session, if any); ``heartbeat`` when a
  worker reports its load; ``worker_removed`` when it is gone.

``PrefixAwareRouting`` (the default):
- Conditional disaggregation: prompts shorter than ``local_prefill_threshold``
  tokens, and every prompt when no prefill-role worker is available, prefill
  locally on a decode-capable worker.
- Prefill: the worker that would finish the prompt soonest: least
  (outstanding prefill tokens + the prompt's tokens its prefix cache likely
  lacks). Outstanding = proxy-tracked tokens of prompts sent and not yet
  done, plus the heartbeat's value; the cache is estimated per worker by a
  bounded LRU set of the chained block hashes of prompts recently sent to
  it, salted as the worker salts them (so another tenant's equal prompt
  predicts no hit, as it gets none). An idle cluster thus keeps a shared prefix on one worker, and a busy
  one spills to the others instead of queueing behind the cache.
- Decode: most free blocks, then fewest running. Both counts add what the
  proxy sent since the worker's last heartbeat, so a burst between two
  heartbeats spreads instead of piling onto one worker. Local prefill
  prefers a prefix hit first, as prefill does.
- Sessions: a conversation's next turn (the same ``X-Session-Id``) goes back to the decode worker that decoded
  its last one, within ``session_ttl_s``, and prefills there: that worker's prefix cache holds the whole
  history, its replies included, so only the new message is computed. Not while that worker is gone, draining
  or at its TPOT capacity: then the turn is routed as any other (its history is prefilled again).
- Draining workers get nothing new.
- Routing weights (``weights``: 1 unless the adaptive controller, proxy/control/tac.py, lowered a worker's because its
  requests missed their targets more than the others of its role did): a worker's prefill cost and decode
  load are divided by its weight, so at equal load the heavier one is picked.
"""
from __future__ import annotations

import time
from collections import OrderedDict, defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from common.protocol.wire import prefix_block_hashes
from proxy.core.workers import WorkerState


MAX_SESSIONS = 100_000  # conversations remembered at once; past it the oldest is forgotten


@dataclass(frozen=True)
class Route:
    worker: WorkerState
    local: bool  # True: DecodeRequest without pages; False: PrefillRequest to ``worker``


class RoutingPolicy(Protocol):
    def route(self, prompt: Sequence[int], workers: Sequence[WorkerState], cache_salt: int = 0,
              session: str | None = None) -> Route | None: ...
    def pick_decode(self, prompt: Sequence[int], workers: Sequence[WorkerState]) -> WorkerState | None: ...
    def prefill_sent(self, worker: WorkerState, prompt: Sequence[int], cache_salt: int = 0) -> None: ...
    def prefill_ended(self, worker_id: str, num_tokens: int) -> None: ...
    def outstanding_prefill_tokens(self, worker_id: str) -> int: ...
    def decode_sent(self, worker: WorkerState, prompt: Sequence[int], local: bool, cache_salt: int = 0,
                    session: str | None = None) -> None: ...
    def heartbeat(self, worker: WorkerState) -> None: ...
    def worker_removed(self, worker_id: str) -> None: ...


class PrefixLRU:
    """A bounded set of block hashes, least recently sent evicted first."""

    def __init__(self, capacity: int) -> None:
        self.capacity = max(capacity, 1)
        self._hashes: OrderedDict[int, None] = OrderedDict()

    def add(self, hashes: Sequence[int]) -> None:
        for h in hashes:
            self._hashes[h] = None
            self._hashes.move_to_end(h)
        while len(self._hashes) > self.capacity:
            self._hashes.popitem(last=False)

    def leading_hits(self, hashes: Sequence[int]) -> int:
        """How many of ``hashes`` from the start are present (chained: the first miss ends it)."""
        hits = 0
        for h in hashes:
            if h not in self._hashes:
                break
            hits += 1
        return hits

    def __len__(self) -> int:
        return len(self._hashes)


@dataclass
class _Pending:
    """What this proxy sent a worker since its last heartbeat."""
    blocks: int = 0
    requests: int = 0


class PrefixAwareRouting:
    def __init__(self, local_prefill_threshold: int = 0, session_ttl_s: float = 600.0) -> None:
        self.local_prefill_threshold = local_prefill_threshold
        self.session_ttl_s = session_ttl_s
        self._sessions: OrderedDict[str, tuple[str, float]] = OrderedDict()  # session -> (decode worker, when)
        self._prefixes: dict[str, PrefixLRU] = {}
        self._prefill_tokens: dict[str, int] = defaultdict(int)  # worker -> tokens sent, not yet done
        self._pending: dict[str, _Pending] = defaultdict(_Pending)
        self._prefills_sent: dict[str, int] = defaultdict(int)
        self.weights: dict[str, float] = {}  # worker -> routing weight, when not 1 (the adaptive controller's)

    def route(self, prompt: Sequence[int], workers: Sequence[WorkerState], cache_salt: int = 0,
              session: str | None = None) -> Route | None:
        active = [w for w in workers if not w.draining]
        decoders = [w for w in active if w.decode_capable]
        if not decoders:
            return None
        holder = self._holder(session, decoders) if session is not None else None
        if holder is not None:
            return Route(holder, local=True)
        prefillers = [w for w in active if w.serves_prefill]
        if not prefillers or len(prompt) < self.local_prefill_threshold:
            return Route(self._best_by_prefix(prompt, cache_salt, decoders, self._decode_load), local=True)
        hashes: dict[int, list[int]] = {}  # by block size: hashed once, whatever the number of workers
        return Route(min(prefillers, key=lambda w: self._prefill_cost(prompt, cache_salt, w, hashes)), local=False)

    def pick_decode(self, prompt: Sequence[int], workers: Sequence[WorkerState]) -> WorkerState | None:
        decoders = [w for w in workers if w.decode_capable and not w.draining]
        return min(decoders, key=self._decode_load, default=None)

    def prefill_sent(self, worker: WorkerState, prompt: Sequence[int], cache_salt: int = 0) -> None:
        self._remember_prefix(worker, prompt, cache_salt)
        self._prefill_tokens[worker.worker_id] += len(prompt)
        self._prefills_sent[worker.worker_id] += 1

    def prefill_ended(self, worker_id: str, num_tokens: int) -> None:
        if worker_id in self._prefill_tokens:  # a removed worker's count is gone already
            self._prefill_tokens[worker_id] = max(self._prefill_tokens[worker_id] - num_tokens, 0)

    def decode_sent(self, worker: WorkerState, prompt: Sequence[int], local: bool, cache_salt: int = 0,
                    session: str | None = None) -> None:
        if local:
            self._remember_prefix(worker, prompt, cache_salt)
        if session is not None:
            now = time.monotonic()
            self._sessions[session] = (worker.worker_id, now)
            self._sessions.move_to_end(session)
            while self._sessions and (len(self._sessions) > MAX_SESSIONS
                                      or now - next(iter(self._sessions.values()))[1] > self.session_ttl_s):
                self._sessions.popitem(last=False)
        pending = self._pending[worker.worker_id]
        pending.blocks += -(-len(prompt) // worker.block_size)
        pending.requests += 1

    def heartbeat(self, worker: WorkerState) -> None:
        self._pending.pop(worker.worker_id, None)

    def worker_removed(self, worker_id: str) -> None:
        self._prefixes.pop(worker_id, None)
        self._prefill_tokens.pop(worker_id, None)
        self._prefills_sent.pop(worker_id, None)
        self._pending.pop(worker_id, None)
        self.weights.pop(worker_id, None)

    def _holder(self, session: str, decoders: list[WorkerState]) -> WorkerState | None:
        """The decode worker holding the session's history, while it is fresh and the worker has room."""
        held = self._sessions.get(session)
        if held is None or time.monotonic() - held[1] > self.session_ttl_s:
            return None
        worker = next((w for w in decoders if w.worker_id == held[0]), None)
        return worker if worker is not None and not self._decode_load(worker)[0] else None

    def outstanding_prefill_tokens(self, worker_id: str) -> int:
        """Proxy-tracked tokens of prompts sent to ``worker_id`` and not yet done."""
        return self._prefill_tokens.get(worker_id, 0)

    def _best_by_prefix(self, prompt: Sequence[int], cache_salt: int, candidates: list[WorkerState],
                        load) -> WorkerState:
        hashes: dict[int, list[int]] = {}

        def score(worker: WorkerState):
            lru = self._prefixes.get(worker.worker_id)
            if lru is None:
                return (0, load(worker))
            return (-lru.leading_hits(_block_hashes(hashes, prompt, worker.block_size, cache_salt)), load(worker))

        return min(candidates, key=score)

    def _prefill_cost(self, prompt: Sequence[int], cache_salt: int, worker: WorkerState,
                      hashes: dict[int, list[int]]) -> tuple[float, int, int]:
        outstanding = self._prefill_tokens.get(worker.worker_id, 0) + worker.outstanding_prefill_tokens
        lru = self._prefixes.get(worker.worker_id)
        cached = 0
        if lru is not None:
            cached = lru.leading_hits(_block_hashes(hashes, prompt, worker.block_size, cache_salt)) * worker.block_size
        # Equal costs rotate by how many prompts each worker was given.
        cost = (outstanding + len(prompt) - cached) / self.weights.get(worker.worker_id, 1.0)
        return cost, outstanding, self._prefills_sent[worker.worker_id]

    def _decode_load(self, worker: WorkerState) -> tuple:
        pending = self._pending.get(worker.worker_id, _Pending())
        running = worker.num_running + pending.requests
        # a worker at its TPOT capacity (proxy/core/capacity.py) comes after any below it
        full = running >= worker.tpot_capacity
        weight = self.weights.get(worker.worker_id, 1.0)
        return (full, -(worker.free_blocks - pending.blocks) * weight, running / weight)

    def _remember_prefix(self, worker: WorkerState, prompt: Sequence[int], cache_salt: int) -> None:
        lru = self._prefixes.get(worker.worker_id)
        if lru is None:
            # The worker cannot cache more blocks than it has.
            lru = self._prefixes[worker.worker_id] = PrefixLRU(worker.num_blocks)
        lru.add(prefix_block_hashes(prompt, worker.block_size, cache_salt))


def _block_hashes(memo: dict[int, list[int]], prompt: Sequence[int], block_size: int, cache_salt: int) -> list[int]:
    """The prompt's block hashes at ``block_size``, computed once per routing decision (``memo``), whatever the
    number of workers scored."""
    if block_size not in memo:
        memo[block_size] = prefix_block_hashes(prompt, block_size, cache_salt)
    return memo[block_size]
