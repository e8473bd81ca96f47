"""Reloading the API keys and tenant settings of a real ``tessera proxy`` process, without dropping requests.

Scripted workers (``tests.scripted_worker``) on real ZeroMQ sockets; in the
first test the decode worker sends only the tokens the test hands it, so that a
stream is still running while the config changes under it. The file is
rewritten as an operator would (a new file renamed over the old one), then
SIGHUP, or only the file watch, applies it.
"""
from __future__ import annotations

import json
import os
import signal
import threading

import yaml

from common.config.roles import merge
from common.protocol.wire import DecodeRequest, TokenDelta, TokenDeltas
from common.runtime.prometheus_text import total
from proxy.tenancy.api_keys import hash_key
from tests.conditions import settle
from tests.e2e.proxy_harness import (  # noqa: F401 -- fixtures
    MODEL, PATIENCE_S, ProxyProcess, ready, script_for, sse_payloads, tokenizer,
)
from tests.scripted_worker import FakeWorker

K1, K2 = "sk-first-key", "sk-second-key"


def write_config(path, **settings) -> None:
    """Replace the file whole, as `mv` of a finished file (or a ConfigMap update) does."""
    fresh = path.with_suffix(".new")
    fresh.write_text(yaml.safe_dump(merge({"tenancy": {"auth_enabled": True}}, settings)))
    os.replace(fresh, path)


def tenant(name: str, key: str) -> dict:
    return {"name": name, "api_key_sha256": [hash_key(key)]}


def start(tmp_path, tokenizer, embedded_model_dir, watch_s: float, stall: bool = False):
    """The proxy and its workers; with ``stall`` the decode worker answers nothing by itself."""
    config = tmp_path / "proxy.yaml"
    write_config(config, tenancy={"tenants": [tenant("alpha", K1)], "config_watch_interval_s": watch_s})
    proxy = ProxyProcess(embedded_model_dir, tmp_path / "proxy.log", config=config)
    script = script_for(tokenizer)
    workers = [FakeWorker(proxy.endpoint, "p0", "prefill", script).start_and_wait(),
               FakeWorker(proxy.endpoint, "d0", "decode", script, stall=stall).start_and_wait()]
    ready(proxy)
    return proxy, workers, config, script


def status(proxy, key: str) -> int:
    """A request's status: one token, which the prefill worker answers (it never reaches the decode worker)."""
    return proxy.http.post("/v1/completions", headers={"Authorization": f"Bearer {key}"},
                           json={"model": MODEL, "prompt": "Hi", "max_tokens": 1}).status_code


def reloads(proxy, result: str) -> float:
    return total(proxy.http.get("/metrics").text, "tessera_proxy_config_reloads_total", result=result)


def stop(proxy, workers) -> None:
    for worker in workers:
        worker.stop(goodbye=False)
    assert proxy.stop() == 0, proxy.log()


def test_sighup_swaps_the_keys_while_a_stream_runs_on(tmp_path, tokenizer, embedded_model_dir):
    proxy, workers, config, script = start(tmp_path, tokenizer, embedded_model_dir, watch_s=0, stall=True)
    decode = workers[1]
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
        handed = decode.wait_for(lambda m: isinstance(m, DecodeRequest))  # its first token came with the prefill
        write_config(config, tenancy={"tenants": [tenant("beta", K2)]})  # alpha, whose stream runs, is gone
        assert reloads(proxy, "ok") == 0  # no file watch: nothing happens before the signal
        proxy.proc.send_signal(signal.SIGHUP)
        settle(lambda: reloads(proxy, "ok"), lambda done: done == 1, PATIENCE_S, "the proxy reloads on SIGHUP")
        assert status(proxy, K2) == 200
        assert status(proxy, K1) == 401
        for i, (token, text) in enumerate(script[1:], start=2):  # the rest of the stream, after the reload
            decode.send(TokenDeltas([TokenDelta(handed.request_id, [token], text,
                                                finish_reason="stop" if i == len(script) else None)]))
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
        write_config(config,
                     tenancy={"tenants": [tenant("alpha", K2)], "config_watch_interval_s": 0.2, "queue_timeout_s": 5})
        settle(lambda: status(proxy, K2), lambda answer: answer == 200, PATIENCE_S,
               "the new key works once the file watch read the file (config_watch_interval_s)")
        assert status(proxy, K1) == 401
        write_config(config, tenancy={"tenants": [{**tenant("alpha", K1), "weight": -1}]})
        settle(lambda: reloads(proxy, "error"), lambda failed: failed == 1, PATIENCE_S,
               "the file watch reads the broken file (config_watch_interval_s)")
        assert status(proxy, K2) == 200 and status(proxy, K1) == 401  # the last good settings stay
        assert reloads(proxy, "ok") == 1
    finally:
        stop(proxy, workers)
    log = proxy.log_path.read_text()
    assert "the file changes tenancy.queue_timeout_s, which needs a restart" in log
    assert "config reload (the config file changed) failed" in log and "tenants['alpha'].weight" in log
