"""Hot and cold models: a worker that serves one model at a time out of several, loading another on demand.

A worker's models are its ``engine.model`` and its ``standby_models`` (registered ``N`` or ``N@V``, or directories),
resolved to ``name@version`` at start, so a bad one stops the worker there. It serves one at a time: its Register names
that one and lists the others (``standby``). When a request names a version no live worker serves and one of its workers
lists it, the proxy (``proxy/cluster/model_loading.py``) answers 503 with Retry-After and sends that worker LoadModel.
The worker then:

1. stops taking work (its heartbeats say draining) and lets what runs finish, up to ``drain_timeout_s``; what is
   left then goes back to the proxy (retryable);
2. says Goodbye under its epoch, closes its KV transfer agent and drops its engine (weights, KV pool, host tier);
3. loads the asked model (weights checked against the registry's manifest as at start), calibrates its step cost
   (``common/engine/calibration.py``), registers a fresh KV pool
   with a new transfer agent, and sends Register under a new epoch, with ``load_s``: how long step 3 took.

After ``model_idle_unload_s`` (0: never) without a request, the worker unloads its model the same way and holds
none: instead of heartbeats it sends Standby every ``heartbeat_interval_s``, listing every model it may load, until
the proxy asks for one. A load that fails is logged, its model is dropped from the list (the proxy stops asking
for it) and the worker stands by with the error in its Standby.

One model's memory at a time is the point: on a GPU the old weights and KV pool are freed before the new ones load.
"""
from __future__ import annotations

import atexit
import gc
import logging
import queue
import time
from dataclasses import replace

from common.engine.calibration import calibrate
from common.engine.tensor_parallel import RankGroupBroken
from common.engine.llm_engine import LLMEngine
from common.protocol import wire
from common.protocol.versions import sendable
from common.runtime.registration import tokenizer_digest
from common.storage.model_store import model_identity
from common.text.tokenizer_files import read_tokenizer_files

log = logging.getLogger(__name__)
REQUEST_MESSAGES = (wire.PrefillRequest, wire.DecodeRequest, wire.EmbedRequest)


def engine_config(engine, spec: str, role: str):
    """The engine settings a worker of ``role`` loads ``spec`` with: a prefill worker's ``engine.cpu.compact_panels``
    "auto" is "off", since the compact copy serves steps of 1-3 rows, which prompt steps are not (1.1 GB at the 1B
    shape; a worker switched to decoding later decodes from the panels alone, the same tokens)."""
    engine = replace(engine, model=spec)
    if role == "prefill" and engine.cpu.compact_panels == "auto":
        engine = replace(engine, cpu=replace(engine.cpu, compact_panels="off"))
    return engine


def load_model(worker, spec: str, name: str = "") -> None:
    """Give ``worker`` (a ``WorkerBase``) the engine of ``spec``, a KV transfer agent over its pool, the hash of its
    tokenizer files and a new epoch; ``name``: the name to announce instead of the model's own (``model_name``)."""
    status = worker.metrics.status
    status.model_loaded, status.last_tick = False, None  # /healthz: starting, not stalled
    started = time.monotonic()
    config = worker.config
    worker.engine = LLMEngine(engine_config(config.engine, spec, worker.role))
    # Before fault injection (a dummy prompt must not trip it), each step holding the core share as traffic's do
    calibrated = calibrate(worker.engine, config.engine.steps.calibration_s, decode=worker.role != "prefill",
                           prompts=worker.role != "decode", cores=worker.cores)
    if calibrated.seconds:
        log.info("step-cost calibration: %s", calibrated.summary(worker.engine.step_timer))
    if config.testing.fault_nonfinite_logits_token is not None:
        log.warning("fault injection: a prompt holding token %d gets NaN logits (testing.fault_nonfinite_logits_token)",
                    config.testing.fault_nonfinite_logits_token)
        worker.engine.runner.fault_nonfinite_token = config.testing.fault_nonfinite_logits_token
    if config.testing.fault_hang_token is not None:
        log.warning("fault injection: a step with a prompt holding token %d hangs (testing.fault_hang_token)",
                    config.testing.fault_hang_token)
        worker.engine.runner.fault_hang_token = config.testing.fault_hang_token
    worker.model_name, worker.model_version = worker.metrics.identify(
        *model_identity(spec, config.engine.dtype, name))
    worker.tokenizer_sha256 = tokenizer_digest(read_tokenizer_files(worker.engine.model_dir))
    worker.transfer = worker.make_transfer()
    worker.transfer_metadata = worker.transfer.register_pool(worker.engine.runner.kv_cache)
    worker.transfer_name = worker.transfer.name
    worker.new_epoch()
    worker.load_s = time.monotonic() - started
    log.info("worker %s: %s@%s loaded in %.2fs, KV transfer over %s", config.worker_id, worker.model_name,
             worker.model_version, worker.load_s, worker.transfer_name)
    worker.last_request = time.monotonic()
    worker.reset()
    freeze_heap()
    status.model_loaded = True
    worker.metrics.model_load_seconds.labels(f"{worker.model_name}@{worker.model_version}").set(worker.load_s)


