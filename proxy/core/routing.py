"""Routing policies: which worker gets a request.

A policy is an object; the cluster calls its hooks and never decides itself.

Hooks (all called by the cluster, in the event loop; ``cache_salt`` is the
request's tenant's, the root of its block hashes on the workers):
- ``route(prompt, workers, cache_salt, session)`` at admission: a ``Route`` that is either
  disaggregated (the prefill worker; the decode worker is picked later) or
  local (a decode-capable worker that prefills itself), or None when no
  worker can take the request. It carries the prompt tokens the index predicts the worker's prefix cache holds.
- ``pick_decode(prompt, workers, cache_salt)`` when a prefilled request gets its
  decode slot: the decode worker that pulls the pages, or None.
- ``prefill_sent(worker, prompt)`` / ``prefill_ended(worker_id, num_tokens)``
  bracket a PrefillRequest, on every path out (PrefillDone, failure, abort,
  worker loss); the cluster says which worker and how many tokens, so the
  policy keeps no per-request state.
- ``decode_sent`` when a DecodeRequest goes out (with the request's session, if any, and its wire id);
  ``decode_ended`` when that request ends; ``heartbeat`` when a worker reports its load; ``kv_pulled`` when a
  decode worker reports a pull's bytes and seconds; ``worker_removed`` when it is gone.

``PrefixAwareRouting`` (the default) routes on ``index``, the exact prefix index (``proxy/core/kv_index.py``, fed
by the workers' KV events): for a prompt's chained block hashes, salted as the workers salt them, how many leading
blocks each worker holds, so what its prefix cache would hit (capped as the engine caps it: the last token is
always computed). Another tenant's equal prompt predicts no hit, as it gets none; a worker's blocks of an old
epoch are gone from the index the moment it registers again.
- Prefill: the worker that would finish the prompt soonest: least (outstanding prefill tokens + the prompt's
  tokens it does not hold). Outstanding = proxy-tracked tokens of prompts sent and not yet done, plus the
  heartbeat's value. An idle cluster thus keeps a shared prefix on one worker, and a busy one spills to the
  others instead of queueing behind the cache.
- Decode (``pick_decode``, and the worker that prefills locally): below its TPOT capacity first, then least
  (blocks it must fill - its free blocks), in blocks: the prompt's blocks it lacks (it pulls only those, so the
  more of the prompt it holds the fewer), each counted once when it runs on the host of the prefill worker that
  holds the pages (``WorkerState.host``, from ``worker.host_name``: shared memory) or of its NVLink fabric
  (``WorkerState.interconnect_domain``, ``common/runtime/topology.py``), and ``CROSS_HOST_PULL_COST`` times when it
  does not, or when it must compute them itself (local prefill); then fewest running. So a
  conversation's history draws its next turn to the worker holding it, a shared system prompt's block or two
  does not pile every request onto one worker, and a prefill worker's pages go to a decode worker of its own
  host unless one elsewhere already holds nearly all of them or has far more room. Running counts the requests
  waiting there too. Both counts add what the proxy sent that the worker's last heartbeat does not count yet
  (the worker names the last DecodeRequest its load counts: one sent while its compute loop was in a step is
  not in the next heartbeat's load), so a burst spreads instead of piling onto one worker.
- Conditional disaggregation, on the *uncached suffix* on that decode worker (the prompt's tokens it does not
  hold): with ``local_prefill_threshold`` >= 0, a suffix shorter than it prefills there (0: never), and every
  prompt does when no prefill-role worker is available. With -1 (the default: derived) the threshold is the
  measured costs' break-even: the suffix prefills locally when its prompt step on the decode worker (its fitted
  step cost, ``Heartbeat.step_cost``; the prefill worker's while the decode worker has prefilled nothing to fit),
  counted once for the request and once for each sequence decoding there (each waits out that step), costs no
  more than disaggregating it: the prefill worker's queue, its prompt step for the tokens it lacks, and the pull
  of the blocks the decode worker lacks (at the rate the decode worker's pulls measured, ``KVPulled``). So an
  idle decode worker prefills what it would compute no slower, and a busy one only a suffix short enough that
  its running sequences barely notice; never one whose prompt step alone is longer than the worker's TPOT
  target (``WorkerState.tpot_target_ms``): its streams, and those it is about to take, would miss it (2,048-token
  prompts prefilled on a decode worker that was idle when they came stalled the streams that came after them). Until
  the prefill worker has fitted its prompt steps, a suffix shorter
  than one block prefills locally.
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

from common.protocol.wire import StepCostModel, prefix_block_hashes
from proxy.core.kv_index import KVIndex
from proxy.core.workers import WorkerState


MAX_SESSIONS = 100_000  # conversations remembered at once; past it the oldest is forgotten
DERIVED = -1  # local_prefill_threshold: the break-even of the measured costs
PULL_RATE_WEIGHT = 0.2  # of each pull in the moving average of a decode worker's pull rate
# A page pulled from another host costs this many pulled on one: a shared-memory read moved 14-20 GB/s here, TCP
# between hosts 0.4-1.3 GB/s (../shared/NOTES-nixl.md); the order of the decode candidates is what it sets. One
# NVLink fabric counts as one host: its GPUs read each other's memory over NVLink.
CROSS_HOST_PULL_COST = 16


@dataclass(frozen=True)
class Route:
    worker: WorkerState
    local: bool  # True: DecodeRequest without pages; False: PrefillRequest to ``worker``
    cached_tokens: int = 0  # the prompt tokens the index predicts ``worker``'s prefix cache holds


class RoutingPolicy(Protocol):
    index: KVIndex

    def route(self, prompt: Sequence[int], workers: Sequence[WorkerState], cache_salt: int = 0,
              session: str | None = None) -> Route | None: ...
    def pick_decode(self, prompt: Sequence[int], workers: Sequence[WorkerState], cache_salt: int = 0,
                    source: WorkerState | None = None) -> WorkerState | None: ...
    def prefill_sent(self, worker: WorkerState, prompt: Sequence[int]) -> None: ...
    def prefill_ended(self, worker_id: str, num_tokens: int) -> None: ...
    def outstanding_prefill_tokens(self, worker_id: str) -> int: ...
    def decode_sent(self, worker: WorkerState, prompt: Sequence[int], session: str | None = None,
                    request_id: str | None = None) -> None: ...
    def decode_ended(self, worker_id: str, request_id: str) -> None: ...
    def heartbeat(self, worker: WorkerState) -> None: ...
    def kv_pulled(self, worker_id: str, num_bytes: int, seconds: float) -> None: ...
    def worker_removed(self, worker_id: str) -> None: ...


class _Pending:
    """What this proxy sent a decode worker that its last heartbeat's load does not count yet: each DecodeRequest
    (request_id -> its prompt's blocks) in the order sent, which is the order the worker takes them in (one
    connection). A heartbeat naming one it took (``WorkerState.last_decode_taken``) counts it and every one before."""

    def __init__(self) -> None:
        self._sent: OrderedDict[str, int] = OrderedDict()
        self.blocks = 0

    @property
    def requests(self) -> int:
        return len(self._sent)

    def add(self, request_id: str, blocks: int) -> None:
        self._sent[request_id] = self._sent.pop(request_id, 0) + blocks
        self.blocks += blocks

    def counted(self, last_taken: str | None) -> None:
        """A heartbeat's load counts the requests through ``last_taken`` (None: all of them; one not here: those it
        counted earlier, or none this proxy still waits on)."""
        if last_taken is None:
            self._sent.clear()
            self.blocks = 0
        elif last_taken in self._sent:
            while self._sent:
                request_id, blocks = self._sent.popitem(last=False)
                self.blocks -= blocks
                if request_id == last_taken:
                    return

    def ended(self, request_id: str) -> None:
        """The request ended before a heartbeat counted it (refused, aborted, or finished at once)."""
        self.blocks -= self._sent.pop(request_id, 0)


class _Prompt:
    """One routing decision's view of a prompt: its block hashes per block size, and what each worker holds of
    them, computed once whatever the number of workers scored."""

    def __init__(self, prompt: Sequence[int], cache_salt: int, index: KVIndex) -> None:
        self.tokens = prompt
        self._salt = cache_salt
        self._index = index
        self._held: dict[int, dict[str, int]] = {}  # block size -> worker -> leading blocks held

    def cached_tokens(self, worker: WorkerState) -> int:
        """The prompt tokens ``worker``'s prefix cache would hit, as the engine counts them: whole blocks, at most
        all but the last token's."""
        bs = worker.block_size
        if bs not in self._held:
            hashes = prefix_block_hashes(self.tokens[:(len(self.tokens) - 1) // bs * bs], bs, self._salt)
            self._held[bs] = self._index.leading(hashes)
        return self._held[bs].get(worker.worker_id, 0) * bs

    def lacking_blocks(self, worker: WorkerState) -> int:
        """The prompt's blocks ``worker`` does not hold: those its pages fill (a pull), or its prompt step computes."""
        return -(-len(self.tokens) // worker.block_size) - self.cached_tokens(worker) // worker.block_size


class PrefixAwareRouting:
    def __init__(self, local_prefill_threshold: int = DERIVED, session_ttl_s: float = 600.0,
                 index: KVIndex | None = None) -> None:
        self.local_prefill_threshold = local_prefill_threshold
        self.session_ttl_s = session_ttl_s
        self.index = index if index is not None else KVIndex()
        self._sessions: OrderedDict[str, tuple[str, float]] = OrderedDict()  # session -> (decode worker, when)
        self._prefill_tokens: dict[str, int] = defaultdict(int)  # worker -> tokens sent, not yet done
        self._pending: dict[str, _Pending] = defaultdict(_Pending)
        self._sent_count = 0  # DecodeRequests, a key for those sent without an id
        self._prefills_sent: dict[str, int] = defaultdict(int)
        self._pull_rate: dict[str, float] = {}  # decode worker -> bytes per second its pulls measured
        self.weights: dict[str, float] = {}  # worker -> routing weight, when not 1 (the adaptive controller's)

    def route(self, prompt: Sequence[int], workers: Sequence[WorkerState], cache_salt: int = 0,
              session: str | None = None) -> Route | None:
        active = [w for w in workers if not w.draining]
        decoders = [w for w in active if w.decode_capable]
        if not decoders:
            return None
        view = _Prompt(prompt, cache_salt, self.index)
        holder = self._holder(session, decoders) if session is not None else None
        if holder is not None:
            return Route(holder, True, view.cached_tokens(holder))
        decoder = self._best_decoder(view, decoders)
        prefillers = [w for w in active if w.serves_prefill]
        if not prefillers:
            return Route(decoder, True, view.cached_tokens(decoder))
        prefiller = min(prefillers, key=lambda w: self._prefill_cost(view, w))
        if self._prefills_locally(view, decoder, prefiller):
            return Route(decoder, True, view.cached_tokens(decoder))
        return Route(prefiller, False, view.cached_tokens(prefiller))

    def pick_decode(self, prompt: Sequence[int], workers: Sequence[WorkerState], cache_salt: int = 0,
                    source: WorkerState | None = None) -> WorkerState | None:
        """The decode worker for a prompt prefilled on ``source`` (None: prefilled nowhere yet)."""
        decoders = [w for w in workers if w.decode_capable and not w.draining]
        return self._best_decoder(_Prompt(prompt, cache_salt, self.index), decoders, source) if decoders else None

    def prefill_sent(self, worker: WorkerState, prompt: Sequence[int]) -> None:
        self._prefill_tokens[worker.worker_id] += len(prompt)
        self._prefills_sent[worker.worker_id] += 1

    def prefill_ended(self, worker_id: str, num_tokens: int) -> None:
        if worker_id in self._prefill_tokens:  # a removed worker's count is gone already
            self._prefill_tokens[worker_id] = max(self._prefill_tokens[worker_id] - num_tokens, 0)

    def decode_sent(self, worker: WorkerState, prompt: Sequence[int], session: str | None = None,
                    request_id: str | None = None) -> None:
        if session is not None:
            now = time.monotonic()
            self._sessions[session] = (worker.worker_id, now)
            self._sessions.move_to_end(session)
            while self._sessions and (len(self._sessions) > MAX_SESSIONS
                                      or now - next(iter(self._sessions.values()))[1] > self.session_ttl_s):
                self._sessions.popitem(last=False)
        self._sent_count += 1
        self._pending[worker.worker_id].add(request_id or f"#{self._sent_count}", -(-len(prompt) // worker.block_size))

    def decode_ended(self, worker_id: str, request_id: str) -> None:
        if (pending := self._pending.get(worker_id)) is not None:
            pending.ended(request_id)

    def heartbeat(self, worker: WorkerState) -> None:
        if (pending := self._pending.get(worker.worker_id)) is not None:
            pending.counted(worker.last_decode_taken)

    def kv_pulled(self, worker_id: str, num_bytes: int, seconds: float) -> None:
        if num_bytes and seconds > 0:
            rate = num_bytes / seconds
            old = self._pull_rate.get(worker_id)
            self._pull_rate[worker_id] = rate if old is None else old + PULL_RATE_WEIGHT * (rate - old)

    def worker_removed(self, worker_id: str) -> None:
        self._prefill_tokens.pop(worker_id, None)
        self._prefills_sent.pop(worker_id, None)
        self._pending.pop(worker_id, None)
        self._pull_rate.pop(worker_id, None)
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

    def _best_decoder(self, view: _Prompt, decoders: list[WorkerState],
                      source: WorkerState | None = None) -> WorkerState:
        def score(worker: WorkerState) -> tuple:
            full, emptiness, running = self._decode_load(worker)  # emptiness: its free blocks, negated
            nearby = source is not None and bool(near(source, worker))
            moved = view.lacking_blocks(worker) * (1 if nearby else CROSS_HOST_PULL_COST)
            return (full, moved + emptiness, running)

        return min(decoders, key=score)

    def _prefill_cost(self, view: _Prompt, worker: WorkerState) -> tuple[float, int, int]:
        outstanding = self._outstanding(worker)
        # Equal costs rotate by how many prompts each worker was given.
        cost = (outstanding + len(view.tokens) - view.cached_tokens(worker)) / self.weights.get(worker.worker_id, 1.0)
        return cost, outstanding, self._prefills_sent[worker.worker_id]

    def _outstanding(self, worker: WorkerState) -> int:
        return self._prefill_tokens.get(worker.worker_id, 0) + worker.outstanding_prefill_tokens

    def _prefills_locally(self, view: _Prompt, decoder: WorkerState, prefiller: WorkerState) -> bool:
        """Whether the prompt's uncached suffix on ``decoder`` is short enough to prefill there (the module's
        docstring says how short)."""
        cached = view.cached_tokens(decoder)
        suffix = len(view.tokens) - cached
        if self.local_prefill_threshold >= 0:
            return suffix < self.local_prefill_threshold
        prefill_model = prefiller.step_cost if prefiller.step_cost and prefiller.step_cost.times_prompts else None
        decode_model = decoder.step_cost if decoder.step_cost and decoder.step_cost.times_prompts else None
        if prefill_model is None:
            return suffix < decoder.block_size
        step_ms = _prompt_ms(decode_model or prefill_model, suffix, cached)
        if decoder.tpot_target_ms and step_ms > decoder.tpot_target_ms:
            return False  # one step past the TPOT target: every stream decoding there would miss it
        stalled = 1 + decoder.num_running + self._pending.get(decoder.worker_id, _Pending()).requests
        local_ms = step_ms * stalled
        prefill_cached = view.cached_tokens(prefiller)
        queue_ms = _prompt_ms(prefill_model, self._outstanding(prefiller), 0) if self._outstanding(prefiller) else 0.0
        rate = self._pull_rate.get(decoder.worker_id)
        pull_ms = view.lacking_blocks(decoder) * _block_bytes(decoder) / rate * 1e3 if rate else 0.0
        remote_ms = queue_ms + _prompt_ms(prefill_model, len(view.tokens) - prefill_cached, prefill_cached) + pull_ms
        return local_ms <= remote_ms

    def _decode_load(self, worker: WorkerState) -> tuple:
        pending = self._pending.get(worker.worker_id, _Pending())
        running = worker.num_running + worker.num_waiting + pending.requests
        # a worker at its TPOT capacity (proxy/core/capacity.py) comes after any below it
        full = running >= worker.tpot_capacity
        weight = self.weights.get(worker.worker_id, 1.0)
        return (full, -(worker.free_blocks - pending.blocks) * weight, running / weight)


def _prompt_ms(model: StepCostModel, tokens: int, cached: int) -> float:
    """A step computing ``tokens`` prompt tokens after ``cached`` ones, alone, by a worker's fitted step cost."""
    return model.step_ms(0, 0, tokens, tokens * cached + tokens * (tokens + 1) // 2)


def _block_bytes(worker: WorkerState) -> int:
    """One KV block's bytes (every layer's K and V) in ``worker``'s layout."""
    return worker.kv_layout.bytes_per_token * worker.kv_layout.block_size


def near(source: WorkerState | None, worker: WorkerState) -> str:
    """How pages of ``source`` reach ``worker`` without crossing the network: ``"same_host"`` (shared memory, or CUDA
    IPC), ``"same_fabric"`` (one multi-node NVLink fabric), or "" (the network; also when either did not say where
    it runs). ``"same_host"`` without a source: nothing to pull."""
    if source is None or (source.host and source.host == worker.host):
        return "same_host"
    if source.interconnect_domain and source.interconnect_domain == worker.interconnect_domain:
        return "same_fabric"
    return ""
