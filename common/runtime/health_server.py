"""A worker's small HTTP server: ``/metrics``, ``/healthz`` and ``/readyz``.

Runs only when ``metrics_port`` is set, in a daemon thread of its own
(``http.server``), so no socket is ever touched by the compute loop. It
reads two things the loop publishes: the metrics registry and the
``WorkerStatus`` (see ``common.runtime.telemetry``).

- ``/metrics``: Prometheus text exposition of the worker's registry.
- ``/healthz``: 200 while the process starts up and while the main loop
  keeps turning; 503 once it has not turned for ``health_stall_s`` (a hung
  model step, a deadlock). Liveness.
- ``/readyz``: 200 once the model is loaded, the proxy accepted the
  registration and the worker is not draining; else 503. Readiness.

Both health answers are small JSON objects with a ``reason``. Life cycle:
``HealthServer(config, metrics).start()`` before the model loads (so probes
answer "loading" instead of refusing connections), ``close()`` at exit.
"""
from __future__ import annotations

import json
import logging
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from prometheus_client.exposition import CONTENT_TYPE_LATEST

from common.config.roles import WorkerConfig
from common.runtime.telemetry import WorkerMetrics

log = logging.getLogger(__name__)


class HealthServer:
    def __init__(self, config: WorkerConfig, metrics: WorkerMetrics) -> None:
        self.config = config
        self.metrics = metrics
        self._server: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None

    @property
    def port(self) -> int:
        return self._server.server_address[1] if self._server else self.config.observability.metrics_port

    def start(self) -> HealthServer:
        handler = type("Handler", (_Handler,), {"owner": self})
        self._server = ThreadingHTTPServer((self.config.observability.metrics_host, self.config.observability.metrics_port), handler)
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": 0.5},
                                        name="worker-health", daemon=True)
        self._thread.start()
        log.info("worker %s serves /metrics, /healthz and /readyz on http://%s:%d", self.config.worker_id,
                 self.config.observability.metrics_host, self.port)
        return self

    def close(self) -> None:
        if self._server is None:
            return
        self._server.shutdown()  # waits for serve_forever to return: at most one poll_interval
        self._server.server_close()
        self._thread.join(timeout=5)
        self._server = None

    def answer(self, path: str) -> tuple[int, str, bytes]:
        """(status, content type, body) for one GET."""
        status = self.metrics.status
        if path == "/metrics":
            return 200, CONTENT_TYPE_LATEST, self.metrics.render()
        if path == "/healthz":
            age = status.loop_age()
            if age is None:  # start-up can take minutes for a large model; readiness covers it
                return _json(200, "ok", "starting: the main loop has not started yet")
            if age <= self.config.observability.health_stall_s:
                return _json(200, "ok", f"main loop turned {age:.1f}s ago")
            return _json(503, "stalled", f"main loop has not turned for {age:.1f}s "
                                         f"(observability.health_stall_s={self.config.observability.health_stall_s})")
        if path == "/readyz":
            ready, reason = status.readiness()
            return _json(200 if ready else 503, "ready" if ready else "not_ready", reason)
        return _json(404, "not_found", "endpoints: /metrics, /healthz, /readyz")


def _json(code: int, state: str, reason: str) -> tuple[int, str, bytes]:
    return code, "application/json", json.dumps({"status": state, "reason": reason}).encode()


class _Handler(BaseHTTPRequestHandler):
    owner: HealthServer
    protocol_version = "HTTP/1.1"

    def do_GET(self) -> None:  # noqa: N802 (http.server's naming)
        code, content_type, body = self.owner.answer(self.path.split("?", 1)[0])
        self.send_response(code)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args) -> None:  # probes every few seconds would flood the log
        log.debug("health %s - %s", self.address_string(), format % args)
