"""A resumable stream outlives its proxy: another proxy takes it over from the decode worker
(proxy/edge/takeover.py, common/runtime/proxy_links.py), and the client misses no event and sees none twice.

Two real proxies (HTTP, ZeroMQ, admission) in front of the tests' scripted workers, each registered with both. The
first proxy's loss is the worker's: ``lose_proxy(0)`` is what its I/O thread does when that proxy's connection
closes (tests/unit/test_orphaned_streams.py holds that part on real sockets; tests/e2e/test_proxy_death.py kills a
real proxy process). The double failure (the decode worker lost after the proxy) needs the proxies' Redis: the
stream is computed again from its context there (proxy/edge/shared_streams.py); a stream that ended on its lost proxy
is taken over whole from the worker that kept it for its window.
"""
from __future__ import annotations

import asyncio
import json
import threading

import httpx
import msgspec
import pytest
import redis
from websockets.sync.client import connect

from common.config.roles import merge
from common.protocol.sampling_params import SamplingParams
from common.runtime.prometheus_text import total
from proxy.core.resume_context import ResumeInfo, decode, encode
from proxy.tenancy.api_keys import hash_key
from tests.conditions import settle
from tests.e2e.proxy_harness import (  # noqa: F401 - fixtures
    MODEL, PATIENCE_S, SCRIPT_TEXT, assert_openai_error, make_proxy, script, tokenizer, workers_of_every_proxy,
)
from tests.e2e.test_resumable_streams import RESUMABLE, parse, read_ids, read_some, text_of
from tests.redis_server import redis_server  # noqa: F401 - fixture
from tests.scripted_worker import FakeWorker

REPEATS = 20
LONG_TEXT = SCRIPT_TEXT * REPEATS
TENANTS = [{"name": "a", "api_key_sha256": [hash_key("sk-a")]}, {"name": "b", "api_key_sha256": [hash_key("sk-b")]}]


def start(make_proxy, script, workers: list, **options) -> tuple:
    """Two proxies and a prefill and a decode worker registered with both, answering ``LONG_TEXT`` (a token every
    20 ms: a stream of 40 tokens or more is still running when its proxy is lost)."""
    script = script * REPEATS
    proxies = [make_proxy(**merge({"shared_state": {"proxy_id": f"proxy-{i}"}}, options)) for i in range(2)]
    return proxies, workers_of_every_proxy(proxies, script, workers)


def lose_first_proxy(decode: FakeWorker) -> None:
    decode.lose_proxy(0)
    settle(lambda: decode._worker.owners.orphans, bool, PATIENCE_S, "the worker keeps the lost proxy's stream")


def held(worker: FakeWorker, response_id: str) -> tuple[int, int]:
    """How many of ``response_id``'s choices ``worker`` keeps, and how many of those as a lost proxy's (a worker
    also keeps, for its window, a stream that ended on a connected proxy: another response in these tests)."""
    kept = [o.resumable for o in list(worker._worker.owners._of.values())
            if o.resumable is not None and o.resumable.response_id == response_id]
    return len(kept), sum(k.orphaned_until is not None for k in kept)


def bodies(events: list) -> list:
    """The events' data less what differs between two responses (their id and time)."""
    out = []
    for _, data in events:
        body = json.loads(data) if data != "[DONE]" else data
        if isinstance(body, dict):
            body.pop("id"), body.pop("created")
        out.append(body)
    return out


def test_a_lost_proxys_stream_goes_on_through_another_with_no_event_repeated_or_missing(make_proxy, script):
    workers = []
    try:
        (a, b), decode = start(make_proxy, script, workers)
        for path, request in [("/v1/completions", {"prompt": "Hi"}),
                              ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}],
                                                        "logprobs": True, "top_logprobs": 2,
                                                        "stream_options": {"include_usage": True}})]:
            body = {"model": MODEL, "max_tokens": 40, "stream": True, **request}
            whole = parse(a.http.post(path, json=body, headers=RESUMABLE).text)  # no fault: the reference
            with a.http.stream("POST", path, json=body, headers=RESUMABLE) as response:
                response_id = response.headers["x-response-id"]
                first = read_some(response.iter_lines(), 6)
            lose_first_proxy(decode)
            resumed = b.http.get(f"/v1/streams/{response_id}", headers={"Last-Event-ID": str(first[-1][0])})
            assert resumed.status_code == 200, resumed.text
            rest = parse(resumed.text)
            assert [n for n, _ in first + rest] == list(range(len(whole))), "no event repeated or missing"
            assert bodies(first + rest) == bodies(whole)
            assert all(json.loads(data)["id"] == response_id for _, data in rest[:-1])
            assert text_of(first + rest) == text_of(whole)
        assert total(b.http.get("/metrics").text, "tessera_proxy_streams_taken_over_total") == 2
        settle(lambda: dict(b.services.cluster.inflight), lambda inflight: not inflight, PATIENCE_S,
               "the taken-over requests end on the proxy that took them")
        assert decode.decoding() == 0
    finally:
        for worker in workers:
            worker.stop(goodbye=False)


