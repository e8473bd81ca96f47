"""No stream lost to a proxy's death: ``tessera proxy --processes 2`` on one port sharing Redis, a real prefill and
decode worker on the short model (float32; tests/tiny_models.py), greedy resumable streams, and ``kill -9`` of one proxy
process while they run. Every client whose connection broke reconnects to the shared port with its last event id; the
other proxy process (or the restarted one) takes its stream over from the decode worker (proxy/edge/takeover.py). Each
stream's text equals its no-fault run's, no event id repeats, and no page is left in use afterwards. The same with
SIGTERM, whose drain hands the streams over at once instead of waiting them out, and with the decode worker killed right
after the proxy (the double failure): there are two decode workers, so that the streams the dead worker held are
computed again on the other from their contexts in Redis (proxy/edge/shared_streams.py) while the rest are taken over
from the live one, and no restart has to be waited for; a restarted decode worker would only add that wait. And without
Redis, a stream that ended on the killed process before its client read it: the worker kept it for its window, and the
other process takes it over (common/runtime/proxy_links.py). Half the streams start on the killed process's own port
(``http.process_port``), so that some certainly break; the other half on the shared port, where the kernel spreads them.
The issue's check (16 streams of 160 tokens) runs as ``STREAMS=16 TOKENS=160`` (about 45 s a signal on two cores, on
the embedded model); the suite runs 8 of 48.
"""
from __future__ import annotations

import asyncio
import json
import os
import signal
from dataclasses import dataclass, field

import httpx
import pytest

from common.cli.local_cluster import LocalCluster
from common.runtime.prometheus_text import total
from tests.conditions import settle
from tests.e2e.proxy_harness import PATIENCE_S
from tests.redis_server import redis_server  # noqa: F401 - fixture

MODEL = "SmolLM2-135M-Instruct"
STREAMS = int(os.environ.get("STREAMS", "8"))
TOKENS = int(os.environ.get("TOKENS", "48"))
RECONNECT_S = 0.2  # the test client's pause before it tries again after a 503 or a refused connection


@pytest.fixture
def cluster(short_model_dir, redis_server, tmp_path, request):  # noqa: F811
    """``tessera proxy --processes 2`` sharing the Redis server (LocalCluster's ``proxy_processes``), with
    ``request.param`` decode workers (1 unless the test says)."""
    c = LocalCluster.for_tests(short_model_dir, tmp_path, dtype="float32", transfer_backend="zmq",
                               proxy_processes=2, redis_url=redis_server.url, decode=getattr(request, "param", 1),
                               proxy_overrides=["slo.tpot_slo_scope=never"]).start()
    yield c
    c.stop()


@dataclass
class Stream:
    index: int
    text: str = ""
    ids: list[int] = field(default_factory=list)  # each event's number, [DONE]'s too
    last: str = "-1"  # the last event's whole id (N.T), which a reconnect sends
    broke: int = 0  # times its connection broke


async def run_stream(client: httpx.AsyncClient, url: str, shared: str, index: int, started: asyncio.Event,
                     streams_started: list) -> Stream:
    """One resumable stream from ``url``, reconnected to ``shared`` with its last event id each time it breaks."""
    body = {"model": MODEL, "messages": [{"role": "user", "content": f"Tell me story number {index}."}],
            "max_tokens": TOKENS, "temperature": 0.0, "ignore_eos": True, "stream": True}
    stream = Stream(index)
    response_id, request = None, client.stream("POST", url + "/v1/chat/completions", json=body,
                                               headers={"X-Resumable": "true"})
    while True:
        try:
            async with request as response:
                if response.status_code == 503:
                    raise httpx.TransportError("503")
                assert response.status_code == 200, await response.aread()
                response_id = response.headers["x-response-id"]
                event_id = None
                async for line in response.aiter_lines():
                    if line.startswith("id: "):
                        stream.last = line[4:]
                        event_id = int(stream.last.partition(".")[0])
                    elif line.startswith("data: "):
                        stream.ids.append(event_id)
                        if len(stream.ids) == 3:
                            streams_started.append(index)
                            if len(streams_started) == STREAMS:
                                started.set()
                        if line == "data: [DONE]":
                            return stream
                        for choice in json.loads(line[6:]).get("choices", []):
                            stream.text += choice["delta"].get("content") or ""
                raise httpx.TransportError("the stream ended before [DONE]")
        except httpx.TransportError:
            if response_id is None:
                raise
            stream.broke += 1
            await asyncio.sleep(RECONNECT_S)
            request = client.stream("GET", f"{shared}/v1/streams/{response_id}", headers={"Last-Event-ID": stream.last})


