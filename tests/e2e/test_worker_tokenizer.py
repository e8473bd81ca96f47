"""A worker started on a model directory the proxy was never given serves at once, under the directory's name.

The proxy runs on the embedded model's directory, with a cache root of the test's own whose registry holds neither
model; its one worker (role both) runs on a tiny random model with a chat template of its own. The first request for the
tiny model gets 503 while the proxy fetches its tokenizer from the worker (proxy/cluster/tokenizer_fetch.py); then it
serves the greedy text the engine computes in-process on that directory, which differs from what the proxy's own
template would have made of the prompt, and the fetched files are kept under the cache root.
"""
from __future__ import annotations

import httpx
import pytest

from common.cli.local_cluster import LocalCluster
from common.config.base import EngineConfig
from common.config.roles import ProxyConfig
from common.engine.llm_engine import LLMEngine
from common.protocol.sampling_params import SamplingParams
from common.text.tokenizer import Tokenizer
from common.text.tokenizer_files import read_tokenizer_files, tokenizer_sha256
from tests.conditions import settle
from tests.tiny_models import build_tiny_model

NAME = "rand-tiny"
PROMPT = "Tell me about the sea."
MAX_TOKENS = 10
TEMPLATE = "{% for m in messages %}## {{ m['role'] }}: {{ m['content'] }}\n{% endfor %}## assistant:"
FETCH_TIMEOUT_S = ProxyConfig().tokenizer_fetch_timeout_s  # how long the proxy waits for the worker's answer


@pytest.fixture(scope="module")
def model(tmp_path_factory, embedded_model_dir):
    """The tiny model's directory and its greedy answer to ``PROMPT`` through its own chat template."""
    path = build_tiny_model("llama", tmp_path_factory.mktemp("unregistered") / NAME, seed=3,
                            tokenizer_from=embedded_model_dir)
    (path / "chat_template.jinja").write_text(TEMPLATE)
    engine = LLMEngine(EngineConfig(model=str(path), num_kv_blocks=64))
    chat = [{"role": "user", "content": PROMPT}]
    prompts = [engine.tokenizer.apply_chat_template(chat), Tokenizer(embedded_model_dir).apply_chat_template(chat)]
    own, proxys = engine.generate(prompts, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True))
    assert own.outputs[0].text != proxys.outputs[0].text  # the answer shows whose template rendered the prompt
    return path, own.outputs[0].text


def ask(client: httpx.Client) -> httpx.Response:
    body = {"model": NAME, "messages": [{"role": "user", "content": PROMPT}], "max_tokens": MAX_TOKENS,
            "temperature": 0, "ignore_eos": True}
    return client.post("/v1/chat/completions", json=body)


def test_an_unregistered_model_directory_serves_under_its_own_name(model, embedded_model_dir, tmp_path,
                                                                    monkeypatch):
    path, expected = model
    cache = tmp_path / "cache"
    monkeypatch.setenv("TESSERA_CACHE_DIR", str(cache))  # the processes' cache root: no model registered in it
    (tmp_path / "logs").mkdir()
    cluster = LocalCluster.for_tests(embedded_model_dir, tmp_path / "logs", prefill=0, decode=0, both=1,
                                     worker_overrides=[f"engine.model={path}"]).start()
    try:
        with httpx.Client(base_url=cluster.url, timeout=60) as client:
            listed = {m["id"]: m for m in client.get("/v1/models").json()["data"]}
            assert listed[NAME]["versions"][0]["workers"] == 1  # registered: start() waited for it
            first = ask(client)  # the first request starts the fetch: nothing asked for the tokenizer before it
            assert first.status_code == 503, first.text
            assert "being fetched from worker 'both-0'" in first.json()["error"]["message"]
            assert int(first.headers["Retry-After"]) >= 1
            served = settle(lambda: ask(client), lambda r: r.status_code != 503, FETCH_TIMEOUT_S,
                            "the worker's tokenizer at the proxy (tokenizer_fetch_timeout_s)")
            assert served.status_code == 200, served.text
            assert served.json()["choices"][0]["message"]["content"] == expected
            assert served.headers["X-Tessera-Model"].partition("@")[0] == NAME
        # Counted as the request ended, before its response was sent.
        counted = cluster.metric("tessera_proxy_tenant_requests_total")
        assert any(f'model="{NAME}"' in labels and 'status="ok"' in labels for labels in counted), counted
    finally:
        codes = cluster.stop()
    assert all(code == 0 for code in codes.values()), codes
    files = read_tokenizer_files(path)
    assert read_tokenizer_files(cache / "tokenizers" / tokenizer_sha256(files)) == files
