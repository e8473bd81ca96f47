"""A NaN in one request's logits, injected on a real decode worker, fails that request alone with the OpenAI error
code ``nonfinite_logits`` (an error event when streamed); the other requests of the batch and the worker go on."""
from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from common.cli.local_cluster import LocalCluster
from common.text.tokenizer import Tokenizer

MARK = " zebra"
PROMPTS = ["The capital of France is", "Once upon a time", "A list of colours: red,", "def add(a, b):"]
BODY = {"model": "SmolLM2-135M-Instruct", "max_tokens": 24, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def mark_token(short_model_dir) -> int:
    tokenizer = Tokenizer(short_model_dir)
    (token,) = tokenizer.encode(MARK, add_special_tokens=False)
    assert all(token not in tokenizer.encode(p) for p in PROMPTS)
    return token


@pytest.fixture(params=["decode", "prefill"])
def cluster(request, short_model_dir, mark_token, tmp_path):
    c = LocalCluster.for_tests(short_model_dir, tmp_path, prefill=1, decode=1,
                               role_overrides=[f"{request.param}:testing.fault_nonfinite_logits_token={mark_token}"])
    c.start()
    yield c, request.param
    c.stop()


def complete(client: httpx.Client, prompt: str, stream: bool = False) -> httpx.Response:
    return client.post("/v1/completions", json={**BODY, "prompt": prompt, "stream": stream})


def test_the_poisoned_request_fails_alone_and_the_worker_serves_on(cluster):
    cluster, poisoned_role = cluster
    with httpx.Client(base_url=cluster.url, timeout=120) as client:
        reference = [complete(client, p).json()["choices"][0]["text"] for p in PROMPTS]
        with ThreadPoolExecutor(len(PROMPTS) + 1) as pool:
            others = [pool.submit(complete, client, p) for p in PROMPTS]
            poisoned = pool.submit(complete, client, "Look at the" + MARK)
            assert [f.result().json()["choices"][0]["text"] for f in others] == reference
            response = poisoned.result()
        assert response.status_code == 500, response.text
        assert response.json()["error"]["code"] == "nonfinite_logits"
        with client.stream("POST", "/v1/completions", json={**BODY, "prompt": "A" + MARK, "stream": True}) as stream:
            if poisoned_role == "prefill":  # before the first token: an HTTP error, as for a request refused
                assert stream.status_code == 500 and json.loads(stream.read())["error"]["code"] == "nonfinite_logits"
                events = []
            else:  # after the prefill worker's first token: an error event ends the stream
                events = [line[6:] for line in stream.iter_lines() if line.startswith("data: ")]
        if poisoned_role == "decode":
            errors = [json.loads(e)["error"] for e in events if e != "[DONE]" and "error" in json.loads(e)]
            assert [e["code"] for e in errors] == ["nonfinite_logits"] and events[-1] == "[DONE]", events
        assert [complete(client, p).json()["choices"][0]["text"] for p in PROMPTS] == reference
    worker = f"http://127.0.0.1:{cluster.metrics_ports[f'{poisoned_role}-0']}"
    assert sum(cluster.metric("tessera_worker_nonfinite_logits_total", worker).values()) == 2