def test_unknown_streams_and_another_tenants_are_not_found(make_proxy, script):
    workers = []
    try:
        (a, b), decode = start(make_proxy, script, workers,
                               tenancy={"auth_enabled": True, "tenants": TENANTS})
        body = {"model": MODEL, "prompt": "Hi", "max_tokens": 2000, "stream": True}
        with a.http.stream("POST", "/v1/completions", json=body,
                           headers={**RESUMABLE, "Authorization": "Bearer sk-a"}) as response:
            response_id = response.headers["x-response-id"]
            read_some(response.iter_lines(), 2)
        lose_first_proxy(decode)
        assert_openai_error(b.http.get("/v1/streams/cmpl-unknown", headers={"Authorization": "Bearer sk-a"}), 404,
                            "resume_window_s")
        assert_openai_error(b.http.get(f"/v1/streams/{response_id}", headers={"Authorization": "Bearer sk-b"}), 404,
                            "resume_window_s")
        assert decode._worker.owners.orphans == 1, "another tenant's ask leaves the stream where it is"
        with b.http.stream("GET", f"/v1/streams/{response_id}", headers={"Authorization": "Bearer sk-a"}) as taken:
            assert taken.status_code == 200
            read_some(taken.iter_lines(), 4)
    finally:
        for worker in workers:
            worker.stop(goodbye=False)


def test_a_stream_whose_window_closed_is_not_found_and_its_request_ended(make_proxy, script):
    workers = []
    try:
        (a, b), decode = start(make_proxy, script, workers, requests={"resume_window_s": 0.3})
        body = {"model": MODEL, "prompt": "Hi", "max_tokens": 2000, "stream": True}
        with a.http.stream("POST", "/v1/completions", json=body, headers=RESUMABLE) as response:
            response_id = response.headers["x-response-id"]
            read_some(response.iter_lines(), 2)
        lose_first_proxy(decode)
        settle(lambda: decode._worker.owners.orphans, lambda n: n == 0, PATIENCE_S,
               "the window (its proxy's requests.resume_window_s) closes with nobody taking the stream over")
        settle(decode.decoding, lambda n: n == 0, PATIENCE_S, "the worker ends the request and frees its pages")
        assert_openai_error(b.http.get(f"/v1/streams/{response_id}"), 404, "resume_window_s")
    finally:
        for worker in workers:
            worker.stop(goodbye=False)


def test_two_clients_racing_to_resume_one_stream_take_it_over_once(make_proxy, script):
    workers = []
    try:
        (a, b), decode = start(make_proxy, script, workers)
        body = {"model": MODEL, "prompt": "Hi", "max_tokens": 40, "stream": True}
        with a.http.stream("POST", "/v1/completions", json=body, headers=RESUMABLE) as response:
            response_id = response.headers["x-response-id"]
            first = read_some(response.iter_lines(), 3)
        lose_first_proxy(decode)

        async def race() -> list[httpx.Response]:
            async with httpx.AsyncClient(base_url=b.url, timeout=30) as client:
                return await asyncio.gather(*(client.get(f"/v1/streams/{response_id}",
                                                         headers={"Last-Event-ID": str(first[-1][0])})
                                              for _ in range(2)))
        answers = asyncio.run(race())
        assert [r.status_code for r in answers] == [200, 200]
        assert total(b.http.get("/metrics").text, "tessera_proxy_streams_taken_over_total") == 1
        done = [parse(r.text) for r in answers if r.text.endswith("data: [DONE]\n\n")]
        assert len(done) == 1, "the later reader took the stream from the earlier one, which ended"
        assert text_of(first + done[0]) == LONG_TEXT[:len(text_of(first + done[0]))]
        assert [n for n, _ in first + done[0]] == list(range(len(first) + len(done[0])))
    finally:
        for worker in workers:
            worker.stop(goodbye=False)


def test_a_resume_context_is_what_the_proxy_reads_back():
    info = ResumeInfo("cmpl-1", 30.0, msgspec.msgpack.encode({"endpoint": "completions"}), [["a", [1], None, None,
                                                                                             None, None, 0]])
    context = decode(encode(info, "t", SamplingParams(max_tokens=3), 7, [1, 2], ("m", "v")))
    assert (context.tenant, context.seed, context.prompt, context.model, context.events) == (
        "t", 7, [1, 2], ("m", "v"), info.events)


