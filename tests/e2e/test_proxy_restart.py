"""A proxy that dies and comes back on the same ports gets its workers back.

The workers keep heartbeating into the new proxy, which does not know them
and answers with Reregister; each worker drops what it ran for the dead
proxy (nobody can receive those tokens), frees the pages, releases the
prefill leases, and registers again under the same id and epoch.

The model is the tiny random Llama with its context stretched, so that one
request with ``ignore_eos`` outlives the restart by far: pages still in use
afterwards could only be a leak.
"""
from __future__ import annotations

import json
import signal
import threading
import time

import httpx
import pytest
import zmq

from common.cli.local_cluster import LocalCluster
from common.runtime.prometheus_text import total
from common.protocol.wire import Heartbeat, Reregister, decode, encode
from tests.conditions import settle
from tests.e2e.proxy_harness import PATIENCE_S, STARTUP_S, make_proxy, tokenizer  # noqa: F401 -- fixtures

MODEL = "SmolLM2-135M-Instruct"
LONG_CONTEXT = 16384
REJOIN_S = 5.0  # heartbeats every 0.2 s, Reregister at most every 0.75 s (heartbeat_timeout_s=3 / 4)


@pytest.fixture(scope="module")
def long_model_dir(tiny_chat_model_dir, tmp_path_factory):
    """The tiny chat model with a context long enough for a request that runs for a minute."""
    directory = tmp_path_factory.mktemp("tiny-long")
    for path in tiny_chat_model_dir.iterdir():
        (directory / path.name).symlink_to(path)
    (directory / "config.json").unlink()
    config = json.loads((tiny_chat_model_dir / "config.json").read_text())
    config["max_position_embeddings"] = LONG_CONTEXT
    (directory / "config.json").write_text(json.dumps(config))
    return directory


@pytest.fixture(scope="module")
def cluster(long_model_dir, tmp_path_factory):
    # One decode slot: a second request is prefilled and then waits, its pages under a prefill lease. Slots alone
    # gate decode admission: under a TPOT cap (on while a worker's capacity is learned, and a worker that never
    # runs two sequences at once never fits one) the second request would wait at the proxy, not prefilled.
    c = LocalCluster.for_tests(long_model_dir, tmp_path_factory.mktemp("restart-logs"), transfer_backend="zmq",
                               worker_overrides=["engine.max_num_seqs=1"],
                               proxy_overrides=["slo.tpot_slo_scope=never"]).start()
    yield c
    codes = c.stop()
    assert all(code == 0 for code in codes.values()), codes


def worker_metric(cluster: LocalCluster, worker: str, name: str, **labels: str) -> float:
    """The sum of one metric's samples on one worker's /metrics that carry every one of ``labels``."""
    return total(cluster.get("/metrics", base=cluster.worker_url(worker))[1], name, **labels)


def kill_proxy(cluster: LocalCluster) -> None:
    proxy = cluster.procs["proxy"]
    proxy.send_signal(signal.SIGKILL)
    proxy.wait(timeout=10)


def start_new_proxy(cluster: LocalCluster) -> float:
    """Start a proxy on the dead one's ports; seconds from its first answer until both workers rejoined (to
    print: the wait is bounded, never timed)."""
    cluster.start_proxy()

    def answers() -> bool:
        try:
            return cluster.get("/healthz")[0] == 200
        except OSError:
            return False

    settle(answers, bool, STARTUP_S, "the new proxy answers /healthz")
    answered = time.monotonic()
    settle(lambda: (cluster.get("/readyz")[0], sum(cluster.metric("tessera_proxy_workers_alive").values())),
           lambda seen: seen == (200, 2), REJOIN_S,
           "both workers rejoin the new proxy (a Reregister every heartbeat_timeout_s / 4 at most)")
    return time.monotonic() - answered


def chat(cluster: LocalCluster, content: str, **extra) -> httpx.Response:
    body = {"model": MODEL, "messages": [{"role": "user", "content": content}], "max_tokens": 8,
            "temperature": 0.0, **extra}
    return httpx.post(cluster.url + "/v1/chat/completions", json=body, timeout=60)


def test_workers_rejoin_a_restarted_proxy(cluster):
    assert chat(cluster, "Hello").status_code == 200
    kill_proxy(cluster)
    rejoined_s = start_new_proxy(cluster)
    print(f"workers rejoined {rejoined_s:.2f}s after the new proxy answered")
    response = chat(cluster, "Hello again")
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["message"]["content"]
    for worker in ("prefill-0", "decode-0"):
        assert cluster.get("/readyz", base=cluster.worker_url(worker))[0] == 200


