"""ZeroMQ CURVE on the control plane and the zmq KV channel, over real sockets.

- A worker whose key is not in the proxy's authorized keys never gets its
  Register through: the ZAP handler refuses it, no RegisterAck comes back and
  no worker joins, while a keyed worker on the same proxy registers at once.
- A plaintext (no CURVE) client cannot talk to a CURVE proxy at all.
- The zmq KV server serves pulls only to authorized peers' keys; a worker
  without CURVE refuses to add a peer that requires it.
- A worker's KV event socket is a CURVE server letting in the proxy's key
  alone: a subscriber pinning its key with the proxy's pair receives the
  events, one with the rogue's pair or none receives nothing.
- A whole cluster (proxy, prefill and decode processes, zmq KV transfer) with
  keys everywhere serves a request end to end, and its proxy's prefix index is
  fed by the workers' KV events.
"""
from __future__ import annotations

import logging
import shutil
import time
from pathlib import Path

import pytest
import torch
import zmq

from common.cli.local_cluster import LocalCluster, post_json
from common.engine.kv_cache import KVCache, KVLayout
from common.cli.curve_keys_command import generate_key_pair
from common.protocol.wire import KVEvents, Register, RegisterAck, decode, encode
from common.runtime.kv_events import KVEventPublisher
from common.runtime.zmq_security import KeyPair, WorkerCurve, apply_curve_client, load_key_pair, load_public_key
from kv_transfer.base import TransferStatus
from kv_transfer.factory import make_backend
from tests.scripted_worker import DEFAULT_LAYOUT
from tests.e2e.proxy_harness import MODEL, make_proxy, tokenizer  # noqa: F401

REFUSAL_WINDOW_S = 2.0  # how long a refused worker is watched for any sign of getting in
SEND_TIMEOUT_MS = 10_000  # bounds a raw worker's Register send (a test that breaks fails, never hangs)

pytestmark = pytest.mark.skipif(not zmq.has("curve"), reason="this libzmq has no CURVE support")


@pytest.fixture(scope="module")
def keys(tmp_path_factory) -> dict[str, Path]:
    """Key pairs for the proxy, a worker and a rogue; the workers' directory authorizes only the worker."""
    root = tmp_path_factory.mktemp("curve")
    for name in ("proxy", "worker", "rogue"):
        generate_key_pair(root / "secret", name)
    authorized = root / "authorized"
    authorized.mkdir()
    shutil.copy(root / "secret" / "worker.key", authorized / "worker.key")
    return {"secret": root / "secret", "authorized": authorized}


def curve_proxy(make_proxy, keys):
    return make_proxy(security={"curve_secret_key_file": str(keys["secret"] / "proxy.key_secret"), "curve_authorized_keys_dir": str(keys["authorized"])})


class RawWorker:
    """A DEALER that sends one Register and records what comes back."""

    def __init__(self, endpoint: str, worker_id: str, keys: KeyPair | None, proxy_public: bytes) -> None:
        self.context = zmq.Context()
        self.sock = self.context.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.IDENTITY, worker_id.encode())
        self.sock.setsockopt(zmq.LINGER, 0)
        if keys is not None:
            apply_curve_client(self.sock, keys, proxy_public)
        self.sock.connect(endpoint)
        register = Register(worker_id, "both", time.time_ns(), MODEL, "test", DEFAULT_LAYOUT, 1024, 8192, "fake",
                            b"fake:" + worker_id.encode())
        # Queued on the connection's pipe until (unless) the handshake completes. A refused handshake can tear
        # that pipe down before the send, and a DEALER with no pipe blocks a send for good: bounded, and a
        # Register that could not leave is a refusal seen early.
        self.sock.setsockopt(zmq.SNDTIMEO, SEND_TIMEOUT_MS)
        try:
            self.sock.send_multipart(encode(register))
        except zmq.Again:
            pass

    def reply(self, timeout_s: float):
        if not self.sock.poll(int(timeout_s * 1000)):
            return None
        return decode(self.sock.recv_multipart())

    def close(self) -> None:
        self.sock.close()
        self.context.term()


@pytest.fixture
def raw_workers():
    made: list[RawWorker] = []

    def make(*args) -> RawWorker:
        made.append(RawWorker(*args))
        return made[-1]

    yield make
    for worker in made:
        worker.close()


def test_a_worker_with_an_unknown_key_cannot_register(make_proxy, keys, raw_workers, caplog):
    caplog.set_level(logging.WARNING, logger="tessera.security")
    proxy = curve_proxy(make_proxy, keys)
    proxy_public = load_public_key(str(keys["secret"] / "proxy.key"), "test")
    rogue_keys = load_key_pair(str(keys["secret"] / "rogue.key_secret"), "test")
    rogue = raw_workers(proxy.endpoint, "rogue", rogue_keys, proxy_public)
    good = raw_workers(proxy.endpoint, "good", load_key_pair(str(keys["secret"] / "worker.key_secret"), "test"),
                       proxy_public)
    ack = good.reply(10.0)
    assert isinstance(ack, RegisterAck) and ack.accepted, ack
    assert set(proxy.services.cluster.registry.workers) == {"good"}
    assert rogue.reply(REFUSAL_WINDOW_S) is None
    assert "rogue" not in proxy.services.cluster.registry.workers
    assert any(rogue_keys.public.decode() in r.getMessage() and "refused" in r.getMessage() for r in caplog.records)