def test_a_websocket_resume_takes_a_lost_proxys_stream_over(make_proxy, script):
    workers = []
    try:
        (a, b), decode = start(make_proxy, script, workers)
        body = {"model": MODEL, "prompt": "Hi", "max_tokens": 40}
        with connect(a.url.replace("http://", "ws://") + "/v1/stream") as socket:
            socket.send(json.dumps({"type": "completions", "id": "r", "body": body, "resumable": True}))
            seen = [json.loads(socket.recv(timeout=30)) for _ in range(3)]
        lose_first_proxy(decode)
        with connect(b.url.replace("http://", "ws://") + "/v1/stream") as socket:
            assert seen[-1]["event_id"].startswith(f'{seen[-1]["event"]}.'), "N.T: the tokens through event N"
            socket.send(json.dumps({"type": "resume", "id": "again", "response_id": seen[0]["data"]["id"],
                                    "last_event_id": seen[-1]["event_id"]}))
            rest = []
            while not rest or not rest[-1].get("done"):
                rest.append(json.loads(socket.recv(timeout=30)))
        assert [f["event"] for f in seen + rest[:-1]] == list(range(len(seen) + len(rest) - 1))
        text = "".join(c["text"] for f in seen + rest[:-1] for c in f["data"]["choices"])
        assert text == LONG_TEXT[:len(text)] and len(text) > len(SCRIPT_TEXT)
    finally:
        for worker in workers:
            worker.stop(goodbye=False)


def test_a_stream_whose_proxy_and_decode_worker_are_both_lost_is_computed_again(make_proxy, script,
                                                                                redis_server):  # noqa: F811
    """The first proxy's event loop is stopped (as a dead proxy's: it neither resumes its request elsewhere when
    the worker goes, nor ends its stream), and its workers lose it; then the decode worker holding the stream."""
    workers, frozen = [], threading.Event()
    try:
        (a, b), decode = start(make_proxy, script, workers, shared_state={"redis_url": redis_server.url},
                               tenancy={"auth_enabled": True, "tenants": TENANTS})
        other = FakeWorker(",".join(p.endpoint for p in (a, b)), "d1", "decode", script * REPEATS,
                           token_interval_s=0.02)
        workers.append(other.start())
        settle(lambda: other._worker is not None and other._worker.registered, bool, PATIENCE_S, "d1 registers")
        store = redis.Redis.from_url(redis_server.url)
        key = "tessera:stream-context:"
        body = {"model": MODEL, "max_tokens": 40, "stream": True, "logprobs": True,
                "messages": [{"role": "user", "content": "Hi"}], "stream_options": {"include_usage": True}}
        headers = {**RESUMABLE, "Authorization": "Bearer sk-a"}
        ended = a.http.post("/v1/chat/completions", json=body, headers=headers)
        whole = parse(ended.text)
        assert store.hget(key + ended.headers["x-response-id"], "context"), "an ended stream's context stays " \
            "while it is in its proxy's resume buffer: its client may not have read its end when the proxy dies"
        with a.http.stream("POST", "/v1/chat/completions", json=body, headers=headers) as response:
            response_id = response.headers["x-response-id"]
            first, last = read_ids(response.iter_lines(), 6)
            settle(lambda: store.hget(key + response_id, "context"), bool, PATIENCE_S, "its context is in Redis")
        assert last.startswith("5.") and int(last[2:]) >= 5, "the event's number, then the tokens through it"
        a.services.link._loop.call_soon_threadsafe(frozen.wait, 4 * PATIENCE_S)  # the first proxy hangs: dead
        for worker in (decode, other):
            worker.lose_proxy(0)
        settle(lambda: held(decode, response_id)[1] + held(other, response_id)[1], bool, PATIENCE_S,
               "a worker keeps the lost proxy's stream")
        holder = decode if held(decode, response_id)[1] else other
        holder.stop(goodbye=False)
        settle(lambda: holder.worker_id in b.services.cluster.registry.workers, lambda known: not known, PATIENCE_S,
               "the proxy sees the worker gone")
        assert_openai_error(b.http.get(f"/v1/streams/{response_id}", headers={"Authorization": "Bearer sk-b",
                                                                             "Last-Event-ID": last}), 404)
        assert_openai_error(b.http.get(f"/v1/streams/{response_id}", headers={"Authorization": "Bearer sk-a",
                                                                             "Last-Event-ID": "5"}), 404,
                            "resume_window_s")  # a plain event number: no token count to go on from
        resumed = b.http.get(f"/v1/streams/{response_id}", headers={"Authorization": "Bearer sk-a",
                                                                   "Last-Event-ID": last})
        assert resumed.status_code == 200, resumed.text
        rest = parse(resumed.text)
        assert [n for n, _ in first + rest] == list(range(len(first) + len(rest))), "no event repeated or missing"
        assert bodies(first + rest) == bodies(whole), "the same chunks: text, logprobs, the whole response's usage"
        assert total(b.http.get("/metrics").text, "tessera_proxy_streams_recomputed_total") == 1
        settle(lambda: dict(b.services.cluster.inflight), lambda inflight: not inflight, PATIENCE_S,
               "the stream computed again ends on the proxy that took it")
        survivor = other if holder is decode else decode
        assert survivor.decoding() == 0
        taker = b.services.streams.shared.owner.encode()
        settle(lambda: store.hget(key + response_id, "owner"), lambda owner: owner == taker, PATIENCE_S,
               "the proxy that took the context from Redis keeps it there as its own")
    finally:
        frozen.set()
        for worker in workers:
            worker.stop(goodbye=False)


