"""A worker serving two proxies: the real I/O thread (``WorkerIO``) against two ROUTER sockets standing in for the
proxies. It registers and heartbeats with both, answers each request to the proxy that sent it, splits a step's
tokens by proxy, and when one proxy loses it, fails that proxy's requests only and registers with it again under
the same epoch."""
from __future__ import annotations

import time

import pytest
import zmq

from common.config.roles import WorkerConfig
from common.protocol import wire
from common.protocol.sampling_params import SamplingParams
from common.runtime.proxy_links import IDLE_S, Owners
from common.runtime.telemetry import WorkerMetrics
from common.runtime.worker_contracts import Load
from common.runtime.worker_io import LinkLost, WorkerIO

LAYOUT = wire.KVLayoutInfo(2, 16, 2, 8, "float32")
MARK = wire.Heartbeat("w0", 99, 0, 0, 0, 0)  # queued by the test: every proxy gets it after what came before it


class Proxy:
    def __init__(self, context: zmq.Context) -> None:
        self.sock = context.socket(zmq.ROUTER)
        port = self.sock.bind_to_random_port("tcp://127.0.0.1")
        self.address = f"tcp://127.0.0.1:{port}"

    def receive(self, kind: type, timeout: float = 5.0):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.sock.poll(50):
                identity, *frames = self.sock.recv_multipart()
                msg = wire.decode(frames)
                if isinstance(msg, kind):
                    return msg
        raise TimeoutError(f"no {kind.__name__}")

    def until_mark(self) -> list:
        """What arrives before the test's ``MARK``: all that the worker queued for this proxy before it."""
        got = []
        while (msg := self.receive(object)) != MARK:
            got.append(msg)
        return got

    def send(self, msg) -> None:
        self.sock.send_multipart([b"w0", *wire.encode(msg)])


def request(request_id: str) -> wire.DecodeRequest:
    return wire.DecodeRequest(request_id, [1, 2, 3], SamplingParams(max_tokens=4), 0)


@pytest.fixture
def two_proxies(tmp_path):
    context = zmq.Context()
    proxies = [Proxy(context), Proxy(context)]
    config = WorkerConfig(worker_id="w0", role="decode", heartbeat_interval_s=0.05,
                          proxy_address=",".join(p.address for p in proxies), register_timeout_s=5)
    registration = wire.Register("w0", "decode", 7, "m", "v", LAYOUT, 64, 256, "fake", b"")
    io = WorkerIO(config, registration, WorkerMetrics(config), tmp_path)
    io._thread.start()
    for proxy in proxies:
        proxy.receive(wire.Register)
        proxy.send(wire.RegisterAck("w0", True))
    yield io, proxies
    io.stop("test over")
    for proxy in proxies:
        proxy.sock.close(0)
    context.term()


def test_each_request_is_answered_to_its_proxy_and_heartbeats_go_to_both(two_proxies):
    io, (a, b) = two_proxies
    assert a.receive(wire.Heartbeat).epoch == b.receive(wire.Heartbeat).epoch == 7
    a.send(request("ra"))
    b.send(request("rb"))
    assert {io.inbox.get(timeout=5).request_id for _ in range(2)} == {"ra", "rb"}
    io.send(wire.TokenDeltas([wire.TokenDelta("ra", [5], "x"), wire.TokenDelta("rb", [6], "y"),
                              wire.TokenDelta("stray", [7], "z")]))
    io.send(wire.KVPulled("rb", "p0", True))
    io.send(MARK)
    got_a = [m for m in a.until_mark() if not isinstance(m, wire.Heartbeat)]
    got_b = [m for m in b.until_mark() if not isinstance(m, wire.Heartbeat)]
    assert [[d.request_id for d in m.deltas] for m in got_a] == [["ra"]]  # a stray request's goes nowhere
    assert [type(m) for m in got_b] == [wire.TokenDeltas, wire.KVPulled]
    assert [d.request_id for d in got_b[0].deltas] == ["rb"]