def test_a_plaintext_client_cannot_talk_to_a_curve_proxy(make_proxy, keys, raw_workers):
    proxy = curve_proxy(make_proxy, keys)
    plain = raw_workers(proxy.endpoint, "plain", None, b"")
    assert plain.reply(REFUSAL_WINDOW_S) is None
    assert proxy.services.cluster.registry.workers == {}


def _worker_curve(keys, name: str) -> WorkerCurve:
    return WorkerCurve(load_key_pair(str(keys["secret"] / f"{name}.key_secret"), "test"),
                       load_public_key(str(keys["secret"] / "proxy.key"), "test"), keys["authorized"])


def _pull(puller, metadata: bytes, deadline_s: float) -> TransferStatus:
    layout = KVLayout(num_layers=1, block_size=16, num_kv_heads=1, head_dim=64, dtype="float32")
    puller.register_pool(KVCache(layout, 8))
    puller.add_peer("server", metadata)
    handle = puller.start_pull("req", "server", [1, 2], [3, 4], deadline_s)
    deadline = time.monotonic() + deadline_s + 10
    while not puller.poll(handle).terminal and time.monotonic() < deadline:
        time.sleep(0.002)
    puller.release(handle)
    return handle.status


def test_the_zmq_kv_server_serves_only_authorized_peers(keys):
    layout = KVLayout(num_layers=1, block_size=16, num_kv_heads=1, head_dim=64, dtype="float32")
    pool = KVCache(layout, 8)
    pool.buffer.copy_(torch.randn(pool.buffer.shape))
    server = make_backend("zmq", curve=_worker_curve(keys, "worker"))
    metadata = server.register_pool(pool)
    backends = [server]
    try:
        good = make_backend("zmq", curve=_worker_curve(keys, "worker"))
        backends.append(good)
        assert _pull(good, metadata, deadline_s=30.0) == TransferStatus.DONE
        rogue = make_backend("zmq", curve=_worker_curve(keys, "rogue"))
        backends.append(rogue)
        assert _pull(rogue, metadata, deadline_s=REFUSAL_WINDOW_S) == TransferStatus.FAILED
        plain = make_backend("zmq")
        backends.append(plain)
        plain.register_pool(KVCache(layout, 8))
        with pytest.raises(ValueError, match="requires CURVE"):
            plain.add_peer("server", metadata)
    finally:
        for backend in backends:
            backend.close()


def test_the_kv_event_socket_publishes_to_the_proxys_key_alone(keys):
    secret = keys["secret"]
    worker = WorkerCurve(load_key_pair(str(secret / "worker.key_secret"), "worker"),
                         load_public_key(str(secret / "proxy.key"), "proxy"), None)
    publisher = KVEventPublisher.bind("127.0.0.1", 0, worker)
    context = zmq.Context()
    subscribers = {}
    try:
        for name in ("proxy", "rogue", None):
            sub = subscribers[name] = context.socket(zmq.SUB)
            sub.setsockopt(zmq.LINGER, 0)
            sub.setsockopt(zmq.SUBSCRIBE, b"")
            if name is not None:
                apply_curve_client(sub, load_key_pair(str(secret / f"{name}.key_secret"), name),
                                   publisher.public_key.encode())
            sub.connect(publisher.endpoint)
        received = None
        for _ in range(100):  # a PUB drops what it sends before a subscription arrives: publish until one is seen
            publisher.publish("w", 1, [7, 8], [], fresh=False)
            if subscribers["proxy"].poll(50):
                received = decode(subscribers["proxy"].recv_multipart())
                break
        assert isinstance(received, KVEvents) and received.worker_id == "w" and 7 in received.stored
        publisher.publish("w", 1, [9], [], fresh=False)
        assert subscribers["proxy"].poll(2000)  # the one it is let in by keeps receiving
        assert not subscribers["rogue"].poll(REFUSAL_WINDOW_S * 1000 / 2)
        assert not subscribers[None].poll(REFUSAL_WINDOW_S * 1000 / 2)
    finally:
        for sub in subscribers.values():
            sub.close()
        context.term()
        publisher.close()


def test_a_keyed_cluster_serves_a_request_end_to_end(embedded_model_dir, keys, tmp_path):
    secret = keys["secret"]
    cluster = LocalCluster.for_tests(
        embedded_model_dir, tmp_path, transfer_backend="zmq",
        proxy_overrides=[f"security.curve_secret_key_file={secret / 'proxy.key_secret'}",
                         f"security.curve_authorized_keys_dir={keys['authorized']}"],
        worker_overrides=[f"security.curve_secret_key_file={secret / 'worker.key_secret'}",
                          f"security.curve_proxy_public_key_file={secret / 'proxy.key'}",
                          f"security.curve_authorized_keys_dir={keys['authorized']}"],
    )
    try:
        cluster.start()
        status, body = post_json(cluster.url + "/v1/chat/completions", {
            "model": MODEL, "messages": [{"role": "user", "content": "Name three colors of the rainbow."}],
            "max_tokens": 8, "temperature": 0.0})
        events = cluster.metric("tessera_proxy_kv_events_total")
    finally:
        codes = cluster.stop()
    assert status == 200, body
    assert body["choices"][0]["message"]["content"] and body["usage"]["completion_tokens"] > 0
    assert all(code == 0 for code in codes.values()), codes
    proxy_log = (tmp_path / "proxy.log").read_text()
    assert "CURVE on" in proxy_log and "CURVE is off" not in proxy_log
    assert "the zmq KV server: CURVE on" in (tmp_path / "prefill-0.log").read_text()
    assert events.get('{outcome="applied"}', 0) > 0, events  # the index is fed over CURVE
