"""Reloading the API keys and tenant settings of a real ``tessera proxy`` process, without dropping requests.

Scripted workers (``tests.scripted_worker``) on real ZeroMQ sockets; the
decode worker sends a token every ``TOKEN_INTERVAL_S``, so that a stream is
still running while the config changes under it. The file is rewritten as an
operator would (a new file renamed over the old one), then SIGHUP, or only the
file watch, applies it.
"""
from __future__ import annotations

import json
import os
import signal
import threading

import yaml

from common.runtime.prometheus_text import total
from proxy.tenants import hash_key
from tests.e2e.proxy_harness import (  # noqa: F401 -- fixtures
    MODEL, ProxyProcess, script_for, sse_payloads, tokenizer, wait_until,
)
from tests.scripted_worker import FakeWorker

TOKEN_INTERVAL_S = 0.15
K1, K2 = "sk-first-key", "sk-second-key"


def write_config(path, **settings) -> None:
    """Replace the file whole, as `mv` of a finished file (or a ConfigMap update) does."""
    fresh = path.with_suffix(".new")
    fresh.write_text(yaml.safe_dump({"auth_enabled": True, **settings}))
    os.replace(fresh, path)


def tenant(name: str, key: str) -> dict:
    return {"name": name, "api_key_sha256": [hash_key(key)]}


def start(tmp_path, tokenizer, embedded_model_dir, watch_s: float):
    config = tmp_path / "proxy.yaml"
    write_config(config, tenants=[tenant("alpha", K1)], config_watch_interval_s=watch_s)
    proxy = ProxyProcess(embedded_model_dir, tmp_path / "proxy.log", config=config)
    script = script_for(tokenizer)
    workers = [FakeWorker(proxy.endpoint, "p0", "prefill", script).start_and_wait(),
               FakeWorker(proxy.endpoint, "d0", "decode", script, token_interval_s=TOKEN_INTERVAL_S).start_and_wait()]
    wait_until(lambda: proxy.http.get("/readyz").status_code == 200, what="/readyz")
    return proxy, workers, config, script


def status(proxy, key: str) -> int:
    return proxy.http.post("/v1/completions", headers={"Authorization": f"Bearer {key}"},
                           json={"model": MODEL, "prompt": "Hi", "max_tokens": 2}).status_code


def reloads(proxy, result: str) -> float:
    return total(proxy.http.get("/metrics").text, "tessera_proxy_config_reloads_total", result=result)


def stop(proxy, workers) -> None:
    for worker in workers:
        worker.stop(goodbye=False)
    assert proxy.stop() == 0, proxy.log()


def test_sighup_swaps_the_keys_while_a_stream_runs_on(tmp_path, tokenizer, embedded_model_dir):
    proxy, workers, config, script = start(tmp_path, tokenizer, embedded_model_dir, watch_s=0)
    raw: list[str] = []

    def stream() -> None:
        with proxy.http.stream("POST", "/v1/completions", headers={"Authorization": f"Bearer {K1}"},
                               json={"model": MODEL, "prompt": "Tell me about foxes.", "stream": True,
                                     "max_tokens": len(script)}) as response:
            assert response.status_code == 200
            raw.extend(response.iter_text())

    client = threading.Thread(target=stream)
    try:
        client.start()
        wait_until(lambda: workers[1].decoding() > 0, what="the stream to decode")
        write_config(config, tenants=[tenant("beta", K2)])  # alpha, whose stream runs, is gone
        assert reloads(proxy, "ok") == 0  # no file watch: nothing happens before the signal
        proxy.proc.send_signal(signal.SIGHUP)
        wait_until(lambda: reloads(proxy, "ok") == 1, what="the reload")
        assert workers[1].decoding() > 0, "the stream was still running when the keys changed"
        assert status(proxy, K2) == 200
        assert status(proxy, K1) == 401
        client.join(30)
    finally:
        stop(proxy, workers)
    chunks = [json.loads(p) for p in sse_payloads("".join(raw))]
    assert "".join(c["choices"][0]["text"] for c in chunks) == "".join(text for _, text in script)
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"
    assert "config reloaded (SIGHUP): tenants added: beta; tenants removed: alpha" in proxy.log_path.read_text()


def test_a_changed_file_applies_by_itself_and_a_broken_one_changes_nothing(tmp_path, tokenizer, embedded_model_dir):
    proxy, workers, config, _ = start(tmp_path, tokenizer, embedded_model_dir, watch_s=0.2)
    try:
        assert status(proxy, K1) == 200
        write_config(config, tenants=[tenant("alpha", K2)], config_watch_interval_s=0.2,
                     queue_timeout_s=5)
        wait_until(lambda: status(proxy, K2) == 200, what="the new key to work")
        assert status(proxy, K1) == 401
        write_config(config, tenants=[{**tenant("alpha", K1), "weight": -1}])
        wait_until(lambda: reloads(proxy, "error") == 1, what="the broken file to be read")
        assert status(proxy, K2) == 200 and status(proxy, K1) == 401  # the last good settings stay
        assert reloads(proxy, "ok") == 1
    finally:
        stop(proxy, workers)
    log = proxy.log_path.read_text()
    assert "the file changes queue_timeout_s, which needs a restart" in log
    assert "config reload (the config file changed) failed" in log and "tenants['alpha'].weight" in log
