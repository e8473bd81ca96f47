"""The proxy's API over real sockets: generation, service endpoints, the official client."""
from __future__ import annotations

from common.protocol.wire import PROTOCOL_VERSION, KVLayoutInfo
from tests.e2e.proxy_harness import *  # noqa: F401,F403 -- fixtures, helpers and wire types


# -- generation ---------------------------------------------------------------------------------


def test_completion_goes_prefill_then_decode_and_releases_the_pages(cluster, tokenizer):
    proxy, prefill, decode = cluster
    r = proxy.http.post("/v1/completions", json={"model": MODEL, "prompt": "Hello there", "max_tokens": 50})
    body = r.json()
    assert r.status_code == 200, body
    assert body["id"].startswith("cmpl-") and body["object"] == "text_completion" and body["model"] == MODEL
    assert isinstance(body["created"], int)
    (choice,) = body["choices"]
    assert choice["text"] == SCRIPT_TEXT and choice["finish_reason"] == "stop" and choice["index"] == 0
    n_script = len(tokenizer.encode(SCRIPT_TEXT, add_special_tokens=False))
    prompt_tokens = len(tokenizer.encode("Hello there"))
    assert body["usage"]["prompt_tokens"] == prompt_tokens
    assert body["usage"]["completion_tokens"] == n_script
    assert body["usage"]["total_tokens"] == prompt_tokens + n_script
    sent = prefill.wait_for(lambda m: isinstance(m, PrefillRequest))
    assert sent.request_id == f"{body['id']}-0" and sent.params.n == 1 and sent.lease_s == 30.0
    handed = decode.wait_for(lambda m: isinstance(m, DecodeRequest))
    assert handed.source_worker_id == "p0" and handed.first_token == prefill.script[0][0]
    assert handed.seed == sent.seed and handed.source_block_ids
    prefill.wait_for(lambda m: isinstance(m, ReleaseKV) and m.request_id == sent.request_id)