async def run_all(cluster: LocalCluster, kill: signal.Signals | None, worker: str | None = None) -> list[Stream]:
    """Every stream; ``kill``: sent to proxy process 0 once each stream has its first events, and SIGKILL to
    ``worker`` right after."""
    started, streams_started = asyncio.Event(), []
    own = cluster.proxy_urls[0]  # process 0's own port
    async with httpx.AsyncClient(timeout=httpx.Timeout(120, connect=10)) as client:
        tasks = [asyncio.create_task(run_stream(client, own if i % 2 == 0 else cluster.url, cluster.url, i, started,
                                                streams_started)) for i in range(STREAMS)]
        if kill is not None:
            await started.wait()
            os.kill(cluster.proxy_children()["proxy-0"], kill)
            if worker is not None:
                os.kill(cluster.procs[worker].pid, signal.SIGKILL)
        return await asyncio.gather(*tasks)


@pytest.mark.parametrize("kill", [signal.SIGKILL, signal.SIGTERM], ids=["kill-9", "sigterm"])
def test_a_proxy_process_that_dies_or_drains_loses_no_stream(cluster, kill):
    """SIGKILL: the workers see its connection close; SIGTERM: its drain hands the streams over (proxy/server.py)."""
    reference = asyncio.run(run_all(cluster, kill=None))
    assert not any(s.broke for s in reference)
    faulted = asyncio.run(run_all(cluster, kill=kill))
    broke = [s.index for s in faulted if s.broke]
    print(f"{len(broke)} of {STREAMS} streams broke and were resumed: {broke}")
    assert broke, "the killed process carried streams"
    check(reference, faulted)
    no_page_left(cluster, ("prefill-0", "decode-0"))


def check(reference: list[Stream], faulted: list[Stream]) -> None:
    """Each stream's text is its reference's, and its event numbers follow each other with none repeated."""
    for ref, got in zip(reference, faulted):
        assert got.text == ref.text, f"stream {got.index}"
        numbered = [n for n in got.ids if n is not None]
        assert numbered == list(range(len(numbered))), f"stream {got.index}: event ids {numbered}"


def metrics_of(cluster: LocalCluster, base: str) -> str:
    """A proxy process's /metrics, once it answers: the killed one is the supervisor's to start again."""
    def read() -> str | None:
        try:
            status, text = cluster.get("/metrics", base=base)
        except OSError:
            return None
        return text if status == 200 else None
    return settle(read, bool, PATIENCE_S, f"the proxy process at {base} serves again")


def no_page_left(cluster: LocalCluster, workers) -> None:
    for worker in workers:
        settle(lambda w=worker: total(cluster.get("/metrics", base=cluster.worker_url(w))[1],
                                      "tessera_worker_kv_pages_used"),
               lambda used: used == 0, PATIENCE_S, f"{worker} holds no page afterwards")