@pytest.mark.parametrize("lost", ["nothing", "proxy", "proxy-and-worker"])
def test_a_stream_that_ended_on_its_proxy_before_its_client_read_it_all(make_proxy, script, redis_server,  # noqa: F811
                                                                         lost):
    """The worker sent the stream's last delta to the first proxy; the client had left after six events. That proxy
    alive: a client that reconnects to the other (as the kernel spreads connections over one port) hears 503 while
    the worker keeps the stream as that proxy's, and the first proxy sends it the rest, nothing computed again. That
    proxy lost: the worker kept the ended stream for its window, and the other proxy takes it over whole, nothing
    computed again. Its worker lost too: the context the first proxy kept in Redis while the stream was in its buffer
    is what the other computes the stream again from, on another worker."""
    workers, frozen = [], threading.Event()
    try:
        (a, b), decode = start(make_proxy, script, workers, shared_state={"redis_url": redis_server.url})
        decoders = [decode]
        if lost == "proxy-and-worker":
            other = FakeWorker(",".join(p.endpoint for p in (a, b)), "d1", "decode", script * REPEATS,
                               token_interval_s=0.02)
            workers.append(other.start())
            settle(lambda: other._worker is not None and other._worker.registered, bool, PATIENCE_S, "d1 registers")
            decoders.append(other)
        body = {"model": MODEL, "max_tokens": 40, "stream": True, "messages": [{"role": "user", "content": "Hi"}]}
        whole = parse(a.http.post("/v1/chat/completions", json=body, headers=RESUMABLE).text)
        with a.http.stream("POST", "/v1/chat/completions", json=body, headers=RESUMABLE) as response:
            response_id = response.headers["x-response-id"]
            first, last = read_ids(response.iter_lines(), 6)
        settle(lambda: a.services.streams.streams[response_id].finished, bool, PATIENCE_S,
               "the proxy produced the stream's last event; its client left after six")

        def resume():
            return b.http.get(f"/v1/streams/{response_id}", headers={"Last-Event-ID": last})
        if lost == "nothing":
            assert_openai_error(resume(), 503, "held by another proxy")
            resumed = a.http.get(f"/v1/streams/{response_id}", headers={"Last-Event-ID": last})
        else:
            a.services.link._loop.call_soon_threadsafe(frozen.wait, 4 * PATIENCE_S)  # the proxy hangs: dead
            for worker in decoders:
                worker.lose_proxy(0)
            settle(lambda: sum(held(w, response_id)[1] for w in decoders), bool, PATIENCE_S,
                   "a worker keeps the lost proxy's ended stream")
            if lost == "proxy-and-worker":
                holder = max(decoders, key=lambda w: held(w, response_id)[1])
                holder.stop(goodbye=False)
                settle(lambda: holder.worker_id in b.services.cluster.registry.workers, lambda known: not known,
                       PATIENCE_S, "the proxy sees the worker gone")
            resumed = resume()
        assert resumed.status_code == 200, resumed.text
        rest = parse(resumed.text)
        assert [n for n, _ in first + rest] == list(range(len(whole))), "no event repeated or missing"
        assert bodies(first + rest) == bodies(whole)
        recomputed = total(b.http.get("/metrics").text, "tessera_proxy_streams_recomputed_total")
        assert recomputed == (lost == "proxy-and-worker")
        if lost != "nothing":  # the lost proxy's key is the taker's now, whichever way it took the stream
            store, taker = redis.Redis.from_url(redis_server.url), b.services.streams.shared.owner.encode()
            settle(lambda: store.hget("tessera:stream-context:" + response_id, "owner"), lambda o: o == taker,
                   PATIENCE_S, "the proxy that took the stream over keeps its context in Redis as its own")
    finally:
        frozen.set()
        for worker in workers:
            worker.stop(goodbye=False)


