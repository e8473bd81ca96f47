"""Schema-driven fuzzing of the proxy: Schemathesis generates requests from /openapi.json.

The proxy is the real one in its own process (``tessera proxy``, as a user
starts it), with scripted workers over the real ZeroMQ wire codec
(``tests/scripted_worker.py``) in this one. For at least 500 generated cases
per operation (completions, chat completions, tokenize, detokenize) it must
answer no 500, 502 or 504, a 503 only with Retry-After, keep serving and
never exit; at the end SIGTERM stops it cleanly.
"""
from __future__ import annotations

import signal
import subprocess
import sys

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings

from common.cli.local_cluster import free_port
from tests.e2e.proxy_harness import MODEL, script_for, tokenizer, wait_until  # noqa: F401
from tests.scripted_worker import FakeWorker

CASES_PER_OPERATION = 500


class ProxyProcess:
    """``tessera proxy`` as its own process, the settings of the in-process harness passed as overrides."""

    def __init__(self, model_dir, log_path) -> None:
        http_port, worker_port = free_port(), free_port()
        self.url = f"http://127.0.0.1:{http_port}"
        self.endpoint = f"tcp://127.0.0.1:{worker_port}"
        settings = [f"model={model_dir}", f"port={http_port}", f"worker_bind={self.endpoint}",
                    "heartbeat_timeout_s=1.0", "first_token_timeout_s=20.0", "token_timeout_s=20.0",
                    "max_prompt_bytes=4096", "retry_after_s=3", "drain_timeout_s=5"]
        self.log_path = log_path
        self._log = open(log_path, "w")
        args = [arg for setting in settings for arg in ("--set", setting)]
        self.proc = subprocess.Popen([sys.executable, "-m", "common.cli.main", "proxy", *args],
                                     stdout=self._log, stderr=subprocess.STDOUT)
        self.http = httpx.Client(base_url=self.url, timeout=30)
        wait_until(self._answers, timeout=60, what=f"the proxy to answer /healthz (log: {log_path})")

    def _answers(self) -> bool:
        assert self.proc.poll() is None, f"the proxy exited with {self.proc.returncode}: {self.log()}"
        try:
            return self.http.get("/healthz").status_code == 200
        except httpx.TransportError:
            return False

    def log(self) -> str:
        self._log.flush()
        return open(self.log_path).read()[-4000:]

    def stop(self) -> int:
        self.http.close()
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(30)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
            self._log.close()


@pytest.fixture(scope="module")
def fuzz_proxy(tokenizer, embedded_model_dir, tmp_path_factory):
    """One proxy process with a prefill and a decode worker, shared by every generated case."""
    proxy = ProxyProcess(embedded_model_dir, tmp_path_factory.mktemp("fuzz") / "proxy.log")
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
        assert fuzz_proxy.proc.poll() is None, f"the proxy exited: {fuzz_proxy.log()}"
        check(case, response)
        statuses[response.status_code] = statuses.get(response.status_code, 0) + 1

    run()
    print(path, dict(sorted(statuses.items())))
    assert sum(statuses.values()) >= CASES_PER_OPERATION
    assert statuses.get(200, 0) > 0, "some generated requests were served"


def test_the_proxy_still_serves_after_the_fuzzing(fuzz_proxy):
    assert fuzz_proxy.proc.poll() is None, fuzz_proxy.log()
    response = fuzz_proxy.http.post("/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 3})
    assert response.status_code == 200, response.text


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
