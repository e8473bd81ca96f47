"""The prefill worker: computes prompts, samples the first token, lends the pages.

Request life cycle:
  PrefillRequest -> engine waiting queue (prefill_only) -> prompt computed
  (batched with other prompts under the step token budget, chunked when
  long) -> first token sampled -> PrefillDone(first token, block ids) to the
  proxy -> pages held under a lease -> ReleaseKV (the decode worker pulled
  them, or the request ended) frees them; a lease not released within
  ``kv_lease_s`` expires and frees them anyway.
  A pipelined prompt (``kv_pipeline_layer_groups``) also sends KVProgress each
  time a layer group of one of its chunks is computed (``prefill_worker/pipeline.py``):
  its decode worker pulls those layers while the rest of the step runs.
  A request whose first token already ends it (EOS, stop, max_tokens=1)
  reports its finish_reason and frees its pages at once.
  Abort frees the request wherever it is.
  Draining (SIGTERM): no new prompt is taken; the prompts under way finish,
  then the worker keeps lending their pages (the decode workers' pulls, the
  ReleaseKV after each) until every lease is released or has ended, within
  ``drain_timeout_s``; only then are the pages freed and the worker exits.
  Pages still lent when drain_timeout_s ends are freed, and their prompts
  recomputed where they decode.
  EmbedRequest (/v1/embeddings) is computed between engine steps (``common/runtime/embed_queue.py``).
"""
from __future__ import annotations

import logging
import time

from common.protocol import wire
from common.engine.llm_engine import RequestOutput
from common.engine.sequence import FinishReason, Sequence
from common.runtime.embed_queue import EmbedQueue
from common.runtime.worker_runtime import WorkerBase
from prefill_worker.pipeline import LayerProgress

log = logging.getLogger(__name__)
SPAN = "prefill_worker.prefill"


