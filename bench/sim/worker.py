"""Simulated workers: the real wire protocol and a real block manager, with no model.

``SimWorker`` is one worker (prefill, decode or both) on a DEALER socket of its own per proxy (``endpoint``, as a
worker's ``proxy_address``: replies go to the sender, common/runtime/proxy_links.py): it registers with each,
heartbeats (free blocks, running sequences and the profile's step model, as a real worker reports its own fit), and
serves PrefillRequest, DecodeRequest, ReleaseKV and Abort as the real workers do, with ``SimEngine`` (bench.sim.
engine) deciding what each step runs and how long it takes. A prefill worker holds a prompt's pages until
ReleaseKV, Abort or its lease ends; a decode worker "pulls" them (``transfer_gbps``) and reports KVPulled. Each
publishes its block manager's KV events on a PUB socket of its own and answers KVSnapshotRequest, as a real worker
does (common/runtime/kv_events.py), so the proxies route on what it holds.

A worker ordered to another role (SwitchRole) switches as a real one does (common/runtime/role_switch.py): it
takes no new work (its heartbeats say draining), lets what it runs finish and its lent pages be pulled, for at
most ``drain_timeout_s`` (what is left then goes back to the proxy, retryable: RequestFailed, and resumes
elsewhere), says Goodbye, and registers again under a new epoch in the new role after ``role_switch_s`` (the
profile's measured cost of a switch beyond the drain, times the time scale), its block manager and prefix cache
kept. Meanwhile it sends no heartbeat, so no proxy asks it to register early.

``SimHost`` runs many of them in one thread: one poller over their sockets, one heap of timers (steps,
heartbeats, pulls, leases). It measures how late each timer runs (its loop's lag): a simulated step's timing
means something only while that lag is small against a step, so ``stats`` reports the lag's p99 with the
step p50, and ``timing_valid`` whether the p99 stayed within ``MAX_LAG_SHARE`` of a step.

Tokens are ``engine.output_token``'s; their text comes from the model's tokenizer when one is given (a table
of each id's text, made once), else from the id.
"""
from __future__ import annotations

import heapq
import itertools
import logging
import os
import queue
import statistics
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import zmq

from bench.sim.engine import FIRST_TOKEN_ID, TOKEN_RANGE, SimEngine, SimSequence
from bench.sim.profile import StepProfile
from common.protocol.wire import (FindStream, KVSnapshotRequest, LeaveStream, Peers, Register, RegisterAck,
                                  Reregister, StreamFound, SwitchRole, Tune)
from common.protocol.wire import (Abort, DecodeRequest, Goodbye, Heartbeat, KVLayoutInfo, KVPulled, PrefillDone,
                                  PrefillRequest, ReleaseKV, RequestFailed, StepCostModel, TokenDelta, TokenDeltas,
                                  WireError, decode, encode)
from common.runtime.kv_events import KVEventPublisher
from common.runtime.proxy_links import Owners, proxy_addresses
from common.runtime.zmq_security import Waker

log = logging.getLogger("tessera.sim")

SWITCH_POLL_S = 0.02  # a switching worker looks this often whether its drain is done
MAX_LAG_SHARE = 0.05  # simulated latencies are published only while the loop's lag p99 is within this of a step
LAYOUT = KVLayoutInfo(num_layers=30, block_size=16, num_kv_heads=3, head_dim=64, dtype="bfloat16")


@dataclass
class SimSpec:
    """One simulated worker, as a real worker's config would describe it."""
    worker_id: str
    role: str = "decode"  # prefill | decode | both
    model: str = "SmolLM2-135M-Instruct"
    model_version: str = "sim"
    num_blocks: int = 16_384
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    max_model_len: int = 8192
    kv_layout: KVLayoutInfo = LAYOUT
    heartbeat_interval_s: float = 1.0
    transfer_gbps: float = 10.0  # KV pull bandwidth, gigabits a second
    time_scale: float = 1.0  # a step's time: the profile's times this; 0: no time
    fixed_step_s: float | None = None  # instead: decode steps this long, prompt steps none (SimEngine)
    drain_timeout_s: float = 30.0  # a role switch's drain, at most (a real worker's drain_timeout_s)