def freeze_heap() -> None:
    """What the worker holds now (its model loaded, its role's handler built) lives as long as the model: the
    collector need not walk it again at each full collection, which the objects of many streams make frequent (a
    pause of ~100 ms each at 256 streams of the tiny shape on 2 CPU cores, bench/host_phases.py). Whatever an
    earlier freeze kept that is garbage now (a role's old handler) is collected first; unload_model thaws it all.
    The first freeze collects only what is in the collector's sight: what a parent froze before forking this
    process (the tests' fork server, tests/fork_server.py) stays frozen, unwalked."""
    global _frozen
    if _frozen:
        thaw_heap()
    else:
        gc.collect()
    gc.freeze()
    _frozen = True


def thaw_heap() -> None:
    """What ``freeze_heap`` froze back in the collector's sight, and what of it is garbage now collected."""
    global _frozen
    gc.unfreeze()
    _frozen = False
    gc.collect()


_frozen = False  # whether freeze_heap froze since the last thaw_heap
atexit.register(gc.unfreeze)  # else what is frozen at exit is never finalized: bindings report their objects leaked


def unload_model(worker) -> None:
    """Free what ``load_model`` gave ``worker``: its transfer agent, engine and their memory."""
    worker.transfer.close()
    worker.engine.runner.close()
    device = worker.engine.runner.kv_cache.buffer.device
    worker.engine = worker.transfer = None
    worker.metrics.status.model_loaded = False
    thaw_heap()  # the model's objects, frozen at its load
    if device.type == "cuda":
        import torch

        torch.cuda.empty_cache()


