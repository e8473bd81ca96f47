"""What every worker process shares: its I/O thread, registration, heartbeats, drain, and the base of the role handlers
(``WorkerBase``: the engine, the KV transfer agent, one intake and one failure path). A worker's identity is
``(worker_id, epoch)``; the epoch is its start time, renewed when it registers again, loads another model
(``model_swap.py``) or switches roles (``role_switch.py``: a handler of the new role adopts this one's model), so a
restarted worker under the same id is recognisably a new process.

Sockets live only in the I/O thread (``worker_io.WorkerIO``: one DEALER per proxy, with curve_* keys a CURVE client
pinning the proxy's public key; the KV events' PUB, ``kv_events``, bound here first so that the Register names
it). The compute loop (the main thread, ``serve``) never touches a socket: each turn it
takes inbound messages, lets the role's handler act on them, steps the engine, and queues what the handler wants
sent. A failure handling a message ends that message's request with an error; a failed engine turn gives every
request back to the proxy (retryable: they resume elsewhere). Neither stops the worker.

SIGTERM or SIGINT starts a drain: heartbeats say ``draining`` so the proxy routes nothing new here, and the loop
turns on while the handler is ``busy``: running requests finish, and a prefill worker's pages lent to decode workers
stay lent (their pulls served, released by ReleaseKV or their lease's end). All of it within ``drain_timeout_s``;
then what is left is failed back to the proxy (retryable), KV held for others is released, a Goodbye is sent and the
sockets closed. Under systemd (``Type=notify``) a worker reports READY=1 once its
model is loaded and its registration acknowledged, STOPPING=1 when it drains. The signal handler only appends to a
list (a threading.Event's lock, taken again by a second signal interrupting the first handler, deadlocked); the loop
looks at it once per turn, at most ``idle_poll_s`` apart. A second signal during the drain ends it at once: what
runs is failed back to the proxy (which resumes it elsewhere), as when ``drain_timeout_s`` passes.

A proxy that does not know this worker (it restarted, or expired the worker) answers its heartbeats with Reregister:
the worker fails what that proxy sent it and registers with it again (``worker_io`` says how with one proxy and with
several), so nothing of what the proxy forgot runs once it routes work here again. A proxy that refuses that
Register stops the worker.
"""

from __future__ import annotations

import logging
import queue
import signal
import time
from collections.abc import Callable, Mapping
from contextlib import nullcontext
from typing import NoReturn

from common.config.roles import WorkerConfig
from common.engine.llm_engine import RequestError
from common.engine.tensor_parallel import RankGroupBroken
from common.protocol import wire
from common.runtime import sd_notify
from common.runtime.core_share import CoreShare
from common.runtime.health_server import HealthServer
from common.runtime.kv_events import KVEventFeed, KVEventPublisher
from common.runtime.model_swap import ModelSwitch, freeze_heap, load_model
from common.runtime.registration import registration, rejoin
from common.runtime.role_switch import RoleSwitch
from common.runtime.telemetry import WorkerMetrics, request_scope
from common.runtime.tracing import make_tracing
from common.runtime.worker_contracts import Adopt, KVTransfer, Load, RoleHandler
from common.runtime.worker_io import LinkLost, OrphansExpired, WorkerIO
from common.runtime.zmq_security import worker_curve

log = logging.getLogger(__name__)


