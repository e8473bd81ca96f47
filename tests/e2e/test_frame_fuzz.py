"""Malformed-frame fuzzing of the control plane's sockets: every process keeps serving.

- A real worker process (tiny model) behind a stand-in proxy's ROUTER: thousands of random and
  half-valid frames (random bytes, known headers over random msgpack, wrong versions, values
  out of range) must each be logged, counted and dropped; a malformed PrefillRequest or
  DecodeRequest whose request id can be read is answered with RequestFailed (its client gets
  an error at once, not a timeout); and the worker then serves a valid request and stops
  cleanly on SIGTERM.
- The proxy's ROUTER gets the same from a registered worker's DEALER and keeps serving.
  (The KV transfer server's socket: tests/e2e/test_kv_transfer_processes.py.)
"""
from __future__ import annotations

import random
import signal
import subprocess
import sys
import time

import msgspec
import pytest
import zmq

from common.cli.local_cluster import free_port
from common.protocol import wire
from common.protocol.sampling_params import SamplingParams
from tests.conditions import settle
from tests.e2e.proxy_harness import (  # noqa: F401
    MODEL, PATIENCE_S, SCRIPT_TEXT, make_proxy, make_worker, ready, script, tokenizer,
)

FRAMES = 3000


def random_frames(rng: random.Random) -> list[bytes]:
    """One malformed message: anything from noise to a known header over a body of the wrong shape."""
    kind = rng.choice(list(wire.MsgType)).value
    version = rng.choice([wire.PROTOCOL_VERSION, wire.PROTOCOL_VERSION, 0, 255])
    noise = rng.randbytes(rng.randrange(0, 64))
    shapes = [
        [noise],
        [bytes([kind, version]), noise],
        [bytes([kind, version]), noise, noise],
        [bytes([kind]), noise],
        [bytes([kind, version]), msgspec.msgpack.encode(rng.choice([
            {"request_id": 5}, {"request_id": "x" * rng.randrange(0, 300)}, [1, 2, 3], "text", 2 ** 64 - 1,
            {"request_id": "fuzz", "prompt_token_ids": [-1]}, {"worker_id": None}, None,
        ]))],
    ]
    return rng.choice(shapes)


def bad_params_request(request_id: str, kind: wire.MsgType) -> list[bytes]:
    """A request the wire decoder refuses though its id is readable (top_p out of range, or too large an int)."""
    body = msgspec.to_builtins(wire.DecodeRequest(request_id, [1, 2, 3], SamplingParams(max_tokens=2), seed=1))
    body["params"]["top_p"] = 0.0 if kind == wire.MsgType.DECODE_REQUEST else 1.5
    body["seed"] = 2 ** 64 - 1 if kind == wire.MsgType.PREFILL_REQUEST else 1
    if kind == wire.MsgType.PREFILL_REQUEST:
        body = {k: v for k, v in body.items() if k in ("request_id", "prompt_token_ids", "params", "seed")}
        body["lease_s"] = 10.0
    return [bytes([kind, wire.PROTOCOL_VERSION]), msgspec.msgpack.encode(body)]


class StandInProxy:
    """A ROUTER that accepts one worker's registration and lets a test talk to it."""

    def __init__(self) -> None:
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        # No high-water mark: a ROUTER drops what it cannot queue for a peer, without a word, and the burst of
        # frames outruns a worker the cores deschedule (a full run lost the last frames, the refused requests).
        self.sock.setsockopt(zmq.SNDHWM, 0)
        self.address = f"tcp://127.0.0.1:{free_port()}"
        self.sock.bind(self.address)
        self.identity = b""

    def recv(self, timeout_s: float = 60.0):
        if not self.sock.poll(int(timeout_s * 1000)):
            raise TimeoutError("the worker sent nothing")
        identity, *frames = self.sock.recv_multipart()
        self.identity = identity
        return wire.decode(frames)

    def recv_until(self, predicate, timeout_s: float = 60.0):
        deadline = time.monotonic() + timeout_s
        while True:
            msg = self.recv(max(0.1, deadline - time.monotonic()))
            if predicate(msg):
                return msg

    def send(self, frames: list[bytes]) -> None:
        self.sock.send_multipart([self.identity, *frames])

    def close(self) -> None:
        self.sock.close(0)
        self.ctx.term()


@pytest.fixture
def worker(tiny_chat_model_dir, tmp_path):
    proxy = StandInProxy()
    log = open(tmp_path / "worker.log", "w")
    proc = subprocess.Popen([sys.executable, "-m", "common.cli.main", "both", "--set", "worker_id=fuzzed",
                             "--set", f"proxy_address={proxy.address}", "--set", f"engine.model={tiny_chat_model_dir}",
                             "--set", "engine.num_threads=1", "--set", "observability.metrics_port=0", "--set", "transfer_backend=zmq",
                             "--set", "heartbeat_interval_s=0.5", "--set", "engine.cpu.huge_pages=false"],
                            stdout=log, stderr=subprocess.STDOUT)
    register = proxy.recv_until(lambda m: isinstance(m, wire.Register), timeout_s=120)
    proxy.send(wire.encode(wire.RegisterAck(register.worker_id, True)))
    yield proxy, proc, tmp_path / "worker.log"
    if proc.poll() is None:
        proc.kill()
    log.close()
    proxy.close()


def test_a_worker_drops_every_malformed_frame_and_keeps_serving(worker):
    proxy, proc, log_path = worker
    rng = random.Random(13)
    for i in range(FRAMES):
        proxy.send(random_frames(rng))
        if i % 500 == 0:
            assert proc.poll() is None, open(log_path).read()[-3000:]
    for kind in (wire.MsgType.PREFILL_REQUEST, wire.MsgType.DECODE_REQUEST):
        request_id = f"refused-{kind.name}"
        proxy.send(bad_params_request(request_id, kind))
        failed = proxy.recv_until(lambda m: isinstance(m, wire.RequestFailed) and m.request_id == request_id)
        assert failed.invalid_request and not failed.retryable and "refused" in failed.message
    proxy.send(wire.encode(wire.DecodeRequest("good", [1, 2, 3, 4], SamplingParams(temperature=0.0, max_tokens=5),
                                              seed=1)))
    tokens = []
    while True:
        msg = proxy.recv_until(lambda m: isinstance(m, wire.TokenDeltas) and m.deltas[0].request_id == "good")
        (delta,) = msg.deltas
        tokens += delta.token_ids
        if delta.finish_reason:
            break
    assert len(tokens) == 5
    assert proc.poll() is None
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(60) == 0, open(log_path).read()[-3000:]
    assert "dropped a malformed message" in open(log_path).read()


def test_the_proxy_drops_every_malformed_frame_and_keeps_serving(make_proxy, make_worker):
    proxy = make_proxy()
    make_worker(proxy, "p0", "prefill")
    decode = make_worker(proxy, "d0", "decode")
    ready(proxy)
    rng = random.Random(17)
    for _ in range(FRAMES):
        decode.send_raw(random_frames(rng))
    settle(lambda: proxy.http.get("/metrics").text, lambda text: "tessera_proxy_malformed_messages_total" in text,
           PATIENCE_S, "the proxy counts the malformed frames it read")
    body = proxy.http.post("/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 50}).json()
    assert body["choices"][0]["text"] == SCRIPT_TEXT
    assert proxy.thread.is_alive()
