"""The decode worker: pulls prompt pages, then generates with continuous batching.

Request life cycle:
  DecodeRequest with pages -> the leading blocks its own prefix cache already
  holds are taken as they are (``transfer.delta_pull``), local blocks reserved for
  the rest -> one-sided pull of those from the prefill worker's pool
  (kv_transfer, polled each turn, with a deadline; none when every block was held)
  -> KVPulled to the proxy (which tells the prefill worker to release) ->
  the sequence joins the running batch at position len(prompt), its first
  token already known -> a TokenDelta per step (all of a step's in one TokenDeltas) -> the last delta carries
  finish_reason; its blocks go back to the pool.
  A pull that fails or times out frees the reserved blocks and the prompt is
  recomputed here (the KV-load failure policy), so the request still
  completes. So does one that cannot be done within the pages' lease
  (``kv_lease_left_s``, from the proxy): past it the prefill worker may have
  handed the pages to another request, so a late pull is never used.
  A DecodeRequest without pages (short prompt, no prefill worker, or role
  ``both``) is prefilled here from the start.
  Abort during a pull waits for the transfer to stop before the blocks are
  freed, so no transfer ever writes into a reused block.
  A pipelined hand-off (``DecodeRequest.kv_pipelined``, sent with the prompt to its prefill worker) reserves the
  blocks at once and pulls each layer group KVProgress names while the prompt is computed; the DecodeRequest after
  PrefillDone pulls the rest (``decode_worker/pipelined_pull.py``). Without the reservation (no room, an unknown
  peer, draining) the pages are pulled after PrefillDone as above.
"""
from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass, field

from common.protocol import wire
from common.engine.sequence import FinishReason, Sequence
from common.runtime.embed_queue import EmbedQueue
from common.runtime.worker_runtime import WorkerBase
from decode_worker.pipelined_pull import Outcome, PipelinedPull, pull_bound
from kv_transfer.base import TransferStatus

log = logging.getLogger(__name__)
DECODE_SPAN = "decode_worker.decode"
TRANSFER_SPAN = "decode_worker.kv_transfer"
# How often a loop with nothing to compute polls its KV pulls. A page pull over shared memory takes about 10 us
# and a prompt's pages well under a millisecond, so this adds at most a fraction of a millisecond to a TTFT,
# where polling without a pause kept a core busy for the whole pull.
PULL_POLL_S = 0.0005
# A pull must be done this long before the lease the proxy reported runs out: the proxy measures the lease from
# when PrefillDone reached it, the prefill worker from when it sent it, and the DecodeRequest takes time to arrive.
LEASE_MARGIN_S = 0.25


@dataclass
class Pull:
    seq: Sequence
    handle: object
    source: str
    started: float
    num_bytes: int
    lease_ends: float  # time.monotonic() past which the source's pages may hold another request's KV
    aborted: bool = False
    staging: list[int] = field(default_factory=list)  # blocks the pages land in first from a peer of another TP


@dataclass
class DelayedPull:
    """A pull held back by the ``fault_kv_pull_delay_s`` fault injection until ``due``."""
    msg: wire.DecodeRequest
    seq: Sequence
    lease_ends: float
    due: float


