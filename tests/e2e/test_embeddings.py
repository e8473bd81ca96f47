"""/v1/embeddings through the whole cluster: proxy, prefill worker and decode worker processes.

The vectors equal transformers' (mean-pooled, normalized last hidden state) on the same weights (the short model's:
tests/tiny_models.py), through the official ``openai`` client; bad inputs get OpenAI-style errors naming the field; a
prefill worker that dies with embeddings in flight does not fail them where another prefill-capable worker is left.
"""
from __future__ import annotations

import asyncio
import base64

import httpx
import numpy as np
import pytest
import torch
from transformers import AutoModel, AutoTokenizer

from common.cli.local_cluster import LocalCluster

MODEL = "SmolLM2-135M-Instruct"
TEXTS = ["The quick brown fox jumps over the lazy dog.", "Paged attention keeps KV in fixed-size blocks.",
         "Bonjour", "A much longer sentence about serving large language models with prefill and decode on "
         "different workers, so that the batch pads the shorter inputs to this one."]


@pytest.fixture(scope="module")
def reference(short_model_dir):
    tokenizer = AutoTokenizer.from_pretrained(short_model_dir)
    model = AutoModel.from_pretrained(short_model_dir, dtype=torch.float32).eval()

    def embed(texts: list[str]) -> np.ndarray:
        with torch.no_grad():
            pooled = [model(torch.tensor([tokenizer(t)["input_ids"]])).last_hidden_state[0].mean(0) for t in texts]
        return torch.nn.functional.normalize(torch.stack(pooled), dim=-1).numpy()
    return embed


@pytest.fixture(scope="module")
def cluster(short_model_dir, tmp_path_factory):
    c = LocalCluster.for_tests(short_model_dir, tmp_path_factory.mktemp("logs-embeddings"), prefill=1, decode=1,
                               both=1).start()
    yield c
    codes = c.stop()
    assert all(code == 0 for code in codes.values()), codes


def post(cluster, body: dict) -> httpx.Response:
    return httpx.post(cluster.url + "/v1/embeddings", json={"model": MODEL, **body}, timeout=120)


def test_the_openai_client_gets_transformers_embeddings(cluster, reference):
    from openai import OpenAI

    client = OpenAI(base_url=cluster.url + "/v1", api_key="unused")
    result = client.embeddings.create(model=MODEL, input=TEXTS)  # the SDK asks for base64 and decodes it
    got = np.array([d.embedding for d in result.data], dtype=np.float32)
    assert [d.index for d in result.data] == list(range(len(TEXTS)))
    assert np.abs(got - reference(TEXTS)).max() <= 1e-4
    assert result.usage.prompt_tokens == result.usage.total_tokens > len(TEXTS)
    single = client.embeddings.create(model=MODEL, input=TEXTS[0], encoding_format="float")
    assert np.abs(np.array(single.data[0].embedding) - got[0]).max() <= 1e-5


def test_float_base64_token_ids_and_dimensions(cluster, reference):
    floats = post(cluster, {"input": TEXTS[:2]}).json()
    vectors = np.array([d["embedding"] for d in floats["data"]], dtype=np.float32)
    assert floats["object"] == "list" and floats["model"] == MODEL
    encoded = post(cluster, {"input": TEXTS[:2], "encoding_format": "base64"}).json()
    decoded = np.stack([np.frombuffer(base64.b64decode(d["embedding"]), dtype="<f4") for d in encoded["data"]])
    assert np.array_equal(decoded, vectors)
    ids = httpx.post(cluster.url + "/tokenize", json={"prompt": TEXTS[0]}).json()["tokens"]
    by_ids = post(cluster, {"input": [ids, ids[:3]]}).json()
    assert np.abs(np.array(by_ids["data"][0]["embedding"]) - vectors[0]).max() <= 1e-5
    short = post(cluster, {"input": TEXTS[0], "dimensions": 64}).json()["data"][0]["embedding"]
    assert len(short) == 64 and abs(np.linalg.norm(short) - 1) < 1e-5
    assert np.abs(np.array(short) - vectors[0][:64] / np.linalg.norm(vectors[0][:64])).max() <= 1e-5


@pytest.mark.parametrize("body, status, param", [
    ({"input": ""}, 400, "input"),
    ({"input": ["fine", ""]}, 400, "input[1]"),
    ({"input": []}, 400, "input"),
    ({"input": [[1, 2], [10 ** 9]]}, 400, "input[1]"),
    ({"input": "x", "encoding_format": "hex"}, 400, "encoding_format"),
    ({"input": "x", "dimensions": 100000}, 400, "dimensions"),
    ({"input": "x", "dimensions": 4096}, 400, "dimensions"),
    ({"input": "word " * 10000}, 400, "input"),
    ({"input": "x", "model": "no-such-model"}, 404, "model"),
])
def test_bad_inputs_get_openai_errors(cluster, body, status, param):
    response = post(cluster, body)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["param"] == param and error["message"]


def test_concurrent_requests_are_all_served_and_each_gets_its_own_vectors(cluster, reference):
    texts = [f"request {i}: " + TEXTS[i % len(TEXTS)] for i in range(24)]

    async def run():
        async with httpx.AsyncClient(timeout=120) as client:
            return await asyncio.gather(*(client.post(cluster.url + "/v1/embeddings",
                                                      json={"model": MODEL, "input": t}) for t in texts))
    responses = asyncio.run(run())
    assert all(r.status_code == 200 for r in responses)
    got = np.array([r.json()["data"][0]["embedding"] for r in responses], dtype=np.float32)
    assert np.abs(got - reference(texts)).max() <= 1e-4
    served = cluster.metric("tessera_proxy_requests_total")
    assert served.get('{endpoint="embeddings",status="200"}', 0) >= len(texts)


def test_embeddings_in_flight_on_a_killed_prefill_worker_are_computed_by_another(cluster, reference):
    """Runs last: it kills the module's prefill worker; the ``both`` worker takes over its embeddings."""
    texts = [f"lost {i}: " + TEXTS[3] * 4 for i in range(16)]

    async def run():
        async with httpx.AsyncClient(timeout=120) as client:
            sent = [asyncio.create_task(client.post(cluster.url + "/v1/embeddings",
                                                    json={"model": MODEL, "input": t})) for t in texts]
            await asyncio.sleep(0.3)
            cluster.procs["prefill-0"].kill()
            return await asyncio.gather(*sent)
    responses = asyncio.run(run())
    assert [r.status_code for r in responses] == [200] * len(texts)
    got = np.array([r.json()["data"][0]["embedding"] for r in responses], dtype=np.float32)
    assert np.abs(got - reference(texts)).max() <= 1e-4
    cluster.procs.pop("prefill-0").wait(timeout=30)