class PrefillHandler(WorkerBase):
    role = "prefill"

    def reset(self) -> None:
        self.computing: dict[str, tuple[Sequence, float]] = {}  # request id -> (seq, lease seconds)
        self.leases: dict[str, tuple[Sequence, float]] = {}  # request id -> (seq, expiry)
        self.embeds = EmbedQueue(self)
        self.lending_said = False  # the drain said once that it now only waits for its pages to be pulled
        self.progress: LayerProgress | None = None  # built with the first pipelined prompt

    # ---- inbound ------------------------------------------------------------
    def handle(self, msg) -> None:
        if isinstance(msg, wire.PrefillRequest):
            self._start(msg)
        elif isinstance(msg, wire.ReleaseKV):
            self._release(msg.request_id)
        elif isinstance(msg, wire.EmbedRequest):
            self.embeds.add(msg)
        elif isinstance(msg, wire.Abort):
            self.embeds.cancel(msg.request_id)
            if msg.request_id in self.computing:
                self.engine.abort_request(msg.request_id)
                self.computing.pop(msg.request_id)
                self._unpipeline(msg.request_id)
                self.metrics.request_done("prefill", "aborted")
                self.trace_end(msg.request_id, SPAN, "aborted")
            self._release(msg.request_id)
        elif not isinstance(msg, wire.Peers):
            log.warning("prefill worker ignores %s", type(msg).__name__)

    def _start(self, msg: wire.PrefillRequest) -> None:
        seqs = self.intake(msg, "prefill", lambda params: self.engine.add_request(
            msg.request_id, msg.prompt_token_ids, params, seed=msg.seed, prefill_only=True,
            output_token_ids=msg.output_token_ids, cache_salt=msg.cache_salt))
        if seqs is None:
            return
        (seq,) = seqs
        self.metrics.prompt_tokens.inc(len(msg.prompt_token_ids))
        self.trace_start(msg.request_id, SPAN, msg.trace_context)
        seq.priority = msg.priority  # the scheduler's preemption order: lowest lane, highest counter first
        seq.fairness_counter, seq.keep_s = msg.fairness_counter, msg.keep_s
        self.computing[msg.request_id] = (seq, msg.lease_s)
        if msg.kv_pipeline_layer_groups:
            if self.progress is None:
                runner = self.engine.runner
                self.progress = LayerProgress(runner.layout.num_layers, runner.layout.block_size,
                                              self.config.worker_id, self.send)
            self.progress.add(msg.request_id, msg.kv_pipeline_layer_groups)

    def _unpipeline(self, request_id: str) -> None:
        if self.progress is not None:
            self.progress.discard(request_id)

    def _release(self, request_id: str) -> None:
        lease = self.leases.pop(request_id, None)
        if lease is not None:
            self.engine.release_held(lease[0])

    # ---- the turn -------------------------------------------------------------
    def tick(self) -> None:
        now = time.monotonic()
        for request_id in [r for r, (_, expiry) in self.leases.items() if expiry <= now]:
            log.warning("KV lease of %s expired unpulled; pages freed", request_id)
            self.metrics.kv_lease_expirations.inc()
            self._release(request_id)
        if self.draining and self.leases and not self.computing and not self.lending_said:
            self.lending_said = True
            log.info("draining: prompts done; lending the pages of %d requests until they are pulled or their "
                     "lease (the proxy's kv_lease_s) ends, within drain_timeout_s=%gs of the signal",
                     len(self.leases), self.config.drain_timeout_s)
        if self.embeds.queue:
            self.embeds.run()
        if not self.engine.has_work():
            return
        with self.cores:
            outputs = self.engine.step(self.progress.hook(self.epoch) if self.progress is not None else None)
        if self.progress is not None:
            self.progress.after_step(self.computing, self.epoch)
        for out in outputs:
            if out.finished and out.request_id in self.computing:
                self._unpipeline(out.request_id)
                self._report(*self.computing.pop(out.request_id), out)

    def _report(self, seq: Sequence, lease_s: float, out: RequestOutput) -> None:
        o = out.outputs[0]
        if o.finish_reason == FinishReason.ABORT.value:
            self.metrics.request_done("prefill", "aborted")
            self.trace_end(out.request_id, SPAN, "aborted")
            return
        if o.finish_reason == FinishReason.ERROR.value:
            self.fail_nonfinite(out.request_id, "prefill", SPAN)
            return
        self.metrics.request_done("prefill", "completed")
        self.trace_end(out.request_id, SPAN)
        handoff = o.finish_reason == FinishReason.HANDOFF.value
        top = o.top_logprobs[-1] if o.top_logprobs else None  # the sampled token is the output's last
        self.send(wire.PrefillDone(
            request_id=out.request_id, worker_id=self.config.worker_id, epoch=self.epoch,
            first_token=o.token_ids[-1], text=o.text_delta, block_ids=list(seq.block_table) if handoff else [],
            num_cached_tokens=out.num_cached_tokens,
            finish_reason=None if handoff else o.finish_reason, stop_reason=o.stop_reason,
            logprob=o.logprobs[-1] if o.logprobs else None, top_logprobs=top,
        ))
        if handoff:
            self.leases[out.request_id] = (seq, time.monotonic() + lease_s)
        else:
            self.engine.release_held(seq)

    # ---- drain ------------------------------------------------------------------
    def busy(self) -> bool:
        return bool(self.computing or self.leases or self.embeds.queue)

    def wait_s(self, idle_s: float) -> float:
        """Pages lent out need no turns of the loop: it wakes for a message or for the next lease's expiry."""
        if self.engine.has_work() or self.embeds.queue:
            return 0.0
        if not self.leases:
            return idle_s
        return max(0.0, min(idle_s, min(expiry for _, expiry in self.leases.values()) - time.monotonic()))

    def fail_all(self, reason: str, only: set[str] | None = None) -> None:
        mine = (lambda request_id: True) if only is None else only.__contains__
        self.embeds.fail_all(reason, only)
        for request_id in [r for r in self.computing if mine(r)]:
            self.computing.pop(request_id)
            self._unpipeline(request_id)
            self.fail(request_id, "prefill", SPAN, reason)
        lent = [r for r in self.leases if mine(r)]
        if lent and self.draining:
            log.warning("drain_timeout_s=%gs ended with the pages of %d requests not yet pulled; freeing them (their "
                        "prompts are recomputed where they decode)", self.config.drain_timeout_s, len(lent))
        for request_id in lent:
            self._release(request_id)
        if only is None and self.engine.has_unfinished() and self.engine.runner.tp.broken is None:
            self.engine.step()  # reports the aborts, so the engine forgets them (with ``only``: the next turn does,
            # which reports what the other requests computed too)