def test_max_tokens_stops_with_length(cluster, script):
    proxy, _, _ = cluster
    body = proxy.http.post("/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 3}).json()
    assert body["choices"][0]["text"] == "".join(t for _, t in script[:3])
    assert body["choices"][0]["finish_reason"] == "length" and body["usage"]["completion_tokens"] == 3


def test_a_request_finished_by_its_first_token_never_reaches_decode(cluster, script):
    proxy, prefill, decode = cluster
    body = proxy.http.post("/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 1}).json()
    assert body["choices"][0]["text"] == script[0][1] and body["choices"][0]["finish_reason"] == "length"
    prefill.wait_for(lambda m: isinstance(m, ReleaseKV))
    assert decode.messages(DecodeRequest) == []


def test_streaming_completion_with_usage(cluster, tokenizer):
    proxy, _, _ = cluster
    request = {"model": MODEL, "prompt": "Hello", "max_tokens": 50, "stream": True,
               "stream_options": {"include_usage": True}}
    with proxy.http.stream("POST", "/v1/completions", json=request) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        chunks = [json.loads(p) for p in sse_payloads(r.read().decode())]
    *token_chunks, usage_chunk = chunks
    assert all(c["object"] == "text_completion" and c["usage"] is None for c in token_chunks)
    assert "".join(c["choices"][0]["text"] for c in token_chunks) == SCRIPT_TEXT
    assert token_chunks[-1]["choices"][0]["finish_reason"] == "stop"
    assert all(c["choices"][0]["finish_reason"] is None for c in token_chunks[:-1])
    assert usage_chunk["choices"] == []
    assert usage_chunk["usage"]["completion_tokens"] == len(tokenizer.encode(SCRIPT_TEXT, add_special_tokens=False))
    assert len({c["id"] for c in chunks}) == 1


def test_chat_completion(cluster, tokenizer):
    proxy, prefill, _ = cluster
    r = proxy.http.post("/v1/chat/completions", json={"model": MODEL, "messages": MESSAGES, "max_tokens": 50})
    body = r.json()
    assert r.status_code == 200, body
    assert body["id"].startswith("chatcmpl-") and body["object"] == "chat.completion"
    assert body["choices"][0]["message"] == {"role": "assistant", "content": SCRIPT_TEXT}
    templated = tokenizer.apply_chat_template(MESSAGES)
    assert body["usage"]["prompt_tokens"] == len(templated)
    assert prefill.wait_for(lambda m: isinstance(m, PrefillRequest)).prompt_token_ids == templated


def test_streaming_chat_opens_with_the_role_and_ends_with_done(cluster):
    proxy, _, _ = cluster
    request = {"model": MODEL, "messages": MESSAGES, "max_completion_tokens": 50, "stream": True}
    with proxy.http.stream("POST", "/v1/chat/completions", json=request) as r:
        chunks = [json.loads(p) for p in sse_payloads(r.read().decode())]
    assert all(c["object"] == "chat.completion.chunk" and "usage" not in c for c in chunks)
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks) == SCRIPT_TEXT
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"


def test_n_fans_out_with_consecutive_seeds_and_own_request_ids(cluster):
    proxy, prefill, _ = cluster
    body = proxy.http.post("/v1/completions", json={"model": MODEL, "prompt": "Hi", "n": 2, "seed": 7,
                                                    "max_tokens": 50}).json()
    assert [c["index"] for c in body["choices"]] == [0, 1]
    assert all(c["text"] == SCRIPT_TEXT for c in body["choices"])
    sent = sorted(prefill.messages(PrefillRequest), key=lambda m: m.request_id)  # both prefilled their answers
    assert [m.request_id for m in sent] == [f"{body['id']}-0", f"{body['id']}-1"]
    assert [m.seed for m in sent] == [7, 8] and [m.params.seed for m in sent] == [7, 8]


def test_a_batch_of_prompts_answers_prompt_major(cluster, tokenizer):
    proxy, _, _ = cluster
    body = proxy.http.post("/v1/completions", json={"model": MODEL, "prompt": ["a b", "c d e"], "n": 2,
                                                    "max_tokens": 2}).json()
    assert [c["index"] for c in body["choices"]] == [0, 1, 2, 3]
    assert body["usage"]["prompt_tokens"] == len(tokenizer.encode("a b")) + len(tokenizer.encode("c d e"))
    body = proxy.http.post("/v1/completions", json={"model": MODEL, "prompt": [[1, 2, 3], [4, 5]],
                                                    "max_tokens": 2}).json()
    assert [c["index"] for c in body["choices"]] == [0, 1] and body["usage"]["prompt_tokens"] == 5


def test_completion_logprobs_shape(cluster, script):
    proxy, _, _ = cluster
    body = proxy.http.post("/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 4,
                                                    "logprobs": 2}).json()
    logprobs = body["choices"][0]["logprobs"]
    assert logprobs["tokens"] == [t for _, t in script[:4]]
    assert logprobs["token_logprobs"] == pytest.approx([-0.1, -0.2, -0.3, -0.4])
    assert [len(top) for top in logprobs["top_logprobs"]] == [2, 2, 2, 2]
    assert logprobs["top_logprobs"][0][script[0][1]] == pytest.approx(-0.1)
    assert logprobs["text_offset"] == [0, *[sum(len(t) for _, t in script[:i]) for i in range(1, 4)]]


def test_chat_logprobs_shape(cluster, script):
    proxy, _, _ = cluster
    body = proxy.http.post("/v1/chat/completions", json={"model": MODEL, "messages": MESSAGES, "max_tokens": 3,
                                                         "logprobs": True, "top_logprobs": 2}).json()
    content = body["choices"][0]["logprobs"]["content"]
    assert [e["token"] for e in content] == [t for _, t in script[:3]]
    first = content[0]
    assert first["bytes"] == list(script[0][1].encode()) and first["logprob"] == pytest.approx(-0.1)
    assert len(first["top_logprobs"]) == 2 and set(first["top_logprobs"][0]) == {"token", "logprob", "bytes"}


