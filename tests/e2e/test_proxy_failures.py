"""The proxy over real sockets when things go wrong: errors, timeouts, lost workers, disconnects."""
from __future__ import annotations

import time

from tests.e2e.proxy_harness import *  # noqa: F401,F403 -- fixtures, helpers and wire types
from common.protocol.wire import TokenDelta, TokenDeltas


# -- errors -------------------------------------------------------------------------------------


def test_error_bodies(make_proxy, make_worker):
    proxy = make_proxy()
    no_worker = proxy.http.post("/v1/completions", json={"model": MODEL, "prompt": "Hi"})
    assert_openai_error(no_worker, 503, "no worker")
    assert no_worker.headers["retry-after"] == "3"
    make_worker(proxy, "x0", "both", max_model_len=64)
    post = proxy.http.post
    assert_openai_error(post("/v1/completions", json={"model": "gpt-4", "prompt": "Hi"}), 404, "gpt-4")
    error = assert_openai_error(post("/v1/completions", json={"model": MODEL, "prompt": "Hi", "temperature": -1}),
                                400, "temperature")
    assert error["param"] == "temperature"
    assert_openai_error(post("/v1/completions", json={"model": MODEL}), 400, "prompt")
    assert_openai_error(post("/v1/completions", json={"model": MODEL, "prompt": "Hi", "n": 0}), 400, "n")
    for field in ("top_k", "seed", "max_tokens", "n"):  # out of their wire type: refused here, never sent on
        error = assert_openai_error(post("/v1/completions", json={"model": MODEL, "prompt": "Hi", field: 2 ** 63}),
                                    400)
        assert error["param"] == field
    for field in ("top_p", "repetition_penalty"):  # subnormal: a worker's flush-to-zero reads it as 0
        error = assert_openai_error(post("/v1/completions", json={"model": MODEL, "prompt": "Hi", field: 5e-324}),
                                    400)
        assert error["param"] == field
    assert_openai_error(post("/v1/completions", json={"model": MODEL, "prompt": "Hi", "echo": True}), 400, "echo")
    assert_openai_error(post("/v1/completions", content=b"{not json", headers={"content-type": "application/json"}),
                        400)
    assert_openai_error(post("/v1/chat/completions", json={"model": MODEL, "messages": []}), 400, "messages")
    long_prompt = " ".join(["word"] * 100)
    error = assert_openai_error(post("/v1/completions", json={"model": MODEL, "prompt": long_prompt}), 400, "64")
    assert error["code"] == "context_length_exceeded"
    assert_openai_error(post("/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 100}),
                        400, "max_tokens")
    assert_openai_error(post("/v1/completions", json={"model": MODEL, "prompt": [10 ** 9]}), 400, "vocabulary")
    assert_openai_error(post("/v1/completions", json={"model": MODEL, "prompt": "x" * 5000}), 413, "max_prompt_bytes")


def test_fastapi_validation_errors_come_out_in_openai_shape(make_proxy):
    proxy = make_proxy()
    assert_openai_error(proxy.http.get("/v1/nope"), 404)
    assert_openai_error(proxy.http.get("/v1/completions"), 405)


def test_first_token_timeout_aborts_and_answers_504(make_proxy, make_worker):
    proxy = make_proxy(requests={"first_token_timeout_s": 0.5})
    prefill = make_worker(proxy, "p0", "prefill", stall=True)
    make_worker(proxy, "d0", "decode")
    r = proxy.http.post("/v1/completions", json={"model": MODEL, "prompt": "Hi"})
    assert_openai_error(r, 504, "first_token_timeout_s")
    prefill.wait_for(lambda m: isinstance(m, Abort))


def test_a_silent_decode_worker_times_out_the_stream(make_proxy, make_worker):
    proxy = make_proxy(requests={"token_timeout_s": 0.5})
    prefill = make_worker(proxy, "p0", "prefill")
    decode = make_worker(proxy, "d0", "decode", stall=True)
    with proxy.http.stream("POST", "/v1/completions", json={"model": MODEL, "prompt": "Hi", "stream": True}) as r:
        rest = r.read().decode()
    assert "requests.token_timeout_s=0.5" in rest and rest.endswith("data: [DONE]\n\n")
    decode.wait_for(lambda m: isinstance(m, Abort))
    prefill.wait_for(lambda m: isinstance(m, ReleaseKV))


def test_one_steps_tokens_reach_each_stream_and_a_stray_among_them_is_aborted(make_proxy, make_worker, script):
    """A decode step's TokenDeltas names several requests: each gets its own tokens, and a delta for a request
    the proxy does not have (an earlier attempt, a request already gone) gets an Abort, not the others."""
    proxy = make_proxy()
    make_worker(proxy, "p0", "prefill")
    decode = make_worker(proxy, "d0", "decode", stall=True)
    body = {"model": MODEL, "prompt": "Hi", "stream": True, "max_tokens": 3}
    with proxy.http.stream("POST", "/v1/completions", json=body) as a, \
            proxy.http.stream("POST", "/v1/completions", json=body) as b:
        settle(lambda: decode.messages(DecodeRequest), lambda sent: len(sent) == 2, HEARTBEAT_TIMEOUT_S,
               "d0 receives both DecodeRequests (heartbeat_timeout_s bounds a send)")
        first, second = (m.request_id for m in decode.messages(DecodeRequest))
        (token, text), (last, last_text) = script[1], script[2]
        decode.send(TokenDeltas([TokenDelta(first, [token], text), TokenDelta("gone~1", [token], text),
                                 TokenDelta(second, [token], text)]))
        decode.send(TokenDeltas([TokenDelta(first, [last], last_text, finish_reason="length"),
                                 TokenDelta(second, [last], last_text, finish_reason="length")]))
        texts = [a.read().decode(), b.read().decode()]
    for raw in texts:
        chunks = [json.loads(p) for p in sse_payloads(raw)]
        assert "".join(c["choices"][0]["text"] for c in chunks) == script[0][1] + text + last_text
    decode.wait_for(lambda m: isinstance(m, Abort) and m.request_id == "gone~1")
    assert not any(isinstance(m, Abort) and m.request_id in (first, second) for m in decode.received)


def test_a_restarted_worker_replaces_its_old_epoch_and_its_requests_resume(make_proxy, make_worker):
    proxy = make_proxy()
    old = make_worker(proxy, "p0", "prefill", stall=True, epoch=1)
    make_worker(proxy, "d0", "decode")
    old.heartbeats = False
    threading.Timer(0.3, lambda: make_worker(proxy, "p0", "prefill", epoch=2)).start()
    body = proxy.http.post("/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 50}).json()
    assert body["choices"][0]["text"] == SCRIPT_TEXT  # resumed on the new epoch over the handed-over identity
    assert not [m for m in old.messages(PrefillRequest) if m.request_id.endswith("~1")]


def test_worker_loss_before_any_token_without_migrations_is_a_503(make_proxy, make_worker):
    proxy = make_proxy(max_migrations=0)
    prefill = make_worker(proxy, "p0", "prefill", stall=True)
    make_worker(proxy, "d0", "decode")
    threading.Timer(0.3, prefill.stop).start()
    r = proxy.http.post("/v1/completions", json={"model": MODEL, "prompt": "Hi"})
    assert_openai_error(r, 503, "p0", "max_migrations=0")
    assert r.headers["retry-after"] == "3"


def test_worker_loss_before_any_token_resumes_on_the_decode_worker(make_proxy, make_worker):
    proxy = make_proxy()
    prefill = make_worker(proxy, "p0", "prefill", stall=True)
    decode = make_worker(proxy, "d0", "decode")
    threading.Timer(0.3, prefill.stop).start()
    body = proxy.http.post("/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 50}).json()
    assert body["choices"][0]["text"] == SCRIPT_TEXT
    assert decode.messages(DecodeRequest)[0].first_token is None  # no prefill worker left: prefilled there


def test_worker_loss_mid_stream_with_no_worker_left_is_an_error_event(make_proxy, make_worker):
    proxy = make_proxy()
    prefill = make_worker(proxy, "p0", "prefill")
    decode = make_worker(proxy, "d0", "decode", stall=True)
    request = {"model": MODEL, "prompt": "Hi", "stream": True}
    with proxy.http.stream("POST", "/v1/completions", json=request) as r:
        lines = r.iter_lines()
        assert next(lines).startswith("data: ")  # the first token, from prefill
        decode.wait_for(lambda m: isinstance(m, DecodeRequest))
        decode.stop()
        rest = "\n".join(lines)
    assert '"error"' in rest and "d0" in rest and rest.rstrip().endswith("data: [DONE]")
    prefill.wait_for(lambda m: isinstance(m, ReleaseKV))


def test_losing_the_prefill_worker_after_the_pull_does_not_matter(make_proxy, make_worker):
    proxy = make_proxy()
    prefill = make_worker(proxy, "p0", "prefill")
    make_worker(proxy, "d0", "decode", token_interval_s=0.05)
    with proxy.http.stream("POST", "/v1/completions", json={"model": MODEL, "prompt": "Hi", "stream": True}) as r:
        lines = r.iter_lines()
        assert next(lines).startswith("data: ")
        prefill.wait_for(lambda m: isinstance(m, ReleaseKV))
        prefill.stop()
        rest = "\n".join(lines)
    assert '"finish_reason":"stop"' in rest and '"error"' not in rest


def test_malformed_worker_frames_are_dropped(cluster):
    proxy, prefill, decode = cluster
    decode.send_raw([b"\x0d", b"\xc1 not msgpack"])
    decode.send_raw([b"\xff", b""])
    decode.send_raw([b"only one frame"])
    prefill.send_raw([bytes([13]), json.dumps({"v": 1, "request_id": 5}).encode()])
    settle(lambda: proxy.http.get("/metrics").text, lambda text: "tessera_proxy_malformed_messages_total 4.0" in text,
           PATIENCE_S, "the proxy counts the four malformed frames it read")
    body = proxy.http.post("/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 50}).json()
    assert body["choices"][0]["text"] == SCRIPT_TEXT


# -- client disconnect --------------------------------------------------------------------------


def test_streaming_client_disconnect_aborts_both_workers_and_releases_pages(make_proxy, make_worker):
    proxy = make_proxy()
    prefill = make_worker(proxy, "p0", "prefill")
    decode = make_worker(proxy, "d0", "decode", stall=True)
    with httpx.Client(base_url=proxy.url, timeout=30) as client:
        with client.stream("POST", "/v1/completions", json={"model": MODEL, "prompt": "Hi", "stream": True}) as r:
            assert next(r.iter_lines()).startswith("data: ")
            decode.wait_for(lambda m: isinstance(m, DecodeRequest))
    decode.wait_for(lambda m: isinstance(m, Abort))
    prefill.wait_for(lambda m: isinstance(m, Abort))
    prefill.wait_for(lambda m: isinstance(m, ReleaseKV))
    settle(lambda: dict(proxy.services.cluster.inflight), lambda inflight: not inflight, PATIENCE_S,
           "the abandoned request leaves the proxy")


def test_non_streaming_client_disconnect_aborts_the_prefill(make_proxy, make_worker):
    proxy = make_proxy()
    prefill = make_worker(proxy, "p0", "prefill", stall=True)
    make_worker(proxy, "d0", "decode")
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{proxy.url}/v1/completions", json={"model": MODEL, "prompt": "Hi"}, timeout=1.0)
    prefill.wait_for(lambda m: isinstance(m, Abort))
    settle(lambda: dict(proxy.services.cluster.inflight), lambda inflight: not inflight, PATIENCE_S,
           "the abandoned request leaves the proxy")


# -- failure detection ----------------------------------------------------------------------------


def test_a_closed_connection_removes_the_worker_at_once_not_after_the_heartbeat_timeout(make_proxy, make_worker):
    proxy = make_proxy(heartbeat_timeout_s=120.0)
    make_worker(proxy, "p0", "prefill")
    decode = make_worker(proxy, "d0", "decode")
    cluster = proxy.services.cluster
    assert "d0" in cluster.registry.workers  # registered before its RegisterAck went out
    decode.stop(goodbye=False)  # its socket closes, as a killed process's does
    # Well within heartbeat_timeout_s=120: the closed connection, not the silence, removed it. The removal and the
    # count are one step of the proxy's loop, before it answers the /metrics request.
    settle(lambda: set(cluster.registry.workers), lambda workers: "d0" not in workers, PATIENCE_S,
           "the proxy removes d0 when its connection closes")
    assert 'tessera_proxy_worker_disconnects_total{worker_id="d0"} 1.0' in proxy.http.get("/metrics").text


def test_a_restarted_worker_on_a_reused_connection_stays_registered(make_proxy, make_worker):
    proxy = make_proxy(heartbeat_timeout_s=120.0)
    make_worker(proxy, "p0", "prefill")
    cluster = proxy.services.cluster
    worker = make_worker(proxy, "d0", "decode", epoch=1)
    for epoch in range(2, 7):  # each restart may get the closed connection's descriptor number
        worker.stop(goodbye=False)
        worker = make_worker(proxy, "d0", "decode", epoch=epoch)
        assert cluster.registry.workers["d0"].epoch == epoch  # registered before its RegisterAck went out
        time.sleep(0.3)  # the old connection's close has been seen by now
        assert cluster.registry.workers["d0"].epoch == epoch
        body = proxy.http.post("/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 50}).json()
        assert body["choices"][0]["text"] == SCRIPT_TEXT
