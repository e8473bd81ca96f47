"""Decode failover with real processes: kill -9 a decode worker mid-stream and lose nothing.

Proxy + 1 prefill + 2 decode workers on the embedded model, each its own process. Sixteen
concurrent streams (greedy, and seeded sampling with a frequency penalty) run once without a fault
for the reference, then again while one decode worker is killed with SIGKILL after the streams
have started. Every stream must complete with the reference's text, each token once (``usage``
counts them), the proxy must have seen the closed connection at once (not after
``heartbeat_timeout_s``), the supervisor must restart the killed worker, and no KV page may stay
in use on any worker.
"""
from __future__ import annotations

import asyncio
import json
import os
import signal
import time

import httpx
import pytest

from common.cli.local_cluster import LocalCluster, Supervisor

MODEL = "SmolLM2-135M-Instruct"
MAX_TOKENS = 64
STREAMS = 16


def requests() -> list[dict]:
    bodies = []
    for i in range(STREAMS):
        body = {"model": MODEL, "prompt": f"Story {i}: once upon a time, a {['fox', 'owl', 'cat', 'bee'][i % 4]}",
                "max_tokens": MAX_TOKENS, "ignore_eos": True, "stream": True,
                "stream_options": {"include_usage": True}}
        if i % 2:
            body.update(temperature=0.8, seed=1000 + i, frequency_penalty=0.5)
        else:
            body.update(temperature=0.0)
        bodies.append(body)
    return bodies


async def one_stream(client: httpx.AsyncClient, url: str, body: dict, started: list) -> tuple[str, int, list]:
    """Its (text, completion tokens, error events); once it has some text, it counts itself in ``started``."""
    text, completion_tokens, errors = "", 0, []
    async with client.stream("POST", url + "/v1/completions", json=body) as response:
        assert response.status_code == 200, await response.aread()
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if "error" in event:
                errors.append(event["error"])
            for choice in event.get("choices", []):
                text += choice.get("text") or ""
                if len(text) > 20 and body not in started:
                    started.append(body)
            if event.get("usage"):
                completion_tokens = event["usage"]["completion_tokens"]
    return text, completion_tokens, errors


async def run_streams(url: str, during=None) -> list[tuple[str, int, list]]:
    started: list = []
    async with httpx.AsyncClient(timeout=300) as client:
        tasks = [asyncio.create_task(one_stream(client, url, body, started)) for body in requests()]
        if during is not None:  # once every stream is under way
            while len(started) < STREAMS:
                await asyncio.sleep(0.01)
            during()
        return await asyncio.gather(*tasks)


@pytest.fixture
def cluster(embedded_model_dir, tmp_path):
    c = LocalCluster.for_tests(embedded_model_dir, tmp_path, prefill=1, decode=2,
                               proxy_overrides=["heartbeat_timeout_s=30"]).start()
    yield c
    c.stop()


def test_kill_9_of_a_decode_worker_mid_stream_loses_nothing(cluster):
    reference = asyncio.run(run_streams(cluster.url))
    assert all(not errors and tokens == MAX_TOKENS for _, tokens, errors in reference)
    killed = []

    def kill_the_busier_decode_worker():
        running = {name: sum(cluster.metric("tessera_worker_running_sequences", cluster.worker_url(name)).values())
                   for name in ("decode-0", "decode-1")}
        name = max(running, key=running.get)
        killed.append((name, running[name], time.monotonic()))
        os.kill(cluster.procs[name].pid, signal.SIGKILL)

    faulted = asyncio.run(run_streams(cluster.url, during=kill_the_busier_decode_worker))
    victim, running, killed_at = killed[0]
    for i, ((text, tokens, errors), (ref_text, _, _)) in enumerate(zip(faulted, reference)):
        assert not errors, (i, errors)
        assert tokens == MAX_TOKENS, (i, tokens)
        assert text == ref_text, (i, text, ref_text)
    migrated = sum(cluster.metric("tessera_proxy_migrations_total").values())
    assert migrated >= STREAMS // 4, f"{victim} ran {running} sequence(s); {migrated} resumed elsewhere"
    # Seen by its closed connection: the heartbeat timeout (30 s) is far longer than this test's wait.
    assert cluster.metric("tessera_proxy_worker_disconnects_total") == {f'{{worker_id="{victim}"}}': 1.0}
    assert time.monotonic() - killed_at < 30

    supervisor = Supervisor(cluster, backoff_s=0.1)
    deadline = time.monotonic() + 120
    while sum(cluster.metric("tessera_proxy_workers_alive").values()) < 3:
        supervisor.check()
        assert time.monotonic() < deadline, "the killed worker did not come back"
        time.sleep(0.2)
    assert supervisor.restarts == {victim: 1}
    deadline = time.monotonic() + 10
    while any(cluster.metric("tessera_proxy_kv_pages_used").values()) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not any(cluster.metric("tessera_proxy_kv_pages_used").values())
    again = asyncio.run(run_streams(cluster.url))
    assert [t for t, _, _ in again] == [t for t, _, _ in reference]