def test_requests_of_the_dead_proxy_free_their_pages(cluster):
    long_request = {"model": MODEL, "messages": [{"role": "user", "content": "Count forever"}],
                    "max_tokens": LONG_CONTEXT // 2, "ignore_eos": True, "stream": True}
    failures: list[BaseException] = []

    def waiting_request() -> None:  # its connection dies with the proxy
        try:
            chat(cluster, "Wait for a slot", max_tokens=4)
        except httpx.HTTPError as exc:
            failures.append(exc)

    def decode_outcomes() -> tuple[float, float]:
        """(completed, dropped): dropped by the Reregister or by an Abort the new proxy sent for a stray token."""
        def count(*statuses: str) -> float:
            return sum(worker_metric(cluster, "decode-0", "tessera_worker_requests_total", stage="decode",
                                     status=status) for status in statuses)
        return count("completed"), count("failed", "aborted")

    def prefill_pages() -> tuple[bool, float]:
        """(whether prefill-0's snapshot counts a step run since ``steps_before``, its pages in use then): one
        /metrics, so both are of the one snapshot its loop published after a turn."""
        text = cluster.get("/metrics", base=cluster.worker_url("prefill-0"))[1]
        return total(text, "tessera_worker_steps_total") > steps_before, total(text, "tessera_worker_kv_pages_used")

    completed_before, dropped_before = decode_outcomes()
    steps_before = worker_metric(cluster, "prefill-0", "tessera_worker_steps_total")
    with httpx.Client(timeout=60) as client, \
            client.stream("POST", cluster.url + "/v1/chat/completions", json=long_request) as stream:
        lines = stream.iter_lines()
        assert next(lines).startswith("data: ")  # decoding on decode-0, which now has no free slot
        # The first token comes with the prefill; until decode-0 has pulled them, prefill-0 still holds the long
        # request's pages. Only once those are released do pages on prefill-0 mean the waiting request's. The
        # worker publishes its page count after the turn that sent the first token, so a count of 0 alone may be
        # the one from before the prompt's step (then the long request's pages were taken for the waiting one's).
        settle(prefill_pages, lambda seen: seen == (True, 0), PATIENCE_S,
               "the long request's pages pulled by decode-0 and released on prefill-0, after its prompt's step")
        waiter = threading.Thread(target=waiting_request)
        waiter.start()
        settle(lambda: worker_metric(cluster, "prefill-0", "tessera_worker_kv_pages_used"), lambda used: used > 0,
               PATIENCE_S, "the waiting request's pages held under a lease on prefill-0")
        kill_proxy(cluster)
        time.sleep(0.5)
        for worker in ("prefill-0", "decode-0"):  # nobody will ever ask for these pages again
            assert worker_metric(cluster, worker, "tessera_worker_kv_pages_used") > 0, worker
        rejoined_s = start_new_proxy(cluster)
    waiter.join(timeout=10)
    assert failures, "the waiting request should have lost its connection with the proxy"
    print(f"workers rejoined {rejoined_s:.2f}s after the new proxy answered")
    for worker in ("prefill-0", "decode-0"):
        settle(lambda w=worker: worker_metric(cluster, w, "tessera_worker_kv_pages_used"), lambda used: used == 0,
               REJOIN_S, f"{worker} frees the pages of the dead proxy's requests as it rejoins")
    # Dropped, not run to the end: the long request had thousands of tokens to go. A request is counted as it is
    # dropped, before the turn of the worker's loop whose published page counts the wait above saw.
    assert decode_outcomes() == (completed_before, dropped_before + 1)
    response = chat(cluster, "Are you still there?")
    assert response.status_code == 200, response.text


class ManualClock:
    """The proxy's clock, moved by the test: a rate limit is a count per step of it, not per second slept."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_a_flood_of_unknown_heartbeats_gets_a_few_reregisters(make_proxy, monkeypatch):  # noqa: F811 -- the fixture
    proxy = make_proxy()  # heartbeat_timeout_s=1: one Reregister per worker id every 0.25 s at most
    clock = ManualClock()
    monkeypatch.setattr(proxy.services.cluster, "_clock", clock)
    context = zmq.Context()
    sock = context.socket(zmq.DEALER)
    sock.setsockopt(zmq.IDENTITY, b"ghost")
    sock.connect(proxy.endpoint)
    try:
        for _ in range(200):  # all at one instant of the proxy's clock
            sock.send_multipart(encode(Heartbeat("ghost", 7, 0, 0, 0, 0)))
        sock.send_multipart([b"one malformed frame"])  # read after the heartbeats: counted, never answered
        settle(lambda: proxy.http.get("/metrics").text,
               lambda text: "tessera_proxy_malformed_messages_total 1.0" in text, PATIENCE_S,
               "the proxy reads the heartbeats and then the malformed frame")
        clock.now += 0.25
        sock.send_multipart(encode(Heartbeat("ghost", 8, 0, 0, 0, 0)))  # a limit's step later: answered again
        replies = []
        while not replies or replies[-1].epoch != 8:  # the proxy answers one worker's messages in order
            assert sock.poll(timeout=int(PATIENCE_S * 1000)), f"no answer to the later heartbeat: {replies}"
            replies.append(decode(sock.recv_multipart()))
        assert replies == [Reregister("ghost", 7, "the proxy does not know worker 'ghost' epoch 7"),
                           Reregister("ghost", 8, "the proxy does not know worker 'ghost' epoch 8")]
    finally:
        sock.close(linger=0)
        context.term()
