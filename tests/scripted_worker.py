"""A scripted worker without a model, speaking the real wire protocol over a real DEALER.

A test double for the proxy (and a load generator's stand-in for a worker):
it registers, heartbeats, and answers from a script of ``(token_id, text)``
pairs instead of a model. It runs in its own thread with its own ZeroMQ
context, so a test drives it from outside:

    worker = FakeWorker(endpoint, "p0", "prefill", script).start_and_wait()
    ...
    worker.wait_for(lambda m: isinstance(m, ReleaseKV))
    worker.stop()

- prefill: PrefillRequest -> PrefillDone(first scripted token, pages held
  until ReleaseKV or Abort), reporting ``cached_tokens`` of the prompt (at
  most all of it) as found in a prefix cache.
- decode / both: DecodeRequest -> KVPulled when it names pages, then one token per step, a step every
  ``token_interval_s`` (with 0, every turn of its loop). Like a real decode worker's, a step is one TokenDeltas
  carrying one TokenDelta for each request decoding; the last has finish_reason "length" when max_tokens ran
  out, else "stop". Abort stops it.
- A resumed request (``output_token_ids``) continues the script after its output so far.
- With logprobs asked for, token i gets logprob ``-(i + 1) / 10`` and k
  alternatives ``[token + j, logprob - j]``.
- ``stall=True`` records requests and never answers (for timeouts and
  disconnects); ``heartbeats=False`` goes silent; ``send_raw`` sends any frames.
"""
from __future__ import annotations

import queue
import threading
import time
from collections import deque
from collections.abc import Callable

import zmq

from common.protocol.wire import (
    Abort, DecodeRequest, Goodbye, Heartbeat, KVLayoutInfo, KVPulled, PrefillDone, PrefillRequest, Register,
    RegisterAck, ReleaseKV, TokenDelta, TokenDeltas, decode, encode,
)

