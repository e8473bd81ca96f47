"""A worker serving one proxy that stops reading (SIGSTOP, a hung process): the real I/O thread (``WorkerIO``)
against a ROUTER socket standing in for the proxy. Its messages wait for the proxy in order, none dropped, while the
thread goes on turning (the watchdog's sign of life) and receiving; once the proxy reads again every message
arrives, in the order the worker sent them."""
from __future__ import annotations

import time

import zmq

from common.config.roles import WorkerConfig
from common.protocol import wire
from common.protocol.sampling_params import SamplingParams
from common.runtime.telemetry import WorkerMetrics
from common.runtime.worker_io import WorkerIO

LAYOUT = wire.KVLayoutInfo(2, 16, 2, 8, "float32")
MESSAGES = 3000  # past ZeroMQ's queue (1,000 messages) and the kernel's socket buffers at 4 KiB each
TEXT = "x" * 4096


def receive(sock: zmq.Socket, kind: type, timeout: float = 10.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if sock.poll(50):
            _, *frames = sock.recv_multipart()
            msg = wire.decode(frames)
            if isinstance(msg, kind):
                return msg
    raise TimeoutError(f"no {kind.__name__}")


def eventually(check, timeout: float = 30.0) -> bool:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def test_a_proxy_that_stops_reading_holds_up_no_turn_of_the_thread_and_loses_nothing(tmp_path):
    context = zmq.Context()
    proxy = context.socket(zmq.ROUTER)
    proxy.setsockopt(zmq.RCVHWM, 10)
    address = f"tcp://127.0.0.1:{proxy.bind_to_random_port('tcp://127.0.0.1')}"
    config = WorkerConfig(worker_id="w0", role="decode", heartbeat_interval_s=0.05, proxy_address=address,
                          register_timeout_s=5)
    io = WorkerIO(config, wire.Register("w0", "decode", 7, "m", "v", LAYOUT, 64, 256, "fake", b""),
                  WorkerMetrics(config), tmp_path)
    io._thread.start()
    try:
        receive(proxy, wire.Register)
        proxy.send_multipart([b"w0", *wire.encode(wire.RegisterAck("w0", True))])
        receive(proxy, wire.Heartbeat)
        for i in range(MESSAGES):  # the proxy reads none of these for now
            io.send(wire.TokenDeltas([wire.TokenDelta(f"r{i}", [i], TEXT)]))
        assert eventually(lambda: io.links[0].unsent), "the socket took 12 MB the proxy did not read"
        turned = io.turned_at
        assert eventually(lambda: io.turned_at > turned), "the I/O thread stopped turning"
        assert io.links[0].unsent  # still waiting: the proxy has read nothing
        proxy.send_multipart([b"w0", *wire.encode(wire.DecodeRequest("q", [1, 2], SamplingParams(max_tokens=4), 0))])
        assert io.inbox.get(timeout=5).request_id == "q"  # and it still receives
        ids = []
        while len(ids) < MESSAGES:  # the proxy reads again: everything, in order
            msg = receive(proxy, wire.TokenDeltas)
            ids += [int(d.request_id[1:]) for d in msg.deltas]
        assert ids == list(range(MESSAGES))
        assert not io.links[0].unsent
    finally:
        io.stop("test over")
        proxy.close(0)
        context.term()
