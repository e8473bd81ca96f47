"""Schema-driven fuzzing of the proxy: Schemathesis generates requests from /openapi.json.

The proxy is the real one in its own process (``tessera proxy``, as a user
starts it), with scripted workers over the real ZeroMQ wire codec
(``tests/scripted_worker.py``) in this one. For at least 500 generated cases
per operation (completions, chat completions, tokenize, detokenize) it must
answer no 500, 502 or 504, a 503 only with Retry-After, keep serving and
never exit; at the end SIGTERM stops it cleanly.

Then the same against a real cluster (proxy, prefill and decode worker
processes on the short model): what passes the proxy's validation reaches
the engines, with ``max_tokens`` and ``n`` capped so that it runs in minutes (a body that names no ``max_tokens``
gets the proxy's ``max_tokens_default``, set to the same cap).
No process may exit, and no KV page may stay in use.
"""
from __future__ import annotations

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings

from common.cli.local_cluster import LocalCluster
from tests.e2e.proxy_harness import (HEARTBEAT_TIMEOUT_S, MODEL, ProxyProcess, script_for, tokenizer,  # noqa: F401
                                     wait_until)
from tests.scripted_worker import FakeWorker

CASES_PER_OPERATION = 500


@pytest.fixture(scope="module")
def fuzz_proxy(tokenizer, embedded_model_dir, tmp_path_factory):
    """One proxy process with a prefill and a decode worker, shared by every generated case.

    The scripted workers heartbeat from a thread of this process, which the case generation keeps busy: at the
    harness's 1 s a loaded machine can starve that thread past the timeout and the proxy drops the workers. The
    default timeout is what a deployment runs, and worker loss is not what this module tests."""
    proxy = ProxyProcess(embedded_model_dir, tmp_path_factory.mktemp("fuzz") / "proxy.log",
                         settings=[f"heartbeat_timeout_s={HEARTBEAT_TIMEOUT_S}"])
    workers = [FakeWorker(proxy.endpoint, worker_id, role, script_for(tokenizer)).start_and_wait()
               for worker_id, role in (("p0", "prefill"), ("d0", "decode"))]
    wait_until(lambda: proxy.http.get("/readyz").status_code == 200, what="/readyz")
    proxy.workers = workers
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
        assert fuzz_proxy.proc.poll() is None, f"the proxy exited: {fuzz_proxy.log()}"
        for worker in fuzz_proxy.workers:  # a case that ends a scripted worker is found at that case
            assert worker.alive, (worker.worker_id, repr(worker.error), case.body)
        check(case, response)
        statuses[response.status_code] = statuses.get(response.status_code, 0) + 1

    run()
    print(path, dict(sorted(statuses.items())))
    assert sum(statuses.values()) >= CASES_PER_OPERATION
    assert statuses.get(200, 0) > 0, "some generated requests were served"


def test_the_proxy_still_serves_after_the_fuzzing(fuzz_proxy):
    assert fuzz_proxy.proc.poll() is None, fuzz_proxy.log()
    for worker in fuzz_proxy.workers:
        assert worker.alive, (worker.worker_id, repr(worker.error))
    response = fuzz_proxy.http.post("/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 3})
    assert response.status_code == 200, (response.text, fuzz_proxy.log())


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


def test_sigterm_stops_the_fuzzed_proxy_cleanly(fuzz_proxy):
    assert fuzz_proxy.stop() == 0, fuzz_proxy.log()


# -- against real workers on the short model (tests/tiny_models.py) --------------------------------------------

REAL_CASES_PER_OPERATION = 150
CAPS = {"max_tokens": 4, "max_completion_tokens": 4, "n": 2, "best_of": 2}  # what the engines get to generate


@pytest.fixture(scope="module")
def real_cluster(short_model_dir, tmp_path_factory):
    cluster = LocalCluster.for_tests(short_model_dir, tmp_path_factory.mktemp("fuzz-real"),
                                     proxy_overrides=["http.max_prompt_bytes=4096", "requests.first_token_timeout_s=30",
                                                      f"requests.max_tokens_default={CAPS['max_tokens']}"]).start()
    yield cluster
    assert set(cluster.stop().values()) == {0}, "every process stops cleanly on SIGTERM"


def capped(body):
    """The body with the model named and max_tokens and n at most CAPS (a generated bound can be huge)."""
    if isinstance(body, dict):
        body["model"] = MODEL
        for name, cap in CAPS.items():
            value = body.get(name)  # 128.0 is an integer to the proxy too
            if isinstance(value, (int, float)) and not isinstance(value, bool) and value > cap:
                body[name] = cap
    return body


def prompts(body: dict) -> int:
    """How many prompts a body asks to complete (a completions ``prompt`` may be a list of them)."""
    prompt = body.get("prompt")
    return len(prompt) if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)) else 1


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_no_server_error_and_no_process_exit_with_real_workers(real_cluster, path):
    schema = schemathesis.openapi.from_url(f"{real_cluster.url}/openapi.json")
    operation = schema[path]["POST"]
    statuses: dict[int, int] = {}

    @given(case=operation.as_strategy())
    @settings(max_examples=REAL_CASES_PER_OPERATION, deadline=None, database=None, derandomize=True,
              suppress_health_check=list(HealthCheck), phases=[Phase.generate])  # shrinking real calls: too slow
    def run(case):
        case.body = capped(case.body)
        response = case.call(base_url=real_cluster.url, timeout=120)
        assert not real_cluster.dead(), f"processes exited: {real_cluster.dead()} (logs: {real_cluster.log_dir})"
        try:
            check(case, response)
            if response.status_code == 200 and not case.body.get("stream"):  # a JSON body with its usage:
                generated = response.json()["usage"]["completion_tokens"]  # within the caps, named or not
                assert generated <= CAPS["max_tokens"] * CAPS["n"] * prompts(case.body), generated
        except AssertionError:
            print("failing body:", case.body)
            raise
        statuses[response.status_code] = statuses.get(response.status_code, 0) + 1

    run()
    print(path, dict(sorted(statuses.items())))
    assert statuses.get(200, 0) > 0, "some generated requests reached the engines"
    wait_until(lambda: not any(real_cluster.metric("tessera_proxy_kv_pages_used").values()), timeout=15,
               what="every KV page to be free")


def test_the_out_of_range_top_k_of_the_issue_is_refused_naming_the_field(real_cluster):
    response = httpx.post(f"{real_cluster.url}/v1/completions", timeout=30, json={
        "model": MODEL, "prompt": "Hi", "max_tokens": 2, "top_k": 9223372036854775808})
    assert response.status_code == 400 and response.json()["error"]["param"] == "top_k", response.text
    assert not real_cluster.dead()