DEFAULT_LAYOUT = KVLayoutInfo(num_layers=30, block_size=16, num_kv_heads=3, head_dim=64, dtype="float32")


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
        self.held_pages: set[str] = set()  # prefill: requests whose pages wait for ReleaseKV
        self._lock = threading.Condition()
        self._outgoing: queue.Queue[list[bytes]] = queue.Queue()
        self._streams: dict[str, deque[TokenDelta]] = {}  # request id -> its tokens still to send, in order
        self._next_step = 0.0  # when the next decode step is due
        self._stop = threading.Event()
        self._goodbye = True
        self._thread = threading.Thread(target=self._run, name=f"fake-worker-{worker_id}", daemon=True)

    # -- driving it from a test ---------------------------------------------------------------

    def start(self) -> FakeWorker:
        self._thread.start()
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

    def send(self, msg) -> None:
        self._outgoing.put(encode(msg))

    def send_raw(self, frames: list[bytes]) -> None:
        self._outgoing.put(frames)

    def stop(self, goodbye: bool = True, timeout: float = 5.0) -> None:
        self._goodbye = goodbye
        self._stop.set()
        self._thread.join(timeout)

    # -- the worker's loop ----------------------------------------------------------------------

    def _run(self) -> None:
        context = zmq.Context()
        sock = context.socket(zmq.DEALER)
        sock.setsockopt(zmq.IDENTITY, self.worker_id.encode())
        sock.setsockopt(zmq.LINGER, 1000)
        sock.connect(self.address)
        sock.send_multipart(encode(self.register_msg))
        next_heartbeat = 0.0
        try:
            while not self._stop.is_set():
                now = time.monotonic()
                if self.heartbeats and now >= next_heartbeat:
                    sock.send_multipart(encode(self._heartbeat()))
                    next_heartbeat = now + self.heartbeat_interval_s
                while not self._outgoing.empty():
                    sock.send_multipart(self._outgoing.get_nowait())
                if self._streams and now >= self._next_step:
                    sock.send_multipart(encode(self._step()))
                    self._next_step = max(self._next_step + self.token_interval_s, now)
                wait_ms = 5 if not self._streams else max(0, min(5, int((self._next_step - now) * 1000)))
                if sock.poll(wait_ms):
                    self._handle(decode(sock.recv_multipart()))
            if self._goodbye:
                sock.send_multipart(encode(Goodbye(self.worker_id, self.epoch, "stopping")))
        finally:
            sock.close()
            context.term()

    def _step(self) -> TokenDeltas:
        """One decode step: the next token of every request decoding."""
        deltas = [stream.popleft() for stream in self._streams.values()]
        self._streams = {request_id: stream for request_id, stream in self._streams.items() if stream}
        return TokenDeltas(deltas)

    def _heartbeat(self) -> Heartbeat:
        used = 2 * len(self.held_pages)
        running = len(self._streams)
        return Heartbeat(self.worker_id, self.epoch, self.register_msg.num_blocks - used, running, 0, 0,
                         self.draining, 100 * running, self.step_cost)

    def decoding(self) -> int:
        """Requests with tokens still to send."""
        return len(self._streams)

    def _handle(self, msg) -> None:
        with self._lock:
            self.received.append(msg)
            self._lock.notify_all()
        if isinstance(msg, (Abort, ReleaseKV)):
            self.held_pages.discard(msg.request_id)
            if isinstance(msg, Abort):
                self._streams.pop(msg.request_id, None)
        elif self.stall:
            return
        elif isinstance(msg, PrefillRequest):
            self._prefill(msg)
        elif isinstance(msg, DecodeRequest):
            self._decode(msg)

    def _prefill(self, msg: PrefillRequest) -> None:
        position = len(msg.output_token_ids)  # a resumed request goes on with the script where it stopped
        token, text = self.script[position]
        logprob, top = self._logprobs(msg.params, position, token)
        done = msg.params.max_tokens <= position + 1 or len(self.script) == position + 1
        self.held_pages.add(msg.request_id)
        num_tokens = len(msg.prompt_token_ids) + position
        blocks = list(range(-(-num_tokens // self.register_msg.kv_layout.block_size)))
        cached = min(self.cached_tokens, len(msg.prompt_token_ids))
        self.send(PrefillDone(msg.request_id, self.worker_id, self.epoch, token, text, blocks, cached,
                              finish_reason=self._finish_reason(msg.params, position + 1) if done else None,
                              logprob=logprob, top_logprobs=top))

    def _decode(self, msg: DecodeRequest) -> None:
        start = len(msg.output_token_ids)
        if msg.first_token is not None:
            start += 1
            self.send(KVPulled(msg.request_id, msg.source_worker_id or "", True,
                               num_bytes=4096 * len(msg.source_block_ids), seconds=0.002))
        end = min(len(self.script), msg.params.max_tokens)
        stream = deque()
        for i in range(start, end):
            token, text = self.script[i]
            logprob, top = self._logprobs(msg.params, i, token)
            finish = self._finish_reason(msg.params, i + 1) if i == end - 1 else None
            stream.append(TokenDelta(msg.request_id, [token], text, finish_reason=finish,
                                     logprobs=None if logprob is None else [logprob],
                                     top_logprobs=None if top is None else [top]))
        if stream:
            if not self._streams:  # an idle worker's first step is one interval away
                self._next_step = max(self._next_step, time.monotonic() + self.token_interval_s)
            self._streams[msg.request_id] = stream

    def _finish_reason(self, params, produced: int) -> str:
        return "length" if produced >= params.max_tokens and produced < len(self.script) else "stop"

    @staticmethod
    def _logprobs(params, position: int, token: int) -> tuple[float | None, list | None]:
        if params.logprobs is None:
            return None, None
        logprob = -(position + 1) / 10
        return logprob, [[token + j, logprob - j] for j in range(params.logprobs)]