def serve(config: WorkerConfig, handler: RoleHandler, adopters: Mapping[str, Adopt] | None = None) -> None:
    """Run a worker until SIGTERM/SIGINT (then drain) or until its I/O fails. ``adopters``: role -> how that role's
    handler takes over from the one serving (a role switch, ``role_switch.py``); None: the worker switches none."""
    signalled: list[int] = []
    switch = ModelSwitch(config, handler, signalled)
    role_switch = RoleSwitch(config, handler, signalled, adopters or {})
    publisher = KVEventPublisher.bind(config.transfer_host, config.kv_events_port, worker_curve(config))
    handler.kv_events_endpoint = publisher.endpoint
    handler.kv_events_public_key = publisher.public_key
    io = switch.io = role_switch.io = WorkerIO(config, handler.registration(), handler.metrics,
                                               handler.engine.model_dir, publisher)
    kv_feed = KVEventFeed(handler, io)
    handler.bind(kv_feed.send)
    # Left in place after serve returns: a late signal must not cut the cleanup (the transfer agent closing) short.
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda signum, _: signalled.append(signum))
    io.start()
    handler.metrics.status.registered = True
    log.info("worker %s registered as %s", config.worker_id, config.role)
    sd_notify.ready(f"worker {config.worker_id} registered as {config.role}")
    watchdog = sd_notify.Watchdog()
    drain_deadline = None
    try:
        while True:
            # each turn of this loop is a step or a wait of at most idle_poll_s; the I/O thread turns at least
            # every worker_io.POLL_MAX_S
            watchdog.pet(watchdog.period is not None and io.alive(watchdog.period / 2))
            if signalled and drain_deadline is None:
                log.info("draining: no new work; %.0fs for running requests", config.drain_timeout_s)
                sd_notify.stopping(f"draining for up to {config.drain_timeout_s}s")
                io.draining = handler.draining = handler.metrics.status.draining = True
                drain_deadline = time.monotonic() + config.drain_timeout_s
            loaded = handler.engine is not None  # not while a worker with standby models holds none
            if drain_deadline is not None and _drained(handler, loaded, drain_deadline, config.drain_timeout_s,
                                                       len(signalled) > 1):
                break
            if not _take_messages(io, handler, switch, role_switch, handler.wait_s(config.idle_poll_s) if loaded
                                  else config.idle_poll_s):
                log.error("worker I/O stopped; exiting")
                break
            if time.monotonic() >= switch.check_at:  # a LoadModel to act on, or an idle model to unload
                switch.act()
            if time.monotonic() >= role_switch.check_at:  # a SwitchRole to act on: maybe a new role's handler
                serving = role_switch.act()
                if serving is not handler:
                    handler = switch.handler = kv_feed.handler = serving
                    freeze_heap()  # the old role's handler, frozen with the load and let go now, collected
            if handler.engine is None:  # standing by: nothing to step
                handler.metrics.status.tick()
                continue
            _turn(handler)
            kv_feed.flush()
            load = handler.load()
            load.decodes_taken = io.decodes_taken  # each one taken before it is in this load
            io.load = load
            handler.metrics.status.registered = io.registered.is_set()
            handler.publish_metrics()
    except RankGroupBroken as exc:  # from a switch, a swap or a lost proxy's requests as well as from a turn
        _end_worker(exc)
    finally:
        if handler.engine is not None:
            try:
                handler.fail_all("worker is shutting down")
                handler.tick()  # lets the handler queue its last messages
            except RankGroupBroken as exc:  # no step runs on a broken group: what could not be told, the Goodbye
                log.error("giving the requests back stopped short: %s", exc)  # tells (the proxy resumes them)
        io.stop("drained" if signalled else "I/O failure")
        log.info("worker %s stopped", config.worker_id)


def _drained(handler: RoleHandler, loaded: bool, deadline: float, drain_timeout_s: float, cut: bool = False) -> bool:
    """Whether a drain is over: nothing held any more, its time is up (said, naming the setting), or ``cut`` (a
    second signal came)."""
    if not (loaded and handler.busy()):
        return True
    if cut:
        log.warning("draining: a second signal came; failing the requests still held back to the proxy")
        return True
    if time.monotonic() <= deadline:
        return False
    log.warning("draining: drain_timeout_s=%gs passed with requests still held; failing them back to the proxy",
                drain_timeout_s)
    return True


