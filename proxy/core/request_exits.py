"""A request's ways off its happy path (``proxy.core.requests``): failure, deadline, cancel, and resume elsewhere.

``RequestExits`` is ``SubRequest``'s base class; the state it works on is the sub-request's.

- Resume (``_resume``), the one way a request goes on elsewhere: when the
  worker running it is lost (gone, or silent past ``heartbeat_timeout_s``)
  or gives it back (a retryable RequestFailed: it drained, or lost its
  proxy), the request returns to the admission queue with the tokens the
  client already has (``output_ids``), under a new wire id
  (``request_id~N``: whatever the old worker still sends is a stray), and
  is prefilled again with that output, on a prefill worker or on its new
  decode worker. The client sees only a pause. At most ``max_migrations``
  times, and only up to ``migration_max_tokens``; past either it fails.
- Preempt (``preempt``): the same way back to admission, taken by the
  cluster for fairness (``preempt_for_fairness``).
- Every way out releases what is held: Abort to each live worker involved,
  ReleaseKV to the page holder, ``prefill_ended`` to the policy, and exactly
  one terminal event (a finishing ``TokenEvent`` or a ``FailureEvent``) to
  the group, whose consumer is the HTTP handler.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

from common.protocol.wire import Abort, RequestFailed
from proxy.tenancy.admission import Stage
from proxy.core.errors import ApiError
from proxy.core.recovery import LOST_AGAIN, Recovery

log = logging.getLogger("tessera.proxy")

Sends = list[tuple[str, object]]  # (worker id, message) for the cluster to send, in order


@dataclass
class FailureEvent:
    index: int
    error: ApiError


class RequestExits:
    """``SubRequest``'s ways out; each returns what the cluster must send."""

    recovery: Recovery | None = None  # from a resume until the resumed attempt's first token
    preemptions = 0  # times it went back to admission for fairness (``preempt``)
    left: str | None = None  # the worker it last resumed from: routed elsewhere while another can take it

    def on_failed(self, msg: RequestFailed, sender: str, now: float) -> Sends | None:
        if not self.involves(sender) or msg.request_id != self.wire_id:
            return None
        why = f"worker {sender!r} failed the request: {msg.message}"
        if msg.invalid_request:
            return self._fail(ApiError(400, why, code="invalid_request"), gone=sender)
        if not msg.retryable:
            return self._fail(ApiError(500, why, code="worker_error"), gone=sender)
        return self._resume(why, now, gone=sender)

    def on_worker_lost(self, worker_id: str, reason: str, now: float) -> Sends:
        if not self.involves(worker_id):
            return []
        if self.stage is Stage.DECODING and worker_id != self.decode_worker:
            # Only the lender of the pages is gone: the decode worker's pull fails and it computes them itself.
            self.kv_holder = None
            return []
        return self._resume(f"worker {worker_id!r} serving the request is gone: {reason}", now, gone=worker_id)

    def _resume(self, why: str, now: float, gone: str) -> Sends:
        """Its worker is lost or gave it back: back to admission, to go on elsewhere after the output the client
        has (or fail, past ``max_migrations`` or ``migration_max_tokens``)."""
        config = self._config
        length = len(self.prompt) + len(self.output_ids)
        if self.migrations >= config.max_migrations:
            limit = f"it has resumed max_migrations={config.max_migrations} time(s) already"
        elif length > config.migration_max_tokens:
            limit = f"its {length} tokens are more than migration_max_tokens={config.migration_max_tokens}"
        else:
            limit = None
        if limit is not None:
            return self._fail(ApiError(503, f"{why}; {limit}", code="worker_unavailable",
                                       retry_after_s=config.retry_after_s), gone=gone)
        sends = self._free(gone)
        if self.recovery is not None:
            self.recovery.ended(LOST_AGAIN)
        self.migrations += 1
        self.recovery = Recovery(self.request_id, self.migrations, gone, len(self.output_ids), self._metrics, now)
        self.left = gone
        self.lost = why
        self._requeue(now)
        self._metrics.migrations.inc()
        log.warning("request %s: %s; resuming elsewhere after %d output token(s) (resume %d of at most %d)",
                    self.request_id, why, len(self.output_ids), self.migrations, config.max_migrations)
        return sends

    def preempt(self, now: float) -> Sends:
        """``preempt_for_fairness``: its tenant runs more than its share of the decode slots while another
        tenant's choice waits for one. Back to admission as a resume goes (the client keeps its output and sees
        a pause; the worker frees the pages on Abort, and they are recomputed when it is admitted again),
        counted against neither ``max_migrations`` nor any worker."""
        sends = self._free(None)
        self.preemptions += 1
        log.info("request %s: preempted after %d output token(s): tenant %r is over its share of the decode "
                 "slots while another tenant waits (preempt_for_fairness)", self.request_id, len(self.output_ids),
                 self.tenant)
        self._requeue(now)
        self._metrics.fairness_preemptions.labels(self.tenant).inc()
        return sends

    def _requeue(self, now: float) -> None:
        """Back to the admission queue under a new wire id: whatever the old attempt still sends is a stray."""
        self.wire_id = f"{self.request_id}~{self.migrations + self.preemptions}"
        self.stage = Stage.QUEUED
        self.route = self._handoff = None
        self.deadline = now + self._config.queue_timeout_s

    def _recovered(self, now: float) -> None:
        """The resumed attempt's first token is here (``SubRequest._emit_tokens``)."""
        self.recovery.recovered(now)
        self.recovery = None

    def check_deadline(self, now: float) -> Sends:
        if self.done or now < self.deadline:
            return []
        if self.stage is Stage.QUEUED or (self.stage is Stage.READY and self.local):
            return self._drop_unadmitted(now)
        if self.stage is Stage.READY:
            self._metrics.tenant_rejections.labels(self.tenant, "queue_timeout").inc()
            return self._fail(ApiError(503, f"the cluster is saturated: no decode slot freed up within "
                                       f"queue_timeout_s={self._config.queue_timeout_s:g}s after the prefill",
                                       code="queue_timeout", retry_after_s=self._config.retry_after_s))
        if self.first_token_at is None:
            why = f"no first token within first_token_timeout_s={self._config.first_token_timeout_s}s"
        else:
            why = f"no message from the worker within token_timeout_s={self._config.token_timeout_s}s"
        return self._fail(ApiError(504, f"request timed out: {why}", code="timeout"))

    def _drop_unadmitted(self, now: float) -> Sends:
        config = self._config
        if self.client_deadline is not None and now >= self.client_deadline:
            reason, error = "deadline", ApiError(
                504, "the request's deadline (X-Request-Timeout) passed while it waited for admission; "
                "it was dropped without running", code="deadline_exceeded")
        else:
            if self.preemptions and (self.lost is None or self.preemptions >= self.migrations):
                what = "to go on after it was preempted for fairness (preempt_for_fairness)"
            else:
                what = "to resume after its worker was lost" if self.migrations else "and was dropped without running"
            reason, error = "queue_timeout", ApiError(
                503, f"the cluster is saturated: the request waited queue_timeout_s={config.queue_timeout_s:g}s "
                f"for admission {what}", code="queue_timeout", retry_after_s=config.retry_after_s)
        self._metrics.tenant_rejections.labels(self.tenant, reason).inc()
        return self._fail(error)

    def reject(self, error: ApiError) -> Sends:
        """Admission could not start it (no worker left to route to): fail it unstarted, or un-resumed."""
        if self.done:
            return []
        if self.lost is not None:
            error = ApiError(error.status, f"{self.lost}; it cannot resume: {error.message}", code=error.code,
                             retry_after_s=error.retry_after_s)
        return self._fail(error)

    def _fail(self, error: ApiError, gone: str | None = None) -> Sends:
        started = self.started
        if self.first_token_at is None and started:
            self._metrics.queue_depth.dec()
        sends = self._free(gone)
        self.stage = Stage.FAILED
        if self.recovery is not None:
            self.recovery.ended(error.code or str(error.status))
        if error.status != 499:
            log.warning("request %s failed: %s", self.request_id, error.message)
        self._count_end(error.code or str(error.status))
        if self.trace:
            self.trace.close(error.message)
        if started:
            self._metrics.in_flight.dec()
        self._sink.put_nowait(FailureEvent(self.index, error))
        return sends

    def _free(self, gone: str | None) -> Sends:
        """Abort it on every live worker holding part of it (not ``gone``), and release its pages."""
        sends: Sends = [(worker_id, Abort(self.wire_id)) for worker_id in sorted(self._holders() - {gone})]
        if self.kv_holder == gone:
            self.kv_holder = None
        return sends + self._release_kv()