class SimWorker:
    def __init__(self, spec: SimSpec, profile: StepProfile, endpoint: str, host: SimHost,
                 token_text: Callable[[int], str] = str) -> None:
        self.spec = spec
        self.endpoint = endpoint
        self.host = host
        self.token_text = token_text
        self.epoch = time.time_ns()
        self.cost = profile.cost
        self.role_switch_s = profile.role_switch_s * spec.time_scale
        self.switching: str | None = None  # the role it was ordered to, until it registers in it
        self.away = False  # said Goodbye for a switch, not yet registered again
        self.halted = False  # its switch's drain timed out: no step starts, what runs goes back once the step ends
        self.switches: list[dict] = []  # each switch: roles, drain, handed back, and how long each part took
        self.engine = SimEngine(profile.step_ms, spec.num_blocks, spec.kv_layout.block_size, spec.max_num_seqs,
                                spec.max_num_batched_tokens, spec.time_scale, prefill_only=spec.role == "prefill",
                                fixed_step_s=spec.fixed_step_s)
        self.sockets: list[zmq.Socket] = []  # one per proxy, in ``endpoint``'s order
        self.links_registered = [False] * len(proxy_addresses(endpoint))
        links = len(self.links_registered)
        self.owners = Owners(spec.role == "prefill") if links > 1 else None
        self.draining = False
        self.stepping = False  # a step is in flight (its end is a timer)
        self.pulls: dict[str, SimSequence] = {}  # decode: pages being pulled
        self.deferred: deque[SimSequence] = deque()  # pulled, waiting for blocks
        self.bytes_per_token = spec.kv_layout.bytes_per_token
        self.step_seconds: deque[float] = deque(maxlen=4096)  # recent steps' durations, for the lag's yardstick
        self.requests = 0
        self.tokens = 0
        self.kv_events: KVEventPublisher | None = None  # bound by ``start``

    # -- life cycle ------------------------------------------------------------------------------------

    def register_message(self) -> Register:
        s = self.spec
        return Register(s.worker_id, s.role, self.epoch, s.model, s.model_version, s.kv_layout, s.num_blocks,
                        s.max_model_len, "sim", b"sim:" + s.worker_id.encode(), max_num_seqs=s.max_num_seqs,
                        kv_events_endpoint=self.kv_events.endpoint if self.kv_events is not None else "")

    @property
    def registered(self) -> bool:
        """Acknowledged by every proxy."""
        return all(self.links_registered)

    def start(self, context: zmq.Context) -> None:
        pub = context.socket(zmq.PUB)
        pub.setsockopt(zmq.LINGER, 0)
        pub.bind("tcp://127.0.0.1:*")
        self.kv_events = KVEventPublisher(None, pub, "127.0.0.1")  # the host's context: it outlives the socket
        self.engine.blocks.record_kv_events()
        for address in proxy_addresses(self.endpoint):
            sock = context.socket(zmq.DEALER)
            sock.setsockopt(zmq.IDENTITY, self.spec.worker_id.encode())
            sock.setsockopt(zmq.LINGER, 1000)
            sock.connect(address)
            self.sockets.append(sock)
        self.send(self.register_message())
        self.host.at(0.0, self.heartbeat)

    def send(self, msg, link: int | None = None) -> None:
        """To proxy ``link``; None: where ``msg`` belongs (its request's proxy, or every proxy)."""
        if link is not None or self.owners is None:
            self._send(self.sockets[link or 0], msg)
            return
        for index, part in self.owners.route(msg):
            for sock in self.sockets if index is None else (self.sockets[index],):
                self._send(sock, part)

    def _send(self, sock: zmq.Socket, msg) -> None:
        stored, removed = self.engine.blocks.take_kv_events()  # a request's blocks go out before its messages
        if (stored or removed) and self.kv_events is not None:
            self.kv_events.publish(self.spec.worker_id, self.epoch, stored, removed, fresh=False)
        try:
            sock.send_multipart(encode(msg), zmq.NOBLOCK)
        except zmq.Again:
            log.warning("%s: dropped a %s: the proxy is not reading", self.spec.worker_id, type(msg).__name__)

    def heartbeat(self) -> None:
        message = self.heartbeat_message()
        if message is not None and not self.away:
            self.send(message)
        if self.owners is not None:  # a lost proxy's resumable streams nobody took over (common/runtime/worker_io)
            for request_id in self.owners.expire():
                self.abort(request_id)
        self.host.after(self.spec.heartbeat_interval_s, self.heartbeat)

    def heartbeat_message(self) -> Heartbeat | None:
        """What a real worker reports: its free blocks, its load, and its step model (here the profile's, times
        the time scale)."""
        engine, scale = self.engine, self.spec.time_scale
        cost = self.cost if scale else None
        if cost is not None and scale != 1.0:
            cost = StepCostModel(cost.small_max_rows, [c * scale for c in cost.small], [c * scale for c in cost.large],
                                 [c * scale for c in cost.mixed], cost.samples)
        return Heartbeat(self.spec.worker_id, self.epoch, engine.blocks.num_free_blocks, len(engine.running),
                         len(engine.waiting), engine.outstanding_prefill_tokens, self.draining, engine.context_tokens,
                         cost)

    @property
    def busy(self) -> bool:
        e = self.engine
        return bool(e.waiting or e.running or e.held or self.pulls or self.deferred)

    def stop(self, goodbye: bool = True) -> None:
        if goodbye:
            self.send(Goodbye(self.spec.worker_id, self.epoch, "stopping"))
        for sock in self.sockets:
            sock.close()
        if self.kv_events is not None:
            self.kv_events.close()

    # -- messages --------------------------------------------------------------------------------------

    def receive(self, link: int = 0) -> None:
        while True:
            try:
                frames = self.sockets[link].recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            try:
                msg = decode(frames)
            except WireError as exc:
                log.warning("%s: dropped a malformed message: %s", self.spec.worker_id, exc)
                continue
            if self.owners is None or self.owners.took(msg, link):
                self.handle(msg, link)

    def handle(self, msg, link: int = 0) -> None:
        if isinstance(msg, PrefillRequest):
            self.requests += 1
            self.engine.add(self.sequence(msg, list(msg.prompt_token_ids) + list(msg.output_token_ids),
                                          len(msg.output_token_ids), lease_s=msg.lease_s))
        elif isinstance(msg, DecodeRequest):
            self.requests += 1
            self._decode(msg)
        elif isinstance(msg, ReleaseKV):
            self.engine.release(msg.request_id)
        elif isinstance(msg, Abort):
            self.abort(msg.request_id)
        elif isinstance(msg, FindStream):
            answers = [StreamFound(msg.response_id, self.spec.worker_id, "absent")] if self.owners is None else \
                self.owners.take_over(msg, link, self.spec.worker_id)
            for answer in answers:
                self.send(answer, link)
        elif isinstance(msg, LeaveStream) and self.owners is not None:
            self.owners.leave(msg.request_id, link)
        elif isinstance(msg, RegisterAck):
            self.links_registered[link] = msg.accepted
            last = self.switches[-1] if self.switches else {}
            if msg.accepted and "register_sent" in last and "registered_s" not in last and self.registered:
                self.switches[-1]["registered_s"] = round(time.monotonic() - self.switches[-1]["register_sent"], 6)
            if not msg.accepted:
                log.error("%s: the proxy refused it: %s", self.spec.worker_id, msg.reason)
        elif isinstance(msg, Reregister):
            if not self.away:  # between its Goodbye and its new Register: it registers when its switch is done
                self.send(self.register_message(), link)
        elif isinstance(msg, SwitchRole):
            self.switch_role(msg.role)
        elif isinstance(msg, KVSnapshotRequest):
            snapshot = self.kv_events.snapshot(self.spec.worker_id, self.epoch, msg)
            if snapshot is not None:
                self.send(snapshot, link)
        elif not isinstance(msg, (Peers, Tune)):
            log.debug("%s: ignored a %s", self.spec.worker_id, type(msg).__name__)
        self.kick()

    def abort(self, request_id: str) -> None:
        self.pulls.pop(request_id, None)
        self.deferred = deque(s for s in self.deferred if s.request_id != request_id)
        self.engine.abort(request_id)

    # -- role switch ---------------------------------------------------------------------------------

    def switch_role(self, role: str) -> None:
        """SwitchRole: drain, hand back what is left after ``drain_timeout_s``, Goodbye, and register anew."""
        if self.switching is not None:
            log.warning("%s: ordered to %s while switching to %s: ignored", self.spec.worker_id, role, self.switching)
            return
        log.info("%s: switching from %s to %s", self.spec.worker_id, self.spec.role, role)
        self.switching, self.draining = role, True
        now = time.monotonic()
        self.switches.append({"from": self.spec.role, "to": role, "ordered": now, "running": len(self.engine.running),
                              "handed_back": 0})
        message = self.heartbeat_message()  # the proxies see it draining before its next heartbeat
        if message is not None:
            self.send(message)
        self._drain_switch(now + self.spec.drain_timeout_s)

    def _drain_switch(self, deadline: float) -> None:
        if self.busy and time.monotonic() < deadline:
            self.host.after(SWITCH_POLL_S, lambda: self._drain_switch(deadline))
            return
        self.halted = True
        if self.stepping:  # a step in flight ends first: its tokens are the clients'
            self.host.after(SWITCH_POLL_S, lambda: self._drain_switch(deadline))
            return
        self._hand_back()
        record = self.switches[-1]
        record["drain_s"] = round(time.monotonic() - record["ordered"], 6)
        self.send(Goodbye(self.spec.worker_id, self.epoch, f"switching role to {self.switching}"))
        self.away = True
        self.host.after(self.role_switch_s, self._rejoin)

    def _hand_back(self) -> None:
        """What the drain did not finish goes back to its proxy, retryable (it resumes elsewhere); lent pages not
        pulled by now are freed (their pull fails, and the request resumes)."""
        engine = self.engine
        failed = [s.request_id for s in (*engine.running, *engine.waiting, *self.pulls.values(), *self.deferred)]
        for request_id in failed:
            self.send(RequestFailed(request_id, self.spec.worker_id, "the worker is switching roles", retryable=True))
            engine.abort(request_id)
        for request_id in list(engine.held):
            engine.release(request_id)
        self.pulls.clear()
        self.deferred.clear()
        self.switches[-1]["handed_back"] = len(failed)

    def _rejoin(self) -> None:
        role = self.switching
        self.spec.role = role
        self.engine.prefill_only = role == "prefill"
        if self.owners is not None:
            self.owners = Owners(role == "prefill")
        self.epoch = time.time_ns()
        self.links_registered = [False] * len(self.links_registered)
        self.switching, self.draining, self.away, self.halted = None, False, False, False
        self.switches[-1]["register_sent"] = time.monotonic()
        self.send(self.register_message())
        message = self.heartbeat_message()
        if message is not None:
            self.send(message)

    def sequence(self, msg, prompt: list[int], produced: int, **kwargs) -> SimSequence:
        """The engine's sequence for a request: it stops at ``max_tokens``, or where the model would stop of
        itself (``output_limit``)."""
        params = msg.params
        limit = min(params.max_tokens, self.output_limit(msg))
        return SimSequence(msg.request_id, prompt, max(limit - produced, 0), msg.seed, produced, msg.cache_salt,
                           logprobs=params.logprobs, max_tokens=params.max_tokens, **kwargs)

    def output_limit(self, msg) -> int:
        """How many tokens the simulated model generates before it stops by itself: it does not."""
        return msg.params.max_tokens

    def finish_reason(self, seq: SimSequence, produced: int) -> str:
        return "length" if produced >= seq.max_tokens else "stop"

    def text_of(self, seq: SimSequence, position: int, token: int) -> str:
        return self.token_text(token)

    @staticmethod
    def logprobs_of(seq: SimSequence, position: int, token: int) -> tuple[float | None, list | None]:
        """The simulated model's logprob of its token, and ``seq.logprobs`` alternatives after it."""
        if seq.logprobs is None:
            return None, None
        logprob = -(position + 1) / 10
        return logprob, [[token + j, logprob - j] for j in range(seq.logprobs)]

    def cached_tokens(self, seq: SimSequence) -> int:
        return seq.cached_tokens

    def _decode(self, msg: DecodeRequest) -> None:
        produced = len(msg.output_token_ids) + (msg.first_token is not None)
        prompt = list(msg.prompt_token_ids) + list(msg.output_token_ids)
        if msg.first_token is not None:
            prompt.append(msg.first_token)
        seq = self.sequence(msg, prompt, produced)
        pages = msg.first_token is not None and msg.source_block_ids
        if seq.max_new <= 0 and not pages:
            return
        if not pages:
            self.engine.add(seq)  # prefilled here
            return
        self.pulls[msg.request_id] = seq
        size = len(prompt) * self.bytes_per_token
        seconds = size * 8 / (self.spec.transfer_gbps * 1e9) * (self.spec.time_scale > 0)
        self.host.after(seconds, lambda: self._pulled(msg, seq, size, seconds))

    def _pulled(self, msg: DecodeRequest, seq: SimSequence, size: int, seconds: float) -> None:
        if self.pulls.pop(msg.request_id, None) is None:
            return  # aborted meanwhile
        self.send(KVPulled(msg.request_id, msg.source_worker_id or "", True, num_bytes=size, seconds=seconds))
        if seq.max_new > 0:
            self.deferred.append(seq)
        self.kick()

    # -- steps -----------------------------------------------------------------------------------------

    def kick(self) -> None:
        """Start a step if none runs and there is work."""
        while self.deferred and self.engine.add_decoding(self.deferred[0]):
            self.deferred.popleft()
        if self.stepping or self.halted:
            return
        plan = self.engine.plan()
        if plan.empty:
            return
        self.stepping = True
        self.step_seconds.append(plan.seconds)
        self.host.after(plan.seconds, lambda: self._step_done(plan))

    def _step_done(self, plan) -> None:
        self.stepping = False
        result = self.engine.finish(plan)
        for seq in result.prefilled:
            if self.engine.prefill_only:  # hand the pages off; they are kept until released or the lease ends
                position = seq.produced
                token = self.engine.first_token(seq)
                logprob, top = self.logprobs_of(seq, position, token)
                done = seq.max_new <= 1
                self.send(PrefillDone(seq.request_id, self.spec.worker_id, self.epoch, token,
                                      self.text_of(seq, position, token), list(seq.blocks), self.cached_tokens(seq),
                                      finish_reason=self.finish_reason(seq, position + 1) if done else None,
                                      logprob=logprob, top_logprobs=top))
                self.tokens += 1
                self.host.after(seq.lease_s, lambda rid=seq.request_id: self.engine.release(rid))
        deltas = []
        for seq, token, done in result.tokens:
            position = seq.produced + seq.emitted - 1
            logprob, top = self.logprobs_of(seq, position, token)
            deltas.append(TokenDelta(seq.request_id, [token], self.text_of(seq, position, token),
                                     finish_reason=self.finish_reason(seq, position + 1) if done else None,
                                     logprobs=None if logprob is None else [logprob],
                                     top_logprobs=None if top is None else [top],
                                     num_cached_tokens=self.cached_tokens(seq)))
        if deltas:
            self.tokens += len(deltas)
            self.send(TokenDeltas(deltas))
        self.kick()