class DecodeHandler(WorkerBase):
    role = "decode"

    def __init__(self, config, make_transfer, role: str = "decode") -> None:
        self.role = role
        super().__init__(config, make_transfer)
        if config.testing.fault_kv_pull_delay_s:
            log.warning("fault injection: every KV pull starts testing.fault_kv_pull_delay_s=%gs late",
                        config.testing.fault_kv_pull_delay_s)

    def reset(self) -> None:
        self.pulls: dict[str, Pull] = {}
        self.delayed: dict[str, DelayedPull] = {}  # only with fault_kv_pull_delay_s
        self.pipelined: dict[str, PipelinedPull] = {}  # pipelined hand-offs, from their first DecodeRequest on
        self.peers: dict[str, int] = {}  # prefill worker id -> epoch known to the transfer agent
        self.embeds = EmbedQueue(self) if self.role == "both" else None  # /v1/embeddings: prefill-capable roles

    # ---- inbound --------------------------------------------------------------
    def handle(self, msg) -> None:
        if isinstance(msg, wire.DecodeRequest):
            self._reserve(msg) if msg.kv_pipelined else self._start(msg)
        elif isinstance(msg, wire.KVProgress):
            state = self.pipelined.get(msg.request_id)
            if state is not None and msg.worker_id == state.source:
                state.on_progress(msg, self.transfer, self.config.kv_pull_timeout_s)
        elif isinstance(msg, wire.Abort):
            pull = self.pulls.get(msg.request_id)
            if msg.request_id in self.pipelined:
                self._drop_pipelined(msg.request_id)
            elif pull is not None:
                self.transfer.abort(pull.handle)
                pull.aborted = True
            else:
                self.delayed.pop(msg.request_id, None)
                self.engine.abort_request(msg.request_id)
                if self.embeds is not None:
                    self.embeds.cancel(msg.request_id)
        elif isinstance(msg, wire.Peers):
            self._update_peers(msg.peers)
        elif isinstance(msg, wire.EmbedRequest) and self.embeds is not None:
            self.embeds.add(msg)
        else:
            log.warning("decode worker ignores %s", type(msg).__name__)

    def _update_peers(self, peers: list[wire.PeerInfo]) -> None:
        listed = {p.worker_id for p in peers}
        for worker_id in [w for w in self.peers if w not in listed]:
            self.transfer.remove_peer(worker_id)
            del self.peers[worker_id]
        for peer in peers:
            if self.peers.get(peer.worker_id) == peer.epoch:
                continue
            if peer.worker_id in self.peers:
                self.transfer.remove_peer(peer.worker_id)
            try:
                self.transfer.add_peer(peer.worker_id, peer.transfer_metadata)
                self.peers[peer.worker_id] = peer.epoch
            except Exception:
                log.exception("cannot reach prefill worker %s for KV transfer", peer.worker_id)

    def _reserve(self, msg: wire.DecodeRequest) -> None:
        """A pipelined hand-off's first DecodeRequest: reserve the prompt's blocks for the layer groups to come."""
        source = msg.source_worker_id or ""
        if (self.draining or msg.request_id in self.pipelined or source not in self.peers
                or (msg.source_epoch and msg.source_epoch != self.peers[source])):
            return  # the pages are pulled after PrefillDone, as without pipelining
        reserved = self.engine.reserve_prompt(msg.prompt_token_ids + msg.output_token_ids, msg.cache_salt,
                                              self.config.transfer.delta_pull)
        if reserved is None:
            return
        wait_s = self.config.kv_pull_timeout_s if msg.kv_lease_left_s is None else msg.kv_lease_left_s
        self.pipelined[msg.request_id] = PipelinedPull(
            msg.request_id, source, self.peers[source], *reserved, self.engine.runner.layout.num_layers,
            self.transfer.needs_staging(source), time.monotonic() + wait_s)

    def _drop_pipelined(self, request_id: str) -> None:
        """Abort its pulls and free its blocks, or end its sequence."""
        state = self._cancel_pipelined(request_id)
        if state.seq is not None:
            self.engine.abort_request(request_id)
            self.trace_end(request_id, TRANSFER_SPAN, "cancelled")

    def _cancel_pipelined(self, request_id: str) -> PipelinedPull:
        """Abort its pulls (no byte lands once that returns) and free the blocks no sequence owns."""
        state = self.pipelined.pop(request_id)
        state.cancel(self.transfer)
        self.engine.free_blocks(state.staging)
        if state.seq is None:
            self.engine.free_blocks(state.block_ids)
        self.metrics.kv_pipelined.labels("cancelled").inc()
        return state

    def _start_pipelined(self, msg: wire.DecodeRequest, state: PipelinedPull) -> None:
        """The DecodeRequest after PrefillDone of a pipelined hand-off: the sequence takes the reserved blocks, and
        the rest of the pages is pulled once the layer groups in flight are in."""
        seq = self.intake(msg, "decode", lambda params: self.engine.add_prefilled_request(
            msg.request_id, msg.prompt_token_ids, msg.first_token, params, msg.seed, msg.first_logprob,
            list(msg.first_top_logprobs or []), msg.output_token_ids, msg.cache_salt, self.config.transfer.delta_pull,
            reserved=(state.block_ids, state.held)))
        if seq is None:
            self.pipelined[msg.request_id] = state
            self._drop_pipelined(msg.request_id)
            return
        _set_fairness(seq, msg)
        self.trace_start(msg.request_id, DECODE_SPAN, msg.trace_context)
        self.trace_start(msg.request_id, TRANSFER_SPAN, msg.trace_context)
        now = time.monotonic()
        lease_ends = math.inf if msg.kv_lease_left_s is None else now + msg.kv_lease_left_s - LEASE_MARGIN_S
        staging = self.engine.reserve_blocks(len(state.block_ids) - state.held) if state.staged else []
        if state.staged and not staging:
            state.failed = "no free KV blocks to stage the pages of a prefill worker of another tensor parallelism"
        self.metrics.kv_blocks_reused.inc(state.held)
        state.finish(seq, msg.source_block_ids, lease_ends, staging)
        state.finished_at = now
        self.pipelined[msg.request_id] = state

    def _start(self, msg: wire.DecodeRequest) -> None:
        state = self.pipelined.pop(msg.request_id, None)
        if state is not None:
            if (msg.first_token is not None and msg.source_worker_id == state.source
                    and msg.source_epoch in (0, state.epoch) and len(msg.source_block_ids) == len(state.block_ids)):
                return self._start_pipelined(msg, state)
            self.pipelined[msg.request_id] = state
            self._drop_pipelined(msg.request_id)
        if msg.first_token is None:  # no pages: the prompt is computed here
            seqs = self.intake(msg, "decode", lambda params: self.engine.add_request(
                msg.request_id, msg.prompt_token_ids, params, seed=msg.seed,
                output_token_ids=msg.output_token_ids, cache_salt=msg.cache_salt))
            if seqs is not None:
                for seq in seqs:
                    _set_fairness(seq, msg)
                self.metrics.prompt_tokens.inc(len(msg.prompt_token_ids) + len(msg.output_token_ids))
                self.trace_start(msg.request_id, DECODE_SPAN, msg.trace_context)
            return
        seq = self.intake(msg, "decode", lambda params: self.engine.add_prefilled_request(
            msg.request_id, msg.prompt_token_ids, msg.first_token, params, msg.seed, msg.first_logprob,
            list(msg.first_top_logprobs or []), msg.output_token_ids, msg.cache_salt, self.config.transfer.delta_pull))
        if seq is None:
            return
        _set_fairness(seq, msg)
        self.trace_start(msg.request_id, DECODE_SPAN, msg.trace_context)
        now = time.monotonic()
        lease_ends = math.inf if msg.kv_lease_left_s is None else now + msg.kv_lease_left_s - LEASE_MARGIN_S
        if self.config.testing.fault_kv_pull_delay_s:
            due = now + self.config.testing.fault_kv_pull_delay_s
            self.delayed[msg.request_id] = DelayedPull(msg, seq, lease_ends, due)
        else:
            self._pull(msg, seq, lease_ends)

    def _pull(self, msg: wire.DecodeRequest, seq: Sequence, lease_ends: float) -> None:
        """Pull the pages of the blocks this worker lacks: its own cached copies of the leading ones
        (``seq.num_cached_blocks``, with ``transfer.delta_pull``) stay as they are."""
        problem = None
        started = time.monotonic()  # a shared-memory pull may complete inside start_pull
        held = seq.num_cached_blocks
        if not seq.block_table:
            problem = "no free KV blocks to receive the pages"
        elif len(msg.source_block_ids) != len(seq.block_table):
            problem = f"{len(msg.source_block_ids)} pages offered for {len(seq.block_table)} blocks"
        elif held == len(seq.block_table):
            self._reused_all(msg, seq, held)
            return
        elif msg.source_worker_id not in self.peers:
            problem = f"prefill worker {msg.source_worker_id!r} is not a known transfer peer"
        elif msg.source_epoch and msg.source_epoch != self.peers[msg.source_worker_id]:
            # It restarted (or registered again) since it lent them: its pool holds other KV under those ids now.
            problem = (f"the pages are of epoch {msg.source_epoch} of prefill worker {msg.source_worker_id!r}, which "
                       f"is at epoch {self.peers[msg.source_worker_id]} now: pull refused")
            self.metrics.kv_pull_refused()
        elif started >= lease_ends:
            problem = "the pages' lease (the proxy's kv_lease_s) ran out before the pull could start"
        missing = seq.block_table[held:]
        staging: list[int] = []
        if problem is None and self.transfer.needs_staging(msg.source_worker_id):
            # A prefill worker of another tensor parallelism: its ranks hold other head slices than ours
            staging = self.engine.reserve_blocks(len(missing))
            if not staging:
                problem = "no free KV blocks to stage the pages of a prefill worker of another tensor parallelism"
        if problem is None:
            try:
                deadline_s, setting = pull_bound(self.config.kv_pull_timeout_s, lease_ends - started)
                handle = self.transfer.start_pull(msg.request_id, msg.source_worker_id, msg.source_block_ids[held:],
                                                  missing, deadline_s, staging or None, deadline_setting=setting)
            except Exception as exc:  # a backend refusing a pull must not take the worker down
                problem = f"pull failed to start: {exc}"
        if problem is not None:
            self.engine.free_blocks(staging)
            log.warning("request %s: %s; recomputing the prompt here", msg.request_id, problem)
            self.metrics.kv_pulled(False, 0, 0.0)
            self.engine.kv_failed(seq)
            self.send(wire.KVPulled(msg.request_id, msg.source_worker_id or "", False, error=problem))
            return
        self.metrics.kv_blocks_reused.inc(held)
        nbytes = len(missing) * self.engine.runner.layout.bytes_per_block
        self.pulls[msg.request_id] = Pull(seq, handle, msg.source_worker_id, started, nbytes, lease_ends,
                                          staging=staging)
        self.trace_start(msg.request_id, TRANSFER_SPAN, msg.trace_context)

    def _reused_all(self, msg: wire.DecodeRequest, seq: Sequence, held: int) -> None:
        """Every page's block is already cached here: nothing to pull, and the prefill worker may free its pages."""
        self.metrics.kv_blocks_reused.inc(held)
        self.metrics.kv_pulled(True, 0, 0.0)
        self.send(wire.KVPulled(msg.request_id, msg.source_worker_id or "", True))
        self.engine.kv_ready(seq)

    # ---- the turn ---------------------------------------------------------------
    def tick(self) -> None:
        now = time.monotonic()
        for request_id in [r for r, delayed in self.delayed.items() if delayed.due <= now]:
            delayed = self.delayed.pop(request_id)
            self._pull(delayed.msg, delayed.seq, delayed.lease_ends)
        for request_id, pull in list(self.pulls.items()):
            status = self.transfer.poll(pull.handle)
            if status in (TransferStatus.DONE, TransferStatus.FAILED):
                self._finish_pull(request_id, pull, status is TransferStatus.DONE)
        for request_id, state in list(self.pipelined.items()):
            if state.seq is None and now >= state.wait_ends:
                log.warning("request %s: no PrefillDone within the bound its pipelined DecodeRequest gave "
                            "(kv_lease_left_s); its reserved blocks are freed", request_id)
                self._drop_pipelined(request_id)
            elif (outcome := state.advance(self.transfer, now, self.config.kv_pull_timeout_s)) is not None:
                self._finish_pipelined(request_id, state, outcome)
        if self._embeds_queued:
            self.embeds.run()
        if self.engine.has_work():  # not while every request waits for its pages
            with self.cores:
                outputs = self.engine.step()
            deltas = []
            for out in outputs:
                try:
                    delta = self._delta(out)
                except Exception as exc:  # that request ends; the step's others still get their tokens
                    log.exception("reporting the step of request %s failed", out.request_id)
                    self.metrics.internal_errors.inc()
                    self.contain(out.request_id, f"the worker failed on this request ({type(exc).__name__}: {exc})")
                    continue
                if delta is not None:
                    deltas.append(delta)
            if deltas:
                self.send(wire.TokenDeltas(deltas))

    def _finish_pull(self, request_id: str, pull: Pull, ok: bool) -> None:
        del self.pulls[request_id]
        self.transfer.release(pull.handle)
        self.engine.free_blocks(pull.staging)  # no byte lands in them once release returned
        now = time.monotonic()
        error = "" if ok else pull.handle.error or "the transfer failed"
        if ok and now > pull.lease_ends:  # done, but seen too late to know it read the pages before they were freed
            ok, error = False, "the pull ended after the pages' lease (the proxy's kv_lease_s)"
        seconds = now - pull.started
        self.metrics.kv_pulled(ok, pull.num_bytes, seconds)
        self.trace_end(request_id, TRANSFER_SPAN, error or None)
        self.send(wire.KVPulled(request_id, pull.source, ok, pull.num_bytes if ok else 0, seconds, error,
                                self.transfer.name))
        if pull.aborted:
            self.engine.abort_request(request_id)
        elif ok:
            self.engine.kv_ready(pull.seq)
        else:
            log.warning("request %s: KV pull from %s failed (%s); recomputing the prompt here",
                        request_id, pull.source, error)
            self.engine.kv_failed(pull.seq)

    def _finish_pipelined(self, request_id: str, state: PipelinedPull, outcome: Outcome) -> None:
        del self.pipelined[request_id]
        self.engine.free_blocks(state.staging)  # no byte lands in them once the pulls were released
        seconds = time.monotonic() - state.finished_at
        self.metrics.kv_pulled(outcome.ok, outcome.num_bytes, seconds)
        self.metrics.kv_pipelined.labels("ok" if outcome.ok else "recomputed").inc()
        self.metrics.kv_pipelined_bytes.labels("during_prefill").inc(state.bytes_during)
        self.metrics.kv_pipelined_bytes.labels("after_prefill").inc(state.bytes_after)
        self.trace_end(request_id, TRANSFER_SPAN, outcome.error or None)
        self.send(wire.KVPulled(request_id, state.source, outcome.ok, outcome.num_bytes if outcome.ok else 0, seconds,
                                outcome.error, self.transfer.name))
        if outcome.ok:
            self.engine.kv_ready(state.seq)
        else:
            log.warning("request %s: pipelined KV pull from %s failed (%s); recomputing the prompt here",
                        request_id, state.source, outcome.error)
            self.engine.kv_failed(state.seq)

    def _delta(self, out) -> wire.TokenDelta | None:
        """What the proxy hears of one request's step: None for an abort, a failure (sent as RequestFailed), or a
        step that added nothing."""
        o = out.outputs[0]
        if o.finish_reason == FinishReason.ABORT.value:
            self.metrics.request_done("decode", "aborted")
            self.trace_end(out.request_id, DECODE_SPAN, "aborted")
            return None
        if o.finish_reason == FinishReason.ERROR.value:
            self.fail_nonfinite(out.request_id, "decode", DECODE_SPAN)
            return None
        if o.finish_reason is not None:
            self.metrics.request_done("decode", "completed")
            self.trace_end(out.request_id, DECODE_SPAN)
        n = len(o.token_ids_delta)
        if n == 0 and not o.text_delta and o.finish_reason is None:
            return None
        return wire.TokenDelta(
            request_id=out.request_id, token_ids=o.token_ids_delta, text=o.text_delta,
            finish_reason=o.finish_reason, stop_reason=o.stop_reason,
            logprobs=o.logprobs_delta, top_logprobs=o.top_logprobs_delta,
            num_cached_tokens=out.num_cached_tokens,
        )

    # ---- drain --------------------------------------------------------------------
    @property
    def _embeds_queued(self) -> bool:
        return self.embeds is not None and bool(self.embeds.queue)

    def busy(self) -> bool:
        return bool(self.pulls or self.pipelined) or self._embeds_queued or self.engine.has_unfinished()

    def wait_s(self, idle_s: float) -> float:
        """Pulls in flight are polled every ``PULL_POLL_S``; the loop does not spin on them."""
        if self.engine.has_work() or self._embeds_queued:
            return 0.0
        if self.pulls or any(state.parts or state.seq is not None for state in self.pipelined.values()):
            return PULL_POLL_S
        due = min([delayed.due for delayed in self.delayed.values()]
                  + [state.wait_ends for state in self.pipelined.values()], default=math.inf)
        return max(0.0, min(idle_s, due - time.monotonic()))

    def fail_all(self, reason: str, only: set[str] | None = None) -> None:
        mine = (lambda request_id: True) if only is None else only.__contains__
        for request_id in [r for r in self.delayed if mine(r)]:
            del self.delayed[request_id]  # their sequences are the engine's, failed below
        for request_id in [r for r in self.pipelined if mine(r)]:
            self._cancel_pipelined(request_id)  # a sequence it has is the engine's, failed below
        if self.embeds is not None:
            self.embeds.fail_all(reason, only)
        for request_id, pull in self.pulls.items():
            if mine(request_id):
                self.transfer.abort(pull.handle)
                pull.aborted = True
        deadline = time.monotonic() + self.config.kv_pull_timeout_s
        while any(map(mine, self.pulls)) and time.monotonic() < deadline and self.engine.runner.tp.broken is None:
            self.tick()  # (no step runs on a broken rank group: those pulls' requests fail below all the same)
            time.sleep(0.001)
        for request_id in [r for r in self.engine.requests if mine(r)]:
            self.fail(request_id, "decode", DECODE_SPAN, reason)
        if only is None and self.engine.has_unfinished() and self.engine.runner.tp.broken is None:
            self.engine.step()  # with ``only`` the next turn reports the aborts, and the others' tokens with them


def _set_fairness(seq: Sequence, msg: wire.DecodeRequest) -> None:
    """Under KV pressure the scheduler preempts the lowest lane (largest number), highest counter first."""
    seq.priority = msg.priority
    seq.fairness_counter = msg.fairness_counter
    seq.keep_s = msg.keep_s  # a session's turn: its history stays cached for its next one
