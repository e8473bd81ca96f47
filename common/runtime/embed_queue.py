"""A prefill-capable worker's embedding requests: queued as they come, computed between engine steps.

Life cycle of one EmbedRequest on the worker:
  EmbedRequest -> refused at once while draining (retryable) or when an input is empty or longer than the
  model's context (the client's 400) -> queued -> on the loop's next turn, with the requests queued before
  it up to ``embedding_batch_tokens`` tokens, one ``Embedder.embed`` call holding the cores like an engine
  step -> EmbedResult each (or RequestFailed, not retried, when the computation raised).
An embedding keeps no KV, so nothing is leased or freed; draining waits for the queue to empty, and
``fail_all`` hands what is queued back to the proxy, which retries it on another worker.
"""
from __future__ import annotations

import logging
from collections import deque

from common.engine.embedder import Embedder, pooling_of
from common.engine.tensor_parallel import RankGroupBroken
from common.protocol import wire

log = logging.getLogger(__name__)


class EmbedQueue:
    def __init__(self, worker) -> None:
        """``worker``: the role handler (``WorkerBase``) whose engine, cores, metrics and sends it uses."""
        self.worker = worker
        runner = worker.engine.runner
        self.embedder = Embedder(runner.embedding_model, runner.device, pooling_of(worker.engine.model_dir),
                                 worker.config.embedding_batch_tokens, worker.config.embedding_padding_budget)
        self.max_len = worker.engine.max_model_len
        self.queue: deque[wire.EmbedRequest] = deque()

    def add(self, msg: wire.EmbedRequest) -> None:
        if self.worker.draining:
            self.worker.refuse(msg.request_id, "worker is draining", retryable=True)
            return
        for i, ids in enumerate(msg.inputs):
            if not ids or len(ids) > self.max_len:
                self.worker.refuse(msg.request_id, f"input[{i}] has {len(ids)} tokens: an input to embed has "
                                   f"1 to {self.max_len} (the model's context)", retryable=False,
                                   invalid_request=True)
                return
        if not msg.inputs:
            self.worker.refuse(msg.request_id, "no input to embed", retryable=False, invalid_request=True)
            return
        self.queue.append(msg)

    def run(self) -> None:
        """One batch: the oldest request, and those after it while their tokens fit the batch budget."""
        taken = [self.queue.popleft()]
        tokens = sum(map(len, taken[0].inputs))
        while self.queue and tokens + sum(map(len, self.queue[0].inputs)) <= self.embedder.max_batch_tokens:
            taken.append(self.queue.popleft())
            tokens += sum(map(len, taken[-1].inputs))
        inputs = [ids for msg in taken for ids in msg.inputs]
        try:
            with self.worker.cores:
                vectors = self.embedder.embed(inputs)
        except RankGroupBroken:
            self.queue.extendleft(reversed(taken))  # failed back with the rest as the worker ends (worker_runtime)
            raise
        except Exception as exc:  # those requests end with an error; the worker goes on
            log.exception("embedding %d input(s) failed", len(inputs))
            self.worker.metrics.internal_errors.inc()
            for msg in taken:
                self.worker.refuse(msg.request_id, f"the worker failed to embed ({type(exc).__name__}: {exc})",
                                   retryable=False)
            return
        start = 0
        for msg in taken:
            end = start + len(msg.inputs)
            self.worker.send(wire.EmbedResult(msg.request_id, self.worker.config.worker_id, self.embedder.dim,
                                              vectors[start:end].astype("<f4").tobytes(), sum(map(len, msg.inputs))))
            start = end
        self.worker.metrics.prompt_tokens.inc(tokens)

    def cancel(self, request_id: str) -> None:
        self.queue = deque(m for m in self.queue if m.request_id != request_id)

    def fail_all(self, reason: str, only: set[str] | None = None) -> None:
        """Refuse what waits (``only``: of these requests), retryable."""
        kept = deque()
        while self.queue:
            msg = self.queue.popleft()
            if only is None or msg.request_id in only:
                self.worker.refuse(msg.request_id, reason, retryable=True)
            else:
                kept.append(msg)
        self.queue = kept