class SimHost:
    """Many simulated workers in one thread: their sockets in one poller, their timers in one heap."""

    def __init__(self, profile: StepProfile, token_text: Callable[[int], str] = str) -> None:
        self.profile = profile
        self.token_text = token_text
        self.context = zmq.Context()
        self.poller = zmq.Poller()
        self.waker = Waker()  # calls from other threads (``call_soon_threadsafe``) wake the poll
        self.poller.register(self.waker.fd, zmq.POLLIN)
        self._calls: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self.workers: dict[str, SimWorker] = {}  # by worker id
        self._sockets: dict[zmq.Socket, tuple[SimWorker, int]] = {}  # each worker's socket per proxy
        self._timers: list[tuple[float, int, Callable[[], None]]] = []
        self._order = itertools.count()
        self.lags: deque[float] = deque(maxlen=20_000)  # how late timers ran, seconds
        self._rss_base = _rss_mib()

    def add(self, spec: SimSpec, endpoint: str, worker_class: type[SimWorker] | None = None, **kwargs) -> SimWorker:
        """A worker of ``spec`` for the proxy at ``endpoint``, started (it registers); ``worker_class``: a
        ``SimWorker`` subclass, given ``kwargs`` besides."""
        worker = (worker_class or SimWorker)(spec, self.profile, endpoint, self, self.token_text, **kwargs)
        worker.start(self.context)
        for link, sock in enumerate(worker.sockets):
            self.poller.register(sock, zmq.POLLIN)
            self._sockets[sock] = (worker, link)
        self.workers[spec.worker_id] = worker
        return worker

    def at(self, when: float, callback: Callable[[], None]) -> None:
        heapq.heappush(self._timers, (when, next(self._order), callback))

    def after(self, seconds: float, callback: Callable[[], None]) -> None:
        self.at(time.monotonic() + seconds, callback)

    def run(self, until: Callable[[], bool]) -> None:
        """Serve until ``until()`` is true (checked at least every 50 ms)."""
        while not until():
            now = time.monotonic()
            while self._timers and self._timers[0][0] <= now:
                due, _, callback = heapq.heappop(self._timers)
                if due > 0:
                    self.lags.append(now - due)
                callback()
                now = time.monotonic()
            wait_ms = 50 if not self._timers else max(0, min(50, (self._timers[0][0] - now) * 1e3))
            for sock, _ in self.poller.poll(wait_ms):
                if sock == self.waker.fd:
                    self.waker.drain()
                    while not self._calls.empty():
                        self._calls.get_nowait()()
                else:
                    worker, link = self._sockets[sock]
                    worker.receive(link)

    def call_soon_threadsafe(self, callback: Callable[[], None]) -> None:
        """Run ``callback`` in the host's thread, at its next turn."""
        self._calls.put(callback)
        self.waker.wake()

    def drain(self, timeout_s: float) -> None:
        """Stop taking work (heartbeats say draining), let what runs finish within ``timeout_s``, say goodbye."""
        for worker in self.workers.values():
            worker.draining = True
        deadline = time.monotonic() + timeout_s
        self.run(lambda: time.monotonic() > deadline or not any(w.busy for w in self.workers.values()))
        self.close()

    def close(self, goodbye: bool = True) -> None:
        for worker in self.workers.values():
            worker.stop(goodbye)
        self.poller.unregister(self.waker.fd)
        self.waker.close()
        self.context.term()

    def stats(self) -> dict:
        lags = sorted(self.lags)
        steps = [s for w in self.workers.values() for s in w.step_seconds if s > 0]
        lag_p99 = lags[int(0.99 * (len(lags) - 1))] if lags else 0.0
        rss = _rss_mib()
        step_p50 = statistics.median(steps) if steps else 0.0
        return {"workers": len(self.workers), "requests": sum(w.requests for w in self.workers.values()),
                "tokens": sum(w.tokens for w in self.workers.values()), "lag_p99_ms": round(lag_p99 * 1e3, 3),
                "step_p50_ms": round(step_p50 * 1e3, 3),
                "timing_valid": bool(step_p50) and lag_p99 <= MAX_LAG_SHARE * step_p50,
                "used_blocks": sum(w.engine.blocks.num_used_blocks for w in self.workers.values()),
                "held_pages": sum(len(w.engine.held) for w in self.workers.values()),
                "switches": [{"worker": w.spec.worker_id, **record} for w in self.workers.values()
                             for record in w.switches],
                "rss_mib": round(rss, 1),  # the process; per worker: what it grew by since the host began
                "mib_per_worker": round((rss - self._rss_base) / max(len(self.workers), 1), 2)}


def _rss_mib() -> float:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / (1 << 20)


def token_texts(tokenizer) -> Callable[[int], str]:
    """Each simulated token id's text from ``tokenizer`` (a table made once), for realistic stream chunks."""
    count = min(TOKEN_RANGE, tokenizer.vocab_size - FIRST_TOKEN_ID)
    table = [tokenizer.decode([FIRST_TOKEN_ID + i]) for i in range(count)]
    return lambda token: table[(token - FIRST_TOKEN_ID) % len(table)]

