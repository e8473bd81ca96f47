"""How a resumed request came back: one ``Recovery`` per resume, its phases timed from detection.

A request resumes (``proxy.core.requests`` ``SubRequest._resume``) at the moment the proxy learns that its worker is
gone or gave it back: *detection*. The resumed attempt then goes

    detected --admission sends it to a worker again--> redispatched --its first token reaches the proxy--> recovered

The resumed attempt's first token is its re-prefill's result (a prefill worker's PrefillDone carries it,
or the first TokenDelta of a decode worker that prefilled it itself); the proxy puts it on the client's
stream in the same call, so re-prefill and first resumed token are one moment here.

- ``tessera_proxy_migration_phase_seconds{phase}``: detection to ``redispatch``, detection to
  ``reprefill`` (the first resumed token).
- One log line per resumed attempt, when it recovers or ends first (lost again, failed, cancelled):
  ``recovery request=<id> attempt=<N> lost=<worker> outcome=<recovered|lost_again|error code>
  worker=<where it went> local=<prefilled on its decode worker> detected_at=<t> redispatched_at=<t>
  recovered_at=<t> output_tokens=<n>``: times in wall-clock seconds (``time.time()``), ``-`` for a phase
  not reached; ``output_tokens`` is what the client had at the resume (the resumed attempt prefills it).
  How long detection itself took needs the time of the failure, which only whoever caused it knows:
  bench/recovery.py subtracts its kill's time from ``detected_at``.

Nothing here runs per token, or for a request that never resumed.
"""
from __future__ import annotations

import logging
import time

from proxy.core.metrics import ProxyMetrics

log = logging.getLogger("tessera.proxy.recovery")

RECOVERED = "recovered"
LOST_AGAIN = "lost_again"


class Recovery:
    """One resumed attempt of request ``request_id``, from its detection on the proxy's clock ``now``."""

    def __init__(self, request_id: str, attempt: int, lost: str, output_tokens: int, metrics: ProxyMetrics,
                 now: float) -> None:
        self.request_id = request_id
        self.attempt = attempt
        self.lost = lost
        self.output_tokens = output_tokens  # the tokens the client had: the resumed attempt prefills them
        self._metrics = metrics
        self._detected = now
        self._wall = time.time() - now  # the proxy's clock (monotonic, or a test's) to wall-clock seconds
        self._redispatched: float | None = None
        self._worker = "-"
        self._local = False

    def redispatched(self, worker_id: str, local: bool, now: float) -> None:
        """Admission sent it to ``worker_id`` again: a prefill worker, or (``local``) the decode worker."""
        self._redispatched, self._worker, self._local = now, worker_id, local
        self._metrics.migration_phase.labels("redispatch").observe(now - self._detected)

    def recovered(self, now: float) -> None:
        """The resumed attempt's first token reached the proxy and went to the client's stream."""
        self._metrics.migration_phase.labels("reprefill").observe(now - self._detected)
        self._log(RECOVERED, now)

    def ended(self, outcome: str) -> None:
        """It ended before its first resumed token: lost again (``LOST_AGAIN``), or failed with this error code."""
        self._log(outcome, None)

    def _log(self, outcome: str, recovered: float | None) -> None:
        log.info("recovery request=%s attempt=%d lost=%s outcome=%s worker=%s local=%s detected_at=%s "
                 "redispatched_at=%s recovered_at=%s output_tokens=%d", self.request_id, self.attempt, self.lost,
                 outcome, self._worker, "yes" if self._local else "no", self._at(self._detected),
                 self._at(self._redispatched), self._at(recovered), self.output_tokens)

    def _at(self, now: float | None) -> str:
        return "-" if now is None else f"{self._wall + now:.6f}"
