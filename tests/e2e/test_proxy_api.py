"""The proxy over real sockets: HTTP in front, scripted fake workers on real ZeroMQ DEALERs behind.

Each test starts its own proxy (uvicorn on uvloop in a thread, the ROUTER on
a free port) with the embedded model's tokenizer; the workers are
``proxy.fake_worker.FakeWorker``s that answer from a script of known text.
"""
from __future__ import annotations

import json
import socket
import threading
import time

import httpx
import openai
import pytest
import uvicorn

from common.role_config import ProxyConfig
from common.tokenizer import Tokenizer
from common.wire import Abort, DecodeRequest, Peers, PrefillRequest, RegisterAck, ReleaseKV
from proxy.app import create_app
from proxy.fake_worker import FakeWorker
from proxy.server import DrainingServer

MODEL = "SmolLM2-135M-Instruct"
SCRIPT_TEXT = " The quick brown fox jumps over the lazy dog."
MESSAGES = [{"role": "user", "content": "Tell me about foxes."}]


@pytest.fixture(scope="module")
def tokenizer(embedded_model_dir) -> Tokenizer:
    return Tokenizer(embedded_model_dir)


@pytest.fixture(scope="module")
def script(tokenizer) -> list[tuple[int, str]]:
    ids = tokenizer.encode(SCRIPT_TEXT, add_special_tokens=False)
    texts = [tokenizer.decode(ids[:i]) for i in range(len(ids) + 1)]
    return [(t, texts[i + 1][len(texts[i]):]) for i, t in enumerate(ids)]


class RunningProxy:
    def __init__(self, config: ProxyConfig, tokenizer: Tokenizer) -> None:
        self.app = create_app(config, tokenizer=tokenizer)
        self.services = self.app.state.services
        listener = socket.socket()
        listener.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{listener.getsockname()[1]}"
        self.server = DrainingServer(uvicorn.Config(self.app, loop="uvloop", log_level="warning"),
                                     self.services.cluster, drain_timeout_s=5.0)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [listener]}, daemon=True)
        self.thread.start()
        wait_until(lambda: self.server.started, what="the proxy to start")
        self.endpoint = self.services.link.endpoint
        self.http = httpx.Client(base_url=self.url, timeout=30)

    def stop(self) -> None:
        self.http.close()
        self.server.should_exit = True
        self.thread.join(15)


def wait_until(condition, timeout: float = 10.0, what: str = "the condition") -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out waiting for {what}")
        time.sleep(0.02)


@pytest.fixture
def make_proxy(tokenizer, embedded_model_dir):
    started: list[RunningProxy] = []

    def make(**overrides) -> RunningProxy:
        settings = dict(model=str(embedded_model_dir), worker_bind="tcp://127.0.0.1:*", heartbeat_timeout_s=1.0,
                        first_token_timeout_s=20.0, token_timeout_s=20.0, max_prompt_bytes=4096, retry_after_s=3)
        proxy = RunningProxy(ProxyConfig(**{**settings, **overrides}), tokenizer)
        started.append(proxy)
        return proxy

    yield make
    for proxy in started:
        proxy.stop()


@pytest.fixture
def make_worker(script):
    started: list[FakeWorker] = []

    def make(proxy: RunningProxy, worker_id: str, role: str, **options) -> FakeWorker:
        worker = FakeWorker(proxy.endpoint, worker_id, role, options.pop("script", script), **options)
        started.append(worker.start_and_wait())
        return worker

    yield make
    for worker in started:
        worker.stop(goodbye=False)


@pytest.fixture
def cluster(make_proxy, make_worker):
    """A proxy with one prefill and one decode worker, ready."""
    proxy = make_proxy()
    prefill = make_worker(proxy, "p0", "prefill")
    decode = make_worker(proxy, "d0", "decode")
    wait_until(lambda: proxy.http.get("/readyz").status_code == 200, what="/readyz")
    return proxy, prefill, decode


def sse_payloads(raw: str) -> list[str]:
    assert raw.endswith("data: [DONE]\n\n"), raw[-200:]
    events = raw.split("\n\n")[:-1]
    assert all(e.startswith("data: ") and "\n" not in e for e in events), events
    return [e[len("data: "):] for e in events[:-1]]


