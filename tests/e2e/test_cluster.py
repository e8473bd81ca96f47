"""The whole cluster over real sockets: proxy + prefill + decode processes on loopback.

Greedy output through the cluster must equal the single-process engine token
for token; streaming, concurrency, client disconnects and worker loss must
leave no KV page allocated on any worker.
"""
import asyncio
import json

import httpx
import pytest

from common.config.base import EngineConfig
from common.engine.llm_engine import LLMEngine
from common.protocol.sampling_params import SamplingParams
from kv_transfer.factory import default_backend_name
from common.cli.local_cluster import LocalCluster, post_json
from tests.e2e.fault_scenarios import check_pages_freed

MODEL = "SmolLM2-135M-Instruct"
PROMPTS = [
    "What is the capital of France?", "Write a haiku about the sea.", "def fibonacci(n):",
    "Explain what a hash table is.", "Once upon a time,", "List three primary colors.",
    "Translate 'good morning' into Spanish.", "What is 12 times 7?", "Name a pet turtle.",
    "Summarize Romeo and Juliet.", "Why is the sky blue?", "Write a SQL query counting users.",
    "What is photosynthesis?", "Give me a synonym for happy.", "How many legs does a spider have?",
    "Describe a sunset in one sentence.", "What is the boiling point of water?", "Tell me a joke.",
    "What is the largest planet?", "Suggest a name for a bakery.", "What does CPU stand for?",
]
MAX_TOKENS = 16
BACKENDS = ["zmq"] + (["nixl"] if default_backend_name() == "nixl" else [])


def nixl_or_skip(backend):
    if backend == "nixl" and default_backend_name() != "nixl":
        pytest.skip("NIXL cannot be imported here")


@pytest.fixture(scope="module")
def reference(embedded_model_dir):
    engine = LLMEngine(EngineConfig(model=str(embedded_model_dir), num_kv_blocks=256))
    chats = [engine.tokenizer.apply_chat_template([{"role": "user", "content": p}]) for p in PROMPTS]
    outs = engine.generate(chats, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS))
    return [o.outputs[0].text for o in outs]


@pytest.fixture(scope="module", params=BACKENDS)
def cluster(request, embedded_model_dir, tmp_path_factory):
    c = LocalCluster.for_tests(embedded_model_dir, tmp_path_factory.mktemp(f"logs-{request.param}"),
                transfer_backend=request.param).start()
    yield c
    codes = c.stop()
    assert all(code == 0 for code in codes.values()), codes


def chat(url, content, **kw):
    body = {"model": MODEL, "messages": [{"role": "user", "content": content}], "max_tokens": MAX_TOKENS,
            "temperature": 0.0, **kw}
    return post_json(url + "/v1/chat/completions", body)


def test_greedy_output_equals_the_single_process_engine(cluster, reference):
    async def run():
        async with httpx.AsyncClient(timeout=300) as client:
            bodies = [{"model": MODEL, "messages": [{"role": "user", "content": p}], "max_tokens": MAX_TOKENS,
                       "temperature": 0.0} for p in PROMPTS]
            return await asyncio.gather(*(client.post(cluster.url + "/v1/chat/completions", json=b) for b in bodies))
    responses = asyncio.run(run())  # all 21 at once: the workers batch them
    texts = [r.json()["choices"][0]["message"]["content"] for r in responses]
    assert texts == reference
    check_pages_freed(cluster)
    transferred = cluster.metric("tessera_proxy_kv_transfer_bytes_total")  # counted before a pull's first token
    assert sum(transferred.values()) > 0, "prompts went through the prefill worker's pages"


def stream_text(url: str, content: str) -> str:
    """A streamed chat completion's deltas, concatenated (its usage chunk checked)."""
    body = {"model": MODEL, "messages": [{"role": "user", "content": content}], "max_tokens": MAX_TOKENS,
            "temperature": 0.0, "stream": True, "stream_options": {"include_usage": True}}
    text, usage = "", None
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=120) as resp:
        for line in resp.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                usage = chunk["usage"]
            for choice in chunk["choices"]:
                text += choice["delta"].get("content") or ""
    assert usage["completion_tokens"] > 0
    return text


def test_stream_deltas_concatenate_to_the_full_text(cluster, reference):
    assert stream_text(cluster.url, PROMPTS[1]) == reference[1]


