"""The tests' worker double: the simulated worker (``tessera sim-worker``, bench/sim/) with a script of its output.

There is one double. ``FakeWorker`` is a ``bench.sim.worker.SimWorker`` (the real wire protocol, a real block
manager, continuous batching) run in a thread of its own with its own ZeroMQ context, whose model answers from a
script of ``(token_id, text)`` pairs and whose steps take a fixed time, so that a test drives it from outside:

    worker = FakeWorker(endpoint, "p0", "prefill", script).start_and_wait()
    ...
    worker.wait_for(lambda m: isinstance(m, ReleaseKV))
    worker.stop()

- prefill: PrefillRequest -> PrefillDone (the first scripted token; its pages held until ReleaseKV, Abort or
  the lease ends), reporting ``cached_tokens`` of the prompt (at most all of it) as found in a prefix cache.
- decode / both: DecodeRequest -> KVPulled when it names pages, then one token per step, a step every
  ``token_interval_s`` (0: every turn of its loop); a step is one TokenDeltas carrying one TokenDelta for each
  request decoding. Prompts are computed in steps of no time. The last delta has finish_reason "length" when
  max_tokens ran out before the script, else "stop". Abort stops it.
- A resumed request (``output_token_ids``) continues the script after its output so far.
- With logprobs asked for, token i gets logprob ``-(i + 1) / 10`` and k alternatives ``[token + j, logprob - j]``.
- ``stall=True`` records requests and never answers (for timeouts and disconnects); ``heartbeats=False`` goes
  silent; ``send_raw`` sends any frames; ``step_cost`` is the step model its heartbeats report (None: none).
"""
from __future__ import annotations

import threading
import time
from collections.abc import Callable

from bench.sim.profile import StepProfile
from bench.sim.worker import SimHost, SimSpec, SimWorker
from common.protocol.wire import Register, Reregister
from common.protocol.wire import (DecodeRequest, Goodbye, Heartbeat, KVLayoutInfo, PrefillRequest, RegisterAck,
                                  StepCostModel, encode)

DEFAULT_LAYOUT = KVLayoutInfo(num_layers=30, block_size=16, num_kv_heads=3, head_dim=64, dtype="float32")


class _Scripted(SimWorker):
    """The simulated worker, answering from ``fake``'s script and reporting what ``fake`` says."""

    def __init__(self, *args, fake: FakeWorker) -> None:
        super().__init__(*args)
        self.fake = fake
        self.epoch = fake.epoch
        script = fake.script
        self.engine.token_of = lambda seq, position: script[position][0]

    def register_message(self) -> Register:
        return self.fake.register_msg

    def heartbeat_message(self) -> Heartbeat | None:
        fake, engine = self.fake, self.engine
        if not fake.heartbeats:
            return None
        running = self.decoding()
        return Heartbeat(self.spec.worker_id, self.epoch, engine.blocks.num_free_blocks, running, 0, 0, fake.draining,
                         100 * running, fake.step_cost)

    def handle(self, msg, link: int = 0) -> None:
        self.fake.record(msg)
        if isinstance(msg, Reregister) or (self.fake.stall and isinstance(msg, (PrefillRequest, DecodeRequest))):
            return  # a test registers it again itself, if it wants to
        super().handle(msg, link)

    def output_limit(self, msg) -> int:
        return len(self.fake.script)

    def finish_reason(self, seq, produced: int) -> str:
        return "length" if seq.max_tokens <= produced < len(self.fake.script) else "stop"

    def text_of(self, seq, position: int, token: int) -> str:
        return self.fake.script[position][1]

    def cached_tokens(self, seq) -> int:
        """As scripted: ``cached_tokens`` of the prompt on the prefill side, none reported on the decode side."""
        return min(self.fake.cached_tokens, len(seq.prompt)) if self.engine.prefill_only else 0

    def decoding(self) -> int:
        engine = self.engine
        return len(engine.running) + len(self.deferred) + len(self.pulls) + (0 if engine.prefill_only
                                                                             else len(engine.waiting))


