"""Simulated workers (``tessera sim-worker``, bench/sim/) behind a real proxy: the wire protocol, prefix hits
from the real block manager, pages all given back, a drain on SIGTERM, and a role switch under load."""
from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading

import pytest

from bench.sim.profile import StepProfile
from bench.sim.worker import SimHost, SimSpec, token_texts
from common.protocol.wire import SwitchRole
from common.runtime.prometheus_text import total
from tests.conditions import settle
from tests.e2e.proxy_harness import (  # noqa: F401 -- fixture
    MODEL, PATIENCE_S, STARTUP_S, RunningProxy, proxy_config, ready, tokenizer,
)


class HostThread:
    """A SimHost serving from a thread of its own (its sockets live in that thread)."""

    def __init__(self, endpoint: str, specs: list[SimSpec], tokenizer) -> None:
        self.stop = threading.Event()
        self.host: SimHost | None = None
        self._args = endpoint, specs, tokenizer
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()
        settle(lambda: self.host is not None and all(w.registered for w in self.host.workers.values()), bool,
               PATIENCE_S, "the simulated workers register")

    def _serve(self) -> None:
        endpoint, specs, tokenizer = self._args
        host = SimHost(StepProfile.load(), token_texts(tokenizer))
        for spec in specs:
            host.add(spec, endpoint)
        self.host = host
        host.run(self.stop.is_set)
        host.drain(5.0)

    def close(self) -> None:
        self.stop.set()
        self.thread.join(15)


@pytest.fixture(params=[0.0, 1.0], ids=["no-step-time", "profiled-step-time"])
def simulated(request, embedded_model_dir, tokenizer):
    proxy = RunningProxy(proxy_config(embedded_model_dir, heartbeat_timeout_s=5.0), tokenizer)
    specs = [SimSpec(f"s-p{i}", "prefill", MODEL, num_blocks=2048, time_scale=request.param,
                     heartbeat_interval_s=0.2) for i in range(2)]
    specs += [SimSpec(f"s-d{i}", "decode", MODEL, num_blocks=2048, time_scale=request.param,
                      heartbeat_interval_s=0.2) for i in range(2)]
    hosts = HostThread(proxy.endpoint, specs, tokenizer)
    ready(proxy)
    yield proxy, hosts
    hosts.close()
    proxy.stop()


def chat(proxy: RunningProxy, content: str, max_tokens: int, **extra) -> tuple[str, dict]:
    body = {"model": MODEL, "messages": [{"role": "user", "content": content}], "max_tokens": max_tokens,
            "stream": True, "stream_options": {"include_usage": True}, **extra}
    text, usage = "", None
    with proxy.http.stream("POST", "/v1/chat/completions", json=body) as response:
        assert response.status_code == 200, response.read()
        for line in response.iter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            if chunk["choices"]:
                text += chunk["choices"][0]["delta"].get("content", "")
            if chunk.get("usage"):
                usage = chunk["usage"]
    return text, usage