def assert_openai_error(response: httpx.Response, status: int, *words: str) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    for word in words:
        assert word in error["message"], error
    return error


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
    assert sent.request_id == f"{body['id']}-0" and sent.params["n"] == 1 and sent.lease_s == 30.0
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
    wait_until(lambda: len(prefill.messages(PrefillRequest)) == 2)
    sent = sorted(prefill.messages(PrefillRequest), key=lambda m: m.request_id)
    assert [m.request_id for m in sent] == [f"{body['id']}-0", f"{body['id']}-1"]
    assert [m.seed for m in sent] == [7, 8] and [m.params["seed"] for m in sent] == [7, 8]


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
                                422, "temperature")
    assert error["param"] == "temperature"
    assert_openai_error(post("/v1/completions", json={"model": MODEL}), 422, "prompt")
    assert_openai_error(post("/v1/completions", json={"model": MODEL, "prompt": "Hi", "n": 0}), 422, "n")
    assert_openai_error(post("/v1/completions", json={"model": MODEL, "prompt": "Hi", "echo": True}), 422, "echo")
    assert_openai_error(post("/v1/completions", content=b"{not json", headers={"content-type": "application/json"}),
                        422)
    assert_openai_error(post("/v1/chat/completions", json={"model": MODEL, "messages": []}), 422, "messages")
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
    proxy = make_proxy(first_token_timeout_s=0.5)
    prefill = make_worker(proxy, "p0", "prefill", stall=True)
    make_worker(proxy, "d0", "decode")
    r = proxy.http.post("/v1/completions", json={"model": MODEL, "prompt": "Hi"})
    assert_openai_error(r, 504, "first_token_timeout_s")
    prefill.wait_for(lambda m: isinstance(m, Abort))


def test_a_silent_decode_worker_times_out_the_stream(make_proxy, make_worker):
    proxy = make_proxy(token_timeout_s=0.5)
    prefill = make_worker(proxy, "p0", "prefill")
    decode = make_worker(proxy, "d0", "decode", stall=True)
    with proxy.http.stream("POST", "/v1/completions", json={"model": MODEL, "prompt": "Hi", "stream": True}) as r:
        rest = r.read().decode()
    assert "token_timeout_s=0.5" in rest and rest.endswith("data: [DONE]\n\n")
    decode.wait_for(lambda m: isinstance(m, Abort))
    prefill.wait_for(lambda m: isinstance(m, ReleaseKV))