def _take_messages(io: WorkerIO, handler: RoleHandler, switch: ModelSwitch, role_switch: RoleSwitch,
                   wait_s: float) -> bool:
    """Hand every queued message to the handler, waiting up to ``wait_s`` for the first; False when the I/O
    thread died."""
    try:
        msg = io.take(wait_s)
    except queue.Empty:
        return True
    while True:
        if msg is None:
            return False
        if isinstance(msg, wire.Reregister):
            rejoin(io, handler, msg)
        elif isinstance(msg, LinkLost):  # one of several proxies lost this worker: its requests only
            if handler.engine is not None:  # else standing by (model_swap.py): its Standby messages tell them
                handler.fail_all(f"the proxy that sent this request lost this worker ({msg.reason})",
                                 only=msg.request_ids)
                io.rejoin(msg.link)
        elif isinstance(msg, OrphansExpired):  # their proxy was lost and no other took them over in time
            if handler.engine is not None:
                handler.fail_all("the client did not resume the stream on any proxy within its resume window",
                                 only=msg.request_ids)
        elif isinstance(msg, wire.SwitchRole):
            role_switch.take(msg, swapping=switch.pending is not None)
        elif handler.engine is None or isinstance(msg, wire.LoadModel):
            switch.take(msg)
        elif isinstance(msg, wire.Tune):  # the proxy's adaptive controller (proxy/control/tac.py)
            engine = handler.engine
            handler.metrics.tuned(engine.scheduler.set_token_budget(msg.max_num_batched_tokens),
                                  *engine.speculator.tune(msg.spec_num_tokens, msg.spec_max_batch_size))
        else:
            with request_scope(getattr(msg, "request_id", None), getattr(msg, "tenant", None)):
                _handle(handler, msg)
        try:
            msg = io.take()
        except queue.Empty:
            return True


def _turn(handler: RoleHandler) -> None:
    """One turn of work; a failure (a bug, or an input no check foresaw) gives every request back to the proxy,
    which resumes them elsewhere, and the worker goes on serving; a broken rank group ends the worker (exit 70)."""
    try:
        handler.tick()
    except RankGroupBroken as exc:
        _end_worker(exc)
    except Exception as exc:
        log.exception("a turn of the engine failed; giving every request back to the proxy")
        handler.metrics.internal_errors.inc()
        handler.fail_all(f"the worker hit an internal error ({type(exc).__name__}: {exc})")


def _end_worker(exc: RankGroupBroken) -> NoReturn:
    """The ranks' group broke: no later step could be trusted, so the worker ends (serve's cleanup gives every
    request back to the proxy, which resumes them elsewhere)."""
    log.critical("%s: the worker exits, giving every request back to the proxy", exc)
    raise SystemExit(70) from exc


def _handle(handler: RoleHandler, msg) -> None:
    """One message; a failure handling it ends its request with an error, and the worker goes on serving."""
    handler.last_request = time.monotonic()  # model_idle_unload_s counts from here
    try:
        handler.handle(msg)
    except RankGroupBroken as exc:
        _end_worker(exc)
    except Exception as exc:
        log.exception("handling %s failed", type(msg).__name__)
        handler.metrics.internal_errors.inc()
        if (request_id := getattr(msg, "request_id", None)) is not None:
            handler.contain(request_id, f"the worker failed on this request ({type(exc).__name__}: {exc})")


# What a handler of another role takes over from the one serving, in a role switch (``WorkerBase.adopt``): the model
# and its KV pool (the prefix cache with them), the transfer agent, the identity, metrics, probes, tracing, cores.
ADOPTED = ("engine", "model_name", "model_version", "tokenizer_sha256", "load_s", "standby", "transfer",
           "transfer_name", "transfer_metadata", "make_transfer", "epoch", "metrics", "health", "tracing", "cores",
           "kv_events_endpoint", "kv_events_public_key", "last_request", "_send")