@pytest.mark.parametrize("cluster", [2], indirect=True)
def test_a_stream_whose_proxy_and_decode_worker_both_die_is_computed_again(cluster):
    """kill -9 of proxy process 0, then of decode-0: proxy-0's streams there are in no worker any more, and the
    proxy a client reconnects to computes them again from Redis, sending what follows the tokens it has."""
    reference = asyncio.run(run_all(cluster, kill=None))
    assert not any(s.broke for s in reference)
    faulted = asyncio.run(run_all(cluster, kill=signal.SIGKILL, worker="decode-0"))
    broke = [s.index for s in faulted if s.broke]
    print(f"{len(broke)} of {STREAMS} streams broke and were resumed: {broke}")
    check(reference, faulted)
    recomputed = sum(total(metrics_of(cluster, base), "tessera_proxy_streams_recomputed_total")
                     for base in cluster.proxy_urls)
    print(f"{recomputed:g} computed again from Redis")
    assert recomputed > 0, "some stream of the killed proxy was on the killed worker"
    no_page_left(cluster, ("prefill-0", "decode-1"))


@pytest.mark.parametrize("kill", [signal.SIGKILL, signal.SIGTERM], ids=["kill-9-no-redis", "sigterm"])
def test_a_stream_that_ended_before_its_client_read_it_is_taken_over(short_model_dir, tmp_path, request, kill):
    """A client reads three events of a stream on proxy process 0 and leaves; the stream ends (its decode worker
    sent the last delta to process 0, which keeps the events for the client); then process 0 is killed with no
    Redis, or drains on SIGTERM with Redis (nothing is in flight: it exits at once, and the stream's context stays
    in Redis). Either way its connection closes and the worker, which kept the ended stream for its window, orphans
    it: the client, reconnecting to the shared port, gets the rest from the other process, nothing computed again,
    and the text is the no-fault run's."""
    redis_url = request.getfixturevalue("redis_server").url if kill == signal.SIGTERM else ""
    c = LocalCluster.for_tests(short_model_dir, tmp_path, dtype="float32", transfer_backend="zmq",
                               proxy_processes=2, redis_url=redis_url).start()
    try:
        body = {"model": MODEL, "messages": [{"role": "user", "content": "Tell me a story."}], "max_tokens": TOKENS,
                "temperature": 0.0, "ignore_eos": True, "stream": True}
        with httpx.Client(timeout=httpx.Timeout(120, connect=10)) as client:
            reference = client.post(c.url + "/v1/chat/completions", json=body)
            with client.stream("POST", c.proxy_urls[0] + "/v1/chat/completions", json=body,
                               headers={"X-Resumable": "true"}) as response:
                response_id, last, first = response.headers["x-response-id"], None, []
                for line in response.iter_lines():
                    if line.startswith("id: "):
                        last = line[4:]
                    elif line.startswith("data: "):
                        first.append(line)
                        if len(first) == 3:
                            break
            no_page_left(c, ("prefill-0", "decode-0"))  # the stream ended on the worker, delivered to process 0
            os.kill(c.proxy_children()["proxy-0"], kill)

            def resume() -> httpx.Response | None:
                try:
                    return client.get(f"{c.url}/v1/streams/{response_id}", headers={"Last-Event-ID": last})
                except httpx.TransportError:
                    return None
            # 503 until the worker has seen process 0's connection close (the stream is that process's till then)
            resumed = settle(resume, lambda r: r is not None and r.status_code != 503, PATIENCE_S,
                             "a proxy process takes the stream over")
        assert resumed.status_code == 200, resumed.text
        rest = [line for line in resumed.text.splitlines() if line.startswith("data: ")]
        ids = [int(line[4:].partition(".")[0]) for line in resumed.text.splitlines() if line.startswith("id: ")]
        assert ids and ids[0] == int(last.partition(".")[0]) + 1 and ids == list(range(ids[0], ids[0] + len(ids)))

        def text(lines: list[str]) -> str:
            return "".join(choice["delta"].get("content") or "" for line in lines if line != "data: [DONE]"
                           for choice in json.loads(line[6:]).get("choices", []))
        whole = [line for line in reference.text.splitlines() if line.startswith("data: ")]
        assert text(first + rest) == text(whole) and rest[-1] == "data: [DONE]"
        assert sum(total(metrics_of(c, base), "tessera_proxy_streams_recomputed_total") for base in c.proxy_urls) == 0
    finally:
        c.stop()