@pytest.mark.parametrize("lose_worker", [False, True], ids=["worker-alive", "worker-lost-too"])
def test_a_response_of_several_choices_is_taken_over_choice_by_choice(make_proxy, script, redis_server,  # noqa: F811
                                                                      lose_worker):
    """``n`` = 2 and two prompts: four choices, whose events interleaved as the lost proxy got them. The client's
    id counts each choice's tokens; the proxy taking over sends each choice's rest (taken over from its worker, or
    computed again when that worker is lost too) numbered from the next event, in whatever order they come."""
    workers, frozen = [], threading.Event()
    try:
        (a, b), decode = start(make_proxy, script, workers, shared_state={"redis_url": redis_server.url})
        decoders = [decode]
        if lose_worker:  # another decode worker: the choices on the one lost are computed again, the rest taken over
            other = FakeWorker(",".join(p.endpoint for p in (a, b)), "d1", "decode", script * REPEATS,
                               token_interval_s=0.02)
            workers.append(other.start())
            settle(lambda: other._worker is not None and other._worker.registered, bool, PATIENCE_S, "d1 registers")
            decoders.append(other)
        body = {"model": MODEL, "prompt": ["Hi", "Hello"], "n": 2, "max_tokens": 40, "stream": True, "logprobs": 1,
                "stream_options": {"include_usage": True}}
        whole = parse(a.http.post("/v1/completions", json=body, headers=RESUMABLE).text)
        with a.http.stream("POST", "/v1/completions", json=body, headers=RESUMABLE) as response:
            response_id = response.headers["x-response-id"]
            first, last = read_ids(response.iter_lines(), 10)
            store = redis.Redis.from_url(redis_server.url)
            settle(lambda: store.hget("tessera:stream-context:" + response_id, "context"), bool, PATIENCE_S,
                   "its contexts are in Redis")
        assert len(last.split(".")) == 5, "the event's number, then the tokens of each of the four choices"
        a.services.link._loop.call_soon_threadsafe(frozen.wait, 4 * PATIENCE_S)  # the first proxy hangs: dead
        for worker in decoders:
            worker.lose_proxy(0)
        settle(lambda: sum(held(w, response_id)[1] for w in decoders), lambda n: n == 4, PATIENCE_S,
               "the workers keep every choice")
        lost = max(decoders, key=lambda w: held(w, response_id)[1])
        live = [w for w in decoders if w is not lost] if lose_worker else decoders
        if lose_worker:
            lost.stop(goodbye=False)
            settle(lambda: lost.worker_id in b.services.cluster.registry.workers, lambda known: not known,
                   PATIENCE_S, "the proxy sees the worker gone")
        assert_openai_error(b.http.get(f"/v1/streams/{response_id}", headers={"Last-Event-ID": last.split(".")[0]}),
                            404, "resume_window_s")  # a plain event number: the choices' order is unknown
        # That try took the live workers' choices and gave them back (LeaveStream), but one that had ended by then
        # its worker forgot as it handed it over: computed again too (how many ended is the machine's timing).
        settle(lambda: [held(w, response_id) for w in live],
               lambda counts: all(kept == orphans for kept, orphans in counts), PATIENCE_S,
               "the live workers hold what the proxy gave back as a lost proxy's")
        recomputed = 4 - sum(held(w, response_id)[1] for w in live)
        print(f"{recomputed} of the 4 choices to compute again")
        resumed = b.http.get(f"/v1/streams/{response_id}", headers={"Last-Event-ID": last})
        assert resumed.status_code == 200, resumed.text
        rest = parse(resumed.text)
        assert [n for n, _ in first + rest] == list(range(len(first) + len(rest))), "no event repeated or missing"
        assert text_of(first + rest) == text_of(whole), "each choice's text"
        assert json.loads(rest[-2][1])["usage"] == json.loads(whole[-2][1])["usage"], "the whole response's usage"
        metrics = b.http.get("/metrics").text
        assert total(metrics, "tessera_proxy_streams_recomputed_total") == recomputed
        settle(lambda: dict(b.services.cluster.inflight), lambda inflight: not inflight, PATIENCE_S,
               "every choice ends on the proxy that took the stream over")
    finally:
        frozen.set()
        for worker in workers:
            worker.stop(goodbye=False)