def test_each_heartbeat_names_the_last_request_of_its_proxy_that_its_load_counts(two_proxies):
    """Requests the compute loop has not taken yet are not in the load a heartbeat carries: it names the last one of
    that proxy's it counts, so the proxy keeps counting the rest as on their way."""
    io, (a, b) = two_proxies
    assert a.receive(wire.Heartbeat).last_decode_taken == b.receive(wire.Heartbeat).last_decode_taken == ""
    a.send(request("ra1"))
    b.send(request("rb1"))
    a.send(request("ra2"))
    taken = [io.take(5).request_id for _ in range(3)]
    # the compute loop takes them, then measures its load ...
    io.send(MARK)
    a.until_mark(), b.until_mark()
    assert a.receive(wire.Heartbeat).last_decode_taken == ""  # ... not measured yet
    io.load = Load(decodes_taken=2)  # a load measured after it took the first two
    io.send(MARK)
    a.until_mark(), b.until_mark()
    beats = a.receive(wire.Heartbeat), b.receive(wire.Heartbeat)
    first_two = taken[:2]
    assert beats[0].last_decode_taken == ("ra1" if "ra2" not in first_two else "ra2")
    assert beats[1].last_decode_taken == ("rb1" if "rb1" in first_two else "")
    io.load = Load(decodes_taken=3)
    io.send(MARK)
    a.until_mark(), b.until_mark()
    assert (a.receive(wire.Heartbeat).last_decode_taken, b.receive(wire.Heartbeat).last_decode_taken) == ("ra2", "rb1")


def test_a_proxy_that_lost_the_worker_gets_its_requests_failed_and_a_new_register(two_proxies):
    io, (a, b) = two_proxies
    a.send(request("ra"))
    b.send(request("rb1"))
    b.send(request("rb2"))
    for _ in range(3):
        io.inbox.get(timeout=5)
    b.send(wire.Reregister("w0", 7, "expired"))
    lost = io.inbox.get(timeout=5)
    assert isinstance(lost, LinkLost) and lost.link == 1 and lost.request_ids == {"rb1", "rb2"}
    assert io.registered.is_set()  # a still has it
    io.send(MARK)
    a.until_mark(), b.until_mark()  # what was on its way before the Reregister
    for _ in range(2):  # two more rounds of heartbeats, to a alone: none to b until it registers again
        a.receive(wire.Heartbeat)
    io.send(MARK)
    assert not any(isinstance(m, wire.Heartbeat) for m in b.until_mark())
    io.rejoin(lost.link)
    assert b.receive(wire.Register).epoch == 7  # the same epoch: a, which knows it, goes on undisturbed
    io.send(MARK)
    assert not any(isinstance(m, wire.Register) for m in a.until_mark())


def test_owners_forget_a_request_with_its_last_message_or_when_idle():
    clock = [0.0]
    owners = Owners(release_ends=True, clock=lambda: clock[0])
    owners.took(request("r1"), 1)
    owners.took(request("r2"), 0)
    assert owners.route(wire.TokenDeltas([wire.TokenDelta("r1", [1], "a", finish_reason="stop")])) != []
    assert owners.forget(1) == set() and len(owners) == 1
    owners.took(wire.ReleaseKV("r2"), 0)  # a prefill worker's lease ended
    assert len(owners) == 0
    owners.took(request("r3"), 1)
    clock[0] = IDLE_S + 61
    assert owners.route(wire.Heartbeat("w0", 1, 0, 0, 0, 0)) == [(None, wire.Heartbeat("w0", 1, 0, 0, 0, 0))]
    assert len(owners) == 0


def test_a_worker_whose_proxy_does_not_answer_waits_between_its_registration_tries(tmp_path):
    """Before any proxy acknowledges it, the I/O thread sends its Register once a heartbeat interval and sleeps
    between: its loop turns a few times a second (it once polled with a zero timeout, a core busy until a proxy
    answered)."""
    context = zmq.Context()
    proxy = Proxy(context)
    config = WorkerConfig(worker_id="w0", role="decode", heartbeat_interval_s=0.2, proxy_address=proxy.address)
    registration = wire.Register("w0", "decode", 7, "m", "v", LAYOUT, 64, 256, "fake", b"")
    io = WorkerIO(config, registration, WorkerMetrics(config), tmp_path)
    turns = 0
    flush = io._flush_outbox

    def counted() -> None:
        nonlocal turns
        turns += 1
        flush()

    io._flush_outbox = counted
    io._thread.start()
    try:
        tries = [proxy.receive(wire.Register) for _ in range(4)]  # a Register each interval, none acknowledged
        assert all(msg.worker_id == "w0" for msg in tries)
        # 4 tries span 3 intervals (0.6 s): about 6 polls of at most POLL_MAX_S and the 4 sends' turns
        assert turns < 100
    finally:
        io.stop("test over")
        proxy.sock.close(0)
        context.term()