def test_a_restarted_worker_replaces_its_old_epoch_and_fails_its_requests(make_proxy, make_worker):
    proxy = make_proxy()
    old = make_worker(proxy, "p0", "prefill", stall=True, epoch=1)
    make_worker(proxy, "d0", "decode")
    old.heartbeats = False
    threading.Timer(0.3, lambda: make_worker(proxy, "p0", "prefill", epoch=2)).start()
    r = proxy.http.post("/v1/completions", json={"model": MODEL, "prompt": "Hi"})
    assert_openai_error(r, 503, "re-registered with epoch 2")
    body = proxy.http.post("/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 50}).json()
    assert body["choices"][0]["text"] == SCRIPT_TEXT  # served by the new epoch over the handed-over identity


def test_worker_loss_before_any_token_is_a_503(make_proxy, make_worker):
    proxy = make_proxy()
    prefill = make_worker(proxy, "p0", "prefill", stall=True)
    make_worker(proxy, "d0", "decode")
    threading.Timer(0.3, prefill.stop).start()
    r = proxy.http.post("/v1/completions", json={"model": MODEL, "prompt": "Hi"})
    assert_openai_error(r, 503, "p0")
    assert r.headers["retry-after"] == "3"


def test_worker_loss_mid_stream_is_an_error_event(make_proxy, make_worker):
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
    wait_until(lambda: "tessera_proxy_malformed_messages_total 4.0" in proxy.http.get("/metrics").text)
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
    wait_until(lambda: not proxy.services.cluster.inflight, what="the request to leave")


def test_non_streaming_client_disconnect_aborts_the_prefill(make_proxy, make_worker):
    proxy = make_proxy()
    prefill = make_worker(proxy, "p0", "prefill", stall=True)
    make_worker(proxy, "d0", "decode")
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{proxy.url}/v1/completions", json={"model": MODEL, "prompt": "Hi"}, timeout=1.0)
    prefill.wait_for(lambda m: isinstance(m, Abort))
    wait_until(lambda: not proxy.services.cluster.inflight, what="the request to leave")


# -- registration, readiness, service endpoints ---------------------------------------------------


def test_readyz_follows_the_workers(make_proxy, make_worker):
    proxy = make_proxy()
    assert_openai_error(proxy.http.get("/readyz"), 503, "prefill")
    assert proxy.http.get("/healthz").status_code == 200
    prefill = make_worker(proxy, "p0", "prefill")
    assert_openai_error(proxy.http.get("/readyz"), 503, "decode")
    decode = make_worker(proxy, "d0", "decode")
    assert proxy.http.get("/readyz").status_code == 200
    peers = decode.wait_for(lambda m: isinstance(m, Peers))
    assert [p.worker_id for p in peers.peers] == ["p0"] and peers.peers[0].transfer_metadata == b"fake:p0"
    decode.stop()
    wait_until(lambda: proxy.http.get("/readyz").status_code == 503, what="goodbye to take effect")
    make_worker(proxy, "d1", "decode")
    assert proxy.http.get("/readyz").status_code == 200
    prefill.heartbeats = False
    wait_until(lambda: proxy.http.get("/readyz").status_code == 503, what="the heartbeat timeout")


def test_decode_workers_hear_of_prefill_changes(make_proxy, make_worker):
    proxy = make_proxy()
    decode = make_worker(proxy, "d0", "decode")
    make_worker(proxy, "p0", "prefill")
    wait_until(lambda: any(len(m.peers) == 1 for m in decode.messages(Peers)), what="Peers with p0")


def test_a_worker_of_another_model_is_refused(make_proxy, make_worker):
    proxy = make_proxy()
    make_worker(proxy, "p0", "prefill")
    stranger = make_worker(proxy, "d0", "decode", model="Llama-3-8B")
    ack = stranger.wait_for(lambda m: isinstance(m, RegisterAck))
    assert not ack.accepted and "Llama-3-8B" in ack.reason and MODEL in ack.reason
    assert proxy.http.get("/readyz").status_code == 503


def test_models_version_tokenize_detokenize(cluster, tokenizer):
    proxy, _, _ = cluster
    (model,) = proxy.http.get("/v1/models").json()["data"]
    assert model["id"] == MODEL and model["tessera_model_version"] == "test" and model["max_model_len"] == 8192
    assert proxy.http.get("/version").json()["protocol_version"] == 1
    tokens = proxy.http.post("/tokenize", json={"prompt": "Hello world"}).json()
    assert tokens == {"tokens": tokenizer.encode("Hello world"), "count": len(tokenizer.encode("Hello world")),
                      "max_model_len": 8192}
    chat = proxy.http.post("/tokenize", json={"messages": MESSAGES}).json()
    assert chat["tokens"] == tokenizer.apply_chat_template(MESSAGES)
    assert proxy.http.post("/detokenize", json={"tokens": tokens["tokens"]}).json() == {"prompt": "Hello world"}
    assert_openai_error(proxy.http.post("/tokenize", json={}), 422, "prompt or messages")


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


def test_drain_lets_in_flight_requests_finish_and_refuses_new_ones(make_proxy, make_worker):
    proxy = make_proxy()
    make_worker(proxy, "x0", "both", token_interval_s=0.05)
    request = {"model": MODEL, "prompt": "Hi", "stream": True, "max_tokens": 50}
    with proxy.http.stream("POST", "/v1/completions", json=request) as r:
        lines = r.iter_lines()
        assert next(lines).startswith("data: ")
        proxy.server._loop.call_soon_threadsafe(proxy.server.start_drain)
        wait_until(lambda: proxy.services.cluster.draining)
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