class ModelSwitch:
    """The worker loop's side of it: LoadModel, idle unloading and standing by (``worker_runtime.serve``)."""

    def __init__(self, config, handler, signalled: list[int]) -> None:
        self.config = config
        self.handler = handler
        self.signalled = signalled
        self.io = None  # the WorkerIO, set by serve once built (it sends the Register this makes)
        own = f"{handler.model_name}@{handler.model_version}"
        self.models = {own: (config.engine.model, config.model_name)}  # name@version -> (spec, name to announce)
        for spec in config.standby_models:
            name, version = model_identity(spec, config.engine.dtype)
            self.models.setdefault(f"{name}@{version}", (spec, ""))
        handler.standby = [key for key in self.models if key != own]
        self.pending: str | None = None  # the model LoadModel asked for, loaded once the running work finished
        self.swap_by = 0.0  # monotonic: when the running work is given back to the proxy, pending a load
        self.error = ""
        self.idle_s = config.model_idle_unload_s or float("inf")
        self.check_at = time.monotonic() + self.idle_s  # when serve next calls ``act``, unless a load is pending

    @property
    def loaded(self) -> bool:
        return self.handler.engine is not None

    def take(self, msg) -> None:
        """A LoadModel, or any message while no model is loaded (a request is sent back: the proxy retries it)."""
        if isinstance(msg, wire.LoadModel):
            self._asked(msg.model)
        elif isinstance(msg, REQUEST_MESSAGES):
            self.handler.refuse(msg.request_id, "this worker holds no model now (it unloaded it)", retryable=True)

    def _asked(self, key: str) -> None:
        current = f"{self.handler.model_name}@{self.handler.model_version}" if self.loaded else None
        if key not in self.models or key == current:
            log.warning("the proxy asked this worker to load %s, which it %s", key,
                        "serves already" if key == current else f"cannot (its models: {', '.join(self.models)})")
            return
        log.info("the proxy asked for %s: %s", key, "draining, then swapping" if self.loaded else "loading")
        self.pending, self.error = key, ""
        self.swap_by = time.monotonic() + self.config.drain_timeout_s
        self.handler.draining = self.io.draining = True
        self.check_at = 0.0

    def act(self) -> None:
        """A load that is due (the running work finished, or its drain time is up), or an idle unload."""
        if self.signalled:  # shutting down: no swap, no unload (serve drains and exits)
            self.check_at = float("inf")
            return
        now = time.monotonic()
        handler = self.handler
        busy = self.loaded and handler.busy()
        if self.pending is not None:
            if busy and now < self.swap_by:
                return
            key, self.pending = self.pending, None
            self._swap(key)
        elif busy or now - handler.last_request < self.idle_s:
            self.check_at = now + 1.0 if busy else handler.last_request + self.idle_s
        elif self.loaded and not sendable(wire.Standby, self.io.speaks):  # a proxy of protocol 11 could not
            self.check_at = float("inf")  # hear it stand by, nor ask it to load: it keeps its model
            log.warning("model_idle_unload_s is off: the proxy speaks protocol %d, without Standby", self.io.speaks)
        elif self.loaded:
            log.info("no request for model_idle_unload_s=%gs: unloading %s@%s", self.config.model_idle_unload_s,
                     handler.model_name, handler.model_version)
            self._leave("unloaded its idle model")
            self._stand_by()
        else:
            self.check_at = float("inf")

    def _leave(self, reason: str) -> None:
        handler = self.handler
        handler.fail_all(f"the worker is changing its model ({reason})")
        handler.tick()  # queues the failures
        self.io.leave(reason)
        unload_model(handler)

    def _swap(self, key: str) -> None:
        if self.loaded:
            self._leave(f"loading {key}")
        self.io.standby = None
        spec, name = self.models[key]
        try:
            load_model(self.handler, spec, name)
        except RankGroupBroken:
            raise  # the worker ends (worker_runtime)
        except Exception as exc:  # a broken model must not take the worker down: it stands by without it
            log.exception("loading %s failed; it is no longer offered", key)
            if self.handler.transfer is not None:  # built before the failure
                self.handler.transfer.close()
            self.handler.engine = self.handler.transfer = None
            thaw_heap()  # what the failed load froze, if it got that far
            self.models.pop(key)
            self.error = f"loading {key} failed: {type(exc).__name__}: {exc}"
            self._stand_by()
            return
        self.handler.standby = [k for k in self.models if k != key]
        self._refuse_queued()
        self.handler.draining = self.io.draining = bool(self.signalled)
        self.io.registration, self.io.tokenizer_dir = self.handler.registration(), self.handler.engine.model_dir
        self.io.rejoin()
        self.check_at = time.monotonic() + self.idle_s

    def _refuse_queued(self) -> None:
        """Requests routed here before the proxy had the Goodbye queued up while the model loaded: back to the
        proxy (it resumed them elsewhere), not run on the model loaded since."""
        kept = []
        while True:
            try:
                msg = self.io.take()
            except queue.Empty:
                break
            if isinstance(msg, REQUEST_MESSAGES):
                self.handler.refuse(msg.request_id, "the worker changed its model", retryable=True)
            elif msg is None or isinstance(msg, wire.LoadModel):  # None: the I/O thread stopped
                kept.append(msg)
        for msg in kept:
            self.io.inbox.put(msg)

    def _stand_by(self) -> None:
        handler = self.handler
        handler.epoch = time.time_ns()
        handler.draining = self.io.draining = bool(self.signalled)
        self.io.standby = wire.Standby(self.config.worker_id, handler.epoch, handler.role, list(self.models),
                                       self.error)
        self.check_at = float("inf")