class FakeWorker:
    def __init__(self, address: str, worker_id: str, role: str, script: list[tuple[int, str]], *,
                 model: str = "SmolLM2-135M-Instruct", model_version: str = "test", epoch: int | None = None,
                 kv_layout: KVLayoutInfo = DEFAULT_LAYOUT, num_blocks: int = 1024, max_model_len: int = 8192,
                 heartbeat_interval_s: float = 0.1, token_interval_s: float = 0.0, stall: bool = False,
                 cached_tokens: int = 0) -> None:
        self.address = address
        self.worker_id = worker_id
        self.role = role
        self.script = script
        self.epoch = epoch if epoch is not None else time.time_ns()
        self.register_msg = Register(worker_id, role, self.epoch, model, model_version, kv_layout, num_blocks,
                                     max_model_len, "fake", b"fake:" + worker_id.encode())
        self.heartbeat_interval_s = heartbeat_interval_s
        self.token_interval_s = token_interval_s
        self.stall = stall
        self.cached_tokens = cached_tokens
        self.heartbeats = True
        self.draining = False
        self.step_cost = None  # a StepCostModel its heartbeats report, as a real worker's fitted step time
        self.received: list = []  # every message from the proxy, in order
        self.error: BaseException | None = None  # what ended the worker's thread, if anything did
        self._lock = threading.Condition()
        self._host: SimHost | None = None
        self._worker: _Scripted | None = None
        self._ready = threading.Event()
        self._stop = threading.Event()
        self._goodbye = True
        self._thread = threading.Thread(target=self._run, name=f"fake-worker-{worker_id}", daemon=True)

    # -- driving it from a test ---------------------------------------------------------------

    def start(self) -> FakeWorker:
        self._thread.start()
        self._ready.wait(10)
        return self

    def start_and_wait(self, timeout: float = 10.0) -> FakeWorker:
        """Start, and wait for the proxy's RegisterAck (accepted or not)."""
        self.start()
        self.wait_for(lambda m: isinstance(m, RegisterAck), timeout)
        return self

    def wait_for(self, predicate: Callable[[object], bool], timeout: float = 10.0):
        """The first received message matching ``predicate``; TimeoutError after ``timeout``."""
        deadline = time.monotonic() + timeout
        with self._lock:
            while True:
                found = next((m for m in self.received if predicate(m)), None)
                if found is not None:
                    return found
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"{self.worker_id}: no matching message in {timeout}s; got {self.received}")
                self._lock.wait(left)

    def messages(self, kind: type) -> list:
        with self._lock:
            return [m for m in self.received if isinstance(m, kind)]

    def record(self, msg) -> None:
        with self._lock:
            self.received.append(msg)
            self._lock.notify_all()

    def send(self, msg) -> None:
        self.send_raw(encode(msg))

    def send_raw(self, frames: list[bytes]) -> None:
        self._host.call_soon_threadsafe(lambda: self._worker.sockets[0].send_multipart(frames))

    def stop(self, goodbye: bool = True, timeout: float = 5.0) -> None:
        self._goodbye = goodbye
        self._stop.set()
        self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        """Its thread still serves (a script or message that raised there ends it, ``error`` says how)."""
        return self._thread.is_alive()

    def lose_proxy(self, link: int) -> None:
        """Proxy ``link`` is lost, as a real worker's I/O thread finds when that proxy's connection closes
        (common/runtime/worker_io.py): its requests are aborted, its resumable streams kept for another proxy to take
        over (``Owners.forget``)."""
        def lose() -> None:
            for request_id in self._worker.owners.forget(link):
                self._worker.abort(request_id)
        self._host.call_soon_threadsafe(lose)

    @property
    def held_pages(self) -> set[str]:
        """Prefill: requests whose pages wait for ReleaseKV."""
        return set(self._worker.engine.held) if self._worker is not None else set()

    def decoding(self) -> int:
        """Requests with tokens still to send."""
        return self._worker.decoding() if self._worker is not None else 0

    # -- the worker's thread --------------------------------------------------------------------

    def _run(self) -> None:
        interval_ms = 1e3 * self.token_interval_s
        constant = StepCostModel(small_max_rows=0, small=[], large=[interval_ms, 0.0, 0.0, 0.0, 0.0])
        host = SimHost(StepProfile(constant, {"model": "scripted"}))
        layout = self.register_msg.kv_layout
        # it runs whatever the proxy sends at once: the slots it registers are the proxy's to keep (a test of
        # admission would otherwise see this double's queue instead)
        spec = SimSpec(self.worker_id, self.role, self.register_msg.model, self.register_msg.model_version,
                       self.register_msg.num_blocks, 1 << 20,
                       max_model_len=self.register_msg.max_model_len, kv_layout=layout,
                       heartbeat_interval_s=self.heartbeat_interval_s, transfer_gbps=1e6,
                       fixed_step_s=self.token_interval_s)
        try:
            self._worker = host.add(spec, self.address, _Scripted, fake=self)
            self._host = host
            self._ready.set()
            host.run(self._stop.is_set)
        except BaseException as error:
            self.error = error
            raise
        finally:
            self._ready.set()
            if self._goodbye and self._worker is not None:
                self._worker.send(Goodbye(self.worker_id, self.epoch, "stopping"))
            host.close(goodbye=False)