def test_only_aggregated_workers_prefill_locally(make_proxy, make_worker):
    proxy = make_proxy()
    worker = make_worker(proxy, "x0", "both")
    assert proxy.http.get("/readyz").status_code == 200
    body = proxy.http.post("/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 50}).json()
    assert body["choices"][0]["text"] == SCRIPT_TEXT
    handed = worker.wait_for(lambda m: isinstance(m, DecodeRequest))
    assert handed.first_token is None and handed.source_block_ids == []


def test_short_prompts_skip_the_prefill_worker(make_proxy, make_worker):
    proxy = make_proxy(local_prefill_threshold=1000)
    prefill = make_worker(proxy, "p0", "prefill")
    decode = make_worker(proxy, "d0", "decode")
    body = proxy.http.post("/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 50}).json()
    assert body["choices"][0]["text"] == SCRIPT_TEXT
    assert decode.wait_for(lambda m: isinstance(m, DecodeRequest)).first_token is None
    assert prefill.messages(PrefillRequest) == []


# -- registration, readiness, service endpoints ---------------------------------------------------


def test_readyz_follows_the_workers(make_proxy, make_worker):
    proxy = make_proxy()
    assert_openai_error(proxy.http.get("/readyz"), 503, "decode-capable")
    assert proxy.http.get("/healthz").status_code == 200
    prefill = make_worker(proxy, "p0", "prefill")
    assert_openai_error(proxy.http.get("/readyz"), 503, "decode-capable")
    decode = make_worker(proxy, "d0", "decode")
    assert proxy.http.get("/readyz").status_code == 200
    peers = decode.wait_for(lambda m: isinstance(m, Peers))
    assert [p.worker_id for p in peers.peers] == ["p0"] and peers.peers[0].transfer_metadata == b"fake:p0"
    decode.stop()
    settle(lambda: proxy.http.get("/readyz").status_code, lambda status: status == 503, PATIENCE_S,
           "/readyz turns 503 on d0's Goodbye")
    make_worker(proxy, "d1", "decode")
    assert proxy.http.get("/readyz").status_code == 200
    prefill.stop()
    settle(lambda: proxy.http.get("/readyz").text, lambda text: "prefilled on the decode side" in text, PATIENCE_S,
           "/readyz says prompts are prefilled on the decode side once p0 said Goodbye")


def test_a_decode_only_cluster_is_ready_and_serves_by_local_prefill(make_proxy, make_worker):
    proxy = make_proxy()
    decode = make_worker(proxy, "d0", "decode")
    ready = proxy.http.get("/readyz")
    assert ready.status_code == 200 and "no prefill worker" in ready.text
    body = proxy.http.post("/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 50}).json()
    assert body["choices"][0]["text"] == SCRIPT_TEXT
    assert decode.messages(DecodeRequest)[0].first_token is None  # prefilled there


def test_decode_workers_hear_of_prefill_changes(make_proxy, make_worker):
    proxy = make_proxy()
    decode = make_worker(proxy, "d0", "decode")
    make_worker(proxy, "p0", "prefill")
    settle(lambda: decode.messages(Peers), lambda peers: any(len(m.peers) == 1 for m in peers),
           HEARTBEAT_TIMEOUT_S, "d0 hears of p0 in a Peers message (heartbeat_timeout_s bounds a send)")


def test_a_worker_of_the_same_version_with_another_kv_layout_is_refused(make_proxy, make_worker):
    proxy = make_proxy()
    make_worker(proxy, "p0", "prefill")
    odd = make_worker(proxy, "d0", "decode", kv_layout=KVLayoutInfo(30, 32, 3, 64, "float32"))
    ack = odd.wait_for(lambda m: isinstance(m, RegisterAck))
    assert not ack.accepted and "block_size=32" in ack.reason and f"{MODEL}@test" in ack.reason
    assert proxy.http.get("/readyz").status_code == 503


def test_workers_of_another_model_join_but_never_serve_this_ones_requests(make_proxy, make_worker):
    proxy = make_proxy()
    make_worker(proxy, "p0", "prefill")
    make_worker(proxy, "d0", "decode")
    other = [make_worker(proxy, f"{role[0]}1", role, model="Llama-3-8B") for role in ("prefill", "decode")]
    settle(lambda: proxy.http.get("/v1/models").json()["data"], lambda data: len(data) == 2, PATIENCE_S,
           "/v1/models lists both models once their workers registered")
    for _ in range(4):
        response = proxy.http.post("/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 50})
        assert response.status_code == 200 and response.headers["X-Tessera-Model"] == f"{MODEL}@test"
    assert not any(worker.messages(PrefillRequest) or worker.messages(DecodeRequest) for worker in other)
    unknown = proxy.http.post("/v1/completions", json={"model": "Llama-3-8B", "prompt": "Hi"})
    assert unknown.status_code == 503 and "no tokenizer for Llama-3-8B@test" in unknown.text  # not registered here
    assert proxy.http.post("/v1/completions", json={"model": "nope", "prompt": "Hi"}).status_code == 404
    assert proxy.http.post("/v1/completions", json={"model": f"{MODEL}@v9", "prompt": "Hi"}).status_code == 404


def test_models_version_tokenize_detokenize(cluster, tokenizer):
    proxy, _, _ = cluster
    (model,) = proxy.http.get("/v1/models").json()["data"]
    assert model["id"] == MODEL and model["promoted_version"] == "test" and model["max_model_len"] == 8192
    assert model["versions"] == [{"version": "test", "workers": 2, "draining": 0, "max_model_len": 8192,
                                  "pinned_sessions": 0}]
    assert proxy.http.get("/version").json()["protocol_version"] == PROTOCOL_VERSION
    tokens = proxy.http.post("/tokenize", json={"prompt": "Hello world"}).json()
    assert tokens == {"tokens": tokenizer.encode("Hello world"), "count": len(tokenizer.encode("Hello world")),
                      "max_model_len": 8192}
    chat = proxy.http.post("/tokenize", json={"messages": MESSAGES}).json()
    assert chat["tokens"] == tokenizer.apply_chat_template(MESSAGES)
    assert proxy.http.post("/detokenize", json={"tokens": tokens["tokens"]}).json() == {"prompt": "Hello world"}
    assert_openai_error(proxy.http.post("/tokenize", json={}), 400, "prompt or messages")


def test_metrics_names(cluster):
    proxy, _, _ = cluster
    proxy.http.post("/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 50})
    text = proxy.http.get("/metrics").text
    for name in ("tessera_proxy_requests_total", "tessera_proxy_time_to_first_token_seconds_bucket",
                 "tessera_proxy_time_per_output_token_seconds_count", "tessera_proxy_inter_token_latency_seconds",
                 "tessera_proxy_e2e_request_latency_seconds", "tessera_proxy_requests_waiting_first_token",
                 'tessera_proxy_workers_alive{role="prefill"} 1.0', 'tessera_proxy_kv_pages_free{worker_id="d0"}',
                 "tessera_proxy_kv_pages_used", "tessera_proxy_kv_transfer_bytes_total",
                 "tessera_proxy_kv_transfer_seconds_count 1.0"):
        assert name in text, name
    assert 'tessera_proxy_requests_total{endpoint="completions",status="200"} 1.0' in text
    # what gateways route on: KV usage as a fraction, waiting and running per model; latency by model
    for name in ('tessera_proxy_kv_usage_ratio{worker_id="d0"}', "tessera_proxy_cluster_kv_usage_ratio",
                 f'tessera_proxy_model_requests_waiting{{model="{MODEL}"}} 0.0',
                 f'tessera_proxy_model_requests_running{{model="{MODEL}"}} 0.0',
                 f'tessera_proxy_time_to_first_token_seconds_count{{model="{MODEL}"}} 1.0'):
        assert name in text, name


def test_drain_lets_in_flight_requests_finish_and_refuses_new_ones(make_proxy, make_worker):
    proxy = make_proxy()
    make_worker(proxy, "x0", "both", token_interval_s=0.05)
    request = {"model": MODEL, "prompt": "Hi", "stream": True, "max_tokens": 50}
    with proxy.http.stream("POST", "/v1/completions", json=request) as r:
        lines = r.iter_lines()
        assert next(lines).startswith("data: ")
        proxy.server._loop.call_soon_threadsafe(proxy.server.start_drain)
        settle(lambda: proxy.services.cluster.draining, bool, PATIENCE_S, "the proxy starts draining")
        with httpx.Client(base_url=proxy.url) as other:
            assert_openai_error(other.get("/readyz"), 503, "shutting down")
            assert_openai_error(other.post("/v1/completions", json={"model": MODEL, "prompt": "Hi"}), 503)
        rest = "\n".join(lines)
    assert rest.rstrip().endswith("data: [DONE]") and '"finish_reason":"stop"' in rest
    proxy.thread.join(10)
    assert not proxy.thread.is_alive()


# -- the official client --------------------------------------------------------------------------


def test_the_openai_client_works_unmodified(cluster):
    proxy, _, _ = cluster
    client = openai.OpenAI(base_url=f"{proxy.url}/v1", api_key="unused", max_retries=0)
    chat = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=50)
    assert chat.choices[0].message.content == SCRIPT_TEXT and chat.usage.completion_tokens > 0
    completion = client.completions.create(model=MODEL, prompt="Hello", max_tokens=50, n=2, seed=3)
    assert [c.text for c in completion.choices] == [SCRIPT_TEXT, SCRIPT_TEXT]
    stream = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=50, stream=True,
                                            stream_options={"include_usage": True})
    chunks = list(stream)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == SCRIPT_TEXT
    assert chunks[-1].usage.total_tokens > 0
    texts = {0: "", 1: ""}
    for chunk in client.completions.create(model=MODEL, prompt="Hello", max_tokens=50, n=2, stream=True):
        for choice in chunk.choices:
            texts[choice.index] += choice.text
    assert texts == {0: SCRIPT_TEXT, 1: SCRIPT_TEXT}
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="nope", prompt="Hello")