def test_requests_through_simulated_workers_get_their_tokens_and_free_every_page(simulated, tokenizer):
    proxy, hosts = simulated
    long_prompt = "Tell me about the history of the harbour and its ships. " * 20
    text, usage = chat(proxy, long_prompt, 24)
    assert usage["completion_tokens"] == 24 and text
    # the prefill worker's KV events (the blocks it stored) reach the proxy's index before the next prompt is routed
    blocks = usage["prompt_tokens"] // 16
    settle(lambda: total(proxy.http.get("/metrics").text, "tessera_proxy_kv_index_blocks"), lambda held: held >= blocks,
           PATIENCE_S, "the proxy's prefix index holds the prompt's blocks")
    _, again = chat(proxy, long_prompt, 8)  # routed by prefix to the prefill worker that has it cached
    assert again["prompt_tokens_details"]["cached_tokens"] >= 16 * (usage["prompt_tokens"] // 16) - 16
    results = []
    threads = [threading.Thread(target=lambda i=i: results.append(chat(proxy, f"Stream {i}: a story.", 16)))
               for i in range(12)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert sorted(u["completion_tokens"] for _, u in results) == [16] * 12
    host = hosts.host
    stats = settle(host.stats, lambda stats: stats["used_blocks"] == 0 and stats["held_pages"] == 0, PATIENCE_S,
                   "every simulated worker gets its pages back (at each request's end; kv_lease_s at the latest)")
    assert stats["requests"] >= 2 * 14  # a prefill and a decode request each, all received before their answers


def test_the_command_hosts_workers_and_drains_on_sigterm(embedded_model_dir, tokenizer, tmp_path):
    proxy = RunningProxy(proxy_config(embedded_model_dir, heartbeat_timeout_s=5.0), tokenizer)
    stats = tmp_path / "stats.json"
    proc = subprocess.Popen([sys.executable, "-m", "common.cli.main", "sim-worker", "--proxy-address", proxy.endpoint,
                             "--prefill", "3", "--decode", "5", "--heartbeat-interval-s", "0.2", "--stats", str(stats)],
                            stdout=subprocess.PIPE, text=True)
    try:
        settle(lambda: len(proxy.services.cluster.registry.workers), lambda registered: registered == 8, STARTUP_S,
               "the sim-worker process starts and its eight workers register")
        ready(proxy)
        _, usage = chat(proxy, "Hello there.", 12)
        assert usage["completion_tokens"] == 12
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=60)
        assert proc.returncode == 0
        final = json.loads(out.strip().splitlines()[-1])
        assert final["workers"] == 8 and final["requests"] >= 2 and final["used_blocks"] == 0
        assert json.loads(stats.read_text())["workers"] == 8
        settle(lambda: set(proxy.services.cluster.registry.workers), lambda registered: not registered, PATIENCE_S,
               "the proxy removes the workers on their Goodbyes")
    finally:
        if proc.poll() is None:
            proc.kill()
        proxy.stop()


def test_a_simulated_worker_switches_roles_under_load_and_every_stream_completes(embedded_model_dir, tokenizer):
    """A decode worker ordered to prefill while 8 streams run: it drains for drain_timeout_s, hands back what is
    left (the streams resume on the other decode worker, their text as without the switch), says Goodbye and
    registers under a new epoch as a prefill worker; no page stays in use."""
    proxy = RunningProxy(proxy_config(embedded_model_dir, heartbeat_timeout_s=5.0), tokenizer)
    specs = [SimSpec("s-p0", "prefill", MODEL, num_blocks=2048, heartbeat_interval_s=0.2)]
    specs += [SimSpec(f"s-d{i}", "decode", MODEL, num_blocks=2048, heartbeat_interval_s=0.2, drain_timeout_s=0.2)
              for i in range(2)]
    hosts = HostThread(proxy.endpoint, specs, tokenizer)
    try:
        ready(proxy)

        def streams() -> tuple[list[threading.Thread], list]:
            results: list = [None] * 8
            threads = [threading.Thread(target=lambda i=i: results.__setitem__(
                i, chat(proxy, f"Stream {i}: a long story.", 320, seed=100 + i))) for i in range(8)]
            for thread in threads:
                thread.start()
            return threads, results

        threads, reference = streams()
        for thread in threads:
            thread.join(60)
        registry = proxy.services.cluster.registry
        old_epoch = registry.workers["s-d0"].epoch
        threads, results = streams()
        worker = hosts.host.workers["s-d0"]
        settle(lambda: len(worker.engine.running), lambda n: n >= 2, PATIENCE_S, "s-d0 decodes some of the streams")
        hosts.host.call_soon_threadsafe(lambda: worker.handle(SwitchRole("s-d0", "prefill")))
        for thread in threads:
            thread.join(60)
        assert [text for text, _ in results] == [text for text, _ in reference]
        assert [u["completion_tokens"] for _, u in results] == [320] * 8
        switched = settle(lambda: registry.workers.get("s-d0"),
                          lambda w: w is not None and w.epoch != old_epoch and w.role.value == "prefill", PATIENCE_S,
                          "s-d0 registers under a new epoch as a prefill worker")
        assert not switched.draining
        assert registry.count_by_role()["prefill"] == 2 and registry.count_by_role()["decode"] == 1
        stats = settle(hosts.host.stats, lambda stats: stats["used_blocks"] == 0 and stats["held_pages"] == 0,
                       PATIENCE_S, "every simulated worker gets its pages back")
        record, = stats["switches"]
        assert record["worker"] == "s-d0" and (record["from"], record["to"]) == ("decode", "prefill")
        assert record["handed_back"] >= 1 and record["registered_s"] >= 0, record
        _, usage = chat(proxy, "After the switch.", 8)  # served, the new prefill worker among the prefill side
        assert usage["completion_tokens"] == 8
    finally:
        hosts.close()
        proxy.stop()