class WorkerBase:
    role = "both"

    def __init__(self, config: WorkerConfig, make_transfer: Callable[[], KVTransfer]) -> None:
        """``make_transfer``: builds a KV transfer backend over a model's pool; the worker owns and closes each."""
        self.config = config
        self.draining = False
        self.metrics = WorkerMetrics(config)
        # Started before the model loads, so that probes see "loading" rather than a refused connection.
        self.health = HealthServer(config, self.metrics).start() if config.observability.metrics_port else None
        self.tracing = make_tracing(config.observability.otel_endpoint, config.observability.otel_service_name)
        self._spans: dict[tuple[str, str], object] = {}  # (request id, span name) -> open span
        self.make_transfer = make_transfer
        self.successor: WorkerBase | None = None  # the handler of another role this one handed everything to
        self.standby: list[str] = []  # the other models it may load (ModelSwitch), announced at registration
        self.kv_events_endpoint = ""  # where it publishes KV events (serve binds it), announced at registration
        self.kv_events_public_key = ""  # that socket's CURVE public key (z85), with CURVE on
        # Held for each engine step (``with self.cores``) where co-located workers time-share the cores; built
        # before the model loads, whose calibration's steps hold it too.
        self.cores = CoreShare(config.core_share, config.core_share_timeout_s) if config.core_share else nullcontext()
        load_model(self, config.engine.model, config.model_name)  # engine, transfer agent, identity, epoch
        self._send = None

    @classmethod
    def adopt(cls, old: WorkerBase, config: WorkerConfig) -> WorkerBase:
        """A handler of this class serving ``config.role`` that takes over what ``old`` holds (``ADOPTED``), its
        model loaded as it is: a role switch (``role_switch.py``), once ``old`` holds no request. ``old`` hands
        closing to it (``close``)."""
        new = cls.__new__(cls)
        for name in ADOPTED:
            setattr(new, name, getattr(old, name))
        new.config, new.role, new.draining, new.successor, new._spans = config, config.role, False, None, {}
        new.metrics.config = config  # tessera_worker_info names the new role
        new.metrics.identify(new.model_name, new.model_version)
        new.reset()
        old.successor = new
        return new

    def reset(self) -> None:
        """What the role keeps about one model's requests, fresh with each model loaded (``load_model``) and with
        each role switch (``adopt``)."""

    def bind(self, send) -> None:
        self._send = send

    def send(self, msg) -> None:
        self._send(msg)

    def registration(self) -> wire.Register:
        return registration(self)

    def load(self) -> Load:
        scheduler = self.engine.scheduler
        return Load(
            free_blocks=self.engine.block_manager.num_free_blocks,
            num_running=len(scheduler.running),
            num_waiting=scheduler.num_waiting,
            outstanding_prefill_tokens=sum(s.num_tokens - s.num_computed_tokens for s in scheduler.waiting),
            context_tokens=sum(s.num_tokens for s in scheduler.running),
            step_cost=self.engine.step_timer.report(),
        )

    def publish_metrics(self) -> None:
        self.metrics.publish(self.engine)
        self.metrics.count_pulls(self.transfer, self.transfer.counters().outcomes)

    def new_epoch(self) -> None:
        """A new identity for the proxies: the time now; the transfer backend lends its pages under it, refusing
        pulls of pages lent under the one before (their ids mean other KV now)."""
        self.epoch = time.time_ns()
        self.transfer_metadata = self.transfer.set_epoch(self.epoch)

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

    def contain(self, request_id: str, reason: str) -> None:
        """Its message made this worker fail: the request ends with an error (not retried: it may do it again)."""
        self.engine.abort_request(request_id)
        self.metrics.request_done(self.role, "failed")
        self.refuse(request_id, reason, retryable=False)

    def refuse(self, request_id: str, message: str, retryable: bool, invalid_request: bool = False,
               code: str = "") -> None:
        self.send(wire.RequestFailed(request_id, self.config.worker_id, message, retryable, invalid_request, code))

    def fail_nonfinite(self, request_id: str, stage: str, span: str) -> None:
        """The engine ended the request: its logits held a NaN or Inf (counted, logged by the engine)."""
        self.metrics.request_done(stage, "failed")
        self.trace_end(request_id, span, "nonfinite_logits")
        self.refuse(request_id, "the model's logits for this request were not finite (NaN or Inf); the worker "
                    "serves on", retryable=False, code="nonfinite_logits")

    def close(self) -> None:
        if self.successor is not None:  # a role switch handed it all over
            self.successor.close()
            return
        if self.transfer is not None:
            self.transfer.close()
        if self.engine is not None:
            self.engine.runner.close()  # the other tensor-parallel ranks, if any
        if isinstance(self.cores, CoreShare):
            self.cores.close()
        self.tracing.shutdown()
        if self.health is not None:
            self.health.close()