def test_client_disconnect_frees_pages_on_every_worker(cluster):
    body = {"model": MODEL, "prompt": "Tell me a very long story about dragons.", "max_tokens": 400,
            "ignore_eos": True, "stream": True}
    with httpx.stream("POST", cluster.url + "/v1/completions", json=body, timeout=120) as resp:
        for i, _ in enumerate(resp.iter_lines()):
            if i > 6:
                break  # hang up mid-stream
    check_pages_freed(cluster)


def test_openai_client_works_unmodified(cluster):
    from openai import OpenAI

    client = OpenAI(base_url=cluster.url + "/v1", api_key="unused")
    chat_resp = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Say hi"}], max_tokens=8, temperature=0)
    assert chat_resp.choices[0].message.content
    comp = client.completions.create(model=MODEL, prompt="The sky is", max_tokens=6, n=2, temperature=1.0, seed=3)
    assert sorted(c.index for c in comp.choices) == [0, 1]
    stream = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Count to three"}], max_tokens=8, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices)


def test_bad_requests_get_openai_errors(cluster):
    status, body = post_json(cluster.url + "/v1/completions", {"model": MODEL, "prompt": "x " * 9000})
    assert status == 400 and "tokens" in body["error"]["message"]
    status, body = post_json(cluster.url + "/v1/completions", {"model": "nope", "prompt": "hi"})
    assert status == 404
    status, body = post_json(cluster.url + "/v1/completions", {"model": MODEL, "prompt": "hi", "temperature": -1})
    assert status == 400 and body["error"]["message"]


def test_sixteen_concurrent_requests_complete(cluster):
    async def run():
        async with httpx.AsyncClient(timeout=300) as client:
            bodies = [{"model": MODEL, "prompt": f"Request {i}: the number after {i} is", "max_tokens": 8,
                       "ignore_eos": True} for i in range(16)]
            return await asyncio.gather(*(client.post(cluster.url + "/v1/completions", json=b) for b in bodies))
    responses = asyncio.run(run())
    assert [r.status_code for r in responses] == [200] * 16
    assert all(r.json()["usage"]["completion_tokens"] == 8 for r in responses)
    check_pages_freed(cluster)


def test_two_prefill_two_decode_spread_and_survive_a_worker_stopping(short_model_dir, tmp_path):
    cluster = LocalCluster.for_tests(short_model_dir, tmp_path, prefill=2, decode=2, transfer_backend=BACKENDS[-1]).start()
    try:
        async def burst():
            async with httpx.AsyncClient(timeout=300) as client:
                bodies = [{"model": MODEL, "max_tokens": 4, "prompt": f"{i} {chr(65 + i)} is for"}
                          for i in range(16)]
                return await asyncio.gather(*(client.post(cluster.url + "/v1/completions", json=b)
                                              for b in bodies))
        assert [r.status_code for r in asyncio.run(burst())] == [200] * 16
        counts = cluster.metric("tessera_proxy_worker_requests_total")  # counted as each request was sent
        assert {k for k, v in counts.items() if v > 0} >= {
            '{stage="prefill",worker_id="prefill-0"}', '{stage="prefill",worker_id="prefill-1"}',
            '{stage="decode",worker_id="decode-0"}', '{stage="decode",worker_id="decode-1"}',
        }, counts
        assert cluster.stop_worker("prefill-0") == 0
        assert cluster.stop_worker("decode-1") == 0
        for i in range(6):
            status, body = chat(cluster.url, f"After the stop {i}: say a color.", max_tokens=4)
            assert status == 200, body
        check_pages_freed(cluster)
    finally:
        cluster.stop()


@pytest.mark.parametrize("overlap", ["auto", "always"])
def test_aggregated_worker_serves_alone_and_matches(embedded_model_dir, tmp_path, reference, overlap):
    """``always``: the worker's steps overlapped as on a GPU (engine.steps.overlap), its tokens reported a step
    later."""
    cluster = LocalCluster.for_tests(embedded_model_dir, tmp_path, prefill=0, decode=0, both=1,
                                     worker_overrides=[f"engine.steps.overlap={overlap}"]).start()
    try:
        for i in (0, 2, 4):
            status, body = chat(cluster.url, PROMPTS[i])
            assert status == 200 and body["choices"][0]["message"]["content"] == reference[i]
        streamed = stream_text(cluster.url, PROMPTS[1])
        assert streamed == reference[1]
        assert sum(cluster.metric("tessera_proxy_kv_transfer_bytes_total").values()) == 0
    finally:
        assert all(code == 0 for code in cluster.stop().values())
