"""What the prefill and decode handlers share: the engine, the KV transfer agent, identity.

A worker's identity is ``(worker_id, epoch)``: the epoch is its start time,
so a restarted worker under the same id is recognisably a new process whose
pages and requests have nothing to do with the old one's.
"""
from __future__ import annotations

import hashlib
import logging
import time
from pathlib import Path
from typing import Protocol

from common.protocol import wire
from common.engine.llm_engine import LLMEngine, RequestError
from common.runtime.health_server import HealthServer
from common.config.roles import WorkerConfig
from common.runtime.tracing import make_tracing
from common.runtime.worker_metrics import WorkerMetrics
from common.runtime.worker_runtime import Load

log = logging.getLogger(__name__)


class KVTransfer(Protocol):
    """What a worker needs of its KV transfer backend here (``kv_transfer.base`` has the full contract)."""
    name: str

    def register_pool(self, kv_cache) -> bytes: ...
    def close(self) -> None: ...


def model_version(model_dir: Path, dtype: str) -> str:
    """Short digest of the model's config and weight files: equal digests, same model."""
    h = hashlib.sha256(dtype.encode())
    h.update((model_dir / "config.json").read_bytes())
    for path in sorted(model_dir.glob("*.safetensors")):
        h.update(f"{path.name}:{path.stat().st_size}".encode())
    return h.hexdigest()[:16]


class WorkerBase:
    role = "both"

    def __init__(self, config: WorkerConfig, transfer: KVTransfer) -> None:
        """``transfer``: the KV transfer backend the role's command built; this worker owns and closes it."""
        self.config = config
        self.epoch = time.time_ns()
        self.draining = False
        self.metrics = WorkerMetrics(config)
        # Started before the model loads, so that probes see "loading" rather than a refused connection.
        self.health = HealthServer(config, self.metrics).start() if config.metrics_port else None
        self.tracing = make_tracing(config.otel_endpoint, config.otel_service_name)
        self._spans: dict[tuple[str, str], object] = {}  # (request id, span name) -> open span
        self.engine = LLMEngine(config.engine)
        self.metrics.status.model_loaded = True
        self.transfer = transfer
        self.transfer_metadata = transfer.register_pool(self.engine.runner.kv_cache)
        self.transfer_name = transfer.name
        self._send = None
        log.info("worker %s: KV transfer over %s", config.worker_id, transfer.name)

    def bind(self, send) -> None:
        self._send = send

    def send(self, msg) -> None:
        self._send(msg)

    def registration(self) -> wire.Register:
        layout = self.engine.runner.layout
        return wire.Register(
            worker_id=self.config.worker_id,
            role=self.role,
            epoch=self.epoch,
            model=self.config.model_name,
            model_version=model_version(self.engine.model_dir, self.config.engine.dtype),
            kv_layout=wire.KVLayoutInfo(
                layout.num_layers, layout.block_size, layout.num_kv_heads, layout.head_dim, layout.dtype
            ),
            num_blocks=self.engine.block_manager.num_blocks,
            max_model_len=self.engine.max_model_len,
            transfer_backend=self.transfer_name,
            transfer_metadata=self.transfer_metadata,
            max_num_seqs=self.config.engine.max_num_seqs,
        )

    def load(self) -> Load:
        scheduler = self.engine.scheduler
        return Load(
            free_blocks=self.engine.block_manager.num_free_blocks,
            num_running=len(scheduler.running),
            num_waiting=scheduler.num_waiting,
            outstanding_prefill_tokens=sum(s.num_tokens - s.num_computed_tokens for s in scheduler.waiting),
        )

    def publish_metrics(self) -> None:
        self.metrics.publish(self.engine)

    def trace_start(self, request_id: str, name: str, trace_context: dict | None) -> None:
        """Open span ``name`` of a request, a child of the proxy's span when the message carried one."""
        if self.tracing.enabled and trace_context:
            self._spans[request_id, name] = self.tracing.start(
                name, parent=trace_context, attributes={"tessera.request_id": request_id,
                                                         "tessera.worker_id": self.config.worker_id})

    def trace_end(self, request_id: str, name: str, error: str | None = None) -> None:
        if self._spans:
            self.tracing.end(self._spans.pop((request_id, name), None), error)

    def intake(self, msg, stage: str, add):
        """Take a Prefill/DecodeRequest: ``add(params)`` puts it in the engine; its result, or None when refused.

        Refused while draining (retryable), or when the engine rejects the request (the client's 400).
        """
        if self.draining:
            self.metrics.request_done(stage, "refused")
            self.refuse(msg.request_id, "worker is draining", retryable=True)
            return None
        try:
            return add(msg.params.replace(n=1))
        except (RequestError, ValueError, TypeError) as exc:
            self.metrics.request_done(stage, "refused")
            self.refuse(msg.request_id, str(exc), retryable=False, invalid_request=True)
            return None

    def fail(self, request_id: str, stage: str, span: str, reason: str) -> None:
        """Drop a request this worker holds (draining, the proxy lost): the proxy may retry it elsewhere."""
        self.engine.abort_request(request_id)
        self.metrics.request_done(stage, "failed")
        self.trace_end(request_id, span, reason)
        self.refuse(request_id, reason, retryable=True)

    def refuse(self, request_id: str, message: str, retryable: bool, invalid_request: bool = False) -> None:
        self.send(wire.RequestFailed(request_id, self.config.worker_id, message, retryable, invalid_request))

    def close(self) -> None:
        self.transfer.close()
        self.tracing.shutdown()
        if self.health is not None:
            self.health.close()
