"""The metering file of a real ``tessera proxy`` process, with scripted workers over real ZeroMQ sockets.

Two tenants send a few requests; the file's records must add up to what was
served, tenant by tenant, and agree with the counters on /metrics. At SIGTERM
the proxy drains and writes a last record with the stream that finished during
the drain.
"""
from __future__ import annotations

import json
import signal
import threading

import yaml

from common.runtime.prometheus_text import total
from proxy.tenancy.api_keys import hash_key
from tests.conditions import settle
from tests.e2e.proxy_harness import MODEL, PATIENCE_S, ProxyProcess, ready, script_for, tokenizer  # noqa: F401
from tests.scripted_worker import FakeWorker

CACHED = 4  # prompt tokens the scripted prefill worker reports as found in its prefix cache
TENANTS = [{"name": "alpha", "api_key_sha256": [hash_key("sk-alpha")]},
           {"name": "beta", "api_key_sha256": [hash_key("sk-beta")]}]


def start(tmp_path, tokenizer, embedded_model_dir, interval_s: float, token_interval_s: float = 0.0):
    config = tmp_path / "proxy.yaml"
    config.write_text(yaml.safe_dump({"tenancy": {"auth_enabled": True, "tenants": TENANTS}}))
    usage = tmp_path / "usage.jsonl"
    proxy = ProxyProcess(embedded_model_dir, tmp_path / "proxy.log", config=config,
                         settings=[f"tenancy.metering_path={usage}", f"tenancy.metering_interval_s={interval_s}"])
    script = script_for(tokenizer)
    workers = [FakeWorker(proxy.endpoint, "p0", "prefill", script, cached_tokens=CACHED).start_and_wait(),
               FakeWorker(proxy.endpoint, "d0", "decode", script, token_interval_s=token_interval_s).start_and_wait()]
    ready(proxy)
    return proxy, workers, usage


def complete(proxy, key: str, **body) -> dict:
    response = proxy.http.post("/v1/completions", headers={"Authorization": f"Bearer {key}"},
                               json={"model": MODEL, "prompt": "Tell me about foxes.", "max_tokens": 5, **body})
    assert response.status_code == 200, response.text
    return response.json()["usage"]


def read_records(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def summed(records: list[dict], tenant: str) -> dict:
    fields = ("requests", "prompt_tokens", "cached_prompt_tokens", "generated_tokens")
    return {f: sum(r[f] for r in records if r["tenant"] == tenant) for f in fields}


def test_records_add_up_to_what_each_tenant_was_served(tmp_path, tokenizer, embedded_model_dir):
    proxy, workers, usage_file = start(tmp_path, tokenizer, embedded_model_dir, interval_s=0.3)
    try:
        alpha = [complete(proxy, "sk-alpha"), complete(proxy, "sk-alpha", max_tokens=3)]
        beta = complete(proxy, "sk-beta", n=2)  # two choices, each a prefill of the prompt
        prompt = alpha[0]["prompt_tokens"]
        expected = {
            "alpha": {"requests": 2, "prompt_tokens": 2 * prompt, "cached_prompt_tokens": 2 * CACHED,
                      "generated_tokens": sum(u["completion_tokens"] for u in alpha)},
            "beta": {"requests": 2, "prompt_tokens": 2 * prompt, "cached_prompt_tokens": 2 * CACHED,
                     "generated_tokens": beta["completion_tokens"]},
        }
        settle(lambda: read_records(usage_file),
               lambda records: all(summed(records, t) == expected[t] for t in expected), PATIENCE_S,
               "the metering file accounts for every request (metering_interval_s)")
        metrics = proxy.http.get("/metrics").text  # a choice's usage is counted as it ends, before its answer
        for tenant, amounts in expected.items():
            assert total(metrics, "tessera_proxy_tenant_prompt_tokens_total", tenant=tenant) == amounts["prompt_tokens"]
            assert total(metrics, "tessera_proxy_tenant_cached_prompt_tokens_total",
                         tenant=tenant) == amounts["cached_prompt_tokens"]
            assert total(metrics, "tessera_proxy_tenant_generated_tokens_total",
                         tenant=tenant) == amounts["generated_tokens"]
    finally:
        for worker in workers:
            worker.stop(goodbye=False)
        assert proxy.stop() == 0, proxy.log()
    records = read_records(usage_file)
    for tenant, amounts in expected.items():
        mine = [r for r in records if r["tenant"] == tenant]
        assert mine[-1]["totals"] == amounts  # the running totals end at the sum of the intervals
        for record in mine:
            assert record["interval_start"] < record["interval_end"] == record["time"]
            assert not record["final"]  # nothing was left for the shutdown record


def test_a_stream_that_finishes_during_the_drain_is_in_the_last_record(tmp_path, tokenizer, embedded_model_dir):
    proxy, workers, usage_file = start(tmp_path, tokenizer, embedded_model_dir, interval_s=3600,
                                       token_interval_s=0.1)
    chunks: list[str] = []

    def stream() -> None:
        with proxy.http.stream("POST", "/v1/completions", headers={"Authorization": "Bearer sk-beta"},
                               json={"model": MODEL, "prompt": "Tell me about foxes.", "max_tokens": 8,
                                     "stream": True}) as response:
            chunks.extend(response.iter_text())

    client = threading.Thread(target=stream)
    try:
        client.start()
        settle(workers[1].decoding, bool, PATIENCE_S, "the stream decodes on d0")
        proxy.proc.send_signal(signal.SIGTERM)
        client.join(20)
        assert proxy.proc.wait(30) == 0, proxy.log()
    finally:
        for worker in workers:
            worker.stop(goodbye=False)
        proxy.stop()
    assert "".join(chunks).endswith("data: [DONE]\n\n")
    [record] = read_records(usage_file)
    assert (record["tenant"], record["requests"], record["generated_tokens"], record["final"]) == ("beta", 1, 8, True)
    assert record["totals"]["generated_tokens"] == 8
