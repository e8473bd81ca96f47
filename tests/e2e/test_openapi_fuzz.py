"""Schema-driven fuzzing of the proxy: Schemathesis generates requests from /openapi.json.

The proxy is the real application under the real server (uvicorn, in this
process), with scripted workers over the real ZeroMQ wire codec
(``tests/scripted_worker.py``). For at least 500 generated cases per
operation (completions, chat completions, tokenize, detokenize) it must
answer no 500, 502 or 504, a 503 only with Retry-After, and keep serving.
"""
from __future__ import annotations

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings

from tests.e2e.proxy_harness import MODEL, RunningProxy, proxy_config, script_for, tokenizer, wait_until  # noqa: F401
from tests.scripted_worker import FakeWorker

CASES_PER_OPERATION = 500


@pytest.fixture(scope="module")
def fuzz_proxy(tokenizer, embedded_model_dir):
    """One proxy with a prefill and a decode worker, shared by every generated case."""
    proxy = RunningProxy(proxy_config(embedded_model_dir), tokenizer)
    workers = [FakeWorker(proxy.endpoint, worker_id, role, script_for(tokenizer)).start_and_wait()
               for worker_id, role in (("p0", "prefill"), ("d0", "decode"))]
    wait_until(lambda: proxy.http.get("/readyz").status_code == 200, what="/readyz")
    yield proxy
    for worker in workers:
        worker.stop(goodbye=False)
    proxy.stop()


OPERATIONS = ["/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize"]


def check(case, response) -> None:
    assert response.status_code not in (500, 502, 504), (response.status_code, response.text[:500])
    if response.status_code == 503:
        assert "retry-after" in response.headers, response.text[:500]
    if response.status_code >= 400:
        error = response.json()["error"]
        assert error["message"] and error["type"], error


@pytest.mark.parametrize("path", OPERATIONS)
def test_no_server_error_for_any_generated_request(fuzz_proxy, path):
    schema = schemathesis.openapi.from_url(f"{fuzz_proxy.url}/openapi.json")
    operation = schema[path]["POST"]
    statuses: dict[int, int] = {}

    @given(case=operation.as_strategy())
    @settings(max_examples=CASES_PER_OPERATION, deadline=None, database=None, derandomize=True,
              suppress_health_check=list(HealthCheck))
    def run(case):
        if isinstance(case.body, dict) and "model" in case.body:
            case.body["model"] = MODEL  # past the 404, into validation, tokenization and the cluster
        response = case.call(base_url=fuzz_proxy.url, timeout=30)
        check(case, response)
        statuses[response.status_code] = statuses.get(response.status_code, 0) + 1

    run()
    print(path, dict(sorted(statuses.items())))
    assert sum(statuses.values()) >= CASES_PER_OPERATION
    assert statuses.get(200, 0) > 0, "some generated requests were served"


def test_the_proxy_still_serves_after_the_fuzzing(fuzz_proxy):
    response = fuzz_proxy.http.post("/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 3})
    assert response.status_code == 200, response.text
    assert fuzz_proxy.thread.is_alive()


def test_the_document_describes_every_generation_field(fuzz_proxy):
    document = fuzz_proxy.http.get("/openapi.json").json()
    schemas = document["components"]["schemas"]
    chat, completion = schemas["ChatCompletionRequest"]["properties"], schemas["CompletionRequest"]["properties"]
    for field in ("model", "messages", "temperature", "top_p", "top_k", "min_p", "seed", "max_tokens", "stop",
                  "n", "logprobs", "top_logprobs", "speculative", "num_speculative_tokens", "stop_token_ids"):
        assert field in chat, field
    assert "prompt" in completion and "echo" in completion
    top_p = next(s for s in completion["top_p"]["anyOf"] if s.get("type") == "number")
    assert top_p["exclusiveMinimum"] == 0 and top_p["maximum"] == 1
    assert chat["seed"]["anyOf"][0]["maximum"] == 2 ** 63 - 1
    paths = document["paths"]
    for path in ("/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize"):
        assert paths[path]["post"]["requestBody"]["content"]["application/json"]["schema"]["$ref"]
